"""What the benchmark, tuner and compile checks know about kernels.lamb (bench/record.py).

The benchmark times one optimizer step over BERT's parameter set (base, large; float32 weights and gradients, as
training under autocast keeps them; bias and LayerNorm parameters without weight decay): ours against a plain
PyTorch LAMB (`lamb_ref`, one tensor at a time, as optimizer libraries write it) and torch's fused AdamW, the step
BERT would take without LAMB. Bytes are what each must move per float32 parameter: AdamW 28 (weight, gradient and
both moments read, weight and moments written), LAMB 44 (its global gradient norm and per-tensor trust ratios
need a pass over the gradients before the moments and one over the weights after them).
"""
import torch

from bertfuse.kernels.lamb import Lamb, LambGroup, lamb_ref, lamb_step

from ..record import Bench, BenchShapes, Case, CompileCall, Goal, Record, Tuning, randn

LAMB_BYTES, ADAMW_BYTES = 44, 28  # per float32 parameter (above)


def _groups(tensors: list) -> list:
    """Two LAMB groups over `tensors` ((count, tensors) pairs): the first half with weight decay, the rest without."""
    half = (len(tensors) + 1) // 2
    return [LambGroup(half, 2e-2, 0.9, 0.999, 1e-6, 0.01), LambGroup(len(tensors) - half, 1e-2, 0.8, 0.99, 1e-6, 0.0)]


def _steps(step_fn, pairs: list, max_grad_norm: float = 1.0):
    """Three steps of step_fn over copies of the weights in `pairs` (weight, gradient, weight, gradient, ...),
    the gradients scaled by 0.1, 1 and 10 (pre-normalised in the last two); the new weights, flattened."""
    weights = [w.detach().clone() for w in pairs[0::2]]
    grads = [g.detach() for g in pairs[1::2]]
    fresh = [Lamb._new_state(w) for w in weights]  # the optimizer's state, as it keeps it
    state = [[s[k] for s in fresh] for k in ("exp_avg", "exp_avg_sq", "step")]
    for scale in (0.1, 1.0, 10.0):
        step_fn(weights, [g * scale for g in grads], *state, _groups(weights), max_grad_norm)
    return torch.cat([w.flatten() for w in weights])


def _smoke(s, device) -> Case:
    shapes = [(s.hidden, s.hidden), (s.intermediate,), (s.vocab, s.hidden), (1,), (s.hidden,), (s.tokens, 3)]
    inputs = [t for i, shape in enumerate(shapes)
              for t in (randn(*shape, seed=2 * i, device=device), randn(*shape, seed=2 * i + 1, device=device))]
    return Case("lamb", inputs, lambda *t: _steps(lamb_step, list(t)), lambda *t: _steps(lamb_ref, list(t)),
                ["weights"])


def parameter_set(preset: str, vocab_size: int = 30522) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter of BertForPreTraining at a BertConfig preset (built on the meta device)."""
    from bertfuse import bert

    with torch.device("meta"):
        model = bert.BertForPreTraining(bert.BertConfig.preset(preset, vocab_size=vocab_size))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


class Stepper:
    """An optimizer's step as a benchmark implementation: fn(params) steps the optimizer `make(groups)` builds for
    these parameters (two groups, BERT's: no weight decay on biases and LayerNorm) on its first call."""

    def __init__(self, make):
        self.make, self.params, self.optimizer = make, None, None

    def __call__(self, params):
        if self.params is not params:
            decay = [p for p in params if not p.no_decay]
            rest = [p for p in params if p.no_decay]
            self.optimizer = self.make([{"params": decay}, {"params": rest, "weight_decay": 0.0}])
            self.params = params
        self.optimizer.step()


class PlainLamb(Lamb):
    """The same LAMB, its state and step, stepping in plain PyTorch (`lamb_ref`, one tensor at a time): what a user
    without our kernels runs."""

    def _stepper(self, params, grads):
        return lamb_ref


def _bench(shape, device, dtype, full):
    preset, vocab = shape
    named = parameter_set(preset, vocab)
    n = sum(torch.Size(s).numel() for _, s in named)

    def inputs():
        params = []
        for name, s in named:
            p = torch.nn.Parameter(torch.randn(s, device=device) * 0.02)
            p.grad = torch.randn(s, device=device) * 1e-3
            p.no_decay = name.endswith("bias") or "LayerNorm" in name
            params.append(p)
        return (params,)

    extra = {"params": f"{n / 1e6:.0f}M float32"}
    lamb = {"ours": Stepper(lambda groups: Lamb(groups, lr=1e-3)),
            "torch-lamb": Stepper(lambda groups: PlainLamb(groups, lr=1e-3))}
    yield Bench("lamb_step", preset, lamb, inputs, LAMB_BYTES * n, extra=extra, step=True)
    fused = {"fused": True} if device.type == "cuda" else {}
    yield Bench("adamw_step", preset, {"torch-fused": Stepper(lambda groups: torch.optim.AdamW(groups, lr=1e-3,
                                                                                                **fused))},
                inputs, ADAMW_BYTES * n, extra=extra, step=True)


def _compiled():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        yield CompileCall(dtype, 1)
        yield CompileCall(dtype, 1, dict(found_inf=True, float32_grads=True))


def _call(dtype, size, found_inf=False, float32_grads=False):
    """One step over a small parameter set in `dtype` (gradients in float32 with `float32_grads`; a found_inf
    flag with `found_inf`)."""
    shapes = [(37, 24), (24,), (5,)]
    params = [torch.zeros(s, dtype=dtype) for s in shapes]
    grads = [torch.ones(s, dtype=torch.float32 if float32_grads else dtype) for s in shapes]
    lamb_step(params, grads, [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes],
              [torch.zeros(()) for _ in shapes], _groups(params), 1.0,
              torch.zeros(1) if found_inf else None)


RECORD = Record(
    name="lamb",
    smoke={"lamb": _smoke},
    bench_shapes=BenchShapes(quick=[("base", 30522), ("large", 30522)], full=[("base", 30522), ("large", 30522)],
                             tiny=[("tiny", 100)]),  # (BertConfig preset, vocabulary)
    bench=_bench,
    tuning=Tuning(shapes=(), setup=None),  # fixed launches: a step moves bytes, its default config streams them
    compiled=_compiled,
    call=_call,
    goals=(Goal("LAMB step bandwidth", ">= 80% of copy", "lamb_step", "copy_share", ">=", 0.80, fmt="{:.0%} of copy"),
           Goal("LAMB step vs plain PyTorch LAMB", "faster", "lamb_step", "step_ms", ">", 1.0, peer="torch-lamb")),
)

"""What the benchmark, tuner and compile checks know about kernels.glu (bench/record.py)."""
import torch

from bertfuse.kernels.glu import GLU_ACTIVATIONS, glu, glu_ref

from ..record import Bench, BenchShapes, Case, CompileCall, Record, TuneShape, Tuning, memory_bound_goals, \
    optional_peer, randn


def _smoke(s, device, activation) -> Case:
    h = s.intermediate // 2
    return Case(f"glu {activation}", [randn(s.tokens, 2 * h, device=device)],
                lambda x: glu(*x.chunk(2, -1), activation), lambda x: glu_ref(*x.chunk(2, -1), activation),
                ["y", "dx"])


_LIGER = {"gelu_tanh": ("liger-geglu", "liger_geglu"), "silu": ("liger-swiglu", "liger_swiglu")}


def _bench(shape, device, dtype, full):
    """The gated MLP's activation on one Linear's output [tokens, 2N] split in two (ModernBERT's Wi): eager
    act(a) * b, ours, and Liger-Kernel's GeGLU (tanh GeLU) and SwiGLU kernels for the activations they have."""
    tokens, n = shape

    def inputs():
        return (torch.randn(tokens, 2 * n, device=device, dtype=dtype, requires_grad=True),)

    nbytes = tokens * n * dtype.itemsize  # forward: read a, b, write y; backward: read dy, a, b, write da, db
    for activation in GLU_ACTIVATIONS:
        impls = {"torch-eager": lambda h, act=activation: glu_ref(*h.chunk(2, -1), act),
                 "ours": lambda h, act=activation: glu(*h.chunk(2, -1), act)}
        if activation in _LIGER:
            name, fn = _LIGER[activation]

            def liger(fn=fn):
                from liger_kernel.transformers import functional
                call = getattr(functional, fn)
                return lambda h: call(*(t.contiguous() for t in h.chunk(2, -1)))
            impls[name] = optional_peer("liger-kernel", liger)
        yield Bench(f"glu {activation}", f"{tokens}x{n}", impls, inputs, 3 * nbytes, 5 * nbytes,
                    reference=lambda h, act=activation: glu_ref(*h.chunk(2, -1), act))


def _compiled():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for activation in GLU_ACTIVATIONS:
            yield CompileCall(dtype, 1152, dict(activation=activation))


def _call(dtype, n, activation="gelu"):
    """Forward and backward at width n over 37 rows, the halves of one [37, 2n] projection."""
    h = torch.randn(37, 2 * n, dtype=dtype, requires_grad=True)
    glu(*h.chunk(2, -1), activation).sum().backward()


def _tune_setup(shape, size, dtype, device, part=None):
    tokens, n = shape
    h = randn(tokens, 2 * n, device=device, dtype=dtype, grad=True)
    return (lambda h: glu(*h.chunk(2, -1), "gelu")), (h,), {"bwd": (h,)}


RECORD = Record(
    name="glu",
    smoke={f"glu_{a}": (lambda s, device, a=a: _smoke(s, device, a)) for a in GLU_ACTIVATIONS},
    bench_shapes=BenchShapes(quick=[(16384, 1152)], full=[(t, n) for t in (16384, 65536) for n in (1152, 2624)],
                             tiny=[(16, 40)]),
    bench=_bench,
    tuning=Tuning(shapes=(TuneShape(1152, None, (16384, 1152)), TuneShape(2624, None, (16384, 2624), rank=1)),
                  setup=_tune_setup),
    compiled=_compiled,
    call=_call,
    goals=(*memory_bound_goals("GeGLU", "glu gelu"),
           *memory_bound_goals("SwiGLU", "glu silu")),
)

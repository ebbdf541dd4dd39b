"""What the benchmark, tuner and compile checks know about kernels.mlm_loss (bench/record.py)."""
import torch
import torch.nn.functional as F

from bertfuse.kernels.mlm_loss import masked_lm_loss, masked_lm_loss_ref

from ..record import Bench, BenchShapes, Case, CompileCall, Goal, Record, TuneShape, Tuning, optional_peer, randn


def _smoke_case(strategy: str):
    def smoke(s, device) -> Case:
        rows = max(1, int(0.15 * s.tokens))
        labels = torch.randint(0, s.vocab, (rows,), generator=torch.Generator().manual_seed(5)).to(device)
        labels[::7] = -100
        inputs = [randn(rows, s.hidden, device=device), randn(s.vocab, s.hidden, device=device, seed=1, scale=.05),
                  randn(s.vocab, device=device, seed=2, scale=.05)]

        def reference(h, w, b):
            return masked_lm_loss_ref(h, w, b, labels)

        return Case(f"mlm_loss {strategy}", inputs,
                    lambda h, w, b: masked_lm_loss(h, w, b, labels, strategy=strategy), reference,
                    ["loss", "dhidden", "dweight", "dbias"])
    return smoke


def _mlm_labels(tokens: int, vocab: int, device):
    g = torch.Generator().manual_seed(0)
    labels = torch.where(torch.rand(tokens, generator=g) < 0.15, torch.randint(0, vocab, (tokens,), generator=g),
                         -100).to(device)
    return labels, (labels != -100).nonzero().squeeze(1)


def _peers(labels, rows) -> dict:
    """The fused linear cross-entropies a user could pick instead, on the same gathered rows: Liger-Kernel's and
    Apple's Cut Cross-Entropy (which takes no bias: it runs without one)."""
    def liger():
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        return lambda x, w, b: liger_fused_linear_cross_entropy(x[rows], w, labels[rows], b)

    def cce():
        from cut_cross_entropy import linear_cross_entropy
        return lambda x, w, b: linear_cross_entropy(x[rows], w, labels[rows])

    return {"(d) liger fused linear CE": optional_peer("liger-kernel", liger),
            "(e) cut cross-entropy, no bias": optional_peer("cut-cross-entropy", cce)}


def _bench(shape, device, dtype, full):
    """Pre-training shapes, 15% of the tokens labelled: HF's path (the decoder on every position), the labelled
    rows gathered before a plain linear + cross-entropy, ours on the gathered rows (auto; on a GPU each strategy
    too), and the peers. On a CPU ours is "auto" = chunked, mostly torch's matmuls with the row kernel in Triton's
    interpreter (the fused strategy would take hours there); the interpreter's own buffers count in its memory."""
    tokens, h, vocab = *shape, 30522
    labels, rows = _mlm_labels(tokens, vocab, device)

    def inputs():
        return (randn(tokens, h, device=device, dtype=dtype, grad=True),
                randn(vocab, h, seed=1, scale=0.02, device=device, dtype=dtype, grad=True),
                torch.zeros(vocab, device=device, dtype=dtype, requires_grad=True))

    def reference(x, w, b):
        return masked_lm_loss_ref(x[rows], w, b, labels[rows])

    def ours(strategy):
        return lambda x, w, b: masked_lm_loss(x[rows], w, b, labels[rows], strategy=strategy)

    impls = {"(a) full logits": lambda x, w, b: F.cross_entropy(F.linear(x, w, b).float(), labels),
             "(b) gather+linear+CE": lambda x, w, b: F.cross_entropy(F.linear(x[rows], w, b).float(), labels[rows]),
             "(c) ours": ours("auto")}
    if device.type == "cuda":
        impls.update({"(c) ours chunked": ours("chunked"), "(c) ours fused": ours("fused")})
    impls.update(_peers(labels, rows))
    yield Bench("mlm_loss", f"{tokens} tok (~{rows.numel()} labelled) x V{vocab} x H{h}", impls, inputs,
                extra=dict(hidden=h, tokens=tokens), reference=reference)


def _compiled():
    """The fused strategy's kernels at BERT-base's and -large's widths, with and without a decoder bias; the
    chunked strategy's row kernel at base's."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for h in (768, 1024):
            for bias in (True, False):
                yield CompileCall(dtype, h, dict(strategy="fused", bias=bias))
        yield CompileCall(dtype, 768, dict(strategy="chunked", bias=True))


def _call(dtype, h, strategy="fused", bias=True):
    """Forward and backward of 37 labelled rows over BERT's vocabulary (30,522), the bias in float32. Recorded,
    not run: the launches depend on the shapes and the labels, not on the values, so the [30522, h] weight is
    zeros (drawing it at random would take most of the compile check's time)."""
    hid = torch.zeros(37, h, dtype=dtype, requires_grad=True)
    w = torch.zeros(30522, h, dtype=dtype, requires_grad=True)
    b = torch.zeros(30522, requires_grad=True) if bias else None
    labels = torch.randint(0, 30522, (37,), generator=torch.Generator().manual_seed(0))
    masked_lm_loss(hid, w, b, labels, strategy=strategy).backward()


# The strategy a tuning part measures: the fused kernels' parts run "fused", the row kernel's "chunked", and the
# strategy part lets the table decide (bench.tune forces each candidate in turn).
_TUNED_STRATEGY = {"fwd": "fused", "dhidden": "fused", "dweight": "fused", "ce": "chunked", "strategy": "auto"}


def _tune_setup(shape, size, dtype, device, part=None):
    rows, h, vocab = shape
    hid, w, b = (randn(*s, seed=i, scale=c, device=device, dtype=dtype, grad=True)
                 for i, (s, c) in enumerate([((rows, h), 1.0), ((vocab, h), 0.05), ((vocab,), 0.05)]))
    labels = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(3)).to(device)
    strategy = _TUNED_STRATEGY.get(part, "auto")
    return ((lambda hid, w, b: masked_lm_loss(hid, w, b, labels, strategy=strategy)), (hid, w, b),
            {"dhidden": (hid,), "dweight": (w, b), "ce": (hid, w, b), "strategy": (hid, w, b)})


def _mlm_goal(name, goal, field, op, bound, peer, share=False, where=None) -> Goal:
    return Goal(name, goal, "mlm_loss", field, op, bound, peer=peer, share=share, where=where or {}, impl="(c) ours")


RECORD = Record(
    name="mlm_loss",
    smoke={"mlm_loss chunked": _smoke_case("chunked"), "mlm_loss fused": _smoke_case("fused")},
    bench_shapes=BenchShapes(quick=[(32768, 768), (131072, 1024)], full=[(32768, 768), (32768, 1024), (131072, 1024)],
                             tiny=[(256, 768)], cpu=[(4096, 768)]),
    bench=_bench,
    # keyed by the labelled rows: BERT-base at 256 x 128 tokens, BERT-large at 256 x 512
    tuning=Tuning(shapes=(TuneShape(768, 4915, (4915, 768, 30522)),
                          TuneShape(1024, 19660, (19660, 1024, 30522), rank=1)),
                  setup=_tune_setup, whole=("ce", "strategy")),
    compiled=_compiled,
    call=_call,
    goals=(_mlm_goal("MLM loss extra memory vs full logits, H768", "<= 1%", "peak_extra_MB", "<=", 0.01,
                     "(a) full logits", share=True, where=dict(hidden=768)),
           _mlm_goal("MLM loss time vs gather + linear + CE", ">= 1x", "fwd_bwd_ms", ">=", 1.0,
                     "(b) gather+linear+CE"),
           _mlm_goal("MLM loss time vs Liger fused linear CE", ">= 1x", "fwd_bwd_ms", ">=", 1.0,
                     "(d) liger fused linear CE"),
           _mlm_goal("MLM loss time vs Cut Cross-Entropy (no bias)", ">= 1x", "fwd_bwd_ms", ">=", 1.0,
                     "(e) cut cross-entropy, no bias"),
           Goal("MLM loss extra memory, BERT-large 256 x 512", "<= 1 GB", "mlm_loss", "peak_extra_MB", "<=", 1024,
                where=dict(hidden=1024, tokens=131072), impl="(c) ours", fmt="{:.0f} MB")),
)

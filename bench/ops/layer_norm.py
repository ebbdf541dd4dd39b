"""What the benchmark, tuner and compile checks know about kernels.layer_norm (bench/record.py)."""
import torch
from torch import nn

from bertfuse.kernels.layer_norm import dropout_mask, layer_norm, layer_norm_ref, rms_norm

from ..record import (Bench, BenchShapes, Case, CompileCall, Goal, Record, TuneShape, Tuning, memory_bound_goals,
                      optional_peer, randn)


def _smoke(s, device) -> Case:
    m, n, p, seed = s.tokens, s.hidden, 0.1, 1234
    keep = dropout_mask(seed, m, n, p, device)
    inputs = [randn(m, n, device=device, seed=i) for i in range(2)] + [1 + randn(n, device=device, seed=2, scale=.1),
                                                                      randn(n, device=device, seed=3, scale=.1)]

    def ours(x, r, w, b):
        return layer_norm(x, w, b, 1e-12, residual=r, dropout_p=p, seed=seed)

    def reference(x, r, w, b):  # with the kernel's own dropout mask
        return layer_norm_ref(x, w, b, 1e-12, residual=r, dropout_p=p, keep=keep)

    return Case("layer_norm+residual+dropout", inputs, ours, reference, ["y", "dx", "dresidual", "dw", "db"])


def _bench(shape, device, dtype, full):
    tokens, h = shape

    def inputs():
        x, r = (torch.randn(tokens, h, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        return x, r, torch.ones(h, device=device, requires_grad=True), torch.zeros(h, device=device, requires_grad=True)

    def eager(x, r, w, b):
        return nn.functional.layer_norm(nn.functional.dropout(x, 0.1) + r, (h,), w.to(x.dtype), b.to(x.dtype), 1e-12)

    def ours(x, r, w, b):
        return layer_norm(x, w, b, 1e-12, residual=r, dropout_p=0.1)

    n = tokens * h * dtype.itemsize  # forward: read x, r, write y; backward: read dy, x, r, write dx, dr
    yield Bench("layer_norm+residual+dropout", f"{tokens}x{h}", {"torch-eager": eager, "ours": ours}, inputs,
                3 * n, 5 * n)

    def exact(x, r, w, b):
        return nn.functional.layer_norm(x + r, (h,), w.to(x.dtype), b.to(x.dtype), 1e-12)

    plain = {"torch-eager": exact, "ours": lambda x, r, w, b: layer_norm(x, w, b, 1e-12, residual=r)}
    plain["liger-layer_norm"] = optional_peer("liger-kernel", _liger)
    yield Bench("layer_norm+residual", f"{tokens}x{h}", plain, inputs, 3 * n, 5 * n, reference=exact)
    yield from _bench_rms(tokens, h, device, dtype)


def _bench_rms(tokens, h, device, dtype):
    """A pre-norm layer's RMSNorm (EuroBERT's): s = x + r and RMSNorm(s), both outputs used (the sum is the next
    residual), against eager, Liger-Kernel's RMSNorm on the sum, and ours (one kernel for both)."""
    def inputs():
        x, r = (torch.randn(tokens, h, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        return x, r, torch.ones(h, device=device, requires_grad=True)

    def eager(x, r, w):
        s = x + r
        return nn.functional.rms_norm(s, (h,), w.to(x.dtype), 1e-6) + s

    def ours(x, r, w):
        y, s = rms_norm(x, w, 1e-6, residual=r, return_sum=True)
        return y + s

    def liger():
        from liger_kernel.transformers.functional import liger_rms_norm

        def run(x, r, w):
            s = x + r
            return liger_rms_norm(s, w, 1e-6, in_place=False) + s
        return run

    n = tokens * h * dtype.itemsize  # forward: read x, r, write y, s; backward: read dy, ds, x, r, write dx, dr
    impls = {"torch-eager": eager, "ours": ours, "liger-rms_norm": optional_peer("liger-kernel", liger)}
    yield Bench("rms_norm+residual prenorm", f"{tokens}x{h}", impls, inputs, 4 * n, 6 * n, reference=eager)


def _liger():
    """Liger-Kernel's LayerNorm on the sum x + r (it fuses no residual)."""
    from liger_kernel.transformers.functional import liger_layer_norm
    return lambda x, r, w, b: liger_layer_norm(x + r, w, b, 1e-12)


def _compiled():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (768, 8192):
            for flags in ((True, True, True), (False, False, False)):
                yield CompileCall(dtype, n, dict(zip(("residual", "dropout", "affine"), flags)))
            yield CompileCall(dtype, n, dict(rms=True, prenorm=True))   # a pre-norm RMSNorm layer
            yield CompileCall(dtype, n, dict(prenorm=True, dropout=False))  # a pre-norm bias-free LayerNorm


def _call(dtype, n, residual=True, dropout=True, affine=True, rms=False, prenorm=False):
    """Forward and backward at hidden size n, over 37 rows (not a multiple of 16, as a real row count may be);
    weights in float32, as under autocast; prenorm: the sum returned too, both outputs used."""
    x, r = (torch.randn(37, n, dtype=dtype, requires_grad=True) for _ in range(2))
    w, b = (torch.ones(n, requires_grad=True), torch.zeros(n, requires_grad=True)) if affine else (None, None)
    y = layer_norm(x, w, None if rms or prenorm else b, 1e-12, residual=r if residual else None,
                   dropout_p=0.1 if dropout else 0.0, seed=1, rms=rms, return_sum=prenorm)
    (y[0] + y[1] if prenorm else y).sum().backward()


def _tune_setup(shape, size, dtype, device, part=None):
    tokens, h = shape
    x, r, w, b = (randn(*s, seed=i, device=device, dtype=dtype, grad=True)
                  for i, s in enumerate([(tokens, h), (tokens, h), (h,), (h,)]))

    def fn(x, r, w, b):
        return layer_norm(x, w, b, 1e-12, residual=r, dropout_p=0.1, seed=1234)
    return fn, (x, r, w, b), {"bwd": (x, r, w, b)}


RECORD = Record(
    name="layer_norm",
    smoke={"layer_norm": _smoke},
    bench_shapes=BenchShapes(quick=[(16384, 768), (16384, 1024)],
                             full=[(t, h) for t in (8192, 32768, 65536) for h in (768, 1024)], tiny=[(16, 48)]),
    bench=_bench,
    tuning=Tuning(shapes=(TuneShape(768, None, (16384, 768)), TuneShape(1024, None, (16384, 1024), rank=1)),
                  setup=_tune_setup),
    compiled=_compiled,
    call=_call,
    goals=(*memory_bound_goals("LayerNorm+residual+dropout", "layer_norm+residual+dropout"),
           Goal("LayerNorm+residual vs Liger-Kernel's LayerNorm", "faster", "layer_norm+residual", "fwd_bwd_ms", ">",
                1.0, peer="liger-layer_norm"),
           *memory_bound_goals("RMSNorm+residual pre-norm", "rms_norm+residual prenorm"),
           Goal("RMSNorm+residual pre-norm vs Liger-Kernel's RMSNorm", "faster", "rms_norm+residual prenorm",
                "fwd_bwd_ms", ">", 1.0, peer="liger-rms_norm")),
)

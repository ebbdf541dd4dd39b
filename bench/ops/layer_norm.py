"""What the benchmark, tuner and compile checks know about kernels.layer_norm (bench/record.py)."""
import torch
from torch import nn

from kernels.layer_norm import (_config, _default_config, _layer_norm_bwd_kernel, _layer_norm_fwd_kernel, dropout_mask,
                                layer_norm, layer_norm_ref)

from ..record import (Bench, BenchShapes, Case, Goal, Record, Site, TuneShape, Tuning, Variant, grid,
                      memory_bound_goals, optional_peer, randn)


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


def _liger():
    """Liger-Kernel's LayerNorm on the sum x + r (it fuses no residual)."""
    from liger_kernel.transformers.functional import liger_layer_norm
    return lambda x, r, w, b: liger_layer_norm(x + r, w, b, 1e-12)


def _variant(part: str, dtype, n: int, launch, residual=True, dropout=True, affine=True) -> Variant:
    common = dict(X=dtype, R=dtype if residual else None, W=torch.float32 if affine else None,
                  HAS_RESIDUAL=residual, HAS_DROPOUT=dropout, HAS_WEIGHT=affine, BLOCK_M=launch.BLOCK_M,
                  BLOCK_N=launch.BLOCK_N, M="i32", N="i32:16", p="fp32", Seed=torch.int64 if dropout else None,
                  stride_x_m="i32:16", stride_r_m="i32:16")
    name = f"layer_norm {part} {dtype} N={n} res={residual} drop={dropout} affine={affine}"
    if part == "fwd":
        fn, args = _layer_norm_fwd_kernel, dict(common, B=torch.float32 if affine else None, Y=dtype,
                                                Mean=torch.float32, Rstd=torch.float32, stride_y_m="i32:16",
                                                eps="fp32", HAS_BIAS=affine)
    else:
        fn, args = _layer_norm_bwd_kernel, dict(common, DY=dtype, DX=dtype, DR=dtype if residual else None,
                                                DW_partial=torch.float32, DB_partial=torch.float32,
                                                Mean=torch.float32, Rstd=torch.float32, stride_dy_m="i32:16",
                                                stride_dx_m="i32:16", stride_dr_m="i32:16", rows_per_program="i32")
    return Variant(name, fn, args, launch.num_warps, dtype=dtype, needs="vectors")


def _sites():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (768, 8192):
            for flags in ((True, True, True), (False, False, False)):
                for part in ("fwd", "bwd"):
                    yield Site(part, dtype, n, dict(zip(("residual", "dropout", "affine"), flags)))


def _tune_setup(shape, size, dtype, device, part=None):
    tokens, h = shape
    x, r, w, b = (randn(*s, seed=i, device=device, dtype=dtype, grad=True)
                  for i, s in enumerate([(tokens, h), (tokens, h), (h,), (h,)]))

    def fn(x, r, w, b):
        return layer_norm(x, w, b, 1e-12, residual=r, dropout_p=0.1, seed=1234)
    return fn, (x, r, w, b), {"bwd": (x, r, w, b)}


_ROWS = grid(BLOCK_M=[1, 2, 4, 8, 16], num_warps=[2, 4, 8, 16])
RECORD = Record(
    name="layer_norm",
    smoke={"layer_norm": _smoke},
    bench_shapes=BenchShapes(quick=[(16384, 768), (16384, 1024)],
                             full=[(t, h) for t in (8192, 32768, 65536) for h in (768, 1024)], tiny=[(16, 48)]),
    bench=_bench,
    tuning=Tuning(parts=("fwd", "bwd"), default=lambda part, dtype, n, target: _default_config(n), config=_config,
                  candidates={"fwd": _ROWS, "bwd": _ROWS},
                  shapes=(TuneShape(768, None, (16384, 768)), TuneShape(1024, None, (16384, 1024), rank=1)),
                  setup=_tune_setup, variant=_variant),
    sites=_sites,
    goals=(*memory_bound_goals("LayerNorm+residual+dropout", "layer_norm+residual+dropout"),
           Goal("LayerNorm+residual vs Liger-Kernel's LayerNorm", "faster", "layer_norm+residual", "fwd_bwd_ms", ">",
                1.0, peer="liger-layer_norm")),
)

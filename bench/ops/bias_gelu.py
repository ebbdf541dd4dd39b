"""What the benchmark, tuner and compile checks know about kernels.bias_gelu (bench/record.py)."""
import torch
import torch.nn.functional as F

from kernels.bias_gelu import (_bias_gelu_bwd_kernel, _bias_gelu_fwd_kernel, _config, _default_config, bias_gelu,
                               bias_gelu_ref)

from ..record import Bench, BenchShapes, Case, Record, Site, TuneShape, Tuning, Variant, grid, memory_bound_goals, randn


def _smoke(s, device, approximate="none") -> Case:
    inputs = [randn(s.tokens, s.intermediate, device=device), randn(s.intermediate, device=device, seed=1)]
    return Case("bias_gelu" + (" tanh" if approximate == "tanh" else ""), inputs,
                lambda x, b: bias_gelu(x, b, approximate), lambda x, b: bias_gelu_ref(x, b, approximate),
                ["y", "dx", "dbias"])


def _bench(shape, device, dtype, full):
    tokens, i = shape

    def inputs():
        return (torch.randn(tokens, i, device=device, dtype=dtype, requires_grad=True),
                torch.randn(i, device=device, dtype=dtype, requires_grad=True))

    n = tokens * i * dtype.itemsize  # forward: read x, write y; backward: read dy, x, write dx
    yield Bench("bias_gelu", f"{tokens}x{i}", {"torch-eager": lambda x, b: F.gelu(x + b), "ours": bias_gelu}, inputs,
                2 * n, 3 * n, reference=bias_gelu_ref)


def _variant(part: str, dtype, n: int, launch, tanh=False) -> Variant:
    common = dict(X=dtype, B=torch.float32, M="i32", N="i32:16", stride_x_m="i32:16", APPROX_TANH=tanh,
                  BLOCK_M=launch.BLOCK_M, BLOCK_N=launch.BLOCK_N)
    if part == "fwd":
        fn, args = _bias_gelu_fwd_kernel, dict(common, Y=dtype, stride_y_m="i32:16")
    else:
        fn, args = _bias_gelu_bwd_kernel, dict(common, DY=dtype, DX=dtype, DB_partial=torch.float32,
                                               stride_dy_m="i32:16", stride_dx_m="i32:16", rows_per_program="i32")
    return Variant(f"bias_gelu {part} {dtype} tanh={tanh}", fn, args, launch.num_warps, dtype=dtype, needs="vectors")


def _sites():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tanh in (False, True):
            for part in ("fwd", "bwd"):
                yield Site(part, dtype, 3072, dict(tanh=tanh))


def _tune_setup(shape, size, dtype, device, part=None):
    tokens, n = shape
    x, b = randn(tokens, n, device=device, dtype=dtype, grad=True), randn(n, seed=1, device=device, dtype=dtype,
                                                                            grad=True)
    return bias_gelu, (x, b), {"bwd": (x, b)}


_TILES = [c for c in grid(BLOCK_M=[2, 4, 8, 16], BLOCK_N=[256, 512, 1024], num_warps=[4, 8])
          if c["BLOCK_M"] * c["BLOCK_N"] <= 8192]
RECORD = Record(
    name="bias_gelu",
    smoke={"bias_gelu": _smoke, "bias_gelu_tanh": lambda s, device: _smoke(s, device, "tanh")},
    bench_shapes=BenchShapes(quick=[(16384, 3072), (16384, 4096)],
                             full=[(t, i) for t in (8192, 32768, 65536) for i in (3072, 4096)], tiny=[(16, 40)]),
    bench=_bench,
    tuning=Tuning(parts=("fwd", "bwd"), default=lambda part, dtype, n, target: _default_config(n), config=_config,
                  candidates={"fwd": _TILES, "bwd": _TILES},
                  shapes=(TuneShape(3072, None, (16384, 3072)), TuneShape(4096, None, (16384, 4096), rank=1)),
                  setup=_tune_setup, variant=_variant),
    sites=_sites,
    goals=memory_bound_goals("bias-GeLU", "bias_gelu"),
)

"""What the benchmark, tuner and compile checks know about kernels.bias_gelu (bench/record.py)."""
import torch
import torch.nn.functional as F

from bertfuse.kernels.bias_gelu import bias_gelu, bias_gelu_ref

from ..record import Bench, BenchShapes, Case, CompileCall, Record, TuneShape, Tuning, memory_bound_goals, randn


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


def _compiled():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tanh in (False, True):
            yield CompileCall(dtype, 3072, dict(tanh=tanh))


def _call(dtype, n, tanh=False):
    """Forward and backward at width n over 37 rows, the bias in float32 (a Linear's, under autocast)."""
    x, b = torch.randn(37, n, dtype=dtype, requires_grad=True), torch.zeros(n, requires_grad=True)
    bias_gelu(x, b, "tanh" if tanh else "none").sum().backward()


def _tune_setup(shape, size, dtype, device, part=None):
    tokens, n = shape
    x, b = randn(tokens, n, device=device, dtype=dtype, grad=True), randn(n, seed=1, device=device, dtype=dtype,
                                                                            grad=True)
    return bias_gelu, (x, b), {"bwd": (x, b)}


RECORD = Record(
    name="bias_gelu",
    smoke={"bias_gelu": _smoke, "bias_gelu_tanh": lambda s, device: _smoke(s, device, "tanh")},
    bench_shapes=BenchShapes(quick=[(16384, 3072), (16384, 4096)],
                             full=[(t, i) for t in (8192, 32768, 65536) for i in (3072, 4096)], tiny=[(16, 40)]),
    bench=_bench,
    tuning=Tuning(shapes=(TuneShape(3072, None, (16384, 3072)), TuneShape(4096, None, (16384, 4096), rank=1)),
                  setup=_tune_setup),
    compiled=_compiled,
    call=_call,
    goals=memory_bound_goals("bias-GeLU", "bias_gelu"),
)

"""pytest-benchmark micro-benchmarks of every kernel record's problems against its peers (`pytest bench
--benchmark-only --import-mode=importlib`).

Sized for the CPU (Triton interpreter, each record's tiny shapes) when there is no GPU, where the numbers say
nothing about kernel speed, only that the benchmarks run; on a GPU each record's first quick shape in bfloat16.
"""
import pytest
import torch

pytest.importorskip("triton")
from bertfuse.bench.ops import RECORDS  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _cases():
    params = []
    for record in RECORDS:
        shape = (record.bench_shapes.quick if CUDA else record.bench_shapes.tiny)[0]
        for case in record.bench(shape, DEV, DTYPE, False):
            params += [pytest.param(case, impl, id=f"{record.name}-{case.shape}-{impl}")
                       for impl, fn in case.impls.items() if not isinstance(fn, str)]
    return params


@pytest.mark.parametrize("case, impl", _cases())
def test_kernel(benchmark, case, impl):
    fn, inputs = case.impls[impl], case.inputs()

    def run():
        out = fn(*inputs)
        if not case.step:  # an optimizer step updates its inputs; the others run forward and backward
            out.backward(torch.ones_like(out))
        if CUDA:
            torch.cuda.synchronize()
    benchmark(run)

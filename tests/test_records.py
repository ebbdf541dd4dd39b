"""One place per kernel: every op has a Record (bench/record.py, one module per op in bench/ops/), and the smoke check, the kernel
benchmark, the tuner, the targets and bert-bench run whatever records there are. A made-up op (x * 2 in
PyTorch) added to bench.ops.RECORDS must reach each of them with no edit of theirs."""
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")
from bertfuse.bench import ops  # noqa: E402
from bertfuse.bench.ops import record  # noqa: E402
from bertfuse.bench.record import Bench, BenchShapes, Case, Goal, Record, TuneShape, Tuning, randn  # noqa: E402
from bertfuse.kernels import launches  # noqa: E402

CPU = torch.device("cpu")
PEAKS = {"copy_GBps": 10.0, "matmul_TFLOPs": 1.0, "matmul_dtype": "float32"}


class _Launch(NamedTuple):
    num_warps: int


def _double(x):
    return x * 2


def _bench(shape, device, dtype, full):
    n, = shape
    yield Bench("double", f"{n}", {"torch-eager": _double, "ours": _double, "other": "not installed"},
                lambda: (torch.randn(n, device=device, dtype=dtype, requires_grad=True),), 4 * n, 8 * n)


DOUBLE = Record(
    name="double",
    smoke={"double": lambda s, device: Case("double", [randn(s.tokens, s.hidden, device=device)], _double, _double,
                                            ["y", "dx"])},
    bench_shapes=BenchShapes(quick=[(64,)], full=[(64,), (128,)], tiny=[(8,)]),
    bench=_bench,
    tuning=Tuning(shapes=(TuneShape(16, None, (16,)),),
                  setup=lambda shape, size, dtype, device, part: (_double, (x := randn(*shape, grad=True),),
                                                                  {"bwd": (x,)})),
    compiled=lambda: [],
    call=lambda dtype, size: _double(torch.ones(size, dtype=dtype)),
    goals=(Goal("double vs eager", "faster", "double", "fwd_bwd_ms", ">", 1.0, peer="torch-eager"),),
)


# Its launch sites, as its kernel module would declare them (kernels.launches); the "kernel" is never started.
SITES = [launches.LaunchSite(f"double.{part}", _double, lambda dtype, size, target: _Launch(4),
                             lambda dtype, size, target, seqlen=None: _Launch(4), launches.grid(num_warps=[2, 4]))
         for part in ("fwd", "bwd")]


@pytest.fixture
def with_double(monkeypatch):
    from bertfuse.bench import smoke

    for site in SITES:
        monkeypatch.setitem(launches._SITES, site.name, site)
    monkeypatch.setattr(ops, "RECORDS", ops.RECORDS + (DOUBLE,))
    monkeypatch.setattr(smoke, "CHECKS", {})  # rebuilt from the records


def test_the_package_lists_one_record_per_op_module():
    from bertfuse import kernels

    ops_here = sorted({s.op for s in launches.sites()})  # every op module of kernels declares its launch sites
    assert [r.name for r in ops.RECORDS] == ops_here and ops_here == sorted(kernels._OPS)
    for r in ops.RECORDS:
        assert r.smoke and r.bench_shapes.tiny and list(r.compiled())
        assert record(f"{r.name}.{launches.sites(r.name)[0].part}") is r
    with pytest.raises(KeyError, match="no kernel record named 'nope'"):
        record("nope.fwd")


def test_a_new_record_reaches_smoke(with_double, capsys):
    from bertfuse.bench import smoke

    assert "double" in smoke.checks()
    assert smoke.main(["--checks", "double", "--dtypes", "float32", "float16", "--device", "cpu"]) == 0
    assert "PASS double float32" in capsys.readouterr().out


def test_a_new_record_reaches_the_kernel_suite_targets_and_precompile(with_double):
    from bertfuse.bench import kernel_suite, precompile, targets

    seen = []  # each row handed on as it is measured (bert-bench saves then: a cut run keeps what finished)
    rows = kernel_suite.rows(DOUBLE, PEAKS, True, CPU, shapes=DOUBLE.bench_shapes.tiny, on_row=seen.append)
    assert [r["impl"] for r in rows] == ["torch-eager", "ours", "other"] and seen == rows
    assert rows[2]["status"] == "skipped: not installed"
    assert all(r["status"] == "ok" and r["fwd_bwd_GBps"] > 0 for r in rows[:2])
    assert kernel_suite.rows(DOUBLE, PEAKS, True, CPU) == []  # no CPU shapes: timed on GPUs only
    verdicts = {v.name: v for v in targets.evaluate({"kernels": [dict(r, dtype="bfloat16") for r in rows]})}
    assert verdicts["double vs eager"].met is not None and "torch-eager" in verdicts["double vs eager"].value
    assert precompile.jobs(["double"], [], [], True, "cpu")[0][1] == "double"


def test_a_new_record_reaches_the_tuner(with_double):
    from bertfuse.bench import tune_problems, tune_timed

    assert "double" in tune_problems.families()
    todo = tune_problems.problems(["double"], [torch.float32])
    assert [p.kernel for p in todo] == ["double.fwd", "double.bwd"]
    times = iter([2.0, 1.0])

    def timer(fn):
        fn()
        return next(times)
    entry = tune_timed.tune_problem(todo[1], CPU, timer)
    assert entry["config"] == {"num_warps": 4} and entry["ms"] == 1.0


def test_bert_bench_lists_a_gpu_only_record_as_such(with_double, tmp_path, capsys, monkeypatch):
    from bertfuse.bench.cli import main

    monkeypatch.setattr("bertfuse.bench.cli.measure_peaks", lambda device: PEAKS)
    monkeypatch.setattr("bertfuse.bench.kernel_suite.rows", lambda record, peaks, quick, device, on_row=None: [])
    assert main(["--suite", "kernels", "--output-dir", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    gpu_only = ", ".join(r.name for r in ops.RECORDS if r.bench_shapes.cpu is None)
    assert gpu_only.endswith(", double") and f"the rows of {gpu_only}, which have no CPU table" in out
    assert "fwd_ms" not in out and "no times" in out

"""bench.smoke on the CPU: a wrong kernel or a crashing check is reported as a FAIL line (never an exception),
with exit status 1. Every check passing in the interpreter at small shapes, in both dtypes within its tolerance,
is tested end to end through the GPU check's smoke stage (tests/test_bench_gpu_check.py), which runs the full
set (TRITON_INTERPRET=1 set, as on a CPU machine that sets it; below, one check without it)."""
import subprocess
import sys

import pytest
import torch

from interpreter_site.sitecustomize import without_interpreter

pytest.importorskip("triton")
from bertfuse.bench import smoke  # noqa: E402


def test_a_wrong_kernel_fails_its_check():
    x = torch.randn(5, 8)
    good = smoke.compare("same", torch.float32, [x], lambda t: t * 2, lambda t: t * 2, ["y", "dx"])
    bad = smoke.compare("off", torch.float32, [x], lambda t: t * 2.001, lambda t: t * 2, ["y", "dx"])
    nan = smoke.compare("nan", torch.float16, [x], lambda t: t * float("nan"), lambda t: t * 2, ["y", "dx"])
    assert good.passed and not bad.passed and not nan.passed
    assert bad.line().startswith("FAIL off float32: max error") and "tolerance 1e-05" in bad.line()


def test_a_crashing_check_is_a_fail_line(monkeypatch, capsys):
    def broken(shapes, dtype, device):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setitem(smoke.CHECKS, "broken", broken)
    assert smoke.main(["--checks", "broken", "--dtypes", "float32", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL broken float32: RuntimeError: out of resources: shared memory" in out
    assert "1 failed" in out


@pytest.mark.slow
def test_on_a_bare_cpu_machine_it_switches_the_interpreter_on_itself(tmp_path):
    """Started without TRITON_INTERPRET (the GPU check's smoke stage test sets it, for speed), bench.smoke sets it
    before triton loads and runs its checks there."""
    env = without_interpreter()
    done = subprocess.run([sys.executable, "-m", "bertfuse.bench.smoke", "--checks", "bias_gelu", "--dtypes",
                           "float32"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cpu (Triton interpreter)" in done.stdout and "PASS bias_gelu float32" in done.stdout
    assert "1 passed, 0 failed" in done.stdout

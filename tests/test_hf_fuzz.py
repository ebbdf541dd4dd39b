"""The configuration fuzzer (bench/hf_fuzz.py): fused against unfused over random tiny models of every family and
random calls. Fast tier: a fixed seed with the real kernels in Triton's interpreter, the fuzzer's own
checks (it finds a planted error and prints the line that reruns it; a rerun line reproduces). Slow tier: a
bounded hypothesis run in the interpreter, and a larger one on the PyTorch path in a fresh process."""
import json
import os
import subprocess
import sys

import pytest

from interpreter_site.sitecustomize import without_interpreter

pytest.importorskip("transformers")
pytest.importorskip("hypothesis", reason="hypothesis is a test extra: pip install -e '.[test]'")
from bertfuse.bench import hf_fuzz  # noqa: E402
from bertfuse.bert import hf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_fixed_seed_finds_nothing_with_the_real_kernels():
    result = hf_fuzz.fuzz(25, 0)
    assert result["cases"] == 25 and result[hf_fuzz.SAME] > 0, result


def test_every_family_and_head_is_drawn():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as with_seed

    seen = set()

    @with_seed(5)
    @settings(max_examples=2000, database=None, suppress_health_check=list(HealthCheck))
    @given(hf_fuzz.cases())
    def draw(case):
        seen.add((case.family, case.head))

    draw()
    families = {f for f, _ in seen}
    assert families == set(hf_fuzz.FAMILIES) and {h for _, h in seen} == set(hf_fuzz.HEADS)


def test_the_fuzzer_finds_a_planted_error_and_prints_its_rerun_line(monkeypatch):
    """With the padded positions heads read (question answering's, a left-padded classifier's) dropped from the
    layout, the fuzzer finds a case whose answers differ, shrunk by hypothesis, and names the line that reruns
    it."""
    monkeypatch.setattr(hf.encoder, "_read_mask", lambda reads, keys: None)
    with pytest.raises(AssertionError) as e:
        hf_fuzz.fuzz(300, 0, families=["bert"])
    message = str(e.value).splitlines()[0]
    assert "differ" in message and "python -m bertfuse.bench.hf_fuzz --case '" in message
    case = hf_fuzz.Case(**json.loads(message.split("--case '", 1)[1].rstrip("'")))
    assert hf_fuzz.run(case) not in hf_fuzz.OUTCOMES
    monkeypatch.undo()
    assert hf_fuzz.run(case) == hf_fuzz.SAME


def test_a_rerun_line_with_a_broken_case_is_one_clear_line():
    out = subprocess.run([sys.executable, "-m", "bertfuse.bench.hf_fuzz", "--case", "{not json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().startswith("hf_fuzz: --case is not a case")
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_bounded_hypothesis_run_with_the_real_kernels_finds_nothing():
    result = hf_fuzz.fuzz(200, 11, minutes=4)
    assert result["cases"] >= 50 and result[hf_fuzz.SAME] > result["cases"] // 2, result


@pytest.mark.slow
def test_a_larger_run_on_the_pytorch_path_finds_nothing():
    env = without_interpreter()
    out = subprocess.run([sys.executable, "-m", "bertfuse.bench.hf_fuzz", "--cases", "1000", "--seed", "12",
                          "--minutes", "4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cases"] >= 200 and result[hf_fuzz.SAME] > result["cases"] // 2, result

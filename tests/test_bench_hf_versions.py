"""bench/hf_versions.py: the release sweep's record (only modules whose model types all came out clean; a release
recorded again replaces its record), its table (a cell per release and model type, FAILING where the fuzz failed)
and its command line. The sweep itself installs releases, which CI runs as `--tests-only`."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
from bertfuse.bench import hf_versions  # noqa: E402
from bertfuse.bert.hf import code  # noqa: E402


def test_record_adds_digests_only_where_every_model_type_came_out_clean(tmp_path, monkeypatch):
    monkeypatch.setattr(code, "CHECKED_FILE", tmp_path / "checked.json")
    result = {"transformers": "9.0.0",
              "families": {"a": {"clean": True, "module": "m1"}, "b": {"clean": False, "module": "m2"},
                           "c": {"clean": True, "module": "m2"}},
              "digests": {"m1": {"x.A": "d1"}, "m2": {"x.B": "d2"}, "attention functions": {"x.f": "d3"}}}
    assert hf_versions.record(result) == ["m1", "attention functions"]
    assert json.loads((tmp_path / "checked.json").read_text()) == {"x.A": {"d1": ["9.0.0"]}, "x.f": {"d3": ["9.0.0"]}}
    result["families"] = {"a": {"clean": False, "module": "m1"}}
    assert hf_versions.record({**result, "transformers": "9.1.0"}) == []
    assert hf_versions.record(result) == []  # a release recorded again: its earlier record goes
    assert json.loads((tmp_path / "checked.json").read_text()) == {}


def test_the_table_has_a_cell_per_release_and_model_type_and_names_what_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_versions, "RESULTS", tmp_path)
    fused = {"clean": True, "cell": "fused", "cases": 60, "same": 50, "seconds": 3.0}
    rows = {"5.0.0": {"when": "2026-12-07", "families": {
                "bert": {**fused, "cell": "the code of BertSelfAttention in the installed transformers 5.0.0 has not "
                                          "been checked"},
                "esm": {"clean": False, "why": "logits differ by 1e-1", "cases": 60, "seconds": 2.0}},
                      "tests": {"rc": 0, "summary": "150 passed", "seconds": 80.0}},
            "4.57.6": {"when": "2026-12-07", "families": {"bert": fused, "esm": {**fused, "cell": "absent"}}}}
    hf_versions.write_table(rows)
    table = (tmp_path / "README.md").read_text()
    assert "| model type | 4.57.6 | 5.0.0 |" in table
    assert "| bert | fused (60 cases, 50 answered, 3 s) | refused: BertSelfAttention's code not checked" in table
    assert "| esm | not in this release | **FAILING**: logits differ by 1e-1 |" in table
    assert "| compatibility tier | - | 150 passed (80 s) |" in table
    assert json.loads((tmp_path / "results.json").read_text()) == rows
    assert hf_versions.failing(rows["5.0.0"]) == ["esm: logits differ by 1e-1"]
    assert hf_versions.failing({**rows["4.57.6"], "tests": {"rc": 1, "summary": "1 failed"}}) == \
        ["compatibility tier: 1 failed"]


def test_the_command_without_a_release_is_one_usage_error():
    out = subprocess.run([sys.executable, "-m", "bertfuse.bench.hf_versions"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "name at least one transformers release" in out.stderr
    assert "Traceback" not in out.stderr

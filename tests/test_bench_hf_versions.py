"""bench/hf_versions.py: the release sweep's record (only modules whose model types all came out clean; a release
recorded again replaces its record), its table (a cell per release and model type, FAILING where the fuzz failed)
and its command line. The sweep itself installs releases, which CI runs as `--tests-only`."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from bertfuse.bench import hf_versions  # noqa: E402
from bertfuse.bench import hf_versions_cache as cache  # noqa: E402
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
            "4.57.6": {"when": "2026-12-07", "families": {"bert": fused, "esm": {**fused, "cell": "absent"}}},
            "5.4.0": {"when": "2026-12-07", "families": {
                "bert": {**fused, "cell": "not built by this release: TypeError: its configuration raises"}}}}
    hf_versions.write_table(rows)
    table = (tmp_path / "README.md").read_text()
    assert "| model type | fused from | 4.57.6 | 5.0.0 | 5.4.0 |" in table
    assert "| not built by this release: TypeError: its configuration raises (60 cases, 3 s) |" in table
    assert "| bert | - | fused (60 cases, 50 answered, 3 s) | refused: BertSelfAttention's code not checked" in table
    assert "| esm | - | not in this release | **FAILING**: logits differ by 1e-1 |" in table
    assert "| compatibility tier | | - | 150 passed (80 s) |" in table
    assert "Cells: 1 fused, 1 refused, 2 not in the release (or not built by it), 1 FAILING." in table
    assert hf_versions._fused_from([fused, {**fused, "cell": "x"}, fused, fused], ["1", "2", "3", "4"]) == "3"
    assert json.loads((tmp_path / "results.json").read_text()) == rows
    assert hf_versions.failing(rows["5.0.0"]) == ["esm: logits differ by 1e-1"]
    assert hf_versions.failing({**rows["4.57.6"], "tests": {"rc": 1, "summary": "1 failed"}}) == \
        ["compatibility tier: 1 failed"]


def _tree(tmp_path):
    """A copy of the files a fuzz's cache key reads (bench.hf_versions_cache.fuzz_sources), to change."""
    for f in {p for family in ("bert", "modernbert", "esm") for p in cache.fuzz_sources(family)}:
        dest = tmp_path / f.relative_to(cache.ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    return tmp_path


def test_a_change_redoes_only_the_model_types_whose_code_it_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "ROOT", _tree(tmp_path / "tree"))
    monkeypatch.setattr(code, "CHECKED_FILE", tmp_path / "checked.json")
    checked = {"transformers.models.bert.modeling_bert.BertLayer": {"d1": ["5.0.0"]}}
    code.CHECKED_FILE.write_text(json.dumps(checked))

    def keys():
        return {(f, mode): cache.fuzz_key(mode, f, m, "5.0.0", 45, 0) for f, m in
                (("bert", "bert.modeling_bert"), ("modernbert", "modernbert.modeling_modernbert"),
                 ("esm", "esm.modeling_esm")) for mode in ("record", "table")}

    before = keys()
    assert keys() == before and len(set(before.values())) == 6
    rotary = cache.ROOT / "bert" / "hf" / "rotary.py"
    rotary.write_text(rotary.read_text() + "\n# a change\n")
    changed = {k for k, v in keys().items() if v != before[k]}
    # rotary.py is ModernBERT's family module, and ESM's imports from it; BERT's code reads neither
    assert changed == {(f, m) for f in ("modernbert", "esm") for m in ("record", "table")}
    before = keys()
    checked["transformers.models.bert.modeling_bert.BertLayer"]["d1"].append("5.1.0")  # the same code again
    checked["transformers.models.roberta.modeling_roberta.RobertaLayer"] = {"d2": ["5.0.0"]}  # another module
    code.CHECKED_FILE.write_text(json.dumps(checked))
    assert keys() == before
    checked["transformers.models.bert.modeling_bert.BertLayer"]["d3"] = ["5.2.0"]  # new code recorded
    code.CHECKED_FILE.write_text(json.dumps(checked))
    assert {k for k, v in keys().items() if v != before[k]} == {("bert", "table")}
    tests = cache.tests_key("5.0.0", ("tests/test_hf.py",))
    assert cache.tests_key("5.0.0", ("tests/test_hf.py",)) == tests != cache.tests_key("5.1.0", ("tests/test_hf.py",))


def test_a_sweep_again_runs_only_what_its_cache_does_not_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_versions, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(hf_versions, "environment", lambda release, venvs: Path("python"))
    monkeypatch.setattr(hf_versions, "record", lambda result: [])
    runs = []

    def run_worker(python, mode, cases, seed, families=None):
        runs.append((mode, tuple(families)))
        return {"transformers": "5.0.0", "digests": {},
                "families": {f: {"clean": True, "cell": "fused", "cases": cases, "same": 1, "seconds": 0.1,
                                 "module": "m"} for f in families}}

    monkeypatch.setattr(hf_versions, "run_worker", run_worker)
    monkeypatch.setattr(hf_versions, "run_tests", lambda python: {"rc": 0, "summary": "1 passed", "seconds": 1.0})
    args = ["5.0.0", "--record", "--cases", "3", "--cache", str(tmp_path / "cache")]
    everything = tuple(hf_versions._families_modules())
    assert hf_versions.main(args) == 0
    assert runs == [("record", everything), ("table", everything)]
    runs.clear()
    assert hf_versions.main(args) == 0
    assert runs == [("record", ())]  # the digests only: every cell cached
    runs.clear()
    assert hf_versions.main([*args, "--fresh"]) == 0
    assert runs == [("record", everything), ("table", everything)]
    table = json.loads((tmp_path / "results" / "results.json").read_text())
    assert table["5.0.0"]["tests"]["summary"] == "1 passed" and set(table["5.0.0"]["families"]) == set(everything)


def test_the_command_without_a_release_is_one_usage_error():
    out = subprocess.run([sys.executable, "-m", "bertfuse.bench.hf_versions"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "name at least one transformers release" in out.stderr
    assert "Traceback" not in out.stderr

"""bench/hf_suite.py's bookkeeping (the run itself needs transformers' source distribution: bash bench/hf_suite.sh)."""
import pytest

from bertfuse.bench import hf_suite

transformers = pytest.importorskip("transformers")


def test_outcomes_and_regressions_from_junit_xml(tmp_path):
    xml = tmp_path / "run.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="t.C" name="test_a" time="0.1"/>'
                   '<testcase classname="t.C" name="test_b" time="0.1"><failure message="x"/></testcase>'
                   '<testcase classname="t.C" name="test_c" time="0.1"><skipped message="y"/></testcase>'
                   '<testcase classname="t.C" name="test_d" time="0.1"><error message="z"/></testcase>'
                   '</testsuite></testsuites>')
    got = hf_suite.outcomes(xml)
    assert got == {"test_a": "passed", "test_b": "failed", "test_c": "skipped", "test_d": "failed"}
    plain = {"test_a": "passed", "test_b": "passed", "test_c": "passed", "test_d": "failed", "test_e": "passed"}
    # passing unfused and failing, skipping or missing fused is a regression; failing both ways is not
    assert hf_suite.compare(plain, got) == ["test_b", "test_c", "test_e"]
    assert hf_suite.counts(got) == "1 passed, 2 failed, 1 skipped"
    assert hf_suite.outcomes(tmp_path / "never-written.xml") == {}


def test_a_group_where_nothing_passed_unfused_is_named():
    """No passing baseline means nothing was compared: the run must not read as "0 regressions"."""
    runs = [{"family": "albert", "heads": 4, "mode": "unfused", "outcomes": {"test_a": "passed"}},
            {"family": "albert", "heads": 4, "mode": "torch", "outcomes": {}},
            {"family": "mpnet", "heads": 2, "mode": "unfused", "outcomes": {"test_a": "failed", "test_b": "skipped"}},
            {"family": "bert", "heads": 2, "mode": "unfused", "outcomes": {}}]
    assert hf_suite.empty_baselines(runs) == ["mpnet (2 heads)", "bert (2 heads)"]


def test_plugin_finds_every_model_class_of_a_family():
    from bertfuse.bench.hf_testers import plugin

    names = {c.__name__ for c in plugin.model_classes(plugin.modeling_module("xlm-roberta"))}
    assert {"XLMRobertaModel", "XLMRobertaForMaskedLM", "XLMRobertaForCausalLM"} <= names


def test_layout_writes_the_stand_ins_and_our_testers(tmp_path):
    import tarfile

    archive = tmp_path / "transformers-0.0.tar.gz"
    src = tmp_path / "src" / "transformers-0.0" / "tests"
    src.mkdir(parents=True)
    (src / "test_modeling_common.py").write_text("X = 1\n")
    (src / "models").mkdir()
    (src / "models" / "deep.py").write_text("")  # only the top-level test modules are taken
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "transformers-0.0", arcname="transformers-0.0")
    work = tmp_path / "work"
    hf_suite.layout(archive, work)
    assert (work / "hf_tests" / "test_modeling_common.py").read_text() == "X = 1\n"
    assert not (work / "hf_tests" / "models").exists()
    assert "class GenerationTesterMixin" in (work / "hf_tests" / "generation" / "test_utils.py").read_text()
    assert (work / "test_fused_families.py").exists()


def test_collect_tabulates_each_familys_runs(tmp_path):
    import json

    def family(name, regressions):
        (tmp_path / name).mkdir()
        runs = [{"family": name, "heads": 4, "mode": m, "outcomes": {"test_a": "passed"}, "regressions": r}
                for m, r in (("unfused", []), ("torch", regressions))]
        (tmp_path / name / "summary.json").write_text(json.dumps({"transformers": "5.25.0", "runs": runs}))

    family("bert", [])
    family("mpnet", ["test_b"])
    table, bad = hf_suite.collect(tmp_path)
    assert bad == 1 and table.startswith("transformers 5.25.0: 2 families, 4 runs, 1 tests")
    assert "| mpnet | 4 | torch | 1 passed, 0 failed, 0 skipped | 1: test_b |" in table
    assert (tmp_path / "summary.md").read_text() == table + "\n"
    assert hf_suite.main(["--collect", "--out", str(tmp_path)]) == 1
    assert hf_suite.main(["--collect", "--out", str(tmp_path / "bert")]) == 2   # no family folders there

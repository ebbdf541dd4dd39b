"""bench.pretrain_runs and bert-bench --suite pretrain: bert-pretrain runs' summaries read into the report."""
import json
import sys

import pytest

from bertfuse.bench import pretrain_runs
from bertfuse.bench.cli import main as bench_main
from bertfuse.bert.pretrain import build_parser, train
from corpus_utils import write_corpus


@pytest.mark.slow
def test_two_phases_and_a_target_are_read_into_bert_benchs_report(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.txt", n_docs=30, sentences=10)
    common = ["--data", corpus, "--batch-size", "8", "--eval-every", "3", "--eval-fraction", "0.1", "--no-progress"]
    train(build_parser().parse_args(common + ["--train-tokenizer", "150", "--config", "tiny", "--max-seq-len", "64",
                                              "--steps", "6", "--output-dir", str(tmp_path / "phase1")]))
    train(build_parser().parse_args(common + ["--init-from", str(tmp_path / "phase1"), "--max-seq-len", "128",
                                              "--steps", "6", "--target-mlm-accuracy", "0.001",
                                              "--output-dir", str(tmp_path / "phase2")]))
    rows = pretrain_runs.read_runs([tmp_path / "phase1", tmp_path / "phase2"])
    one, two = rows
    assert (one["objective"], one["steps"], one["init_from"], one["target"]) == ("mlm+nsp", 6, None, None)
    assert two["init_from"] == str(tmp_path / "phase1") and two["reached"] and two["target_step"] == 3
    assert two["steps"] == 3 and two["target_tokens"] == two["tokens"] > 0
    (t1, a1), (t2, a2) = pretrain_runs.curves(rows)
    assert len(t1) == 2 and len(t2) == 1 and t2[0] > t1[-1] == one["tokens"]  # phase 2 goes on from phase 1
    assert (one["optimizer"], one["batch_size"]) == ("adamw", 8)
    assert "| phase2 | mlm+nsp | adamw | 8 | phase1 | 128 |" in pretrain_runs.table(rows)
    out = tmp_path / "report"
    assert bench_main(["--suite", "pretrain", "--pretrain-runs", str(tmp_path / "phase1"), str(tmp_path / "phase2"),
                       "--output-dir", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "## Pre-training runs" in printed and "Measured peaks" not in printed
    results = json.loads((out / "results.json").read_text())
    assert [r["run"] for r in results["pretrain"]] == ["phase1", "phase2"]
    assert (out / "pretrain.csv").exists() and ((out / "pretrain.png").exists() or "matplotlib" not in sys.modules)


def test_missing_runs_are_one_line_before_any_work(tmp_path, capsys):
    assert bench_main(["--suite", "pretrain", "--output-dir", str(tmp_path / "o")]) == 2
    assert "--suite pretrain reads bert-pretrain runs: give --pretrain-runs RUN..." in capsys.readouterr().err
    assert bench_main(["--suite", "pretrain", "--pretrain-runs", str(tmp_path), "--output-dir",
                       str(tmp_path / "o")]) == 2
    assert f"--pretrain-runs {tmp_path}: no summary.json" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

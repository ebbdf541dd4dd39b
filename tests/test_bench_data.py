"""bert-bench --suite data: every stage measured at a scale, its rows in results.json, errors named."""
import json
import os

import pytest

from bertfuse.bench import data
from bertfuse.bench.cli import main
from corpus_utils import write_wikipedia_jsonl


def test_a_scaled_corpus_is_every_document_scale_times_shuffled(tmp_path):
    from bertfuse.bert.data.text import iter_document_texts

    source = write_wikipedia_jsonl(tmp_path / "wiki.jsonl", n_docs=7)
    scaled = data.scaled_corpus(source, 3, str(tmp_path))
    docs, tripled = list(iter_document_texts(source)), list(iter_document_texts(scaled))
    assert sorted(map(tuple, tripled)) == sorted(map(tuple, docs * 3)) and tripled[:7] != docs
    assert data.scaled_corpus(source, 1, str(tmp_path)) == source


@pytest.mark.slow
def test_data_suite_writes_one_row_per_stage_and_scale(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(data, "MIN_TEXT_BYTES", 0)  # a corpus small enough for the CPU suite
    source = write_wikipedia_jsonl(tmp_path / "wiki.jsonl", n_docs=60, sentences=20)
    out = tmp_path / "out"
    assert main(["--suite", "data", "--corpus", source, "--scale", "1", "2", "--num-proc", "2",
                 "--output-dir", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["data"]
    units = {"tokenise": "MB/s", "instances": "tokens/s", "packing": "instances/s", "collation": "tokens/s/worker",
             "first_batch": "s"}
    assert {(r["stage"], r["scale"]) for r in rows} == {(stage, n) for stage in units for n in (1, 2)}
    for r in rows:
        assert r["unit"] == units[r["stage"]] and r["value"] > 0 and r["peak_rss_MB"] > 0
    assert {r["seq_len"] for r in rows if r["stage"] == "collation"} == {128, 512}
    tokens = {r["scale"]: r["tokens"] for r in rows if r["stage"] == "tokenise"}
    assert tokens[2] == 2 * tokens[1]  # the same documents, twice
    assert (out / "data.csv").exists() and "worker(s) feed" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--scale", "2"], "--scale applies to --suite data, not --suite all"),
    (["--suite", "data", "--scale", "0"], "--scale must be positive, got 0"),
    (["--suite", "data", "--corpus", "/no/such/corpus.txt"], "--corpus /no/such/corpus.txt: no such file"),
])
def test_data_suite_options_are_checked_with_one_line(tmp_path, capsys, flags, message):
    assert main(flags + ["--output-dir", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "results.json")


def test_a_corpus_too_small_to_time_is_refused_naming_the_scale_that_would_do(tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("One short sentence. And another one here.\n")  # 42 bytes
    assert main(["--suite", "data", "--corpus", str(tiny), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "x1 is 42 bytes of text, too little to measure a rate" in err and "--scale 24967 or more" in err
    assert "Traceback" not in err and not os.path.exists(tmp_path / "out" / "results.json")


def test_workers_needed_reads_the_fastest_gpu_rate_of_any_results_file(tmp_path):
    assert data.gpu_rate(str(tmp_path)) == (data.TARGET_GPU_TOKENS_PER_S, "the project's target (no GPU result yet)")
    (tmp_path / "nvidia-h200" / "run").mkdir(parents=True)
    rows = [{"device": "cuda", "status": "ok", "config": "base", "seq_len": 128, "tokens_per_s": 2.5e6,
             "variant": "ours-packed-graphs"},
            {"device": "cuda", "status": "ok", "config": "large", "seq_len": 128, "tokens_per_s": 9e6, "variant": "x"},
            {"device": "cpu", "status": "ok", "config": "base", "seq_len": 128, "tokens_per_s": 9e6, "variant": "y"}]
    (tmp_path / "nvidia-h200" / "run" / "results.json").write_text(json.dumps({"e2e": rows}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text("{not json")
    rate, where = data.gpu_rate(str(tmp_path))
    assert rate == 2.5e6 and "ours-packed-graphs" in where
    collation = [{"stage": "collation", "seq_len": 128, "scale": 1, "value": 1.0e6}]
    assert data.workers_needed(collation, str(tmp_path)) == \
        "s128 x1: 3 worker(s) feed 2,500,000 real tokens/s (ours-packed-graphs in nvidia-h200/run/results.json)"

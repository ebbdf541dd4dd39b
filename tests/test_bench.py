"""The benchmark's own pieces (no timing asserted): lengths, batches, FLOP counts, suites at tiny sizes, the CLI."""
import json
import os

import numpy as np
import pytest
import torch

from bertfuse import bert
from bertfuse import kernels  # noqa: F401  (triton imported now, interpreter on, before run_variant turns it off for itself)
from bertfuse.bench import e2e
from bertfuse.bench.batches import make_batch
from bertfuse.bench.cli import main
from bertfuse.bench.report import by_measure, plot
from bertfuse.bench import kernel_suite
from bertfuse.bench.lengths import WIKI_PERCENTILES, sample_lengths

PEAKS = {"copy_GBps": 10.0, "matmul_TFLOPs": 0.1, "matmul_dtype": "float32"}


@pytest.fixture(autouse=True)
def few_repeats(monkeypatch):
    monkeypatch.setattr("bertfuse.bench.peaks.CPU_REPEATS", (0, 1))


def test_lengths_follow_the_table_and_padding_levels():
    rng = np.random.default_rng(0)
    wiki = sample_lengths(20000, 10**6, "wiki", rng)
    assert abs(np.median(wiki) - WIKI_PERCENTILES[10]) <= 3
    for f in (0.0, 0.25, 0.5):
        lengths = sample_lengths(20000, 512, f, rng)
        assert lengths.min() >= 1 and lengths.max() <= 512
        assert abs(1 - lengths.mean() / 512 - f) < 0.01
    with pytest.raises(ValueError):
        sample_lengths(4, 128, 0.7, rng)


def test_batches_label_fifteen_percent_of_real_tokens():
    b = make_batch(256, 128, 30522, "wiki", seed=0)
    real = b.attention_mask.sum().item()
    assert abs(b.labelled / real - 0.15) < 0.01
    assert ((b.labels != -100) <= b.attention_mask.bool()).all()


def test_step_flops_counts_real_tokens():
    cfg = bert.BertConfig.base()
    one = e2e.step_flops(cfg, [128], 0)
    assert e2e.step_flops(cfg, [128, 128], 0) == 2 * one
    # about 6 x encoder parameters per token, plus attention
    assert 6 * 85e6 * 128 < one < 6 * 85e6 * 128 * 1.2


@pytest.mark.slow
def test_e2e_variants_run_in_process(monkeypatch):
    # run_variant turns the interpreter off for its own (normally fresh) process; put it back afterwards.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    spec = {"config": "tiny", "seq_len": 32, "batch": 4, "padding": "wiki", "dtype": "float32", "device": "cpu",
            "warmup": 1, "steps": 2}
    compiled = e2e.in_fresh_process(e2e.run_variant, "ours-packed-compile", dict(spec, compile_backend="aot_eager"))
    for row in [e2e.run_variant(v, spec) for v in ("hf-eager", "ours-torch", "ours-packed")] + [compiled]:
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and 0 <= row["padding_share"] < 1
    packed = e2e.run_variant("ours-packed", spec)
    assert packed["padding_share"] < 0.1 and packed["seqs_per_s"] > 0  # rows filled with several sequences
    assert "CUDA graphs need a GPU" in e2e.run_variant("ours-packed-graphs", spec)["status"]


@pytest.mark.slow
def test_a_fresh_process_reports_its_own_peak_memory_not_its_parents():
    """The CPU memory columns come from spawned children; ru_maxrss there is inherited across exec from the parent
    (a parent that once held 512 MB more made every child report that), VmHWM is the child's own."""
    held = np.ones(64 * 2**20)  # 512 MB, every page touched
    parent = e2e.peak_rss_mb()
    child = e2e.in_fresh_process(e2e.peak_rss_mb)
    del held
    assert parent - child > 400, (parent, child)


@pytest.mark.slow
def test_kernel_suites_at_tiny_sizes_on_this_device(device):
    from bertfuse.bench.ops import record, records

    every = []
    for r in records():
        if r.bench_shapes.cpu is None:  # timed in process; the memory ones below
            every += kernel_suite.rows(r, PEAKS, True, device, shapes=r.bench_shapes.tiny)
    _peer_rows_say_why(every)
    every, steps = by_measure(every)
    assert {(r["kernel"], r["impl"]) for r in steps} == {("lamb_step", "ours"), ("lamb_step", "torch-lamb"),
                                                         ("adamw_step", "torch-fused")}
    assert all(r["status"] == "ok" and r["step_ms"] > 0 and r["step_GBps"] > 0 for r in steps), steps
    rows = [r for r in every if r["impl"] in ("torch-eager", "ours", "sdpa-masked")]
    assert rows and all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    assert {r["impl"] for r in rows} == {"torch-eager", "ours", "sdpa-masked"}
    timed_here = {b.kernel for r in records() if r.bench_shapes.cpu is None for shape in r.bench_shapes.tiny
                  for b in r.bench(shape, device, torch.float32, True) if not b.step}  # what each record benchmarks
    assert {r["kernel"] for r in rows} == timed_here
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows)
    counted = ("attention", "disentangled")  # FLOP-counted; the other ops are counted in bytes
    assert all(r["fwd_bwd_GBps"] > 0 for r in rows if not r["kernel"].startswith(counted))
    assert all(r["fwd_TFLOPs"] > 0 for r in rows if r["kernel"].startswith(counted))
    # float32: each row with an exact reference is within float32 rounding of it; the dropout row has none
    exact = [r for r in rows if r["kernel"] != "layer_norm+residual+dropout"]
    assert all(r["rel_err_fp64"] < 1e-5 for r in exact), [(r["kernel"], r["impl"], r["rel_err_fp64"]) for r in exact]
    assert not any("rel_err_fp64" in r for r in rows if r["kernel"] == "layer_norm+residual+dropout")
    mlm_record = record("mlm_loss")
    mlm = kernel_suite.rows(mlm_record, PEAKS, True, torch.device("cpu"), shapes=mlm_record.bench_shapes.tiny)
    _peer_rows_say_why(mlm)
    ours = [r for r in mlm if r["impl"][:3] not in ("(d)", "(e)")]
    assert [r["impl"] for r in ours] == ["(a) full logits", "(b) gather+linear+CE", "(c) ours"]
    assert all(r["status"] == "ok" and r["peak_extra_MB"] >= 0 and r["rel_err_fp64"] < 1e-5 for r in ours[1:]), ours
    assert not [k for r in mlm for k in r if k.endswith(("_ms", "GBps", "TFLOPs"))]  # the CPU table times nothing


def _peer_rows_say_why(rows):
    """A peer that is not installed, does not import or fails here is a row saying so; one that ran is judged by
    its error to the float64 reference like ours."""
    peers = [r for r in rows if r["impl"].startswith(("liger", "flash_attn", "torch-varlen", "(d)", "(e)"))]
    for r in peers:
        assert r["status"] == "ok" or r["status"].startswith(("skipped: ", "failed: ")), r
        assert r["status"] != "ok" or "rel_err_fp64" in r, r


@pytest.mark.slow
def test_cli_writes_tables_json_csv_and_plots(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("bertfuse.bench.cli.measure_peaks", lambda device: PEAKS)
    out = tmp_path / "results"
    assert main(["--suite", "e2e", "--config", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "1",
                 "--variants", "hf-eager", "ours-torch", "--output-dir", str(out), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "| ours-torch | mlm+nsp | torch | bert | tiny | 32 |" in text and "CPU mode" in text
    assert "Configuration: BERT-tiny (2 layers, hidden 128, 2 heads), seq 32, batch 4, float32" in text
    assert "speedup_vs_hf-compile" not in text and "| vs_padded_eager | vs_strongest_hf | strongest_hf |" in text
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["peaks"] == PEAKS
    assert {r["variant"] for r in results["e2e"]} == {"hf-eager", "ours-torch"}
    assert any("speedup_vs_hf-eager" in r for r in results["e2e"] if r["variant"] == "ours-torch")
    for name in ("e2e.csv", "speedup.png"):
        assert (out / name).stat().st_size > 0


def test_padding_plot(tmp_path):
    rows = [{"variant": v, "config": "mini", "seq_len": 128, "padding": str(p), "status": "ok",
             "tokens_per_s": 1000.0 * (1 + p) * (2 if v == "ours-torch" else 1)}
            for v in ("hf-eager", "ours-torch") for p in (0.0, 0.25, 0.5)]
    assert plot(rows, str(tmp_path)) == ["speedup.png", "padding.png"]  # speedups at the first padding level too
    assert (tmp_path / "padding.png").stat().st_size > 0


@pytest.mark.slow
def test_cli_defaults_outside_the_source_tree_and_says_only_what_it_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("bertfuse.bench.cli.measure_peaks", lambda device: PEAKS)
    monkeypatch.chdir(tmp_path)
    assert main(["--suite", "e2e", "--config", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "1",
                 "--variants", "hf-eager", "ours-torch", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    (out,) = (tmp_path / "bert-bench-results").iterdir()
    assert out.name.startswith("cpu")
    assert sorted(p.name for p in out.iterdir()) == ["e2e.csv", "results.json", "speedup.png"]
    assert f"Wrote e2e.csv, results.json, speedup.png to {out}" in text
    assert text.index("Plan: end to end: hf-eager, ours-torch on tiny s32 b4, 1 timed steps each, 2 runs") \
        < text.index("Measured peaks")
    assert "Roughly" in text and "--full adds" in text


def test_the_speedup_plot_shows_throughput_spread_ratios_memory_and_the_configuration():
    import matplotlib

    matplotlib.use("Agg")
    from bertfuse.bench.report import add_e2e_speedups, configuration, measured_on, speedup_figure

    meta = {"device": "cpu-some-xeon", "date": "2026-12-05T10:00:00+00:00", "threads": 2, "torch": "2.13.0",
            "transformers": "5.25.0"}
    row = dict(config="mini", seq_len=128, batch=32, padding="wiki", dtype="float32", status="ok", peak_mem_MB=1000.0)
    rows = [dict(row, variant=v, objective="mlm", tokens_per_s=t, tokens_per_s_min=t - 100, tokens_per_s_max=t + 50)
            for v, t in (("hf-mlm-eager", 1000.0), ("hf-flat", 1250.0), ("ours-mlm", 3294.0))]
    add_e2e_speedups(rows)
    config = configuration(rows, meta)
    assert config == ("BERT-mini (4 layers, hidden 256, 4 heads), seq 128, batch 32, float32, 2 threads, torch 2.13.0, "
                      "transformers 5.25.0")
    (ax,) = speedup_figure(rows, measured_on(meta), config).axes
    assert [t.get_text() for t in ax.texts] == [
        "1,000 tok/s  1.00x padded eager  0.80x strongest HF  1,000 MB",
        "1,250 tok/s  1.25x padded eager  1.00x strongest HF  1,000 MB",
        "3,294 tok/s  3.29x padded eager  2.64x strongest HF  1,000 MB"]
    assert ax.get_title().endswith(f"\n{config}\ncpu-some-xeon, 2026-12-05")
    whiskers = [seg for c in ax.collections for seg in c.get_segments()]
    assert sorted((seg[0][0], seg[1][0]) for seg in whiskers) == [(900.0, 1050.0), (1150.0, 1300.0),
                                                                 (3194.0, 3344.0)]


def test_repeated_runs_give_the_median_run_and_a_spread_over_the_runs(capsys):
    from bertfuse.bench.report import e2e_table

    rows = [dict(variant="ours-mlm", objective="mlm", status="ok", steps=5, tokens_per_s=t, tokens_per_s_min=t / 2,
                 tokens_per_s_median=t, tokens_per_s_max=2 * t) for t in (300.0, 100.0, 200.0)]
    merged = e2e.median_run(rows)
    assert merged["tokens_per_s"] == 200.0 and merged["repeats"] == 3
    assert [merged[f"tokens_per_s_{k}"] for k in ("min", "median", "max")] == [100.0, 200.0, 300.0]
    failed = e2e.median_run(rows[:1] + [dict(variant="ours-mlm", status="failed: boom")])
    assert failed["status"] == "failed: boom" and failed["runs_done"] == 2
    assert e2e.median_run(rows[:1]) is rows[0]
    table = e2e_table([merged], {})
    assert "| 100 / 200 / 300 | 3 |" in table and "fastest of 3 runs, each in a fresh process" in table
    assert "fastest of 5 timed steps" in e2e_table(rows[:1], {})
    assert main(["--dry-run", "--suite", "e2e", "--variants", "hf-eager", "ours-torch", "--repeats", "3",
                 "--device", "cpu"]) == 0
    assert "5 timed steps each, 6 runs in fresh processes" in capsys.readouterr().out


def test_repeats_end_at_a_run_that_did_not_end_ok(monkeypatch):
    outcomes = iter([dict(status="ok", tokens_per_s=1.0), dict(status="left out: no flash attention"),
                     dict(status="ok", tokens_per_s=2.0)])
    calls = []
    monkeypatch.setattr(e2e, "in_fresh_process", lambda fn, *args: calls.append(args) or next(outcomes))
    row = e2e.repeated_run("hf-flat-fa", dict(repeats=3))
    assert len(calls) == 2 and row["status"] == "left out: no flash attention" and row["runs_done"] == 2


def test_speedups_are_over_padded_eager_and_the_strongest_transformers_row_of_the_same_objective():
    from bertfuse.bench.report import add_e2e_speedups, e2e_table

    shape = dict(family="bert", config="mini", seq_len=128, batch=32, padding="wiki", dtype="float32", status="ok")
    rows = [dict(shape, variant=v, objective=o, tokens_per_s=t) for v, o, t in (
        ("hf-eager", "mlm+nsp", 1000.0), ("hf-compile", "mlm+nsp", 1600.0), ("ours-torch", "mlm+nsp", 3200.0),
        ("hf-fused", "mlm+nsp", 9000.0),  # this project's layers: never the baseline
        ("hf-mlm-eager", "mlm", 1100.0), ("hf-flat", "mlm", 1300.0), ("hf-flat-compile", "mlm", 2000.0),
        ("ours-mlm", "mlm", 4000.0))]
    rows.append(dict(shape, variant="hf-flat-fa", objective="mlm", status="left out: flash attention needs a GPU"))
    add_e2e_speedups(rows)
    by = {r["variant"]: r for r in rows}
    assert (by["ours-torch"]["vs_padded_eager"], by["ours-torch"]["vs_strongest_hf"]) == (3.2, 2.0)
    assert by["ours-torch"]["strongest_hf"] == "hf-compile" and by["hf-fused"]["strongest_hf"] == "hf-compile"
    assert (by["ours-mlm"]["vs_padded_eager"], by["ours-mlm"]["vs_strongest_hf"]) == (4000 / 1100, 2.0)
    assert by["ours-mlm"]["strongest_hf"] == "hf-flat-compile"
    assert "speedup_vs_hf-eager" not in by["ours-mlm"]  # NSP's eager step is not an MLM-only row's baseline
    assert "vs_padded_eager" not in by["hf-flat-fa"]
    table = e2e_table(rows, {"threads": 2})
    header = table.splitlines()[2]
    assert "| strongest_hf |" in header and "MFU" not in header and "spread" not in header  # none measured
    assert "| hf-flat-fa | mlm |" in table and "left out: flash attention needs a GPU |" in table


def test_the_plots_are_drawn_again_from_a_results_file(tmp_path, capsys):
    from bertfuse.bench.report import main as replot

    rows = [{"variant": v, "config": "mini", "seq_len": 128, "padding": str(p), "status": "ok",
             "tokens_per_s": 1000.0 * (1 + p), "speedup_vs_hf-eager": 1.0 + p}
            for v in ("hf-eager", "ours-torch") for p in (0.0, 0.5)]
    (tmp_path / "results.json").write_text(json.dumps({"meta": {"device": "cpu", "date": "2026-12-05"}, "e2e": rows}))
    assert replot([str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["padding.png", "speedup.png"]
    assert replot([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench.report: cannot read") and "\n" not in err


def test_padding_plot_needs_two_levels(tmp_path):
    rows = [{"variant": "ours-torch", "config": "mini", "seq_len": 128, "padding": "0.25", "status": "ok",
             "tokens_per_s": 1000.0}]
    assert plot(rows, str(tmp_path)) == []
    assert not (tmp_path / "padding.png").exists()


def test_quick_cpu_default_leaves_out_compile():
    from bertfuse.bench.cli import default_variants, e2e_specs, parse_args

    assert default_variants(False) == ["hf-eager", "ours-torch", "ours-packed", "hf-mlm-eager", "hf-flat", "ours-mlm",
                                       "ours-mlm-packed"]
    for name in ("hf-compile", "ours-packed-compile", "hf-mlm-compile", "hf-flat-compile"):
        assert name in default_variants(False, full=True) and name in default_variants(True)
    assert "ours-packed-graphs" in default_variants(True) and "ours-packed-graphs" not in default_variants(False, True)
    gpu = default_variants(True)  # every variant, the headline comparisons first (a run cut short keeps them)
    assert set(gpu) == set(e2e.VARIANTS) and gpu[:3] == ["ours-triton", "hf-eager", "hf-compile"]
    assert gpu.index("hf-flat-flex") < gpu.index("ours-packed-compile")
    (spec,) = e2e_specs(parse_args([]), cuda=False)
    assert (spec["config"], spec["steps"], spec["warmup"]) == ("mini", 5, 2)


def test_bad_padding_is_one_line_before_any_work(capsys):
    assert main(["--padding", "0.7", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bert-bench: error: --padding 0.7: use 'wiki' or a padding fraction") and "Traceback" not in err


@pytest.mark.slow
def test_encode_suite_on_the_cpu(tmp_path, capsys, monkeypatch):
    """Forward-only encoding, eager against fused (its PyTorch path on a CPU), in fresh processes."""
    monkeypatch.setattr("bertfuse.bench.cli.measure_peaks", lambda device: PEAKS)
    assert main(["--suite", "encode", "--encode-models", "minilm", "--batch", "2", "--device", "cpu",
                 "--output-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())["encode"]
    assert [(r["variant"], r["status"]) for r in rows] == [("hf-eager", "ok"), ("hf-fused", "ok")]
    assert rows[1]["sentences_per_s"] > 0 and "speedup_vs_hf-eager" in rows[1]
    assert "## Encoding (forward only, no gradients)" in text and (tmp_path / "encode.csv").exists()


def test_qa_suite_plan(capsys):
    from bertfuse.bench import qa

    (plan,) = qa.specs(False, False, None, None)
    assert plan["seq_len"] == 384 and plan["variants"] == list(qa.VARIANTS) and plan["model"] == "minilm"
    assert main(["--suite", "qa", "--device", "cpu", "--dry-run"]) == 0
    assert "qa: hf-eager, hf-fused, hf-fused-zero on minilm s384 b8" in capsys.readouterr().out


@pytest.mark.slow
def test_qa_step_rows_unfused_fused_exact_and_zero():
    """The question-answering suite's rows on a short row, each in a fresh process (the fused model's PyTorch
    path on this CPU): each variant ok, the exact fused one running every call fused, SQuAD-shaped padding."""
    from bertfuse.bench import qa

    spec = {"model": "minilm", "batch": 2, "seq_len": 48, "device": "cpu", "dtype": "float32", "warmup": 0,
            "steps": 1}
    rows = [e2e.in_fresh_process(qa.run_variant, v, spec) for v in qa.VARIANTS]
    assert [(r["variant"], r["status"]) for r in rows] == [(v, "ok") for v in qa.VARIANTS]
    assert all(r["tokens_per_s"] > 0 and 0 <= r["padding"] < 1 for r in rows)


@pytest.mark.slow
def test_roberta_family_step_runs_eager_and_fused():
    spec = {"family": "roberta", "config": "tiny", "seq_len": 32, "batch": 4, "padding": "wiki",
            "dtype": "float32", "device": "cpu", "warmup": 1, "steps": 2}
    for variant in ("hf-eager", "hf-fused"):  # fresh processes: the fused model's PyTorch path on this CPU
        row = e2e.in_fresh_process(e2e.run_variant, variant, spec)
        assert row["status"] == "ok" and row["family"] == "roberta", row


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "--device tpu: use cuda (or cuda:N) or cpu"),
    (["--seq-len", "0"], "--seq-len 0: must be in [8, 512]"),
    (["--seq-len", "128", "1024"], "--seq-len 1024: must be in [8, 512]"),
    (["--steps", "-3"], "--steps must be positive, got -3"),
    (["--steps", "0"], "--steps must be positive, got 0"),
    (["--batch", "0"], "--batch must be positive, got 0"),
    (["--padding", "abc"], "--padding abc: use 'wiki' or a padding fraction"),
    (["--suite", "encode", "--families", "roberta"], "--families applies to the end-to-end suite"),
    (["--suite", "e2e", "--encode-models", "minilm"], "--encode-models applies to --suite encode"),
])
def test_bad_options_are_one_line_before_any_work(argv, message, capsys, tmp_path):
    assert main(argv + ["--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bert-bench: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(capsys):
    assert main(["--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device is available here" in capsys.readouterr().err


def test_ctrl_c_writes_what_finished_and_says_so(tmp_path, capsys, monkeypatch):
    """Ctrl-C during the second variant: the first variant's row is kept and written, with one line saying so
    (it was a traceback, and the finished result was thrown away)."""
    monkeypatch.setattr("bertfuse.bench.cli.measure_peaks", lambda device: PEAKS)
    calls = []

    def fake(fn, variant, spec):
        calls.append(variant)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return dict(spec, variant=variant, status="ok", tokens_per_s=100.0, TFLOPs=0.01, step_ms=1.0)

    monkeypatch.setattr(e2e, "in_fresh_process", fake)
    out = tmp_path / "o"
    assert main(["--suite", "e2e", "--config", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "1",
                 "--variants", "hf-eager", "ours-torch", "--output-dir", str(out), "--device", "cpu"]) == 130
    err = capsys.readouterr().err
    assert "Interrupted: wrote e2e.csv, results.json" in err and "with the 1 row(s) that finished" in err
    assert "Traceback" not in err
    assert [r["variant"] for r in json.loads((out / "results.json").read_text())["e2e"]] == ["hf-eager"]


def test_a_later_run_leaves_no_stale_files_of_an_earlier_one(tmp_path, monkeypatch):
    monkeypatch.setattr("bertfuse.bench.cli.measure_peaks", lambda device: PEAKS)
    out = tmp_path / "o"
    out.mkdir()
    for name in ("e2e.csv", "speedup.png", "padding.png"):
        (out / name).write_text("from an earlier run")
    def rows(record, peaks, quick, device, on_row):
        on_row({"kernel": record.name, "status": "ok"})

    monkeypatch.setattr("bertfuse.bench.kernel_suite.rows", rows)
    assert main(["--suite", "kernels", "--output-dir", str(out), "--device", "cpu"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["kernels.csv", "results.json"]

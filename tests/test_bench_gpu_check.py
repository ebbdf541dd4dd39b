"""bench/gpu_check.sh, bench.summary and bench.targets on the CPU: the staged check runs its smoke stage in the
interpreter and leaves a summary and one archive; targets read benchmark rows as met, not met or not measured."""
import json
import os
import subprocess
import tarfile

import pytest

from bertfuse.bench import precompile
from bertfuse.bench.smoke import checks
from bertfuse.bench.summary import render
from bertfuse.bench.targets import evaluate, targets
from interpreter_site.sitecustomize import subprocess_env, without_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")


def run(*args, timeout=300, interpret=False):
    """The script as on a bare machine, where it decides on the interpreter itself; with `interpret`, as on a CPU
    machine with TRITON_INTERPRET=1 set, whose processes then run the interpreter at the tests' speed (its
    sitecustomize, tests/interpreter_site, acts on TRITON_INTERPRET=1 set at a process's start)."""
    env = without_interpreter()
    if interpret:
        env = subprocess_env(dict(env, TRITON_INTERPRET="1"))
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_smoke_stage_on_the_cpu_leaves_a_summary_and_one_archive(tmp_path):
    """The smoke stage runs bench.smoke's full set in the interpreter (this is bench.smoke's end-to-end test too):
    every check passes in both dtypes within its tolerance, and the stage leaves a summary and one archive."""
    out = tmp_path / "out"
    done = run(str(out), "--budget", "300", "--stages", "smoke", timeout=600, interpret=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["all.tar.gz", "summary.md"]  # raw/ packed, then removed
    summary = (out / "summary.md").read_text()
    # every smoke check, run in two dtypes
    assert "| smoke | ok |" in summary and f"{2 * len(checks())} passed, 0 failed" in summary
    assert "not measured" in summary and "## GPU tests" in summary
    with tarfile.open(out / "all.tar.gz") as tar:
        names = {os.path.normpath(n) for n in tar.getnames()}
        smoke_json = next(m for m in tar.getmembers() if os.path.normpath(m.name) == "smoke.json")
        results = json.load(tar.extractfile(smoke_json))
    assert {"smoke.json", "smoke.log", "stages.tsv", "environment.json", "summary.md"} <= names
    assert "PASS attention dropout0.1 float16" in done.stdout
    assert len(results) == 2 * len(checks()) and all(r["passed"] for r in results)
    assert {r["dtype"] for r in results} == {"float32", "float16"}
    assert done.stdout.count("PASS ") == len(results) and "0 failed" in done.stdout
    for r in results:
        assert 0 <= r["error"] <= r["tolerance"]


def test_arguments_are_checked(tmp_path):
    assert run("--help").returncode == 0 and "--stages" in run("--help").stdout
    bad = run(str(tmp_path), "--stages", "smoke,nonsense")
    assert bad.returncode == 2 and "unknown stage 'nonsense'" in bad.stderr
    assert run(str(tmp_path), "--budget", "soon").returncode == 2
    assert run().returncode == 2


@pytest.mark.slow
def test_the_dry_run_lists_the_padding_free_rows_and_the_transformers_they_run_on(tmp_path):
    """No OUT_DIR, no GPU: each stage's time, and the end-to-end rows bert-bench will run on a GPU, with the
    transformers the stage takes (the carried wheels where .gpu_deps/wheels has them, else the image's)."""
    done = run("--dry-run", "--budget", "600", "--stages", "smoke,e2e")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "== stage smoke: about 218 s" in out and "== stage e2e: about 381 s" in out and "tests" not in out
    carried = os.path.exists(os.path.join(ROOT, ".gpu_deps", "wheels"))
    assert ("(carried in .gpu_deps/wheels)" in out) == carried
    assert "Padding-free rows on transformers " in out and "hf-flat-flex (flex_attention)" in out
    assert "hf-flat-compile (sdpa)" in out and "hf-flat-fa (the newest flash attention" in out
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_a_cut_stage_is_reported_and_later_stages_still_run(tmp_path):
    out = tmp_path / "out"
    # Every stage gets at least 10 s; the GPU-test stage (pytest processes all at once) needs more than that.
    done = run(str(out), "--budget", "1", "--stages", "tests,tune", "--keep-raw")
    summary = (out / "summary.md").read_text()
    assert "| tests | cut |" in summary and "Cut at their time limit" in summary, summary
    assert "| tune | skipped |" in summary  # no GPU here: nothing to tune
    assert done.returncode == 0 and (out / "raw" / "stages.tsv").exists()


def rows():
    kernels = []
    for kernel in ("layer_norm+residual+dropout", "bias_gelu"):
        row = {"kernel": kernel, "shape": "16384x768", "dtype": "bfloat16", "status": "ok"}
        kernels += [dict(row, impl="ours", fwd_bwd_ms=1.0, fwd_bwd_GBps=4000.0, copy_share=0.9),
                    dict(row, impl="torch-compile", fwd_bwd_ms=0.8)]
    att = dict(kernel="attention", shape="b64 s512 h12 d64", seq_len=512, head_dim=64, dtype="bfloat16", status="ok")
    kernels += [dict(att, impl="ours", padding=0.0, fwd_TFLOPs=400.0, bwd_TFLOPs=200.0, fwd_bwd_ms=1.0),
                dict(att, impl="torch-varlen_attn", padding=0.0, fwd_bwd_ms=1.2),
                dict(att, impl="ours", padding=0.5, fwd_bwd_ms=0.5),
                dict(att, impl="sdpa-masked", padding=0.5, fwd_bwd_ms=1.1),
                dict(att, impl="flash_attn-varlen", padding=0.0, fwd_bwd_ms=1.1)]
    ln = dict(kernel="layer_norm+residual", shape="16384x768", dtype="bfloat16", status="ok")
    kernels += [dict(ln, impl="ours", fwd_bwd_ms=1.0), dict(ln, impl="liger-layer_norm", fwd_bwd_ms=1.1)]
    # The rotary encoders' ops, each met: at 90% of copy, faster than torch.compile and than Liger-Kernel.
    for kernel, liger in (("glu gelu", None), ("glu silu", None), ("rms_norm+residual prenorm", "liger-rms_norm"),
                          ("rotary", "liger-rope")):
        row = {"kernel": kernel, "shape": "16384x1152", "dtype": "bfloat16", "status": "ok"}
        kernels += [dict(row, impl="ours", fwd_bwd_ms=0.7, fwd_bwd_GBps=4000.0, copy_share=0.9),
                    dict(row, impl="torch-compile", fwd_bwd_ms=0.8)]
        kernels += [dict(row, impl=liger, fwd_bwd_ms=0.9)] if liger else []
    win = dict(att, kernel="attention+window", shape="b64 s512 h12 d64 window64+64", padding=0.25)
    kernels += [dict(win, impl="ours", fwd_bwd_ms=0.3), dict(win, impl="flash_attn-varlen", fwd_bwd_ms=0.33)]
    # DeBERTa's attention layer, met: twice transformers' eager, faster than both Triton peers.
    deb = dict(kernel="disentangled", shape="b64 s512 h12 d64 pad0%", seq_len=512, padding=0.0, head_dim=64,
               dtype="bfloat16", status="ok")
    kernels += [dict(deb, impl="ours", fwd_bwd_ms=1.0), dict(deb, impl="hf-eager", fwd_bwd_ms=2.5),
                dict(deb, impl="disentangled_flash", fwd_bwd_ms=1.1), dict(deb, impl="flashdeberta-varlen",
                                                                        fwd_bwd_ms=1.3)]
    mlm = dict(kernel="mlm_loss", shape="32768 tok x H768", hidden=768, tokens=32768, dtype="bfloat16", status="ok")
    kernels += [dict(mlm, impl="(a) full logits", peak_extra_MB=6000.0, fwd_bwd_ms=9.0),
                dict(mlm, impl="(b) gather+linear+CE", peak_extra_MB=900.0, fwd_bwd_ms=3.0),
                dict(mlm, impl="(c) ours", peak_extra_MB=70.0, fwd_bwd_ms=2.0),
                dict(mlm, impl="(d) liger fused linear CE", peak_extra_MB=400.0, fwd_bwd_ms=2.5),
                dict(mlm, impl="(e) cut cross-entropy, no bias", peak_extra_MB=100.0, fwd_bwd_ms=1.8),
                dict(mlm, impl="(c) ours", shape="131072 tok x H1024", hidden=1024, tokens=131072,
                     peak_extra_MB=800.0, fwd_bwd_ms=9.0)]
    # The optimizer step: LAMB at 70% of copy (not met) and 5x faster than the plain PyTorch LAMB (met).
    step = dict(kernel="lamb_step", shape="base", dtype="bfloat16", measure="step", status="ok")
    kernels += [dict(step, impl="ours", step_ms=2.0, step_GBps=2800.0, copy_share=0.7),
                dict(step, impl="torch-lamb", step_ms=10.0), dict(step, kernel="adamw_step", impl="torch-fused",
                                                                   step_ms=1.5)]
    e2e = dict(family="bert", config="base", seq_len=128, padding="wiki", dtype="bfloat16", batch=256, status="ok")
    enc = dict(batch=256, dtype="bfloat16", seq_len=128, status="ok")
    return {"meta": {"device": "NVIDIA H200", "peaks": {"matmul_TFLOPs": 700.0, "copy_GBps": 4000.0}},
            "kernels": kernels,
            "e2e": [dict(e2e, variant="hf-eager", tokens_per_s=300e3),
                    dict(e2e, variant="hf-flat-flex-compile", objective="mlm", tokens_per_s=600e3),
                    dict(e2e, variant="ours-mlm", objective="mlm", tokens_per_s=840e3, vs_strongest_hf=1.4),
                    dict(e2e, variant="hf-compile", tokens_per_s=500e3),
                    dict(e2e, variant="ours-triton", tokens_per_s=900e3,
                         **{"speedup_vs_hf-eager": 3.0, "speedup_vs_hf-compile": 1.8}),
                    dict(e2e, variant="ours-packed-graphs", tokens_per_s=960e3, **{"speedup_vs_hf-eager": 3.2}),
                    dict(e2e, variant="ours-packed", config="large", seq_len=512, batch=32, seqs_per_s=800.0),
                    dict(e2e, family="roberta", variant="hf-fused", tokens_per_s=500e3, **{"speedup_vs_hf-eager": 1.9})],
            "encode": [dict(enc, model="bert-base", variant="hf-fused", sentences_per_s=9000.0,
                            **{"speedup_vs_hf-eager": 1.6})]}


def test_targets_read_the_benchmark_rows():
    verdicts = {v.name: v for v in evaluate(rows())}
    assert len(verdicts) == len(targets())
    met = {name for name, v in verdicts.items() if v.met}
    not_met = {name for name, v in verdicts.items() if v.met is False}
    assert not_met == {"LayerNorm+residual+dropout vs torch.compile", "bias-GeLU vs torch.compile",
                       "attention bwd, d64 s512 bf16", "MLM loss extra memory vs full logits, H768",
                       "MLM loss time vs Cut Cross-Entropy (no bias)",
                       "RoBERTa-base step s128 wiki bf16, fused HF vs HF eager",
                       "BERT-large step s512 wiki bf16, packed", "LAMB step bandwidth"}
    unmeasured = {name for name, v in verdicts.items() if v.met is None}
    assert unmeasured == {"encode RoBERTa-base, batch 256, wiki lengths, bf16: fused vs HF SDPA"}
    assert len(met) + len(not_met) + 1 == len(targets())
    assert verdicts["encode BERT-base, batch 256, wiki lengths, bf16: fused vs HF SDPA"].value.startswith("1.60x")
    assert verdicts["attention vs torch varlen_attn, s512"].value.startswith("1.20x")
    assert verdicts["BERT-base step s128 wiki bf16 throughput"].value == "900,000 tokens/s"
    assert verdicts["BERT-base step s128 wiki bf16, packed + CUDA graphs vs HF eager"].met
    assert verdicts["BERT-large step s512 wiki bf16, packed"].value == "800 sequences/s"
    strongest = verdicts["BERT-base MLM-only step s128 wiki bf16 vs the strongest transformers (padded, "
                         "padding-free, compiled, flex, flash attention)"]
    assert strongest.met and strongest.value == "1.40x"
    assert verdicts["MLM loss time vs Liger fused linear CE"].value.startswith("1.25x")
    assert verdicts["MLM loss extra memory, BERT-large 256 x 512"].value == "800 MB"
    assert verdicts["attention vs flash-attn varlen, every shape"].value.startswith("1.10x")
    assert verdicts["LAMB step vs plain PyTorch LAMB"].met and verdicts["LAMB step vs plain PyTorch LAMB"].value \
        .startswith("5.00x")
    assert verdicts["LAMB step bandwidth"].value.startswith("70% of copy")
    assert all(v.met is None and v.status == "not measured" for v in evaluate({}))


def test_summary_of_a_partial_run(tmp_path):
    import json

    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "results.json").write_text(json.dumps({"kernels": rows()["kernels"],
                                                                   "meta": rows()["meta"]}))
    (tmp_path / "stages.tsv").write_text("smoke\tok\t40\t72\ntests\tcut\t96\t96\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_attention.log").write_text("FAILED tests/test_attention.py::test_x - boom\n"
                                                           "1 failed, 3 passed in 9.1s\n")
    (tmp_path / "smoke.json").write_text(json.dumps([{"name": "mlm_loss", "dtype": "bfloat16", "passed": False,
                                                     "error": 0.5, "tolerance": 0.01, "worst": "dweight",
                                                     "detail": ""}]))
    text = render(str(tmp_path))
    assert "Cut at their time limit (partial results kept): tests." in text
    assert "- test_attention: 1 failed, 3 passed in 9.1s" in text
    assert "FAILED tests/test_attention.py::test_x - boom" in text
    assert "- FAIL mlm_loss bfloat16: error 0.5, tolerance 0.01" in text
    assert "| attention fwd, d64 s512 bf16 | >= 350 TFLOP/s (H200) | 400 TFLOP/s | met |" in text
    assert "| BERT-base step s128 wiki bf16 throughput | >= 0.8M real tokens/s (H200) |  | not measured |" in text
    assert "| mlm_loss | 32768 tok x H768 | (d) liger fused linear CE | 2.5 | 400 |  | ok |" in text
    assert "## Optimizer steps" in text and "| lamb_step | base |  | ours | 2 | 2,800 | 0.7 |  | ok |" in text
    assert "| lamb_step |" not in text.split("## Optimizer steps")[0]  # not in the forward + backward table
    assert "## Pre-training step: ours against what transformers users run\n\nnot run" in text
    (tmp_path / "e2e").mkdir()
    meta = dict(rows()["meta"], padding_free="Padding-free rows on transformers 5.25.0: hf-flat (sdpa)")
    (tmp_path / "e2e" / "results.json").write_text(json.dumps({"e2e": rows()["e2e"], "meta": meta}))
    text = render(str(tmp_path))
    assert "Padding-free rows on transformers 5.25.0: hf-flat (sdpa)" in text
    assert "| ours-mlm | mlm | bert | base | 128 | 256 | wiki | bfloat16 | 840,000 |" in text
    assert "| 1.4 | hf-flat-flex-compile | ok |" in text  # over the strongest transformers row: 840k / 600k


def test_precompile_runs_pieces_in_workers_and_reports_failures():
    import math

    errors = precompile.run([(math.sqrt, 4.0), (math.sqrt, -1.0)], workers=2, log=lambda *_: None)
    assert len(errors) == 1 and "ValueError" in errors[0]
    pieces = precompile.jobs(["attention"], ["hf-eager", "ours-triton"], [{"config": "base", "seq_len": 128}],
                             True, "cuda")
    assert [p[0].__name__ for p in pieces] == ["_warm_suite", "_warm_variant"]

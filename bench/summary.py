"""`python -m bertfuse.bench.summary RAW_DIR OUTPUT.md`: one page from a GPU check's raw outputs (bench/gpu_check.sh).

Reads what the stages left in RAW_DIR, each part optional (a stage cut short or not run leaves less):
environment.json, stages.tsv (stage, status, seconds, allowed seconds), smoke.json, tests/*.log (pytest),
e2e/, kernels/, encode/ and qa/results.json (bert-bench), tune.log and configs/*.json (bench.tune). Writes the
targets table (bench/targets.py) with the measured value and met / not met, the pre-training step's table
(ours against transformers padded, padding-free, compiled, with flex and flash attention), the question-answering
fine-tuning step's (unfused, fused exact, fused with padding removed), every kernel row
beside its peers' (time, extra memory, error to float64), every smoke and test failure, the environment and the
stages that were cut.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys

from .report import STEP_COLUMNS, add_e2e_speedups, add_speedups, by_measure, e2e_table, markdown
from .targets import evaluate


def _json(path, default):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _results(raw: str) -> dict:
    """The e2e and kernel rows of both bench stages, as one results.json would hold them."""
    merged = {"e2e": [], "kernels": [], "encode": [], "qa": [], "meta": {}}
    for stage in ("e2e", "kernels", "encode", "qa"):
        part = _json(os.path.join(raw, stage, "results.json"), {})
        for suite in ("e2e", "kernels", "encode", "qa"):
            merged[suite] += part.get(suite, [])
        merged["meta"] = merged["meta"] or part.get("meta", {})
    add_e2e_speedups(merged["e2e"])  # a cut stage saved its rows but not the speedups
    add_speedups(merged["encode"], keys=("model", "batch", "seq_len", "dtype"), metric="sentences_per_s")
    add_speedups(merged["qa"], keys=("model", "batch", "seq_len", "dtype"), metric="tokens_per_s")
    return merged


def _stages(raw: str) -> list[dict]:
    rows = []
    try:
        with open(os.path.join(raw, "stages.tsv"), encoding="utf-8") as f:
            for line in f:
                name, status, seconds, allowed = line.rstrip("\n").split("\t")
                rows.append({"stage": name, "status": status, "seconds": int(seconds), "allowed": int(allowed)})
    except (OSError, ValueError):
        pass
    return rows


def _test_lines(raw: str) -> tuple[list[str], list[str]]:
    """(one summary line per test file, every FAILED/ERROR line)."""
    summaries, failures = [], []
    for path in sorted(glob.glob(os.path.join(raw, "tests", "*.log"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        name = os.path.basename(path)[:-4]
        tail = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", ln)]
        summaries.append(f"{name}: {tail[-1].strip('= ') if tail else 'no result (cut short?)'}")
        failures += [f"{name}: {ln}" for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return summaries, failures


def render(raw: str) -> str:
    env = _json(os.path.join(raw, "environment.json"), {})
    lines = ["# GPU check summary", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()] or ["- environment: not recorded"]
    stages = _stages(raw)
    lines += ["", "## Stages", "", markdown(stages, ["stage", "status", "seconds", "allowed"]) if stages
              else "(no stage ran)"]
    cut = [s["stage"] for s in stages if s["status"] == "cut"]
    if cut:
        lines += ["", f"Cut at their time limit (partial results kept): {', '.join(cut)}."]
    results = _results(raw)
    verdicts = evaluate(results)
    lines += ["", "## Targets", "", markdown([v._asdict() | {"status": v.status} for v in verdicts],
                                            ["name", "goal", "value", "status"])]
    e2e = results.get("e2e", [])
    lines += ["", "## Pre-training step: ours against what transformers users run", ""]
    if e2e:
        meta = results.get("meta", {})
        lines += ([meta["padding_free"], ""] if meta.get("padding_free") else []) + [e2e_table(e2e, meta)]
    else:
        lines.append("not run")
    qa = results.get("qa", [])
    lines += ["", "## Question answering: one fine-tuning step on SQuAD-shaped padded batches", "",
              markdown(qa, ["variant", "model", "batch", "seq_len", "dtype", "padding", "step_ms", "tokens_per_s",
                            "speedup_vs_hf-eager", "status"]) if qa else "not run"]
    kernels = results.get("kernels", [])
    ops, steps = by_measure(kernels)
    lines += ["", "## Kernels and their peers", "", "Each row's time, extra memory and error to the float64 "
              "reference (where there is one), so a fast row can be seen to be right.", "",
              markdown(ops, ["kernel", "shape", "impl", "fwd_bwd_ms", "peak_extra_MB", "rel_err_fp64", "status"])
              if kernels else "not run"]
    if steps:
        lines += ["", "## Optimizer steps", "", markdown(steps, STEP_COLUMNS)]
    smoke = _json(os.path.join(raw, "smoke.json"), None)
    lines += ["", "## Smoke", ""]
    if smoke is None:
        lines.append("not run")
    else:
        failed = [r for r in smoke if not r["passed"]]
        lines.append(f"{len(smoke) - len(failed)} passed, {len(failed)} failed")
        lines += [f"- FAIL {r['name']} {r['dtype']}: error {r['error']:.3g}, tolerance {r['tolerance']:.3g} "
                  f"{(r.get('detail') or '').splitlines()[0] if r.get('detail') else ''}" for r in failed]
    summaries, failures = _test_lines(raw)
    lines += ["", "## GPU tests", ""] + ([f"- {s}" for s in summaries] or ["not run"])
    if failures:
        lines += ["", "Failures:", ""] + [f"- {f}" for f in failures]
    tables = sorted(glob.glob(os.path.join(raw, "configs", "*.json")))
    lines += ["", "## Tuning", ""]
    for path in tables:
        table = _json(path, {})
        entries = sum(len(v) for v in table.get("kernels", {}).values())
        lines.append(f"- {os.path.basename(path)}: {entries} tuned entries (copy to kernels/configs/ to use them)")
    if not tables:
        lines.append("no table written")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m bertfuse.bench.summary RAW_DIR OUTPUT.md", file=sys.stderr)
        return 2
    text = render(argv[0])
    tmp = argv[1] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, argv[1])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

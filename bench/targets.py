"""The speed and memory targets of the project, evaluated on a benchmark's results (never asserted in tests).

Each target reads the rows of `results.json` (`bert-bench`) and gives (value, met): met is None when the rows
it needs were not measured (a stage cut short, a CPU run, a peer that is not installed).

Most targets are relative (a share of the measured copy bandwidth, a speedup over a peer) and mean the same on
every GPU. The absolute ones (attention TFLOP/s, training throughput) are set for an H200; on another GPU their
bound is scaled by that run's measured matmul throughput (`meta.peaks`, bench/peaks.py) over the H200's, read from
the H200 results committed under bench/results/ (until one is committed, they are not judged elsewhere).
"""
from __future__ import annotations

import glob
import json
import os
from typing import Callable, NamedTuple

REFERENCE_GPU = "H200"      # the GPU the absolute bounds are set for
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class Target(NamedTuple):
    name: str
    goal: str
    evaluate: Callable[[dict], tuple[str, bool | None]]


class Verdict(NamedTuple):
    name: str
    goal: str
    value: str
    met: bool | None

    @property
    def status(self) -> str:
        return {True: "met", False: "not met", None: "not measured"}[self.met]


def _ok(rows, **match):
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


_OPS = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b}


def reference_peaks(results_dir: str | None = None) -> dict:
    """The measured peaks of the committed H200 run (its results.json's meta), {} before one is committed."""
    pattern = os.path.join(results_dir or RESULTS, f"*{REFERENCE_GPU.lower()}*", "**", "results.json")
    for path in sorted(glob.glob(pattern, recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                peaks = json.load(f).get("meta", {}).get("peaks")
        except (OSError, ValueError):
            continue
        if peaks:
            return peaks
    return {}


def scaled_bound(bound: float, scale: str | None, meta: dict, reference: dict | None = None):
    """(the bound on this run's GPU or None where it cannot be judged, a note saying how it was scaled)."""
    if scale is None or REFERENCE_GPU in str(meta.get("device", "")):
        return bound, ""
    here = meta.get("peaks", {}).get(scale)
    there = (reference_peaks() if reference is None else reference).get(scale)
    if not here:
        return None, f"not judged: this run measured no {scale}"
    if not there:
        return None, f"not judged: set for an {REFERENCE_GPU}, whose measured {scale} is not committed yet"
    factor = here / there
    return bound * factor, f"scaled x{factor:.2f}: {scale} {here:.0f} here, {there:.0f} on the {REFERENCE_GPU}"


def _judge(measured: float, text: str, op: str, bound: float, scale: str | None, meta: dict, fmt: str):
    """(text, met) of a measured value against a bound scaled to this run's GPU; the text says how it was
    scaled, and met is None where it cannot be judged here."""
    bound, how = scaled_bound(bound, scale, meta)
    if how:
        text += f"; goal here {op} {fmt.format(bound)} ({how})" if bound is not None else f"; {how}"
    return text, None if bound is None else _OPS[op](measured, bound)


def _goal_rows(goal, rows, impl):
    return _ok(rows, kernel=goal.kernel, impl=impl, dtype="bfloat16", **goal.where)


def _level(goal, rows, meta):
    """The worst of ours' rows in the goal's field, against the bound scaled to this GPU."""
    ours = [r for r in _goal_rows(goal, rows, goal.impl) if goal.field in r]
    if not ours:
        return "", None
    worst = (max if goal.op == "<=" else min)(ours, key=lambda r: r[goal.field])
    where = f" ({worst['shape']})" if len(ours) > 1 else ""  # which of several shapes is the worst
    return _judge(worst[goal.field], goal.fmt.format(worst[goal.field]) + where, goal.op, goal.bound, goal.scale,
                  meta, goal.fmt)


def _ratio(goal, rows, meta):
    """On each shape both ran: peer/ours of a time (how many times faster ours is) or ours/peer of a share."""
    peers = {r["shape"]: r for r in _goal_rows(goal, rows, goal.peer) if goal.field in r}
    pairs = [(o, peers[o["shape"]]) for o in _goal_rows(goal, rows, goal.impl) if o["shape"] in peers
             and goal.field in o]
    if not pairs:
        return "", None

    def ratio(pair):
        ours, peer = pair[0][goal.field], pair[1][goal.field]
        return ours / peer if goal.share else peer / ours
    worst = (max if goal.op == "<=" else min)(pairs, key=ratio)
    value, (ours, peer) = ratio(worst), (worst[0][goal.field], worst[1][goal.field])
    unit = goal.field.rsplit("_", 1)[-1]  # the fields end in their unit: fwd_bwd_ms, peak_extra_MB
    text = (f"{value:.2%} of {goal.peer} ({ours:,.0f} of {peer:,.0f} {unit}" if goal.share
            else f"{value:.2f}x {goal.peer} ({ours:.3g} vs {peer:.3g} {unit}")
    return f"{text}, {worst[0]['shape']})", _OPS[goal.op](value, goal.bound)


def kernel_target(goal) -> Target:
    """A kernel record's Goal (bench/record.py) as a Target over the rows of the kernel suite."""
    judge = _ratio if goal.peer else _level
    return Target(goal.name, goal.goal, lambda res: judge(goal, res.get("kernels", []), res.get("meta", {})))


def _e2e(field: str, goal: float, fmt: str, variant="ours-triton", family="bert", config="base", seq_len=128,
         scale=None):
    def evaluate(res):
        rows = [r for r in _ok(res.get("e2e", []), variant=variant, config=config, seq_len=seq_len, padding="wiki",
                               dtype="bfloat16") if r.get("family", "bert") == family]
        if not rows or field not in rows[0]:
            return "", None
        return _judge(rows[0][field], fmt.format(rows[0][field]), ">=", goal, scale, res.get("meta", {}), fmt)
    return evaluate


def _encode(model: str, goal: float):
    def evaluate(res):
        rows = _ok(res.get("encode", []), variant="hf-fused", model=model, batch=256, dtype="bfloat16")
        if not rows or "speedup_vs_hf-eager" not in rows[0]:
            return "", None
        value = rows[0]["speedup_vs_hf-eager"]
        return f"{value:.2f}x ({rows[0]['sentences_per_s']:,.0f} sentences/s)", value >= goal
    return evaluate


MODEL_TARGETS = [
    Target("BERT-base step s128 wiki bf16 vs HF eager", ">= 2.5x", _e2e("speedup_vs_hf-eager", 2.5, "{:.2f}x")),
    Target("BERT-base step s128 wiki bf16 vs HF + torch.compile", ">= 1.6x",
           _e2e("speedup_vs_hf-compile", 1.6, "{:.2f}x")),
    Target("BERT-base step s128 wiki bf16 throughput", ">= 0.8M real tokens/s (H200)",
           _e2e("tokens_per_s", 0.8e6, "{:,.0f} tokens/s", scale="matmul_TFLOPs")),
    Target("BERT-base step s128 wiki bf16, packed + CUDA graphs vs HF eager", ">= 3x",
           _e2e("speedup_vs_hf-eager", 3.0, "{:.2f}x", variant="ours-packed-graphs")),
    Target("BERT-base MLM-only step s128 wiki bf16 vs the strongest transformers (padded, padding-free, compiled, "
           "flex, flash attention)", ">= 1.3x", _e2e("vs_strongest_hf", 1.3, "{:.2f}x", variant="ours-mlm")),
    Target("BERT-large step s512 wiki bf16, packed", ">= 1,000 sequences/s (H200)",
           _e2e("seqs_per_s", 1000, "{:,.0f} sequences/s", variant="ours-packed", config="large", seq_len=512,
                scale="matmul_TFLOPs")),
    Target("RoBERTa-base step s128 wiki bf16, fused HF vs HF eager", ">= 2x",
           _e2e("speedup_vs_hf-eager", 2.0, "{:.2f}x", variant="hf-fused", family="roberta")),
    Target("encode BERT-base, batch 256, wiki lengths, bf16: fused vs HF SDPA", ">= 1.5x", _encode("bert-base", 1.5)),
    Target("encode RoBERTa-base, batch 256, wiki lengths, bf16: fused vs HF SDPA", ">= 1.5x",
           _encode("roberta-base", 1.5)),
]


def targets() -> list[Target]:
    """Every kernel record's goals (bench/record.py), then the model targets. Without the kernels package (no
    triton on this platform) only the model targets."""
    try:
        from bertfuse.bench.ops import records
    except ImportError:
        return list(MODEL_TARGETS)
    return [kernel_target(g) for r in records() for g in r.goals] + MODEL_TARGETS


def evaluate(results: dict) -> list[Verdict]:
    out = []
    for t in targets():
        try:
            value, met = t.evaluate(results)
        except (KeyError, TypeError, ZeroDivisionError) as e:  # a row without the field: not measured
            value, met = f"({type(e).__name__})", None
        out.append(Verdict(t.name, t.goal, value, met))
    return out

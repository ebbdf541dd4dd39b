"""The speed and memory targets of the project, evaluated on a benchmark's results (never asserted in tests).

Each target reads the rows of `results.json` (`bert-bench`) and gives (value, met): met is None when the rows
it needs were not measured (a stage cut short, a CPU run, a peer that is not installed).
"""
from __future__ import annotations

from typing import Callable, NamedTuple


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


def _bandwidth(kernel: str):
    def evaluate(res):
        ours = _ok(res.get("kernels", []), kernel=kernel, impl="ours")
        if not ours or "copy_share" not in ours[0]:
            return "", None
        worst = min(ours, key=lambda r: r["copy_share"])
        return f"{worst['copy_share']:.0%} of copy ({worst['fwd_bwd_GBps']:,.0f} GB/s, {worst['shape']})", \
            worst["copy_share"] >= 0.85
    return evaluate


def _beats_compile(kernel: str):
    def evaluate(res):
        rows = res.get("kernels", [])
        pairs = [(o, c) for o in _ok(rows, kernel=kernel, impl="ours")
                 for c in _ok(rows, kernel=kernel, impl="torch-compile", shape=o["shape"])]
        if not pairs:
            return "", None
        o, c = min(pairs, key=lambda p: p[1]["fwd_bwd_ms"] / p[0]["fwd_bwd_ms"])
        speedup = c["fwd_bwd_ms"] / o["fwd_bwd_ms"]
        return f"{speedup:.2f}x torch.compile ({o['shape']})", speedup > 1.0
    return evaluate


def _attention(impl: str, padding: float):
    def row(res):
        rows = _ok(res.get("kernels", []), kernel="attention", impl=impl, seq_len=512, padding=padding,
                   head_dim=64, dtype="bfloat16")
        return rows[0] if rows else None
    return row


def _attention_tflops(direction: str, goal: float):
    def evaluate(res):
        r = _attention("ours", 0.0)(res)
        if r is None:
            return "", None
        value = r[f"{direction}_TFLOPs"]
        return f"{value:.0f} TFLOP/s", value >= goal
    return evaluate


def _attention_vs(peer: str, padding: float, factor: float):
    def evaluate(res):
        ours, other = _attention("ours", padding)(res), _attention(peer, padding)(res)
        if ours is None or other is None:
            return "", None
        speedup = other["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
        return f"{speedup:.2f}x {peer} (fwd+bwd)", speedup >= factor
    return evaluate


def _mlm(res, impl):
    rows = _ok(res.get("kernels", []), kernel="mlm_loss", impl=impl, hidden=768, dtype="bfloat16")
    return rows[0] if rows else None


def _mlm_memory(res):
    ours, full = _mlm(res, "(c) ours"), _mlm(res, "(a) full logits")
    if ours is None or full is None:
        return "", None
    share = ours["peak_extra_MB"] / full["peak_extra_MB"]
    return f"{share:.2%} ({ours['peak_extra_MB']:,.0f} of {full['peak_extra_MB']:,.0f} MB)", share <= 0.01


def _mlm_time(res):
    ours, gathered = _mlm(res, "(c) ours"), _mlm(res, "(b) gather+linear+CE")
    if ours is None or gathered is None:
        return "", None
    return f"{ours['fwd_bwd_ms']:.2f} ms vs {gathered['fwd_bwd_ms']:.2f} ms", \
        ours["fwd_bwd_ms"] <= gathered["fwd_bwd_ms"]


def _e2e(field: str, goal: float, fmt: str, variant="ours-triton", family="bert", config="base", seq_len=128):
    def evaluate(res):
        rows = [r for r in _ok(res.get("e2e", []), variant=variant, config=config, seq_len=seq_len, padding="wiki",
                               dtype="bfloat16") if r.get("family", "bert") == family]
        if not rows or field not in rows[0]:
            return "", None
        return fmt.format(rows[0][field]), rows[0][field] >= goal
    return evaluate


def _encode(model: str, goal: float):
    def evaluate(res):
        rows = _ok(res.get("encode", []), variant="hf-fused", model=model, batch=256, dtype="bfloat16")
        if not rows or "speedup_vs_hf-eager" not in rows[0]:
            return "", None
        value = rows[0]["speedup_vs_hf-eager"]
        return f"{value:.2f}x ({rows[0]['sentences_per_s']:,.0f} sentences/s)", value >= goal
    return evaluate


TARGETS = [
    Target("LayerNorm+residual+dropout fwd+bwd bandwidth", ">= 85% of copy", _bandwidth("layer_norm+residual+dropout")),
    Target("LayerNorm+residual+dropout vs torch.compile", "faster", _beats_compile("layer_norm+residual+dropout")),
    Target("bias-GeLU fwd+bwd bandwidth", ">= 85% of copy", _bandwidth("bias_gelu")),
    Target("bias-GeLU vs torch.compile", "faster", _beats_compile("bias_gelu")),
    Target("attention fwd, d64 s512 bf16", ">= 350 TFLOP/s", _attention_tflops("fwd", 350)),
    Target("attention bwd, d64 s512 bf16", ">= 250 TFLOP/s", _attention_tflops("bwd", 250)),
    Target("attention vs torch varlen_attn, s512", ">= 1x", _attention_vs("torch-varlen_attn", 0.0, 1.0)),
    Target("attention at 50% padding vs SDPA + padding mask, s512", ">= 2x", _attention_vs("sdpa-masked", 0.5, 2.0)),
    Target("MLM loss extra memory vs full logits, H768", "<= 1%", _mlm_memory),
    Target("MLM loss time vs gather + linear + CE, H768", "<= 1x", _mlm_time),
    Target("BERT-base step s128 wiki bf16 vs HF eager", ">= 2.5x", _e2e("speedup_vs_hf-eager", 2.5, "{:.2f}x")),
    Target("BERT-base step s128 wiki bf16 vs HF + torch.compile", ">= 1.6x",
           _e2e("speedup_vs_hf-compile", 1.6, "{:.2f}x")),
    Target("BERT-base step s128 wiki bf16 throughput", ">= 0.8M real tokens/s",
           _e2e("tokens_per_s", 0.8e6, "{:,.0f} tokens/s")),
    Target("BERT-base step s128 wiki bf16, packed + CUDA graphs vs HF eager", ">= 3x",
           _e2e("speedup_vs_hf-eager", 3.0, "{:.2f}x", variant="ours-packed-graphs")),
    Target("BERT-large step s512 wiki bf16, packed", ">= 1,000 sequences/s",
           _e2e("seqs_per_s", 1000, "{:,.0f} sequences/s", variant="ours-packed", config="large", seq_len=512)),
    Target("RoBERTa-base step s128 wiki bf16, fused HF vs HF eager", ">= 2x",
           _e2e("speedup_vs_hf-eager", 2.0, "{:.2f}x", variant="hf-fused", family="roberta")),
    Target("encode BERT-base, batch 256, wiki lengths, bf16: fused vs HF SDPA", ">= 1.5x", _encode("bert-base", 1.5)),
    Target("encode RoBERTa-base, batch 256, wiki lengths, bf16: fused vs HF SDPA", ">= 1.5x",
           _encode("roberta-base", 1.5)),
]


def evaluate(results: dict) -> list[Verdict]:
    out = []
    for t in TARGETS:
        try:
            value, met = t.evaluate(results)
        except (KeyError, TypeError, ZeroDivisionError) as e:  # a row without the field: not measured
            value, met = f"({type(e).__name__})", None
        out.append(Verdict(t.name, t.goal, value, met))
    return out

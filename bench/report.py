"""The benchmark's reports: markdown tables, speedups over the baseline rows, CSV files and plots (bert-bench writes
them, bench.summary reads them back)."""
from __future__ import annotations

import csv
import os


def markdown(rows, columns) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


STEP_COLUMNS = ["kernel", "shape", "params", "impl", "step_ms", "step_GBps", "copy_share", "peak_extra_MB", "status"]


def by_measure(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Kernel-suite rows split: (the rows of forward + backward problems, those of optimizer steps), each kind a
    table of its own."""
    return [r for r in rows if r.get("measure") != "step"], [r for r in rows if r.get("measure") == "step"]


def add_speedups(rows, keys=("family", "objective", "config", "seq_len", "batch", "padding", "dtype"),
                 metric="tokens_per_s"):
    """speedup_vs_<ref> on every ok row: its metric over the same-shaped row of each reference variant (the same
    objective too: a masked-LM-only row is not measured against a pre-training step with NSP)."""
    for r in rows:
        for ref in ("hf-eager", "hf-compile"):
            base = next((b for b in rows if b["variant"] == ref and b.get("status") == "ok" and all(
                b.get(k) == r.get(k) for k in keys)), None)
            if base and r.get("status") == "ok":
                r[f"speedup_vs_{ref}"] = r[metric] / base[metric]


SHAPE = ("family", "objective", "config", "seq_len", "batch", "padding", "dtype")
PADDED_EAGER = ("hf-eager", "hf-mlm-eager")  # transformers eager on the padded batch, per objective


def add_e2e_speedups(rows) -> None:
    """The end-to-end rows' speedups: add_speedups' columns, and two a reader compares by: vs_padded_eager (over
    transformers eager on the padded batch of the same objective and shape) and vs_strongest_hf (over the fastest
    transformers row of that objective and shape that ran: padded, padding-free, compiled, flex or flash
    attention; named in strongest_hf). hf-fused is this project's layers, not a baseline."""
    from .e2e import BASELINES

    add_speedups(rows)
    ok = [r for r in rows if r.get("status") == "ok"]
    for r in ok:
        same = [b for b in ok if all(b.get(k) == r.get(k) for k in SHAPE)]
        eager = next((b for b in same if b["variant"] in PADDED_EAGER), None)
        if eager:
            r["vs_padded_eager"] = r["tokens_per_s"] / eager["tokens_per_s"]
        baselines = [b for b in same if b["variant"] in BASELINES]
        if baselines:
            strongest = max(baselines, key=lambda b: b["tokens_per_s"])
            r["vs_strongest_hf"], r["strongest_hf"] = r["tokens_per_s"] / strongest["tokens_per_s"], \
                strongest["variant"]


E2E_COLUMNS = ["variant", "objective", "runs", "family", "config", "seq_len", "batch", "padding", "padding_share",
               "dtype", "step_ms", "tokens_per_step", "tokens_per_s", "spread", "repeats", "seqs_per_s", "MFU",
               "peak_mem_MB", "vs_padded_eager", "vs_strongest_hf", "strongest_hf", "status"]


def model_name(config: str) -> str:
    """"BERT-base (12 layers, hidden 768, 12 heads)" for a preset's name."""
    from bertfuse.bert import BertConfig

    c = BertConfig.preset(config)
    return f"BERT-{config} ({c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads)"


def configuration(rows, meta: dict | None) -> str:
    """One line of what the rows ran on: models, sequence lengths, batches, dtypes, threads, torch and transformers
    versions (a run's meta, results.json's)."""
    meta = meta or {}

    def values(key, fmt=str):
        return ", ".join(fmt(v) for v in dict.fromkeys(r[key] for r in rows if r.get(key) is not None))

    parts = [values("config", model_name), f"seq {values('seq_len')}", f"batch {values('batch')}",
             values("dtype"), f"{meta['threads']} threads" if meta.get("threads") else None,
             f"torch {meta['torch']}" if meta.get("torch") else None,
             f"transformers {meta['transformers']}" if meta.get("transformers") else None]
    return ", ".join(p for p in parts if p)


def _spread(r: dict) -> str | None:
    if "tokens_per_s_min" not in r:
        return None
    return " / ".join(f"{r[f'tokens_per_s_{k}']:,.0f}" for k in ("min", "median", "max"))


def e2e_table(rows, meta: dict | None) -> str:
    """The end-to-end rows as bert-bench prints them and the GPU check's summary shows them: the configuration,
    then every column some row measured (a column no row has is left out), then what the columns mean."""
    add_e2e_speedups(rows)
    shown = [dict(r, spread=_spread(r)) for r in rows]
    columns = [c for c in E2E_COLUMNS if any(r.get(c) is not None for r in shown)]
    repeats = sorted({r.get("repeats", 1) for r in rows if r.get("status") == "ok"})
    steps = "/".join(str(n) for n in sorted({r["steps"] for r in rows if r.get("steps")})) or "the"
    over = f"of {steps} timed steps" if repeats in ([], [1]) else \
        f"of {'/'.join(map(str, repeats))} runs, each in a fresh process (the row is the median run)"
    notes = [
        f"Configuration: {configuration(rows, meta)}.",
        "",
        markdown(shown, columns),
        "",
        "tokens_per_s: real tokens (padding is not counted) over the timed steps; spread: real tokens/s of the "
        f"slowest, median and fastest {over}. padding_share: the share of a step's "
        "token slots that hold padding; the packed rows fill the padded batch's slots with more sequences, so each "
        "of their steps carries more real tokens (tokens_per_step) and takes longer: tokens_per_s is what compares "
        "them with the others. vs_padded_eager: over transformers eager on the padded batch of the same objective (mlm+nsp: "
        "BertForPreTraining; mlm: BertForMaskedLM); vs_strongest_hf: over the fastest transformers row of the "
        "same objective and shape that ran (strongest_hf): padded, padding-free (DataCollatorWithFlattening), "
        "compiled, flex or flash attention. runs: the attention a transformers row ran, or the backend of ours.",
    ]
    return "\n".join(notes)


def measured_on(meta: dict | None) -> str:
    """"<device>, <date>" of a run's meta (results.json), for a plot's title; "" without one."""
    meta = meta or {}
    return ", ".join(str(v) for v in (meta.get("device"), str(meta.get("date") or "")[:10]) if v)


def _bar_label(r: dict) -> str:
    ratios = [f"{r[k]:.2f}x {name}" for k, name in (("vs_padded_eager", "padded eager"),
                                                     ("vs_strongest_hf", "strongest HF")) if k in r]
    peak = f"{r['peak_mem_MB']:,.0f} MB" if r.get("peak_mem_MB") is not None else None
    return "  ".join(p for p in [f"{r['tokens_per_s']:,.0f} tok/s", *ratios, peak] if p)


def speedup_figure(rows, where: str, config: str = ""):
    """One horizontal bar per row: its real tokens/s, with the step-to-step spread (min to max) as an error bar,
    labelled with the value, its speedups over padded eager and over the strongest transformers row, and its peak
    memory; the configuration, the machine and the date (`where`) in the title."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.42 * len(rows)))
    y = range(len(rows))[::-1]
    rates = [r["tokens_per_s"] for r in rows]
    low = [max(v - r.get("tokens_per_s_min", v), 0) for v, r in zip(rates, rows)]
    high = [max(r.get("tokens_per_s_max", v) - v, 0) for v, r in zip(rates, rows)]
    colors = ["tab:gray" if r["variant"].startswith("hf-") and r["variant"] != "hf-fused" else "tab:blue"
              for r in rows]
    ax.barh(y, rates, xerr=[low, high], color=colors, error_kw={"lw": 0.8, "capsize": 2})
    right = max(v + h for v, h in zip(rates, high))
    for yi, v, h, r in zip(y, rates, high, rows):  # each label right of its whisker
        ax.text(v + h + 0.02 * right, yi, _bar_label(r), va="center", fontsize=7)
    ax.set_yticks(list(y), [f"{r['variant']} ({r['config']} s{r['seq_len']}, {r['objective']}, pad {r['padding']})"
                            if "objective" in r else f"{r['variant']} ({r['config']} s{r['seq_len']})"
                            for r in rows], fontsize=7)
    ax.set_xlabel("real tokens / s (bar: the whole run; whisker: the slowest and fastest step)")
    ax.set_xlim(0, right * 2.2)  # room for the labels right of the longest whisker
    title = "Pre-training step: this project (blue) and transformers (gray)"
    ax.set_title("\n".join(t for t in (title, config, where) if t), fontsize=8)
    fig.tight_layout()
    return fig


def padding_figure(sweep, where: str):
    """Real tokens/s against the padding fraction, one line per variant and shape; the machine and date in the
    title."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["variant"], r["config"], r["seq_len"]) for r in sweep}):
        pts = sorted((float(r["padding"]), r["tokens_per_s"]) for r in sweep
                     if (r["variant"], r["config"], r["seq_len"]) == key)
        ax.plot([p for p, _ in pts], [t for _, t in pts], marker="o", label=f"{key[0]} ({key[1]}, s{key[2]})")
    ax.set_xlabel("padding fraction")
    ax.set_ylabel("real tokens / s")
    ax.set_title("Throughput against padding" + (f"\n{where}" if where else ""), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot(rows, out_dir, meta: dict | None = None) -> list[str]:
    """speedup.png (when there is a speedup to show) and padding.png (when at least two padding levels were run),
    titled with the machine and date of `meta` (results.json's); returns the names written."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok, written, where = [r for r in rows if r.get("status") == "ok"], [], measured_on(meta)
    add_e2e_speedups(ok)
    headline = [r for r in ok if r["padding"] == rows[0]["padding"] and "vs_padded_eager" in r]
    sweep = [r for r in ok if r["padding"] != "wiki"]
    figures = {"speedup.png": headline and speedup_figure(headline, where, configuration(headline, meta)),
               # one padding level is a point, not a curve
               "padding.png": len({r["padding"] for r in sweep}) >= 2 and padding_figure(sweep, where)}
    for name, fig in figures.items():
        if fig:
            fig.savefig(os.path.join(out_dir, name), dpi=120)
            plt.close(fig)
            written.append(name)
    return written


def main(argv=None) -> int:
    """`python -m bertfuse.bench.report DIR`: draws DIR's plots again from its results.json."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m bertfuse.bench.report", description=main.__doc__)
    p.add_argument("dir", help="a bert-bench output directory (holding results.json)")
    args = p.parse_args(argv)
    try:
        with open(os.path.join(args.dir, "results.json")) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        print(f"bench.report: cannot read {args.dir}/results.json: {e}", file=sys.stderr)
        return 2
    written = plot(results.get("e2e", []), args.dir, results.get("meta"))
    print(f"Wrote {', '.join(written) or 'no plot'} to {os.path.abspath(args.dir)}")
    return 0


def write_csv(path, rows) -> bool:
    if not rows:
        return False
    cols = sorted({k for r in rows for k in r if k != "traceback"})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return True


if __name__ == "__main__":
    raise SystemExit(main())

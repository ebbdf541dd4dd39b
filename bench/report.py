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


def add_speedups(rows, keys=("family", "config", "seq_len", "batch", "padding", "dtype"),
                 metric="tokens_per_s"):
    """speedup_vs_<ref> on every ok row: its metric over the same-shaped row of each reference variant."""
    for r in rows:
        for ref in ("hf-eager", "hf-compile"):
            base = next((b for b in rows if b["variant"] == ref and b.get("status") == "ok" and all(
                b.get(k) == r.get(k) for k in keys)), None)
            if base and r.get("status") == "ok":
                r[f"speedup_vs_{ref}"] = r[metric] / base[metric]


def measured_on(meta: dict | None) -> str:
    """"<device>, <date>" of a run's meta (results.json), for a plot's title; "" without one."""
    meta = meta or {}
    return ", ".join(str(v) for v in (meta.get("device"), str(meta.get("date") or "")[:10]) if v)


def speedup_figure(rows, where: str):
    """The bars of each row's speedup over transformers eager, each labelled with its value; the machine and date
    (`where`) in the title."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    speedups = [r["speedup_vs_hf-eager"] for r in rows]
    bars = ax.bar(range(len(rows)), speedups, color="tab:blue")
    ax.bar_label(bars, labels=[f"{v:.2f}x" for v in speedups], fontsize=7, padding=2)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['config']} s{r['seq_len']}\n{r['variant']}" for r in rows], rotation=60,
                  ha="right", fontsize=7)
    ax.set_ylabel("speedup over transformers eager (real tokens/s)")
    ax.set_title("Pre-training step speedup" + (f"\n{where}" if where else ""), fontsize=9)
    ax.margins(y=0.12)  # room for the labels over the tallest bar
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
    headline = [r for r in ok if r["padding"] == rows[0]["padding"] and "speedup_vs_hf-eager" in r]
    sweep = [r for r in ok if r["padding"] != "wiki"]
    figures = {"speedup.png": headline and speedup_figure(headline, where),
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

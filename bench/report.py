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


def plot(rows, out_dir) -> list[str]:
    """speedup.png (when there is a speedup to show) and padding.png (when at least two padding levels were run);
    returns the names written."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok, written = [r for r in rows if r.get("status") == "ok"], []
    main = [r for r in ok if r["padding"] == rows[0]["padding"] and "speedup_vs_hf-eager" in r]
    if main:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['config']} s{r['seq_len']}\n{r['variant']}" for r in main]
        ax.bar(range(len(main)), [r["speedup_vs_hf-eager"] for r in main], color="tab:blue")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(main)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("speedup over transformers eager (real tokens/s)")
        ax.set_title("Pre-training step speedup")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "speedup.png"), dpi=120)
        plt.close(fig)
        written.append("speedup.png")
    sweep = [r for r in ok if r["padding"] != "wiki"]
    if len({r["padding"] for r in sweep}) >= 2:  # one level is a point, not a curve
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in sorted({(r["variant"], r["config"], r["seq_len"]) for r in sweep}):
            pts = sorted((float(r["padding"]), r["tokens_per_s"]) for r in sweep
                         if (r["variant"], r["config"], r["seq_len"]) == key)
            ax.plot([p for p, _ in pts], [t for _, t in pts], marker="o", label=f"{key[0]} ({key[1]}, s{key[2]})")
        ax.set_xlabel("padding fraction")
        ax.set_ylabel("real tokens / s")
        ax.set_title("Throughput against padding")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "padding.png"), dpi=120)
        plt.close(fig)
        written.append("padding.png")
    return written


def write_csv(path, rows) -> bool:
    if not rows:
        return False
    cols = sorted({k for r in rows for k in r if k != "traceback"})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return True

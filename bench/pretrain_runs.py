"""Pre-training runs read back into a report: each bert-pretrain run's summary.json as a table row (objective,
optimizer and global batch where the summary records them, starting weights, steps, sequences, tokens, training
seconds, the last held-out MLM accuracy and, with a target, the time to it), and the held-out MLM accuracy of each
run's log against the tokens it trained on, as a plot.

`bert-bench --suite pretrain --pretrain-runs RUN...` puts them into its report (pretrain.csv, pretrain.png);
`python -m bertfuse.bench.pretrain_runs RUN... [--plot PNG]` prints the table alone. A run that starts from
another run of the same set (--init-from: a second phase) is drawn from where that run ended, in tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .report import markdown

COLUMNS = ("run", "objective", "optimizer", "batch_size", "init_from", "max_seq_len", "mlm_probability", "steps",
           "sequences", "tokens",
           "train_seconds", "eval_mlm_acc", "target", "reached", "target_step", "target_seconds", "target_tokens")


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a finished bert-pretrain run's summary ({e})") from None


def read_run(run_dir: str) -> dict:
    """A table row from RUN/summary.json (written when a run ends)."""
    s = _read_json(os.path.join(run_dir, "summary.json"))
    start = (s.get("init_from") or {}).get("path")
    target = s.get("target") or {}
    return {"run": os.path.basename(os.path.normpath(run_dir)), "path": os.path.abspath(run_dir),
            "objective": s.get("objective"), "optimizer": s.get("optimizer"), "batch_size": s.get("batch_size"),
            "init_from": start and os.path.abspath(start),
            "max_seq_len": s.get("max_seq_len"), "mlm_probability": s.get("mlm_probability"), "steps": s["steps"],
            "sequences": s["sequences"], "tokens": s["tokens"], "train_seconds": s["train_seconds"],
            "eval_mlm_acc": (s.get("last") or {}).get("eval_mlm_acc"), "target": target.get("value"),
            "reached": target.get("reached"), "target_step": target.get("step"),
            "target_seconds": target.get("train_seconds"), "target_tokens": target.get("tokens")}


def read_runs(run_dirs) -> list[dict]:
    return [read_run(d) for d in run_dirs]


def table(rows: list[dict]) -> str:
    shown = [dict(r, init_from=r["init_from"] and _short(r["init_from"], rows)) for r in rows]
    return markdown(shown, COLUMNS)


def _short(path: str, rows: list[dict]) -> str:
    """A starting point by the name of the run of the set it lies in, else by its last two path parts."""
    owner = _owner(path, rows)
    return owner["run"] if owner else os.path.join(*path.split(os.sep)[-2:])


def _owner(path: str, rows: list[dict]) -> dict | None:
    """The run of the set whose directory holds `path` (its final model or one of its checkpoints); else, for
    runs copied elsewhere (results kept with their logs), the run of the same directory name."""
    held = next((r for r in rows if path == r["path"] or path.startswith(r["path"] + os.sep)), None)
    if held:
        return held
    parts = os.path.normpath(path).split(os.sep)
    name = parts[-3] if len(parts) >= 3 and parts[-2] == "checkpoints" else parts[-1]
    return next((r for r in rows if r["run"] == name), None)


def curves(rows: list[dict]) -> list[tuple[list[float], list[float]]]:
    """Per run, (tokens, held-out MLM accuracy) at each evaluation of its log; a run started from another of
    the set continues from that run's last tokens."""
    out = []
    for r in rows:
        with open(os.path.join(r["path"], "log.jsonl"), encoding="utf-8") as f:
            log = [json.loads(line) for line in f if line.strip()]
        owner = _owner(r["init_from"], rows) if r["init_from"] else None
        offset = owner["tokens"] if owner and owner is not r else 0.0
        points = [(offset + row["tokens_seen"], row["eval_mlm_acc"]) for row in log
                  if row.get("eval_mlm_acc") is not None and "tokens_seen" in row]
        out.append(([t for t, _ in points], [a for _, a in points]))
    return out


def plot(rows: list[dict], path: str, title: str = "") -> bool:
    """Held-out MLM accuracy against tokens trained on, one line a run; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r, (tokens, acc) in zip(rows, curves(rows)):
        label = f"{r['run']} ({r['objective']}, {r['max_seq_len']} tokens)"
        ax.plot([t / 1e6 for t in tokens], acc, marker="o", markersize=3, label=label)
        if r.get("reached"):
            ax.axhline(r["target"], color="grey", linewidth=0.6, linestyle="--")
    ax.set_xlabel("tokens trained on (millions)")
    ax.set_ylabel("held-out masked-LM accuracy")
    ax.set_title(title or "bert-pretrain runs", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertfuse.bench.pretrain_runs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="bert-pretrain output directories (each with summary.json, log.jsonl)")
    p.add_argument("--plot", help="also draw held-out MLM accuracy against tokens into this PNG")
    p.add_argument("--title", default="", help="the plot's title")
    args = p.parse_args(argv)
    try:
        rows = read_runs(args.runs)
    except ValueError as e:
        print(f"pretrain_runs: error: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.plot and plot(rows, args.plot, args.title):
        print(f"\nWrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Reading, checking and writing the launch-config tables (kernels/configs/<family>.json) the tuners produce."""
from __future__ import annotations

import datetime
import json
import os
import sys

import torch


def table_problems(path: str) -> list[str]:
    """What is wrong with the launch-config table at `path` ([] for a good one): its format, and each entry's
    key ("<dtype>/<size>/<bucket>") and config (only fields its launcher lets a table tune, values it accepts)."""
    from bertfuse.kernels import launches, tuned

    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    if table.get("format") != tuned.FORMAT or not isinstance(table.get("kernels"), dict):
        return [f"{path}: not a format-{tuned.FORMAT} table"]
    found = []
    for kernel, entries in table["kernels"].items():
        site = launches.site(kernel)
        tunable = set(site.candidates[0] if site.candidates else ())
        for key, entry in entries.items():
            extra = set(entry.get("config", {})) - tunable
            why = tuned.key_problem(key) or (
                None if isinstance(getattr(torch, key.split("/")[0], None), torch.dtype) else "not a dtype's key")
            if extra or why:
                found.append(f"{kernel} {key}: " + (f"sets {sorted(extra)}, which the table may not tune" if extra
                                                    else why))
    return found


RUN_FIELDS = ("compile_checked", "command", "date", "torch", "triton", "device")  # the run, once table-wide


def write_table(folder: str, arch: str, results: dict, kind: str, run: dict) -> str:
    """Merge {kernel: {key: entry}} into <folder>/<arch>.json, atomically; returns the path. `run` (meta(): the
    command, date, versions) is recorded as runs[kernel][kind] ("timed" or "compile_checked") for each kernel
    written, so every kernel's entries name the command that made them, though a table is filled by several."""
    from bertfuse.bert.common.files import atomic_write
    from bertfuse.kernels import tuned

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{arch}.json")
    table = tuned.load_table(folder, arch) or {"format": tuned.FORMAT, "arch": arch, "kernels": {}}
    table = json.loads(json.dumps(table))  # a copy: load_table's result is cached
    for field in RUN_FIELDS:  # a table-wide record could only describe its last run
        table.pop(field, None)
    for kernel, entries in results.items():
        table["kernels"].setdefault(kernel, {}).update(entries)
        table.setdefault("runs", {}).setdefault(kernel, {})[kind] = run

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")

    atomic_write(path, write)
    tuned.clear_cache()
    return path


def timed(entries: dict, problem) -> bool:
    """Whether a table's entries ({kernel: {key: entry}}) hold a GPU-timed entry for the problem."""
    entry = entries.get(problem.kernel, {}).get(problem.key, {})
    return bool(entry.get("timed", "ms" in entry))


def meta(argv) -> dict:
    """What a table records of the run that wrote it."""
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m bertfuse.bench.tune " + " ".join(sys.argv[1:] if argv is None else argv)}

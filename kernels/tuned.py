"""Launch configs per GPU family: one lookup per launch site, falling back to the launcher's own default.

Each GPU family the kernels are built for (kernels/targets.py: "sm_80", "sm_90", "gfx942", ...) has a table
`kernels/configs/<name>.json`, keyed by kernel ("attention.fwd", "layer_norm.bwd", ...), then
"<dtype>/<size>/<bucket>": the dtype name, the head_dim or hidden size, and a sequence-length bucket ("s128",
"s512", ...; "all": every length). A table is data, small and committed, and comes two ways:

* compile-checked ("timed": false): without a GPU, `python -m bench.tune --compile-only --arch <name>` keeps the
  launcher's default where it compiles clean for that family (no register spill, within shared memory or LDS,
  dots on its tensor cores) and otherwise the clean candidate with the largest tiles, one "all" entry per
  dtype and size the compile check covers;
* timed ("timed": true): `python -m bench.tune` on a GPU of the family times the candidates at BERT's shapes and
  merges the fastest into the table, per sequence bucket; those entries win over the compile-checked ones.

A launcher calls `pick` with its default config; the table's entry replaces the tunable fields, or the default
stays where there is none (a GPU outside the list, another size, the CPU, the interpreter). The choice is
deterministic: no autotuning ever runs during training.

The environment variable BERTFUSE_CONFIG_DIR points the lookup at another folder of tables (the GPU check writes
fresh ones outside the source tree); `forced` sets one kernel's config for a block of code (the tuner's sweep).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import warnings
from typing import NamedTuple

import torch

from .targets import Target

FORMAT = 1
_forced: dict[str, dict] = {}


def config_dir() -> str:
    return os.environ.get("BERTFUSE_CONFIG_DIR") or os.path.join(os.path.dirname(__file__), "configs")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def bucket(seqlen: int | None) -> str:
    """'all' without a sequence length, else 's<n>' for the smallest power of two n >= max(seqlen, 128)."""
    if seqlen is None:
        return "all"
    return f"s{max(128, 1 << max(0, int(seqlen) - 1).bit_length())}"


def entry_key(dtype: torch.dtype | str, size: int, seq_bucket: str) -> str:
    return f"{dtype if isinstance(dtype, str) else dtype_name(dtype)}/{int(size)}/{seq_bucket}"


@functools.lru_cache(maxsize=None)
def load_table(folder: str, arch: str) -> dict:
    """The table for one GPU architecture ({} when there is none or it cannot be read, with a warning)."""
    path = os.path.join(folder, f"{arch}.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
        if table.get("format") != FORMAT or not isinstance(table.get("kernels"), dict):
            raise ValueError(f"not a format-{FORMAT} table")
        return table
    except (OSError, ValueError) as e:
        warnings.warn(f"kernels: ignoring launch-config table {path} ({e}); using the built-in defaults")
        return {}


def _nearest(entries: dict, dtype: str, size: int, seq_bucket: str):
    """The entry for (dtype, size) whose sequence bucket is nearest to seq_bucket (log scale), else its "all"
    entry (one config for every length: a compile-checked table's), or None."""
    prefix = f"{dtype}/{size}/"
    if prefix + seq_bucket in entries:
        return entries[prefix + seq_bucket]
    if seq_bucket != "all":
        want = math.log2(int(seq_bucket[1:]))
        near = [(abs(math.log2(int(k[len(prefix) + 1:])) - want), k) for k in entries
                if k.startswith(prefix + "s") and k[len(prefix) + 1:].isdigit()]
        if near:
            return entries[min(near)[1]]
    return entries.get(prefix + "all")


@functools.lru_cache(maxsize=None)
def _table_config(kernel: str, folder: str, arch: str, dtype: str, size: int, seq_bucket: str):
    entry = _nearest(load_table(folder, arch).get("kernels", {}).get(kernel, {}), dtype, size, seq_bucket)
    return None if entry is None else entry.get("config")


def _valid_value(name: str, value, default) -> bool:
    """A choice (a string) where the default is one; else a positive int, a power of two for a block size."""
    if isinstance(default, str):
        return isinstance(value, str)
    return (isinstance(value, int) and not isinstance(value, bool) and value >= 1
            and (not name.startswith("BLOCK") or value & (value - 1) == 0))


def _valid(kernel: str, config, default: NamedTuple, tunable) -> bool:
    ok = isinstance(config, dict) and set(config) <= set(tunable) and all(
        _valid_value(k, v, getattr(default, k)) for k, v in config.items())
    if not ok:
        warn_ignored(kernel, json.dumps(config, sort_keys=True, default=str))
    return ok


@functools.lru_cache(maxsize=None)
def warn_ignored(kernel: str, text: str) -> None:
    """Warn once per (kernel, config) that a table's config is unusable and the launcher's default stays."""
    warnings.warn(f"kernels: ignoring the launch config {text} for {kernel} (expected positive ints, powers of two "
                  "for block sizes, a known choice, only tunable fields); using the default")


def pick(kernel: str, default: NamedTuple, target: Target | None, dtype: torch.dtype, size: int,
         seqlen: int | None = None, tunable=None) -> NamedTuple:
    """The config for one launch of `kernel` on `target` (kernels.targets.of(device); None: the CPU or the
    interpreter): a forced one, else the target's table entry, else `default`. Only the fields in `tunable`
    (default: all of default's) may be replaced."""
    tunable = default._fields if tunable is None else tunable
    config = _forced.get(kernel)
    if config is None and target is not None:
        config = _table_config(kernel, config_dir(), target.name, dtype_name(dtype), int(size), bucket(seqlen))
    if config is None or not _valid(kernel, config, default, tunable):
        return default
    return default._replace(**config)


@contextlib.contextmanager
def forced(kernel: str, config: dict):
    """Every launch of `kernel` inside the block uses `config` (any device, the interpreter too): the tuner's
    sweep, and tests of non-default configs."""
    previous = _forced.get(kernel)
    _forced[kernel] = dict(config)
    try:
        yield
    finally:
        if previous is None:
            _forced.pop(kernel, None)
        else:
            _forced[kernel] = previous


def clear_cache() -> None:
    """Forget loaded tables (after writing a new one in the same process)."""
    load_table.cache_clear()
    _table_config.cache_clear()

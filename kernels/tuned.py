"""Launch configs per GPU family: one lookup per launch site, falling back to the launcher's own default.

Each GPU family the kernels are built for (kernels/targets.py: "sm_80", "sm_90", "gfx942", ...) has a table
`kernels/configs/<name>.json`, keyed by kernel ("attention.fwd", "layer_norm.bwd", ...), then
"<dtype>/<size>/<bucket>": the dtype name, the head_dim or hidden size, and a sequence-length bucket ("s128",
"s512", ...; "all": every length). A table is data, small and committed, and comes two ways:

* compile-checked ("timed": false): without a GPU, `python -m bertfuse.bench.tune --compile-only --arch <name>` keeps the
  launcher's default where it compiles clean for that family (no register spill, within shared memory or LDS,
  dots on its tensor cores) and otherwise the clean candidate with the largest tiles, one "all" entry per
  dtype and size the compile check covers;
* timed ("timed": true): `python -m bertfuse.bench.tune` on a GPU of the family times the candidates at BERT's shapes and
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
_strict: set[str] = set()  # forced kernels whose config must be taken as it is (ValueError otherwise)
_refusing: list[bool] = [False]  # inside `refusing()`: a table entry the launcher cannot take raises too


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
    """The table for one GPU architecture: {} when there is none or it cannot be read as a table, with a warning;
    otherwise its usable entries, each unusable part left out with one warning naming the file and the key (a
    kernel that is not an object, a key not "<dtype>/<size>/<bucket>" with a positive power-of-two bucket, an
    entry without a config object). What is left out falls back to the launchers' defaults."""
    path = os.path.join(folder, f"{arch}.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
        if not isinstance(table, dict):
            raise ValueError(f"its top level is a JSON {_json_type(table)}, not an object")
        if table.get("format") != FORMAT or not isinstance(table.get("kernels"), dict):
            raise ValueError(f"not a format-{FORMAT} table")
    except (OSError, ValueError) as e:
        warnings.warn(f"kernels: ignoring launch-config table {path} ({e}); using the built-in defaults")
        return {}
    kernels = {}
    for kernel, entries in table["kernels"].items():
        if not isinstance(entries, dict):
            _warn_part(path, kernel, f"a JSON {_json_type(entries)}, not an object of entries")
            continue
        kept = {}
        for key, entry in entries.items():
            why = key_problem(key) or (None if isinstance(entry, dict) and isinstance(entry.get("config"), dict)
                                        else "an entry without a \"config\" object")
            if why:
                _warn_part(path, f"{kernel}: {key}", why)
            else:
                kept[key] = entry
        kernels[kernel] = kept
    return dict(table, kernels=kernels)


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _warn_part(path: str, key: str, why: str) -> None:
    warnings.warn(f"kernels: ignoring {key} in launch-config table {path} ({why}); the launcher's default is used "
                  "there")


def key_problem(key: str) -> str | None:
    """Why `key` is not "<dtype>/<size>/<bucket>" (a positive size; "all" or "s<n>", n a power of two)."""
    parts = key.split("/")
    if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) < 1:
        return "not a key <dtype>/<size>/<bucket>"
    b = parts[2]
    if b != "all" and not (b[:1] == "s" and b[1:].isdigit() and int(b[1:]) >= 1 and int(b[1:]) & (int(b[1:]) - 1) == 0):
        return f"sequence bucket {b!r} is not 'all' or 's<n>' with n a positive power of two"
    return None


def _nearest(entries: dict, dtype: str, size: int, seq_bucket: str) -> str | None:
    """The key of the entry for (dtype, size) whose sequence bucket is nearest to seq_bucket (log scale), else
    of its "all" entry (one config for every length: a compile-checked table's), or None."""
    prefix = f"{dtype}/{size}/"
    if prefix + seq_bucket in entries:
        return prefix + seq_bucket
    if seq_bucket != "all":
        want = math.log2(int(seq_bucket[1:]))
        near = [(abs(math.log2(int(k[len(prefix) + 1:])) - want), k) for k in entries
                if k.startswith(prefix + "s") and k[len(prefix) + 1:].isdigit()]
        if near:
            return min(near)[1]
    return prefix + "all" if prefix + "all" in entries else None


@functools.lru_cache(maxsize=None)
def _table_config(kernel: str, folder: str, arch: str, dtype: str, size: int, seq_bucket: str):
    """(the entry's key, its config) for one launch, or None."""
    entries = load_table(folder, arch).get("kernels", {}).get(kernel, {})
    key = _nearest(entries, dtype, size, seq_bucket)
    return None if key is None else (key, entries[key]["config"])


class Need(NamedTuple):
    """Lower bounds on what one program of a launch needs, from its config: an entry asking more than the
    family has cannot be what its tuner measured, and is refused."""
    shared_bytes: int = 0   # shared memory (LDS) its pipelined tile loads take at the least
    per_thread: int = 0     # 32-bit values one thread holds at once at the least (its share of the largest tile)


def tile_need(elements: int, config, target: Target, shared_bytes: int = 0) -> Need:
    """The Need of a program holding `elements` values at once across its config's warps."""
    return Need(shared_bytes, -(-elements // (config.num_warps * target.warp_size)))


MAX_THREADS = 1024                    # per block, on every family (and Triton's limit)
MAX_BLOCK = 1 << 20                   # elements of one tile dimension (Triton's TRITON_MAX_TENSOR_NUMEL)


def _value_problem(name: str, value, default) -> str | None:
    """Why `value` cannot be field `name` (None if it can): a choice (a string) where the default is one; else a
    positive int, a power of two for a block size or a warp count."""
    if isinstance(default, str):
        return None if isinstance(value, str) else f"{name}={value!r} is not a choice (a string)"
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return f"{name}={value!r} is not a positive integer"
    if (name.startswith("BLOCK") or name == "num_warps") and value & (value - 1):
        return f"{name}={value} is not a power of two"
    if name.startswith("BLOCK") and value > MAX_BLOCK:
        return f"{name}={value} is over Triton's {MAX_BLOCK:,} elements"
    return None


def _problem(config, default: NamedTuple, tunable, target: Target | None, need) -> str | None:
    """Why `config` cannot replace `default`'s fields on `target` (None if it can)."""
    if not isinstance(config, dict):
        return "not an object"
    if set(config) - set(tunable):
        return f"fields {', '.join(sorted(set(config) - set(tunable)))} are not tunable (only {', '.join(tunable)})"
    why = next(filter(None, (_value_problem(k, v, getattr(default, k)) for k, v in config.items())), None)
    if why or target is None:
        return why
    full = default._replace(**config)
    threads = getattr(full, "num_warps", 1) * target.warp_size
    if threads > MAX_THREADS:
        return f"num_warps={full.num_warps} is {threads} threads on {target.name}, over {MAX_THREADS} a block"
    n = need(full, target) if need else Need()
    if n.shared_bytes > target.shared_bytes:
        return f"needs at least {n.shared_bytes:,} bytes of shared memory, over {target.name}'s {target.shared_bytes:,}"
    if n.per_thread > target.registers:
        return f"holds at least {n.per_thread} values a thread, over {target.name}'s {target.registers} registers"
    return None


@functools.lru_cache(maxsize=None)
def warn_ignored(kernel: str, where: str, text: str, why: str) -> None:
    """Warn once per (kernel, config) that a config is unusable and the launcher's default stays."""
    warnings.warn(f"kernels: ignoring the launch config {text} for {kernel} ({where}): {why}; using the default")


def pick(kernel: str, default: NamedTuple, target: Target | None, dtype: torch.dtype, size: int,
         seqlen: int | None = None, tunable=None, need=None) -> NamedTuple:
    """The config for one launch of `kernel` on `target` (kernels.targets.of(device); None: the CPU or the
    interpreter): a forced one, else the target's table entry, else `default`. Only the fields in `tunable`
    (default: all of default's) may be replaced; `need(config, target) -> Need` bounds what the config takes, so that an
    entry the family cannot hold is refused (with one warning naming the table and the key)."""
    tunable = default._fields if tunable is None else tunable
    config, key = _forced.get(kernel), None
    if config is None and target is not None:
        key, config = _table_config(kernel, config_dir(), target.name, dtype_name(dtype), int(size),
                                    bucket(seqlen)) or (None, None)
    if config is None:
        return default
    why = _problem(config, default, tunable, target, need)
    where = "forced" if key is None else f"{os.path.join(config_dir(), target.name + '.json')}, {key}"
    if why and ((kernel in _strict and key is None) or _refusing[0]):
        raise ValueError(f"{kernel}: the launcher refuses the config {json.dumps(config, sort_keys=True)} "
                         f"({where}): {why}")
    if why:
        warn_ignored(kernel, where, json.dumps(config, sort_keys=True, default=str), why)
        return default
    return default._replace(**config)


@contextlib.contextmanager
def forced(kernel: str, config: dict, strict: bool = False):
    """Every launch of `kernel` inside the block uses `config` (any device, the interpreter too): the tuner's
    sweep, and tests of non-default configs. A config the launcher cannot take is warned about and its default
    used, or, `strict`, refused with a ValueError saying why (the compile check of a candidate)."""
    previous, was_strict = _forced.get(kernel), kernel in _strict
    _forced[kernel] = dict(config)
    _strict.add(kernel) if strict else _strict.discard(kernel)
    try:
        yield
    finally:
        _strict.add(kernel) if was_strict else _strict.discard(kernel)
        if previous is None:
            _forced.pop(kernel, None)
        else:
            _forced[kernel] = previous


@contextlib.contextmanager
def refusing():
    """Inside the block, a table entry the launcher cannot take raises a ValueError (naming the table and the key)
    instead of being warned about and replaced by the default: the compile check of a table."""
    was, _refusing[0] = _refusing[0], True
    try:
        yield
    finally:
        _refusing[0] = was


def clear_cache() -> None:
    """Forget loaded tables (after writing a new one in the same process)."""
    load_table.cache_clear()
    _table_config.cache_clear()

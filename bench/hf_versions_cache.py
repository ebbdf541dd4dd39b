"""The release sweep's cache (bench.hf_versions): each release's fuzz per model type and its compatibility tier,
kept under a key of everything its answer depends on, so that a sweep after a change redoes only what the change
touches.

  * a fuzz cell (release x model type x mode): the release, the mode, the cases and seed, the sweep's own worker
    code, the source of every module of this checkout the fuzz of that model type runs (what bench/hf_fuzz.py and
    hf_parity.py import, transitively, less the family modules of bert/hf that are neither its own nor imported
    by it: a change to rotary.py redoes ModernBERT, NomicBERT and EuroBERT, and ESM and RoFormer, whose module
    imports from it), and, for the table's run, the digests checked.json lists for that model type's
    transformers module and transformers' attention functions (what fuse checks the installed code against);
  * the compatibility tier: the release and every source and test file.
A changed file redoes each cell whose key holds it; `--fresh` redoes everything. The cache lives in
~/.cache/bertfuse/hf_versions/<release>/ (`--cache`), one JSON file per result, written under a temporary name
and renamed.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "bertfuse" / "hf_versions"
_FUZZ_FILES = ("bench/hf_fuzz.py", "bench/hf_parity.py")
_TEST_FILES = ("conftest.py", "pytest.ini", "setup.py")


@functools.cache
def family_modules() -> dict[str, tuple[str, ...]]:
    """The family modules of bert/hf (those whose GROUP the registry, bert.hf.families.GROUPS, holds, which imports
    them all): module name -> the families its GROUP holds."""
    from bertfuse.bert.hf import families

    found = {}
    for name, module in sorted(sys.modules.items()):
        group = getattr(module, "GROUP", None) if name.startswith("bertfuse.bert.hf.") else None
        if any(group is g for g in families.GROUPS):
            found[name.rsplit(".", 1)[1]] = tuple(f.name for f in group.families)
    return found


@functools.cache
def family_module(family: str) -> str:
    """The family module of bert/hf whose GROUP holds a fuzzed model type (the copies of BERT's code: bert)."""
    from bertfuse.bench.hf_parity import COPIES

    base = COPIES[family][1] if family in COPIES else family.removesuffix("-sinusoidal")
    found = [name for name, held in family_modules().items() if base in held]
    if not found:
        raise ValueError(f"no family module holds {family!r}")
    return found[0]


def _file(module: str) -> Path | None:
    """The file of a module of this package ("bertfuse.bert.hf.code"), None for a name that is not one."""
    parts = module.split(".")[1:]
    for f in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if parts and f.is_file():
            return f
    return None


def _imports(f: Path) -> set[str]:
    """The package modules a file imports, at any depth of its code (`from bertfuse.a import b` may name module
    a.b or a name in a)."""
    text, found = f.read_text(), set()
    for base, wrapped, names in re.findall(r"from (bertfuse(?:\.\w+)*) import (?:\(([^)]*)\)|([\w, ]+))", text):
        found.add(base)
        found |= {f"{base}.{n.split()[0]}" for n in (wrapped or names).replace("\n", ",").split(",") if n.strip()}
    found |= set(re.findall(r"^\s*import (bertfuse(?:\.\w+)+)", text, re.M))
    return found


def fuzz_sources(family: str) -> list[Path]:
    """The files of this checkout whose code the fuzz of `family` runs (module docstring): what the fuzz's own
    files import, transitively, less the family modules of bert/hf that are not its own or imported by it."""
    own = family_module(family)
    others = {f"bertfuse.bert.hf.{m}" for m in family_modules() if m != own}
    seen, todo = set(), [ROOT / f for f in _FUZZ_FILES]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for module in _imports(f) - (others if f.parent != ROOT / "bert" / "hf" or f.stem != own else set()):
            if (g := _file(module)) is not None:
                todo.append(g)
    return sorted(seen)


def _checked_slice(transformers_module: str) -> dict:
    """The digests checked.json lists for a transformers modeling module's classes and for transformers' attention
    functions, without the releases (another release recorded with the same code changes nothing here)."""
    from bertfuse.bert.hf.code import CHECKED_FILE

    table = json.loads(CHECKED_FILE.read_text()) if CHECKED_FILE.exists() else {}
    prefixes = (f"transformers.models.{transformers_module}.", "transformers.integrations.")
    return {name: sorted(d) for name, d in sorted(table.items()) if name.startswith(prefixes)}


def _digest(parts: list, files: list[Path]) -> str:
    h = hashlib.sha256(json.dumps(parts, sort_keys=True).encode())
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def fuzz_key(mode: str, family: str, transformers_module: str, release: str, cases: int, seed: int,
             worker: str = "") -> str:
    """`worker`: the source of the sweep's own worker code (bench.hf_versions), which runs beside the fuzz."""
    parts = [mode, family, release, cases, seed, hashlib.sha256(worker.encode()).hexdigest()]
    if mode == "table":
        parts.append(_checked_slice(transformers_module))
    return _digest(parts, fuzz_sources(family))


def tests_key(release: str, tests: tuple[str, ...]) -> str:
    from bertfuse.bert.hf.code import CHECKED_FILE

    files = [p for d in ("bert", "kernels", "bench", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    files += [ROOT / f for f in _TEST_FILES if (ROOT / f).exists()]
    checked = CHECKED_FILE.read_text() if CHECKED_FILE.exists() else ""
    return _digest([release, list(tests), checked], files)


def path(cache: Path, release: str, what: str, key: str) -> Path:
    return cache / release / f"{what}-{key}.json"


def load(file: Path) -> dict | None:
    return json.loads(file.read_text()) if file.exists() else None


def save(file: Path, value: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(file)

"""`python -m bertfuse.bench.hf_versions RELEASE...`: the drop-in on each transformers release, as a table.

Each release is installed in a cached virtual environment of its own (`--venvs`, default
~/.cache/bertfuse/transformers-venvs/<release>), made with --system-site-packages so that it shares this
environment's torch and the rest beneath its own transformers; this checkout runs there from source
(PYTHONPATH). In it, for every model type the drop-in fuses (bench.hf_fuzz.FAMILIES: its families and the
model types fused as BERT's code under their own names), the configuration fuzzer runs fused against unfused
(`--cases` per model type; each case also unfuses and checks the original answer comes back to the bit), and one
small model is fused to read what fuse did with its attention. Then the compatibility tier (`COMPAT_TESTS`) runs
there. Each cell of the table (releases x model types) is:

  fused      the attention fused, and the fuzz found no differing answer and no crash;
  refused    fuse kept the original attention, with the reason (code not checked on that release, ...), and
             the fuzz found nothing: refusing is never wrong;
  FAILING    the fuzz found an answer that differs, a crash where the unfused model runs, or an unfuse that does
             not give the original back.

With --record, a first pass fuzzes with fuse(..., unchecked_code=True) and records the digests of the code of
every transformers class the drop-in knows in each modeling module whose model types all came out clean
(bertfuse/bert/hf/checked.json, bert.hf.code), and of transformers' attention functions where any did: the
evidence that the fused forwards compute that release's code is the fuzz. The table is written to
bench/results/hf_versions/ (README.md, results.json: each release's rows replaced, the others kept), with the
release from which each model type is fused on every release after it, and the count of each kind of cell. Any
FAILING cell or failing test exits 1.

Every result is cached per release (bench.hf_versions_cache: each fuzz cell under a key of the code it runs, the
tier under a key of every source and test file), so a sweep after a change redoes only the cells whose code the
change touches (a change to one family module: that family's model types; to the shared drop-in code or the
fuzzer: every cell); `--fresh` ignores the cache, `--jobs N` sweeps N releases at a time. The table's README
gives the machine time the whole range took (the latest patch of every minor release from the floor); CI runs
the compatibility tier of the oldest and a middle release (the newest is its own environment).

    python -m bertfuse.bench.hf_versions 4.57.6 5.0.0 5.1.0 ... 5.25.0 --record --cases 45 --jobs 2
    python -m bertfuse.bench.hf_versions 4.57.6 --tests-only        # the compatibility tier alone (CI; where
                                                                    # the table has the release, its row's tier)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from bertfuse.bench import hf_versions_cache as cache

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "hf_versions"
VENVS = Path.home() / ".cache" / "bertfuse" / "transformers-venvs"
# The compatibility tier: the drop-in, padding-free, model, client and namespace tests (fast tier).
COMPAT_TESTS = ("tests/test_hf.py", "tests/test_hf_contract.py", "tests/test_hf_families.py",
                "tests/test_hf_albert.py", "tests/test_hf_mpnet.py", "tests/test_hf_rotary.py",
                "tests/test_hf_esm_roformer.py", "tests/test_hf_deberta.py", "tests/test_hf_clients.py",
                "tests/test_model.py", "tests/test_names.py", "tests/test_masks.py", "tests/test_hf_code.py")
_TOO_OLD, _ABSENT, _UNBUILT = "too old", "absent", "not built by this release"


class VersionsError(Exception):
    """An expected failure of the command (a release pip cannot install): one line, no traceback."""


# ---- inside a release's environment ---------------------------------------------------------------------------
def _families_modules() -> dict[str, tuple[str, str]]:
    """Each fuzzed model type -> (its transformers modeling module, class-name prefix)."""
    from bertfuse.bench.hf_fuzz import FAMILIES
    from bertfuse.bench.hf_parity import _record

    out = {}
    for name in FAMILIES:
        record = _record(name)
        module = next(m for m, prefix in _all_models() if prefix == record.prefix)
        out[name] = (module, record.prefix)
    return out


def _all_models() -> tuple[tuple[str, str], ...]:
    from bertfuse.bert.hf import families

    norms = tuple(m for n in families.FAMILY_NORMS for m in n.models)
    return tuple(dict.fromkeys((*families.BLOCK_MODELS, *norms)))


def _class_templates() -> tuple[str, ...]:
    """Every class name (a "{P}" template) whose code some fused forward stands in for."""
    from bertfuse.bert.hf import families, fuser, heads

    names = [*fuser._OUTPUT_BLOCK_CLASSES, *heads._MLM_TASK_CLASSES, *heads._MLM_HEAD_CLASSES,
             *(b.cls for b in families.GELU_BLOCKS), *(c for n in families.FAMILY_NORMS for c in n.classes)]
    for kind in families.LAYERS:
        names += [n for _, group in kind.roles for n in group] + list(kind.stack.group_classes)
    return tuple(dict.fromkeys(names))


def checked_objects(model: tuple[str, str]) -> list:
    """The transformers classes of one modeling module whose code the drop-in's forwards stand in for."""
    from bertfuse.bert.hf.known import known_classes

    return list(known_classes(_class_templates(), (model,)))


def attention_functions() -> list:
    """transformers' own attention functions, as registered (none before the registry)."""
    from bertfuse.bert.hf.known import _ATTENTION_FUNCTIONS

    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return []
    return [f for impl in _ATTENTION_FUNCTIONS if (f := ALL_ATTENTION_FUNCTIONS.get(impl)) is not None]


def _head(family: str) -> str | None:
    """The task head a small model of `family` is built with (None: this release has no such model type)."""
    from bertfuse.bench.hf_parity import model_class

    return next((h for h in ("Model", "ForMaskedLM", "ForQuestionAnswering") if model_class(family, h)), None)


def _probe(family: str) -> str:
    """What fuse does with one small model's attention: "fused" (and a plain padded call runs fused), or the
    reason it keeps the original."""
    import warnings

    from bertfuse.bench.hf_parity import batch, build
    from bertfuse.bert.hf import fuse, fuse_report

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = build(family, _head(family))
            if getattr(model.config, "_attn_implementation", "sdpa") not in ("eager", "sdpa"):
                # ModernBERT on transformers 5.1 and 5.2 asks for flash attention unless told otherwise (a hub
                # kernel where the kernels library is installed): the probe asks for sdpa, as the fuzz draws
                model = build(family, _head(family), attn_implementation="sdpa")
        except Exception as e:  # transformers itself cannot build it (EuroBERT's configuration on 5.4)
            return f"{_UNBUILT}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        model = fuse(model)
        report = fuse_report(model)[0]
        if "attention" in dict(report.kept):
            return dict(report.kept)["attention"]
        ids, mask, _ = batch(family)
        model(input_ids=ids, attention_mask=mask)  # a plain padded call runs fused
    calls = "; ".join(report.calls)
    return f"fused, but a plain call runs the original code: {calls}" if calls else "fused"


def _fuzz_family(family: str, cases: int, seed: int, unchecked: bool) -> dict:
    from bertfuse.bench import hf_fuzz

    start = time.monotonic()
    try:
        result = hf_fuzz.fuzz(cases, seed, [family], unchecked=unchecked)
        return {"clean": True, "cases": result["cases"], "same": result[hf_fuzz.SAME], "seconds": result["seconds"]}
    except AssertionError as e:
        return {"clean": False, "why": str(e).splitlines()[0], "cases": cases,
                "seconds": round(time.monotonic() - start, 1)}


def worker(mode: str, cases: int, seed: int, families: list[str] | None = None) -> dict:
    """One release, in its environment: per model type (`families`, None: every one), the fuzz (mode "record":
    unchecked, with the digests of every known class of every modeling module; "table": as users fuse, with what
    fuse does to its attention)."""
    import transformers

    from bertfuse.bert.hf import code
    from bertfuse.bert.hf.code import version_problem

    out = {"transformers": transformers.__version__, "families": {}, "digests": {}}
    chosen = {f: m for f, m in _families_modules().items() if families is None or f in families}
    if version_problem():
        out["families"] = {f: {"clean": True, "cell": _TOO_OLD, "cases": 0, "seconds": 0} for f in chosen}
        return out
    for family, model in chosen.items():
        if _head(family) is None:  # a model type this release does not have
            out["families"][family] = {"clean": True, "cell": _ABSENT, "cases": 0, "seconds": 0, "module": model[0]}
            continue
        cell = _fuzz_family(family, cases, seed, unchecked=mode == "record")
        if mode == "table":
            try:
                cell["cell"] = _probe(family)
            except Exception as e:  # a crash where the unfused model runs (it does on this call)
                cell.update(clean=False, why=f"fuse, or a plain fused call, raises {type(e).__name__}: {e}")
        cell["module"] = model[0]
        out["families"][family] = cell
        print(f"{family}: {cell}", file=sys.stderr, flush=True)
    if mode == "record":
        for model in _all_models():
            out["digests"][model[0]] = {code.qualified(c): code.digest(c) for c in checked_objects(model)}
        out["digests"]["attention functions"] = {code.qualified(f): code.digest(f) for f in attention_functions()}
    return out


# ---- the command: environments, records, the table -----------------------------------------------------------
def environment(release: str, venvs: Path) -> Path:
    """The python of a virtual environment with transformers==release over this one's packages (made once).
    transformers' hub-kernels extra (named kernels in later 5.x releases) installs the `kernels` its release works
    with, and pip the newest sentence-transformers and datasets that accept it and its huggingface_hub
    (sentence-transformers 5.x before transformers 5), beneath this environment's."""
    venv = venvs / release
    python, made = venv / "bin" / "python", venv / "bertfuse-requirement.txt"
    requirements = [f"transformers[hub-kernels,kernels]=={release}", "sentence-transformers", "datasets"]
    if python.exists() and made.exists() and made.read_text() == " ".join(requirements) \
            and _installed(python) == release:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements],
                         capture_output=True, text=True)
    if pip.returncode != 0 or _installed(python) != release:
        raise VersionsError(f"{' '.join(requirements)} did not install: {pip.stderr.strip().splitlines()[-1:]}")
    made.write_text(" ".join(requirements))
    return python


def _installed(python: Path) -> str | None:
    out = subprocess.run([str(python), "-c", "import transformers; print(transformers.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the fuzz's PyTorch path
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_worker(python: Path, mode: str, cases: int, seed: int, families: list[str] | None = None) -> dict:
    chosen = [] if families is None else ["--families", ",".join(families)]
    out = subprocess.run([str(python), "-m", "bertfuse.bench.hf_versions", "--worker", mode, "--cases", str(cases),
                          "--seed", str(seed), *chosen], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise VersionsError(f"the {mode} run failed (exit {out.returncode}) with {_installed(python)}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_tests(python: Path) -> dict:
    """The compatibility tier in a release's environment: its pytest summary line and exit code."""
    start = time.monotonic()
    out = subprocess.run([str(python), "-m", "pytest", *COMPAT_TESTS, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                         env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines = [ln for ln in out.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    if out.returncode != 0:
        print(out.stdout[-6000:], file=sys.stderr)
    return {"rc": out.returncode, "summary": (lines[-1] if lines else out.stdout.strip()[-200:]).strip("= "),
            "seconds": round(time.monotonic() - start, 1)}


def record(result: dict) -> list[str]:
    """Record a record run's digests in checked.json (this release's earlier record replaced) for every modeling
    module whose model types all came out clean (the attention functions: where any did); returns the modules
    recorded."""
    from bertfuse.bert.hf.code import CHECKED_FILE

    release, fams = result["transformers"], result["families"]
    clean = {m: all(c["clean"] for c in fams.values() if c["module"] == m) for m in {c["module"] for c in
                                                                                      fams.values()}}
    # transformers' shared attention functions: checked by every model type that came out clean with them (its
    # fuzz drew sdpa as well as eager); a model type that failed is refused by its own classes' digests.
    clean["attention functions"] = any(c["clean"] for c in fams.values())
    table = json.loads(CHECKED_FILE.read_text()) if CHECKED_FILE.exists() else {}
    for digests in table.values():  # this release's record, made anew
        for d in [d for d, releases in digests.items() if release in releases]:
            digests[d].remove(release)
            if not digests[d]:
                del digests[d]
    table = {name: digests for name, digests in table.items() if digests}
    recorded = []
    for module, digests in result["digests"].items():
        if not clean.get(module):
            continue
        recorded.append(module)
        for name, d in digests.items():
            releases = table.setdefault(name, {}).setdefault(d, [])
            if release not in releases:
                releases.append(release)
                releases.sort(key=_release_key)
    tmp = CHECKED_FILE.with_suffix(".json.tmp")
    # sorted throughout, so that a record of the same code rewrites the file as it was
    tmp.write_text(json.dumps({n: dict(sorted(d.items())) for n, d in sorted(table.items())}, indent=1) + "\n")
    tmp.replace(CHECKED_FILE)
    return recorded


def _release_key(release: str):
    return tuple(int(p) if p.isdigit() else 0 for p in release.split("."))


def _cell(c: dict) -> str:
    if not c["clean"]:
        return f"**FAILING**: {c['why'][:160]}"
    if c.get("cell") == _TOO_OLD:
        return "refused: older than the floor (fuse raises)"
    if c.get("cell") == _ABSENT:
        return "not in this release"
    if c.get("cell", "").startswith(_UNBUILT):
        return f"{c['cell'][:160]} ({c['cases']} cases, {c['seconds']:.0f} s)"
    cell = c.get("cell", "?")
    what = "fused" if cell == "fused" else _short(cell) if cell.startswith("fused, but") else f"refused: {_short(cell)}"
    same = f", {c['same']} answered" if "same" in c else ""
    return f"{what} ({c['cases']} cases{same}, {c['seconds']:.0f} s)"


def _short(why: str) -> str:
    m = re.search(r"the code of (\w+) in the installed transformers", why)
    if not m:
        return why.split(" (")[0][:120]
    newer = re.search(r"fused on transformers (\S+) and", why)
    return f"{m[1]}'s code not checked on this release" + (f"; fused from {newer[1]} on" if newer else "")


def _kind(c: dict) -> str:
    """A cell's kind, for the counts: fused, partly (fused, but a plain call runs the original code), refused,
    absent (not in this release), failing."""
    cell = c.get("cell", "?")
    if not c["clean"]:
        return "failing"
    if cell == _ABSENT or cell.startswith(_UNBUILT):
        return "absent"
    return "fused" if cell == "fused" else "partly" if cell.startswith("fused, but") else "refused"


def _fused_from(cells: list[dict | None], releases: list[str]) -> str:
    """The oldest release from which the model type is fused on every release after it ("-": not the newest)."""
    oldest = "-"
    for release, c in reversed(list(zip(releases, cells))):
        if c is None or _kind(c) != "fused":
            break
        oldest = release
    return oldest


def write_table(rows: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    releases = sorted(rows, key=_release_key)
    families = list(dict.fromkeys(f for r in releases for f in rows[r]["families"]))
    dates = sorted({rows[r].get("when", "?") for r in releases})
    cases = {r: max(c["cases"] for c in rows[r]["families"].values()) for r in releases}
    usual = max(set(cases.values()), key=list(cases.values()).count)
    others = {n: [r for r in releases if cases[r] == n] for n in sorted(set(cases.values()) - {usual})}
    lines = ["# The drop-in on each transformers release", "",
             "`python -m bertfuse.bench.hf_versions " + " ".join(releases) + f" --record --cases {usual}` "
             + "".join(f"(--cases {n} on {', '.join(rs)}) " for n, rs in others.items())
             + "(bench/hf_versions.py): per "
             "release, the configuration fuzz per model type (fused against unfused, then unfused again) and what "
             "fuse does with a small model's attention; then the compatibility tier. Run on "
             + ", ".join(dates) + ".", "",
             "| model type | fused from | " + " | ".join(releases) + " |", "|---" * (len(releases) + 2) + "|"]
    counts: dict[str, int] = {}
    for f in families:
        cells = [rows[r]["families"].get(f) for r in releases]
        for c in filter(None, cells):
            counts[_kind(c)] = counts.get(_kind(c), 0) + 1
        lines.append(f"| {f} | {_fused_from(cells, releases)} | "
                     + " | ".join("-" if c is None else _cell(c) for c in cells) + " |")
    lines.append("| compatibility tier | | " + " | ".join(
        f"{rows[r]['tests']['summary']} ({rows[r]['tests']['seconds']:.0f} s)" if rows[r].get("tests") else "-"
        for r in releases) + " |")
    lines.append("| fuzz cases, time | | " + " | ".join(
        f"{sum(c['cases'] for c in rows[r]['families'].values())}, "
        f"{sum(c['seconds'] for c in rows[r]['families'].values()) / 60:.1f} min" for r in releases) + " |")
    names = {"fused": "fused", "partly": "fused with plain calls running the original code", "refused": "refused",
             "absent": "not in the release (or not built by it)", "failing": "FAILING"}
    fuzz = sum(c["seconds"] for r in releases for c in rows[r]["families"].values())
    tier = sum(rows[r]["tests"]["seconds"] for r in releases if rows[r].get("tests"))
    lines += ["", "Cells: " + ", ".join(f"{counts[k]} {v}" for k, v in names.items() if counts.get(k)) + ".",
              "", f"Machine time (each result as long as it took when it ran, cached or not): the table's fuzz "
                  f"{fuzz / 60:.0f} min, the compatibility tier {tier / 60:.0f} min; a --record sweep fuzzes once "
                  "more before the table."]
    (RESULTS / "README.md").write_text("\n".join(lines) + "\n")
    tmp = RESULTS / "results.json.tmp"
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    tmp.replace(RESULTS / "results.json")


def failing(row: dict) -> list[str]:
    bad = [f"{f}: {c['why']}" for f, c in row["families"].items() if not c["clean"]]
    if row.get("tests") and row["tests"]["rc"] != 0:
        bad.append(f"compatibility tier: {row['tests']['summary']}")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertfuse.bench.hf_versions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("releases", nargs="*", help="transformers releases, e.g. 4.57.6 5.25.0")
    p.add_argument("--cases", type=int, default=60, help="fuzz cases per model type and release")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", action="store_true", help="record the checked code first (see above)")
    p.add_argument("--tests-only", action="store_true",
                   help="the compatibility tier alone (written to the table's row of a release it has)")
    p.add_argument("--no-tests", action="store_true", help="the fuzz alone")
    p.add_argument("--venvs", type=Path, default=VENVS, help=f"where the environments are kept (default {VENVS})")
    p.add_argument("--jobs", type=int, default=1, help="releases swept at a time (each its own processes)")
    p.add_argument("--cache", type=Path, default=cache.CACHE,
                   help=f"where each release's results are kept (default {cache.CACHE})")
    p.add_argument("--fresh", action="store_true", help="run everything again, whatever the cache holds")
    p.add_argument("--worker", choices=("record", "table"), help=argparse.SUPPRESS)
    p.add_argument("--families", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        chosen = None if args.families is None else [f for f in args.families.split(",") if f]
        print(json.dumps(worker(args.worker, args.cases, args.seed, chosen)))
        return 0
    if not args.releases:
        p.error("name at least one transformers release")
    try:
        return _sweep(args)
    except VersionsError as e:
        print(f"hf_versions: {e}", file=sys.stderr)
        return 2


@functools.cache
def _worker_code() -> str:
    """The code a worker runs beside the fuzzer's (its part of every fuzz cell's cache key)."""
    return "".join(inspect.getsource(f) for f in (worker, _fuzz_family, _probe, _head, _families_modules))


class _Sweep:
    """One sweep: each release's record, fuzz and tests (cached: bench.hf_versions_cache), its row written to the
    table as it ends; releases run `--jobs` at a time, checked.json and the table written under one lock."""

    def __init__(self, args):
        self.args, self.lock = args, threading.Lock()
        self.rows = json.loads((RESULTS / "results.json").read_text()) if (RESULTS / "results.json").exists() else {}

    def _cells(self, python: Path, release: str, mode: str) -> tuple[dict, dict]:
        """Every model type's cell in `mode`, from the cache where its key is there, else fuzzed now (the worker
        runs in record mode anyway, for the digests); and the worker's answer."""
        args, cells, todo, keys = self.args, {}, [], {}
        families = _families_modules()
        for family, (module, _) in families.items():
            with self.lock:  # the table's key reads checked.json, which another release may be writing
                keys[family] = cache.fuzz_key(mode, family, module, release, args.cases, args.seed, _worker_code())
            hit = None if args.fresh else cache.load(cache.path(args.cache, release, f"{mode}-{family}", keys[family]))
            if hit is None:
                todo.append(family)
            else:
                cells[family] = hit
        out = run_worker(python, mode, args.cases, args.seed, todo) if todo or mode == "record" else {"families": {}}
        for family, cell in out["families"].items():
            cache.save(cache.path(args.cache, release, f"{mode}-{family}", keys[family]), cell)
            cells[family] = cell
        print(f"transformers {release}: {mode}: {len(todo)} model types fuzzed, {len(cells) - len(todo)} cached",
              flush=True)
        return {f: cells[f] for f in families}, out

    def _tests(self, python: Path, release: str) -> dict:
        file = cache.path(self.args.cache, release, "tests", cache.tests_key(release, COMPAT_TESTS))
        tests = None if self.args.fresh else cache.load(file)
        if tests is None or tests["rc"] != 0:  # a failing tier always runs again
            tests = run_tests(python)
            cache.save(file, tests)
        return tests

    def _write(self, release: str, row: dict) -> None:
        with self.lock:
            self.rows[release] = row
            write_table(self.rows)

    def release(self, release: str) -> list[str]:
        """One release's row (its failing cells, or its tier's failure, returned)."""
        args = self.args
        python = environment(release, args.venvs)
        if args.tests_only:
            tests = run_tests(python)
            print(f"transformers {release}: compatibility tier: {tests['summary']}", flush=True)
            if release in self.rows:  # the table's row for it: its tier's result now
                self._write(release, {**self.rows[release], "tests": tests})
            return [f"{release}: {tests['summary']}"] if tests["rc"] else []
        if args.record:
            cells, out = self._cells(python, release, "record")
            with self.lock:
                recorded = record({**out, "families": cells})
            print(f"transformers {release}: recorded the code of {', '.join(sorted(recorded)) or 'nothing'}",
                  flush=True)
        cells, out = self._cells(python, release, "table")
        row = {"transformers": release, "families": cells, "when": time.strftime("%Y-%m-%d")}
        self._write(release, row)  # before its tests, which read this release's row
        if not args.no_tests:
            row = {**row, "tests": self._tests(python, release)}
            self._write(release, row)
        print(f"transformers {release}: " + (", ".join(failing(row)) or "no failing cell"), flush=True)
        return [f"{release}: {b}" for b in failing(row)]


def _sweep(args) -> int:
    sweep = _Sweep(args)
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        bad = [b for found in pool.map(sweep.release, args.releases) for b in found]
    for b in bad:
        print(f"hf_versions: FAILING {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

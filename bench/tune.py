"""`python -m bench.tune`: measure every kernel's launch configs on this GPU and write the winners to a table; with
`--compile-only --arch A`, no GPU needed, write the best configs that compile clean for GPU family A instead.

On a GPU, for each kernel at the shapes BERT uses (base and large: hidden 768/1024, intermediate 3072/4096,
head_dim 64, sequences of 128 and 512; bfloat16, then float16; what the GPU refuses, such as bfloat16 on sm_75,
left out with one line per reason), the candidates (block sizes, num_warps, num_stages; the launcher's default
always among them) are

1. pruned, in parallel worker processes, to those that compile for this GPU's family without register spills,
   within shared memory, with half-precision dots on its tensor cores and 16-byte vectors where the compile check
   demands them (bench/compile_check.py, the rules of tests/compile_gpus.py); on a GPU the same workers then run
   each survivor once, so that Triton's on-disk cache holds it before timing starts;
2. timed one after another (triton's do_bench, median, after warm-up) through the real launcher, with the
   config forced (kernels.tuned.forced);
3. checked: the winner's outputs (or gradients) against the default config's on the same inputs and the same
   dropout seed (dropout masks depend on coordinates only, not on tiles); a winner that differs is dropped
   for the next best;

and the winners are merged into `<output>/<family>.json` as timed entries (written to a temporary name, then
renamed). Launchers read that table at first launch (kernels/tuned.py). The budget stops the sweep between
problems: what was measured by then is written.

With --compile-only, for each launch the compile check covers (every record's sites) the launcher's default on
the family is kept if it compiles clean with every kernel flag the model may set, else the first clean one of
the candidates with tiles, and tile per warp, no larger than the default's, largest first (`ranked`); the
choices are merged as untimed "all" entries, and timed entries already in the table are left alone.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import itertools
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Callable, NamedTuple

import torch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def families() -> list[str]:
    """The kernel records (bench/record.py), each a family of table kernels "<record>.<part>"."""
    from bench.record import records

    return [r.name for r in records()]


class Problem(NamedTuple):
    kernel: str          # table name: "attention.fwd", "layer_norm.bwd", ...
    dtype: torch.dtype
    size: int            # head_dim or hidden size: the table key
    seq_len: int | None  # the attention's max_seqlen (its table bucket); None elsewhere
    shape: tuple         # the family's problem size (see setup)

    @property
    def key(self) -> str:
        from kernels import tuned

        return tuned.entry_key(self.dtype, self.size, tuned.bucket(self.seq_len))

    def __str__(self):
        return f"{self.kernel} {self.key} {self.shape}"


def _tuning(kernel: str):
    from bench.record import record

    return record(kernel).tuning


def candidates(kernel: str) -> list[dict]:
    """The configs swept for a table kernel ("attention.fwd"), before pruning (the default is added to them)."""
    return _tuning(kernel).candidates[kernel.split(".")[1]]


def problems(names, dtypes) -> list[Problem]:
    """BERT's shapes of the named records' kernels, most used first: per dtype, BERT-base's shapes before
    BERT-large's (each record's TuneShape.rank), the first dtype before the next."""
    from bench.record import record

    out = []
    for dtype in dtypes:
        mine = [(s.rank, Problem(f"{name}.{part}", dtype, s.size, s.seq_len, s.shape))
                for name in names for s in record(name).tuning.shapes for part in record(name).tuning.parts]
        out += [p for _, p in sorted(mine, key=lambda rp: rp[0])]  # stable: the records' order within a rank
    return out


def refusal(problem: Problem, target) -> str | None:
    """Why GPU family `target` refuses the problem's kernel in its dtype (bench.record.Variant.refusal: bfloat16,
    or half-precision dots, on sm_75), so that a table has nothing to configure there; None where it runs it,
    and for a launch site that chooses among implementations (mlm_loss.strategy)."""
    launch = default_launch(problem.kernel, problem.dtype, problem.size, target)
    variant = _tuning(problem.kernel).variant(problem.kernel.split(".")[1], problem.dtype, problem.size, launch)
    return None if variant is None else variant.refusal(target)


def default_launch(kernel: str, dtype, size: int, target) -> NamedTuple:
    """The launcher's built-in config for a table kernel name ("attention.fwd", "layer_norm.bwd", ...) on a
    kernels.targets.Target (None: the interpreter's)."""
    return _tuning(kernel).default(kernel.split(".")[1], dtype, size, target)


# -- one problem on the device: build inputs, return what to time and what to compare -------------------------------

class Run(NamedTuple):
    timed: Callable[[], object]       # the call whose time is the kernel's (a forward, or a backward)
    outputs: Callable[[], list]       # the tensors that kernel produces, to compare across configs


def _backward_run(forward, inputs, grad_of) -> Run:
    """A Run timing the backward of forward(*inputs) (graph kept), comparing the gradients of grad_of."""
    out = forward(*inputs)
    grad = torch.randn_like(out)

    def timed():
        out.backward(grad, retain_graph=True)

    def outputs():
        for t in inputs:
            t.grad = None
        forward(*inputs).backward(grad)
        return [t.grad for t in grad_of]

    return Run(timed, outputs)


def _whole_run(forward, inputs, grad_of) -> Run:
    """A Run timing forward(*inputs) and its backward together, comparing the gradients of grad_of."""
    grad = torch.randn_like(forward(*inputs))

    def timed():
        forward(*inputs).backward(grad)

    def outputs():
        for t in inputs:
            t.grad = None
        timed()
        return [t.grad for t in grad_of]

    return Run(timed, outputs)


def setup(problem: Problem, device: torch.device) -> Run:
    """What to time and compare for one problem: the forward kernel's call without gradients, the backward of
    the record's function comparing the gradients that kernel writes, or, for the record's `whole` parts (a
    strategy; a kernel that computes gradients in the forward), forward and backward together."""
    part = problem.kernel.split(".")[1]
    tuning = _tuning(problem.kernel)
    fn, inputs, grads = tuning.setup(problem.shape, problem.size, problem.dtype, device, part)
    if part in tuning.whole:
        return _whole_run(fn, inputs, grads[part])
    if part not in grads:
        def forward():
            with torch.no_grad():
                return fn(*inputs)
        return Run(forward, lambda: [forward()])
    return _backward_run(fn, inputs, grads[part])


def run_with(problem: Problem, config: dict, run: Run, what: str):
    from kernels import tuned

    with tuned.forced(problem.kernel, config):
        return getattr(run, what)()


def do_bench_timer(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


# -- pruning, in worker processes -----------------------------------------------------------------------------------

def _check_candidate(problem: Problem, config: dict, arch: str, warm: bool) -> str | None:
    """In a worker: None if the candidate compiles cleanly for GPU family `arch` ("sm_90", "gfx942") with every
    flag combination the compile check gives it (and, on a GPU, after running it once so that Triton's disk
    cache holds it), else the reason it was pruned."""
    from kernels.targets import named

    from . import compile_check

    t = named(arch)
    failure = None  # stays None for a choice between implementations, which compiles nothing
    for variant in compile_check.variants_for(problem.kernel, problem.dtype, problem.size, config, t):
        failure = compile_check.check(variant, t)[0]
        if failure is not None:
            break
    if failure is None and warm:
        try:
            run_with(problem, config, setup(problem, torch.device("cuda")), "timed")
            torch.cuda.synchronize()
        except Exception as e:  # e.g. out of resources on this GPU
            failure = f"fails to run: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return failure


@contextlib.contextmanager
def workers(jobs: int):
    """A pool of `jobs` spawned processes started without TRITON_INTERPRET (the compiler must be real)."""
    from .e2e import environment

    ctx = multiprocessing.get_context("spawn")
    with environment({"TRITON_INTERPRET": None}), \
            concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        yield pool


def check_all(pool, pairs: list[tuple[Problem, dict]], arch: str, warm: bool) -> list:
    """The reason each (problem, config) fails `_check_candidate` (None: it passes), in the pool's workers."""
    return list(pool.map(_check_candidate, [p for p, _ in pairs], [c for _, c in pairs], itertools.repeat(arch),
                         itertools.repeat(warm)))


def prune(problem: Problem, configs: list[dict], arch: str, jobs: int, warm: bool) -> tuple[list[dict], dict]:
    """(configs that pass, {config as JSON: reason} for those that do not)."""
    with workers(jobs) as pool:
        reasons = check_all(pool, [(problem, c) for c in configs], arch, warm)
    kept = [c for c, r in zip(configs, reasons) if r is None]
    return kept, {json.dumps(c, sort_keys=True): r for c, r in zip(configs, reasons) if r is not None}


# -- the sweep ------------------------------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf if a has a non-finite value)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def pool_of(problem: Problem, target, configs=None) -> tuple[dict, list[dict]]:
    """(the launcher's default on `target`, in the fields the sweep varies; the candidates, each completed from
    it, without duplicates, the default last)."""
    default = default_launch(problem.kernel, problem.dtype, problem.size, target)._asdict()
    swept = configs if configs is not None else candidates(problem.kernel)
    base = {k: default[k] for k in swept[0]}  # only the fields the sweep varies
    pool = []
    for config in [*swept, base]:
        config = dict(base, **config)
        if config not in pool:
            pool.append(config)
    return base, pool


def tune_problem(problem: Problem, device: torch.device, timer, prune_fn=None, configs=None) -> dict | None:
    """The table entry for one problem: {"config", "ms", "default_ms", "candidates", "pruned", "timed"}; None
    if no candidate survives (the default then stays)."""
    from kernels import targets

    base, pool = pool_of(problem, targets.of(device), configs)
    kept, pruned = prune_fn(problem, pool) if prune_fn else (pool, {})
    if not kept:
        return None
    run = setup(problem, device)
    times = []
    for config in kept:
        try:
            times.append((timer(lambda c=config: run_with(problem, c, run, "timed")), config))
        except Exception as e:  # a config that compiles but cannot launch here
            pruned[json.dumps(config, sort_keys=True)] = f"fails to run: {type(e).__name__}"
    reference = run_with(problem, base, run, "outputs")
    default_ms = next((t for t, c in times if c == base), None)
    for t, config in sorted(times, key=lambda tc: tc[0]):
        outputs = run_with(problem, config, run, "outputs")
        if max(rel_err(o, r) for o, r in zip(outputs, reference)) <= TOLERANCE[problem.dtype]:
            return {"config": config, "ms": t, "default_ms": default_ms, "candidates": len(pool),
                    "pruned": len(pruned), "timed": True}
        pruned[json.dumps(config, sort_keys=True)] = "output differs from the default config's"
    return None


def table_problems(path: str) -> list[str]:
    """What is wrong with the launch-config table at `path` ([] for a good one): its format, and each entry's
    key ("<dtype>/<size>/<bucket>") and config (only fields its launcher lets a table tune, values it accepts)."""
    from kernels import tuned

    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    if table.get("format") != tuned.FORMAT or not isinstance(table.get("kernels"), dict):
        return [f"{path}: not a format-{tuned.FORMAT} table"]
    found = []
    for kernel, entries in table["kernels"].items():
        for key, entry in entries.items():
            extra = set(entry.get("config", {})) - set(candidates(kernel)[0])
            why = tuned.key_problem(key) or (
                None if isinstance(getattr(torch, key.split("/")[0], None), torch.dtype) else "not a dtype's key")
            if extra or why:
                found.append(f"{kernel} {key}: " + (f"sets {sorted(extra)}, which the table may not tune" if extra
                                                    else why))
    return found


def write_table(folder: str, arch: str, results: dict, meta: dict) -> str:
    """Merge {kernel: {key: entry}} into <folder>/<arch>.json, atomically; returns the path."""
    from bert.common.files import atomic_write
    from kernels import tuned

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{arch}.json")
    table = tuned.load_table(folder, arch) or {"format": tuned.FORMAT, "arch": arch, "kernels": {}}
    table = json.loads(json.dumps(table))  # a copy: load_table's result is cached
    table.update(meta)
    for kernel, entries in results.items():
        table["kernels"].setdefault(kernel, {}).update(entries)
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")

    atomic_write(path, write)
    tuned.clear_cache()
    return path


def sweep(todo: list[Problem], device: torch.device, budget: float, timer, prune_fn, log=print) -> dict:
    """Tune problems in order until the budget is spent; {kernel: {key: entry}}."""
    deadline = time.monotonic() + budget
    results: dict = {}
    for problem in todo:
        if time.monotonic() > deadline:
            log(f"budget spent: {problem} and later problems not tuned")
            break
        t0 = time.monotonic()
        entry = tune_problem(problem, device, timer, prune_fn)
        if entry is None:
            log(f"{problem}: no candidate survived; the default stays")
            continue
        results.setdefault(problem.kernel, {})[problem.key] = entry
        gain = f", default {entry['default_ms']:.4f} ms" if entry["default_ms"] else ""
        log(f"{problem}: {entry['config']} {entry['ms']:.4f} ms{gain} ({entry['candidates']} candidates, "
            f"{entry['pruned']} pruned, {time.monotonic() - t0:.0f} s)")
    return results


# -- without a GPU: the best config that compiles clean on a family -------------------------------------------------

def compile_problems(names, target) -> list[Problem]:
    """Each (launch site, dtype, size) of the named records' compile-check sites that a table may configure,
    once, keyed for every sequence length ("all"), on family `target`: a site the family refuses (bfloat16, or
    half-precision dots, on sm_75) has nothing to configure."""
    from bench.record import record

    out = []
    for name in names:
        rec = record(name)
        for site in rec.sites():
            problem = Problem(f"{name}.{site.part}", site.dtype, site.size, None, ())
            if site.part in rec.tuning.parts and problem not in out and not refusal(problem, target):
                out.append(problem)
    return out


def ranked(base: dict, pool: list[dict]) -> list[dict]:
    """The configs tried, untimed, in the order preferred: the launcher's default; then, since a default that
    fails has spilled registers or overflowed shared memory, the candidates with tiles no larger than its and no
    more of a tile per warp (registers per thread), the largest tiles first (the most work, and reuse, per
    program), then more warps, then more pipeline stages. Larger ones would fail the same way (and some take
    ptxas minutes and gigabytes to spill)."""
    def tiles(c):
        return math.prod(v for k, v in c.items() if k.startswith("BLOCK"))

    def per_warp(c):
        return tiles(c) / c.get("num_warps", 1)

    smaller = [c for c in pool if c != base and tiles(c) <= tiles(base) and per_warp(c) <= per_warp(base)]
    return [base] + sorted(smaller, key=lambda c: (-tiles(c), -c.get("num_warps", 0), -c.get("num_stages", 0)))


def timed(entries: dict, problem: Problem) -> bool:
    """Whether a table's entries ({kernel: {key: entry}}) hold a GPU-timed entry for the problem."""
    entry = entries.get(problem.kernel, {}).get(problem.key, {})
    return bool(entry.get("timed", "ms" in entry))


def compile_only(arch: str, names, jobs: int, keep: dict, log=print) -> dict:
    """{kernel: {key: entry}}: for each compile problem on family `arch`, the first of `ranked` that compiles
    clean with every flag its sites use (bench/compile_check.py), as an untimed entry. Problems whose key is in
    `keep` (timed entries of the table) are left alone; a problem with no clean candidate gets no entry."""
    from kernels import tuned
    from kernels.targets import named

    t = named(arch)
    todo = [p for p in compile_problems(names, t) if not timed(keep, p)]
    orders = {p: ranked(*pool_of(p, t)) for p in todo}
    results: dict = {}
    with workers(jobs) as pool:
        for p, failure in zip(todo, check_all(pool, [(p, orders[p][0]) for p in todo], arch, False)):
            order = orders[p]
            chosen = 0 if failure is None else None  # the index in `order` of the first clean config
            for start in range(1, len(order), jobs) if failure else ():
                reasons = check_all(pool, [(p, c) for c in order[start:start + jobs]], arch, False)
                chosen = next((start + i for i, r in enumerate(reasons) if r is None), None)
                if chosen is not None:
                    break
            if chosen is None:
                log(f"{arch} {p}: none of {len(order)} configs compiles clean ({failure}); the default stays")
                continue
            results.setdefault(p.kernel, {})[tuned.entry_key(p.dtype, p.size, "all")] = {
                "config": order[chosen], "timed": False, "candidates": chosen + 1, "pruned": chosen}
            log(f"{arch} {p}: {order[chosen]}" + (f" ({chosen} better-ranked ones do not compile clean)"
                                                   if chosen else ""))
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", choices=families(), default=families(),
                   help="kernel records to tune (default: all)")
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16"], default=["bfloat16", "float16"])
    p.add_argument("--budget", type=float, default=600, help="seconds; the sweep stops between problems")
    p.add_argument("--output", default=os.path.join("kernels", "configs"),
                   help="folder of the tables (default: kernels/configs, the committed ones)")
    p.add_argument("--skip-existing", action="store_true",
                   help="leave out problems the table in --output already has (a later run continues an earlier one)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="worker processes that compile candidates")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU needed: for each launch site the compile check covers, write the best config that "
                        "compiles clean for --arch as an untimed entry (timed entries are kept)")
    p.add_argument("--arch", nargs="+", choices=[*_families(), "all"],
                   help="GPU families for --compile-only (default: this GPU's)")
    return p.parse_args(argv)


def _families() -> list[str]:
    from kernels.targets import TARGETS

    return list(TARGETS)


def _meta(argv) -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m bench.tune " + " ".join(sys.argv[1:] if argv is None else argv)}


def main_compile_only(args, argv) -> int:
    from kernels import targets, tuned

    arches = args.arch or ([targets.of(torch.device("cuda")).name] if torch.cuda.is_available() else None)
    if not arches:
        print("bench.tune: --compile-only needs --arch here (no GPU to read it from)", file=sys.stderr)
        return 2
    for arch in _families() if "all" in arches else arches:
        keep = tuned.load_table(args.output, arch).get("kernels", {})
        results = compile_only(arch, args.kernels, args.jobs, keep)
        meta = {"compile_checked": dict(_meta(argv), rule="untimed: the launcher's default where it compiles "
                                        "clean (no spill, within shared memory, dots on the tensor cores), else "
                                        "the clean candidate with the largest tiles no larger than its")}
        print(f"wrote {write_table(args.output, arch, results, meta)}" if results else f"{arch}: nothing written")
    return 0


def usage_problem(args) -> str | None:
    """Why the arguments cannot work, said before anything is compiled: no worker, or an --output folder this
    process cannot write its table into."""
    if args.jobs < 1:
        return f"--jobs must be at least 1, got {args.jobs}"
    try:
        os.makedirs(args.output, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=args.output, prefix=".write-check-"):
            pass
    except OSError as e:
        return f"--output {args.output} is not a folder this process can write ({e.strerror or e})"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = usage_problem(args)
    if problem:
        print(f"bench.tune: {problem}", file=sys.stderr)
        return 2
    if args.compile_only:
        return main_compile_only(args, argv)
    if not torch.cuda.is_available():
        print("bench.tune: no GPU here; launch configs can only be timed on one (--compile-only --arch A writes "
              "compile-checked ones without)", file=sys.stderr)
        return 2
    from kernels import targets, tuned

    device = torch.device("cuda")
    target = targets.of(device)
    arch = target.name

    def prune_fn(problem, configs):
        return prune(problem, configs, arch, args.jobs, warm=True)

    todo = problems(args.kernels, [getattr(torch, d) for d in args.dtypes])
    reasons = {p: refusal(p, target) for p in todo}
    for reason in dict.fromkeys(r for r in reasons.values() if r):  # every candidate would fail to run
        print(f"# {sum(r == reason for r in reasons.values())} problems left out: {reason}")
    todo = [p for p in todo if not reasons[p]]
    if args.skip_existing:
        have = tuned.load_table(args.output, arch).get("kernels", {})
        todo = [p for p in todo if not timed(have, p)]
    print(f"# tuning {len(todo)} problems on {torch.cuda.get_device_name(device)} ({arch}), budget {args.budget:.0f} s")
    results = sweep(todo, device, args.budget, do_bench_timer, prune_fn)
    meta = dict(_meta(argv), device=torch.cuda.get_device_name(device))
    if results:
        print(f"wrote {write_table(args.output, arch, results, meta)}")
    else:
        print("nothing tuned: no table written")
    return 0


if __name__ == "__main__":
    sys.exit(main())

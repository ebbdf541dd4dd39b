"""`python -m bench.tune`: measure every kernel's launch configs on this GPU and write the winners to a table.

For each kernel at the shapes BERT uses (base and large: hidden 768/1024, intermediate 3072/4096, head_dim 64,
sequences of 128 and 512; bfloat16, then float16), the candidates (block sizes, num_warps, num_stages; the
launcher's default always among them) are

1. pruned, in parallel worker processes, to those that compile for this GPU's architecture without register
   spills, within shared memory, with half-precision dots on wgmma and 16-byte vectors where the compile check
   demands them (bench/compile_check.py, the rules of tests/compile_sm90.py); on a GPU the same workers then run
   each survivor once, so that Triton's on-disk cache holds it before timing starts;
2. timed one after another (triton's do_bench, median, after warm-up) through the real launcher, with the
   config forced (kernels.tuned.forced);
3. checked: the winner's outputs (or gradients) against the default config's on the same inputs and the same
   dropout seed (dropout masks depend on coordinates only, not on tiles); a winner that differs is dropped
   for the next best;

and the winners are merged into `<output>/<arch>.json` (written to a temporary name, then renamed). Launchers
read that table at first launch (kernels/tuned.py). The budget stops the sweep between problems: what was
measured by then is written.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import itertools
import json
import multiprocessing
import os
import sys
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


def default_launch(kernel: str, dtype, size: int) -> NamedTuple:
    """The launcher's built-in config for a table kernel name ("attention.fwd", "layer_norm.bwd", ...)."""
    return _tuning(kernel).default(kernel.split(".")[1], dtype, size)


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

def _check_candidate(problem: Problem, config: dict, arch: int, warm: bool) -> str | None:
    """In a worker: None if the candidate compiles cleanly for `arch` (and, on a GPU, after running it once so
    that Triton's disk cache holds it), else the reason it was pruned."""
    from . import compile_check

    variant = compile_check.variant_for(problem.kernel, problem.dtype, problem.size, config)
    failure = None if variant is None else compile_check.check(variant, arch)[0]  # None: a choice, not a kernel
    if failure is None and warm:
        try:
            run_with(problem, config, setup(problem, torch.device("cuda")), "timed")
            torch.cuda.synchronize()
        except Exception as e:  # e.g. out of resources on this GPU
            failure = f"fails to run: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return failure


def prune(problem: Problem, configs: list[dict], arch: int, jobs: int, warm: bool) -> tuple[list[dict], dict]:
    """(configs that pass, {config as JSON: reason} for those that do not), checked in `jobs` spawned processes
    started without TRITON_INTERPRET (the compiler must be real)."""
    from .e2e import environment

    ctx = multiprocessing.get_context("spawn")
    with environment({"TRITON_INTERPRET": None}), \
            concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        reasons = list(pool.map(_check_candidate, itertools.repeat(problem), configs, itertools.repeat(arch),
                                itertools.repeat(warm)))
    kept = [c for c, r in zip(configs, reasons) if r is None]
    return kept, {json.dumps(c, sort_keys=True): r for c, r in zip(configs, reasons) if r is not None}


# -- the sweep ------------------------------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf if a has a non-finite value)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tune_problem(problem: Problem, device: torch.device, timer, prune_fn=None, configs=None) -> dict | None:
    """The table entry for one problem: {"config", "ms", "default_ms", "candidates", "pruned"}; None if no
    candidate survives (the default then stays)."""
    default = default_launch(problem.kernel, problem.dtype, problem.size)._asdict()
    swept = configs if configs is not None else candidates(problem.kernel)
    base = {k: default[k] for k in swept[0]}  # only the fields the sweep varies
    pool = []
    for config in [*swept, base]:
        config = dict(base, **config)
        if config not in pool:
            pool.append(config)
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
                    "pruned": len(pruned)}
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
            dtype, size, _ = (key.split("/") + ["", "", ""])[:3]
            extra = set(entry.get("config", {})) - set(candidates(kernel)[0])
            if extra or not size.isdigit() or not isinstance(getattr(torch, dtype, None), torch.dtype):
                found.append(f"{kernel} {key}: " + (f"sets {sorted(extra)}, which the table may not tune" if extra
                                                    else "not a <dtype>/<size>/<bucket> key"))
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
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.tune: no CUDA GPU here; launch configs can only be measured on one", file=sys.stderr)
        return 2
    from kernels import tuned

    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    arch = tuned.arch_name(major, minor)

    def prune_fn(problem, configs):
        return prune(problem, configs, major * 10 + minor, args.jobs, warm=True)

    todo = problems(args.kernels, [getattr(torch, d) for d in args.dtypes])
    if args.skip_existing:
        have = tuned.load_table(args.output, arch).get("kernels", {})
        todo = [p for p in todo if p.key not in have.get(p.kernel, {})]
    print(f"# tuning {len(todo)} problems on {torch.cuda.get_device_name(device)} ({arch}), budget {args.budget:.0f} s")
    results = sweep(todo, device, args.budget, do_bench_timer, prune_fn)
    import triton

    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m bench.tune " + " ".join(sys.argv[1:] if argv is None else argv)}
    if results:
        print(f"wrote {write_table(args.output, arch, results, meta)}")
    else:
        print("nothing tuned: no table written")
    return 0


if __name__ == "__main__":
    sys.exit(main())

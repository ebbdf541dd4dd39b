"""The timed tuner (`python -m bertfuse.bench.tune` on a GPU): each problem's candidates pruned to those that compile
clean and run, timed through the real launcher with the config forced, the fastest whose outputs match the
default config's kept; see bench/tune.py for the whole procedure.
"""
from __future__ import annotations

import json
import time
from typing import Callable, NamedTuple

import torch

from .tables import meta, timed, write_table
from .tune_problems import Problem, check_all, check_candidate, pool_of, problems, refusal, workers

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


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
    from .ops import record

    tuning = record(problem.kernel).tuning
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
    from bertfuse.kernels import tuned

    with tuned.forced(problem.kernel, config):
        return getattr(run, what)()


def do_bench_timer(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


# -- pruning and timing ----------------------------------------------------------------------------------------------

def check_and_warm(problem: Problem, config: dict, arch: str) -> str | None:
    """In a worker on a GPU: `check_candidate`, then one run of a clean candidate, so that Triton's disk cache
    holds it before timing starts; the reason it fails, or None."""
    failure = check_candidate(problem, config, arch)
    if failure is None:
        try:
            run_with(problem, config, setup(problem, torch.device("cuda")), "timed")
            torch.cuda.synchronize()
        except Exception as e:  # e.g. out of resources on this GPU
            failure = f"fails to run: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return failure


def prune(problem: Problem, configs: list[dict], arch: str, jobs: int, warm: bool) -> tuple[list[dict], dict]:
    """(configs that pass, {config as JSON: reason} for those that do not); with `warm`, each that compiles clean
    is also run once on this GPU."""
    with workers(jobs) as pool:
        reasons = check_all(pool, [(problem, c) for c in configs], arch, check_and_warm if warm else check_candidate)
    kept = [c for c, r in zip(configs, reasons) if r is None]
    return kept, {json.dumps(c, sort_keys=True): r for c, r in zip(configs, reasons) if r is not None}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf if a has a non-finite value)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tune_problem(problem: Problem, device: torch.device, timer, prune_fn=None, configs=None) -> dict | None:
    """The table entry for one problem: {"config", "ms", "default_ms", "candidates", "pruned", "timed"}; None
    if no candidate survives (the default then stays)."""
    from bertfuse.kernels import targets

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


def main_timed(args, argv) -> int:
    """`python -m bertfuse.bench.tune` on a GPU: sweep, write the winners to the table in --output."""
    from bertfuse.kernels import targets, tuned

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
    info = dict(meta(argv), device=torch.cuda.get_device_name(device))
    if results:
        print(f"wrote {write_table(args.output, arch, results, 'timed', info)}")
    else:
        print("nothing tuned: no table written")
    return 0

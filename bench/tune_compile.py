"""The compile-only tuner (`python -m bertfuse.bench.tune --compile-only --arch A`, no GPU): for each launch the compile check
records on family A, the launcher's default where it compiles clean, else the best clean candidate (`ranked`),
written as untimed "all" entries.
"""
from __future__ import annotations

import math
import sys

import torch

from .tables import meta, timed, write_table
from .tune_problems import Problem, check_all, pool_of, workers


def compile_problems(names, target) -> list[Problem]:
    """Each (launch site, dtype, size) that the named records' compile calls launch on family `target` and a
    table may configure (a site with candidates), once, keyed for every sequence length ("all"): a call the
    family refuses (bfloat16, or half-precision dots, on sm_75) has nothing to configure."""
    from bertfuse.bench.ops import record
    from bertfuse.bench.record import record_launches
    from bertfuse.kernels import launches

    out = []
    for rec in map(record, names):
        for call in rec.compiled():
            for launch in record_launches(rec, call, target).launches:  # none where the family refuses
                problem = Problem(launch.site, call.dtype, call.size, None, ())
                if launches.site(launch.site).candidates and problem not in out:
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


def compile_only(arch: str, names, jobs: int, keep: dict, log=print) -> dict:
    """{kernel: {key: entry}}: for each compile problem on family `arch`, the first of `ranked` that compiles
    clean with every flag its sites use (bench/compile_check.py), as an untimed entry. Problems whose key is in
    `keep` (timed entries of the table) are left alone; a problem with no clean candidate gets no entry."""
    from bertfuse.kernels import tuned
    from bertfuse.kernels.targets import named

    t = named(arch)
    todo = [p for p in compile_problems(names, t) if not timed(keep, p)]
    orders = {p: ranked(*pool_of(p, t)) for p in todo}
    results: dict = {}
    with workers(jobs) as pool:
        for p, failure in zip(todo, check_all(pool, [(p, orders[p][0]) for p in todo], arch)):
            order = orders[p]
            chosen = 0 if failure is None else None  # the index in `order` of the first clean config
            for start in range(1, len(order), jobs) if failure else ():
                reasons = check_all(pool, [(p, c) for c in order[start:start + jobs]], arch)
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


def main_compile_only(args, argv) -> int:
    from bertfuse.kernels import targets, tuned

    arches = args.arch or ([targets.of(torch.device("cuda")).name] if torch.cuda.is_available() else None)
    if not arches:
        print("bench.tune: --compile-only needs --arch here (no GPU to read it from)", file=sys.stderr)
        return 2
    for arch in targets.TARGETS if "all" in arches else arches:
        keep = tuned.load_table(args.output, arch).get("kernels", {})
        results = compile_only(arch, args.kernels, args.jobs, keep)
        run = dict(meta(argv), rule="untimed: the launcher's default where it compiles clean (no spill, within "
                   "shared memory, dots on the tensor cores), else the clean candidate with the largest tiles no "
                   "larger than its")
        print(f"wrote {write_table(args.output, arch, results, 'compile_checked', run)}" if results
              else f"{arch}: nothing written")
    return 0

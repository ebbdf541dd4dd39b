"""Compile every kernel variant the launchers use on one GPU family, on a machine without a GPU, and judge the
compiler's report. Run as a script (not under TRITON_INTERPRET):

    python tests/compile_gpus.py --arch A [--shard I/N] [group ...]

A: sm_75 sm_80 sm_86 sm_89 sm_90 sm_100 sm_120 gfx90a gfx942 (kernels/targets.py), or "all" for each in turn.
It prints one line per variant (`ok ...` with shared memory or LDS, registers, bytes spilled, tensor-core
instructions; `FAIL ...` with the reason), then "N failed", and exits non-zero if any variant does not compile,
needs more shared memory than a block gets there, spills registers, has a register report that cannot be read,
runs a half-precision dot off the family's tensor cores, or moves half-precision elements of a memory-bound
kernel one at a time (the rules are in bench/compile_check.py, which the tuner uses to prune its candidates). A
dtype the family cannot run (bfloat16 on sm_75) is not compiled: its line shows the error the launchers raise.

Groups: each kernel record's name (its launch sites, with the config the launcher picks on that family: the
family's table, kernels/configs/<A>.json, else the default), and "table" (every entry of that table; entries
that are the launchers' picks already are compiled once). `--shard I/N` compiles every N-th variant from the
I-th (0-based), so that N processes share the work.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)

from bertfuse.bench import compile_check  # noqa: E402
from bertfuse.kernels.targets import TARGETS, named  # noqa: E402


def variants(arch: str, names: list[str]) -> list:
    """The variants of the named groups (all by default) for one family, each once."""
    groups = compile_check.groups(named(arch))
    seen, out = set(), []
    for name, group in groups.items():
        if name in (names or groups):
            for v in group():
                if compile_check.variant_key(v) not in seen:
                    seen.add(compile_check.variant_key(v))
                    out.append(v)
    return out


def run(arch: str, names: list[str], shard: int, shards: int) -> int:
    t = named(arch)
    failures = 0
    for variant in variants(arch, names)[shard::shards]:
        failure, report = compile_check.check(variant, t)
        failures += failure is not None
        print(f"FAIL {arch} {variant.name}: {failure}" if failure else f"ok   {arch} {variant.name} ({report})",
              flush=True)
    return failures


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python tests/compile_gpus.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", required=True, choices=[*TARGETS, "all"])
    p.add_argument("--shard", default="0/1", help="I/N: every N-th variant from the I-th")
    p.add_argument("groups", nargs="*")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    shard, shards = map(int, args.shard.split("/"))
    known = set(compile_check.groups(next(iter(TARGETS.values()))))
    unknown = set(args.groups) - known
    if unknown:
        print(f"unknown group(s) {', '.join(sorted(unknown))}; have {', '.join(known)}", file=sys.stderr)
        return 2
    failures = sum(run(arch, args.groups, shard, shards) for arch in (TARGETS if args.arch == "all" else [args.arch]))
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

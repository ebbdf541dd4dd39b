"""Compile every kernel variant the launchers use for an sm_90 GPU (H100/H200), down to a cubin, on a machine
without a GPU, and read ptxas's register report. Run as a script (not under TRITON_INTERPRET):
`python tests/compile_sm90.py [--shard I/N] [group ...]`; it prints one line per variant (shared memory,
registers per thread, bytes spilled to local memory) and exits non-zero if any variant fails to compile, needs
more shared memory than a block gets, spills registers, runs a half-precision dot off Hopper's wgmma, or moves
half-precision elements of a memory-bound kernel one at a time (the rules are in bench/compile_check.py, which
the tuner uses to prune its candidates). Groups: each kernel record's name (the launchers' default variants of
that op), and "table", the configs of the committed sm_90 launch-config table (kernels/configs/sm_90.json).
`--shard I/N` compiles every N-th variant from the I-th (0-based), so that N processes share the work;
tests/test_compile_sm90.py runs it that way."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)

from bench import compile_check  # noqa: E402


def main(argv: list[str]) -> int:
    shard, shards = 0, 1
    if argv[:1] == ["--shard"]:
        shard, shards = map(int, argv[1].split("/"))
        argv = argv[2:]
    groups = compile_check.groups()
    unknown = set(argv) - set(groups)
    if unknown:
        print(f"unknown group(s) {', '.join(sorted(unknown))}; have {', '.join(groups)}", file=sys.stderr)
        return 2
    variants = [v for name, group in groups.items() if name in (argv or groups) for v in group()]
    failures = 0
    for variant in variants[shard::shards]:
        failure, report = compile_check.check(variant)
        failures += failure is not None
        print(f"FAIL {variant.name}: {failure}" if failure else f"ok   {variant.name} ({report})", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

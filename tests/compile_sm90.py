"""Compile every kernel variant the launchers use for an sm_90 GPU (H100/H200), down to a cubin, on a machine
without a GPU, and read ptxas's register report. Run as a script (not under TRITON_INTERPRET):
`python tests/compile_sm90.py [group ...]`; it prints one line per variant (shared memory, registers per thread,
bytes spilled to local memory) and exits non-zero if any variant fails to compile, needs more shared memory
than a block gets, spills registers, runs a half-precision dot off Hopper's wgmma, or moves half-precision
elements of a memory-bound kernel one at a time (the rules are in bench/compile_check.py, which the tuner uses
to prune its candidates). Groups: the default variants of each kernel, and "table_variants", the configs of the
committed sm_90 launch-config table (kernels/configs/sm_90.json). tests/test_compile_sm90.py runs it."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)

from bench import compile_check  # noqa: E402


def main() -> int:
    failures = 0
    groups = compile_check.GROUPS
    selected = sys.argv[1:] or [g.__name__ for g in groups]
    for group in groups:
        if group.__name__ not in selected:
            continue
        for variant in group():
            failure, report = compile_check.check(variant)
            failures += failure is not None
            print(f"FAIL {variant[0]}: {failure}" if failure else f"ok   {variant[0]} ({report})", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

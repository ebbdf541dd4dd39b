"""`python -m bertfuse.bench.tune`: measure every kernel's launch configs on this GPU and write the winners to a table; with
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

With --compile-only, for each launch the compile check records (every record's compile calls) the launcher's
default on the family is kept if it compiles clean with every kernel flag the model may set, else the first clean
one of the candidates with tiles, and tile per warp, no larger than the default's, largest first (`ranked`); the
choices are merged as untimed "all" entries, and timed entries already in the table are left alone.

The launch sites, their defaults and candidates are the kernels' declaration (kernels.launches). This module is
the command; the work is in bench/tune_problems.py (the problems, compiling candidates in worker processes),
bench/tune_timed.py (the timed sweep), bench/tune_compile.py (the compile-only choice) and bench/tables.py (the
tables' checks and writing).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from .tune_problems import families


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bertfuse.bench.tune", description=__doc__,
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
    from bertfuse.kernels.targets import TARGETS

    return list(TARGETS)


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
        from .tune_compile import main_compile_only

        return main_compile_only(args, argv)
    if not torch.cuda.is_available():
        print("bench.tune: no GPU here; launch configs can only be timed on one (--compile-only --arch A writes "
              "compile-checked ones without)", file=sys.stderr)
        return 2
    from .tune_timed import main_timed

    return main_timed(args, argv)

if __name__ == "__main__":
    sys.exit(main())

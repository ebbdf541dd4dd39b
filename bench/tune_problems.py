"""The problems both launch-config tuners work on (bench/tune.py): one launch site of kernels.launches at one dtype
and size, its candidates completed from the launcher's default, what a GPU family refuses, and the worker
processes that compile candidates for a family (bench/compile_check.py) before any is kept.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import multiprocessing
from typing import NamedTuple

import torch


def families() -> list[str]:
    """The kernel records (bench/record.py), each a family of table kernels "<record>.<part>"."""
    from bertfuse.bench.ops import records

    return [r.name for r in records()]


class Problem(NamedTuple):
    kernel: str          # table name: "attention.fwd", "layer_norm.bwd", ...
    dtype: torch.dtype
    size: int            # head_dim or hidden size: the table key
    seq_len: int | None  # the attention's max_seqlen (its table bucket); None elsewhere
    shape: tuple         # the family's problem size (see setup)

    @property
    def key(self) -> str:
        from bertfuse.kernels import tuned

        return tuned.entry_key(self.dtype, self.size, tuned.bucket(self.seq_len))

    def __str__(self):
        return f"{self.kernel} {self.key} {self.shape}"


def _site(kernel: str):
    from bertfuse.kernels import launches

    return launches.site(kernel)


def tunable(name: str) -> list[str]:
    """The launch sites of record `name` that a tuner sweeps (kernels.launches: those with candidates)."""
    from bertfuse.kernels import launches

    return [s.part for s in launches.sites(name) if s.candidates]


def candidates(kernel: str) -> list[dict]:
    """The configs swept for a table kernel ("attention.fwd"), before pruning (the default is added to them)."""
    return list(_site(kernel).candidates)


def problems(names, dtypes) -> list[Problem]:
    """BERT's shapes of the named records' kernels, most used first: per dtype, BERT-base's shapes before
    BERT-large's (each record's TuneShape.rank), the first dtype before the next."""
    from bertfuse.bench.ops import record

    out = []
    for dtype in dtypes:
        mine = [(s.rank, Problem(f"{name}.{part}", dtype, s.size, s.seq_len, s.shape))
                for name in names for s in record(name).tuning.shapes for part in tunable(name)]
        out += [p for _, p in sorted(mine, key=lambda rp: rp[0])]  # stable: the records' order within a rank
    return out


def refusal(problem: Problem, target) -> str | None:
    """Why GPU family `target` refuses the problem's kernel in its dtype (kernels.targets.refusal: bfloat16, or
    half-precision dots, on sm_75), so that a table has nothing to configure there; None where it runs it, and
    for a launch site that chooses among implementations (mlm_loss.strategy)."""
    from bertfuse.kernels.targets import refusal as refused

    site = _site(problem.kernel)
    return None if site.choice else refused(site.op, problem.dtype, target, site.needs == "tensor_cores")


def default_launch(kernel: str, dtype, size: int, target) -> NamedTuple:
    """The launcher's built-in config for a table kernel name ("attention.fwd", "layer_norm.bwd", ...) on a
    kernels.targets.Target (None: the interpreter's)."""
    return _site(kernel).default(dtype, size, target)


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


# -- compiling candidates, in worker processes -----------------------------------------------------------------------

def check_candidate(problem: Problem, config: dict, arch: str) -> str | None:
    """In a worker: None if the candidate compiles cleanly for GPU family `arch` ("sm_90", "gfx942") in every
    launch the compile check records for it, else the reason it was pruned."""
    from bertfuse.kernels.targets import named

    from . import compile_check

    t = named(arch)
    failure = None  # stays None for a choice between implementations, which compiles nothing
    try:
        variants = compile_check.variants_for(problem.kernel, problem.dtype, problem.size, config, t)
    except ValueError as e:  # a config the launcher refuses there (kernels.tuned.pick)
        return str(e)
    for variant in variants:
        failure = compile_check.check(variant, t)[0]
        if failure is not None:
            break
    return failure


@contextlib.contextmanager
def workers(jobs: int):
    """A pool of `jobs` spawned processes started without TRITON_INTERPRET (the compiler must be real)."""
    from .e2e import environment

    ctx = multiprocessing.get_context("spawn")
    with environment({"TRITON_INTERPRET": None}), \
            concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        yield pool


def check_all(pool, pairs: list[tuple[Problem, dict]], arch: str, check=check_candidate) -> list:
    """The reason each (problem, config) fails `check` (a module-level function of (problem, config, arch);
    None: it passes), in the pool's workers."""
    return list(pool.map(check, [p for p, _ in pairs], [c for _, c in pairs], itertools.repeat(arch)))

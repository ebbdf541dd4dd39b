"""What the benchmark and check tools need to know about one fused op, declared once, in the op's own record.

Each op of `kernels` has a module of the same name in `bench/ops/` that ends with `RECORD = Record(...)`;
`bench.ops.RECORDS` collects them in module-name order. The tools iterate over the records and name no op
themselves:

    bench.smoke           `smoke`: one check per entry, the op against its float64 reference
    bench.kernel_suite    `bench`: the shapes it is timed at, its peers, the bytes and FLOPs it must move
    bench.tune            `tuning`: where the op's tunable launch sites (kernels.launches) are measured
    bench.compile_check   `compiled` and `call`: the calls whose launches are recorded and compiled for each GPU
                          family, with the configs the launchers pick there
    bench.targets         `goals`: the speed and memory targets read from the benchmark rows
    bench.precompile, bert-bench, bench/test_kernels.py: the record names and `bench`

This module holds the record types (the records are in bench.ops) and `record_launches`, which records what a
record's compile call launches. Reading the records imports the kernels package and so triton (set
TRITON_INTERPRET=1 first on a machine without a GPU), but compiles nothing: kernels compile at their first launch.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, NamedTuple

import torch

# -- smoke: the op against a float64 reference ------------------------------------------------------------------

class SmokeShapes(NamedTuple):
    """One problem size shared by every smoke check (BERT-base on a GPU, tiny in the interpreter)."""
    lengths: tuple        # sequence lengths (the token count is their sum)
    heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


class Case(NamedTuple):
    """Inputs and two functions of them: `ours` is run in the checked dtype, `reference` in float64 and in the
    checked dtype (PyTorch's own error there sets the tolerance). `outputs` names the output, then the gradient
    of each input."""
    name: str
    inputs: list
    ours: Callable
    reference: Callable
    outputs: list


def optional_peer(package: str, load: Callable[[], Callable]) -> Callable | str:
    """A peer implementation from another package, `load()` importing it, or, where that package is missing or
    fails to import here, the reason (an impl given as a string is a skipped row saying why)."""
    try:
        return load()
    except Exception as e:  # not installed, or broken here: its row says so, the suite goes on
        return f"{package} unavailable ({type(e).__name__}: {e})"[:160]


def randn(*shape, seed: int = 0, scale: float = 1.0, device="cpu", dtype=torch.float32, grad: bool = False):
    """Normal noise from a CPU generator (the same numbers on every device), scaled, optionally a leaf."""
    t = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)
    return t.requires_grad_() if grad else t


# -- the kernel benchmark ---------------------------------------------------------------------------------------

class BenchShapes(NamedTuple):
    """Shapes per run kind; `cpu` None: the op is timed on a GPU only (the interpreter times nothing useful)."""
    quick: list
    full: list
    tiny: list                  # the test suite's, seconds in the interpreter
    cpu: list | None = None


class Bench(NamedTuple):
    """One benchmarked problem: each implementation runs forward + backward (or, `step`, one optimizer step) on
    fresh `inputs()`. An impl given as a string is reported as skipped for that reason; names containing "ours"
    are this project's. With a "torch-eager" impl, a GPU run adds "torch-compile" of it."""
    kernel: str                 # the row label, as the targets read it
    shape: str
    impls: dict
    inputs: Callable[[], tuple]
    bytes_fwd: int = 0          # bytes the op must move (each input read once, each output written once)
    bytes_bwd: int = 0
    flops_fwd: float = 0.0      # FLOPs of the forward (the backward counted as 2.5x: FlashAttention's convention)
    extra: dict = {}            # more row fields (what the targets select on)
    reference: Callable | None = None  # the exact function, run in float64 on the same inputs: each impl's
                                       # output and gradients get their relative error to it (rel_err_fp64)
    step: bool = False          # the impls are optimizer steps, fn(*inputs) updating its inputs in place with no
                                # autograd: timed as one call (step_ms; bandwidth from bytes_fwd, step_GBps), the
                                # peak memory that of the first step (the optimizer's state included)


# -- launch-config tuning and the compile check of every GPU family ------------------------------------------------
# The launch sites themselves (their kernels, default and candidate configs, tunable fields) are the kernels'
# own declaration (kernels.launches); a record adds where they are measured and which calls are compiled.

class Variant(NamedTuple):
    """A kernel specialised as the JIT specialises it for one recorded launch (kernels.launches.signature):
    every argument -> a torch dtype (pointer), "i32", "i32:16" (divisible by 16), "i64", "fp32", or a constexpr's
    value (None: an absent pointer). `needs`: its launch site's demand in half precision ("tensor_cores",
    "vectors")."""
    name: str
    fn: object
    args: dict
    num_warps: int
    num_stages: int = 3
    dtype: torch.dtype = torch.float32
    needs: str | None = None
    tail: int = 0               # its launch site's masked-tail accesses (kernels.launches.LaunchSite.tail)
    refused: str | None = None  # the launchers' error, for a call the family refuses (fn is then None): a
                                # launch they make has passed their refusals (kernels.targets.check) already
    failed: str | None = None   # a launch-config table entry the launcher refuses (fn is then None): a failure


class CompileCall(NamedTuple):
    """One call of the op that the compile check records on every GPU family (kernels.launches.recording): the
    launches its forward and backward make at (dtype, size), with the config each launcher picks on the family
    checked, and the kernel flags `flags` (keyword arguments of the record's `call`)."""
    dtype: torch.dtype
    size: int
    flags: dict = {}


class Recorded(NamedTuple):
    launches: list              # kernels.launches.Launch, in launch order
    refused: str | None         # the launchers' error where the family refuses the call (then no launches)


def record_launches(rec: "Record", call: CompileCall, target, force: tuple[str, dict] | None = None) -> Recorded:
    """The launches `call` of record `rec` makes on GPU family `target`, recorded, not run
    (kernels.launches.recording: what the launchers pass and the configs they pick there); with `force` =
    (launch site, config), that site's config forced (kernels.tuned.forced: a ValueError where the launcher
    cannot take it)."""
    from bertfuse.kernels import launches, targets, tuned  # imported here: kernels imports triton

    with contextlib.ExitStack() as stack:
        if force:
            stack.enter_context(tuned.forced(*force, strict=True))
        got = stack.enter_context(launches.recording(target))
        try:
            rec.call(call.dtype, call.size, **call.flags)
        except targets.Refused as e:  # bfloat16, or half-precision dots, on sm_75
            return Recorded([], str(e))
    return Recorded(list(got), None)


class TuneShape(NamedTuple):
    size: int                   # the table's size key (hidden, intermediate or head_dim)
    seq_len: int | None         # the table's sequence bucket (None: the kernel does not depend on it)
    shape: tuple                # the problem `Tuning.setup` builds
    rank: int = 0               # sweep order within a dtype: BERT-base's shapes (0) before BERT-large's (1)


class Tuning(NamedTuple):
    """Where the timed tuner measures the op's tunable launch sites ("<record>.<part>", those of
    kernels.launches with candidates). `setup(shape, size, dtype, device, part)` gives (fn, inputs, {part:
    inputs whose gradients that backward kernel writes}); parts missing there are forward kernels, timed without
    gradients; parts in `whole` are timed forward + backward together (a strategy; a kernel that computes the
    gradients in the forward)."""
    shapes: tuple
    setup: Callable
    whole: tuple = ()


# -- targets --------------------------------------------------------------------------------------------------------

class Goal(NamedTuple):
    """A target read from this op's benchmark rows (status ok, `kernel`, dtype bfloat16, matching `where`).

    Without `peer`: the worst of `impl`'s rows in `field` must be `op` `bound`. With `peer`: on each shape where
    both ran, the ratio peer/ours of `field` (a time: how many times faster ours is) or, with `share`, ours/peer
    (how much of the peer's memory ours needs), worst shape judged."""
    name: str
    goal: str                   # as the summary prints it
    kernel: str
    field: str
    op: str                     # ">=", ">" or "<="
    bound: float
    peer: str | None = None
    share: bool = False
    where: dict = {}
    impl: str = "ours"
    fmt: str = "{:.3g}"         # the value without a peer
    scale: str | None = None    # an absolute bound set for an H200: on another GPU, scaled by the run's measured
                                # peak of this name ("matmul_TFLOPs") relative to the H200's (bench/targets.py)


def memory_bound_goals(title: str, kernel: str) -> tuple:
    """The targets of an op bound by memory: forward + backward at >= 85% of a plain copy's bandwidth, and faster
    than torch.compile's fusion of the same eager code at every shape."""
    return (Goal(f"{title} fwd+bwd bandwidth", ">= 85% of copy", kernel, "copy_share", ">=", 0.85,
                 fmt="{:.0%} of copy"),
            Goal(f"{title} vs torch.compile", "faster", kernel, "fwd_bwd_ms", ">", 1.0, peer="torch-compile"))


class Record(NamedTuple):
    name: str                   # the module's name; the tuning table's prefix
    smoke: dict                 # check name -> fn(SmokeShapes, device) -> Case
    bench_shapes: BenchShapes
    bench: Callable             # fn(shape, device, dtype, full) -> Iterable[Bench]
    tuning: Tuning
    compiled: Callable[[], Iterable[CompileCall]]  # what the compile check records and compiles, every family
    call: Callable              # fn(dtype, size, **flags): the op forward and backward on small CPU tensors
    goals: tuple = ()

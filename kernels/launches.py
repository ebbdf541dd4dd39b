"""The launch sites of the kernels, declared once by their op modules, and a recorder of the launches they make.

A launch site is one place where a launcher starts a kernel ("attention.fwd", "layer_norm.bwd", ...): the name
its launch-config table uses (kernels/tuned.py), the jit function it starts, its built-in config, the config it
runs on a GPU family (the table's entry, else the default: `config`), the configs a tuner may sweep and what the
compile check demands of it. Each op module declares its sites with `declare`; the timed tuner, the compile-only
tuner, the compile check and the launchers themselves read that one declaration.

`recording(target)` runs the launchers as on GPU family `target` without a GPU: every `LaunchSite.launch` inside is
recorded (the jit function, each argument as passed, the launch options) instead of started, CPU tensors pass the
device check, and `kernels.targets.of` answers `target`. `signature` turns a recorded launch into what the JIT
compiles for it (pointer dtypes, integers divisible by 16, constexprs), so the compile check compiles exactly what
the launchers pass, with nothing restated by hand.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
from typing import Callable, NamedTuple

import torch

from . import targets


class LaunchSite(NamedTuple):
    name: str                   # "<op>.<part>": the launch-config table's kernel key
    kernel: object              # the jit function started here (None: a choice between implementations)
    default: Callable           # (dtype, size, target) -> the launcher's built-in config (a NamedTuple)
    config: Callable            # (dtype, size, target, seqlen=None) -> the config the launcher runs on target
                                # (seqlen: the length, or labelled-row count, its table bucket is keyed by)
    candidates: tuple = ()      # configs (dicts of the fields a table may set) a tuner sweeps; () for a fixed launch
    needs: str | None = None    # in half precision, what the compile check demands: "tensor_cores" (a kernel built
                                # on dots: every one on the family's tensor-core instruction; refused where Triton
                                # has none), "warp_dots" (on tensor cores, the per-warp mma.sync
                                # accepted on families that also have a wider instruction) or "vectors"
                                # (16-byte global accesses)
    tail: int = 0               # with "vectors", a kernel over tensors of any size (the optimizer's): the
                                # half-precision accesses its masked tail block makes, which move one element at a
                                # time; the compile check allows that many per element a thread holds, no more

    @property
    def op(self) -> str:
        return self.name.split(".")[0]

    @property
    def part(self) -> str:
        return self.name.split(".", 1)[1]

    @property
    def choice(self) -> bool:
        """A choice between implementations (mlm_loss.strategy): it configures no kernel."""
        return self.kernel is None

    def launch(self, grid, *args, num_warps: int = 4, num_stages: int = 3, **constexprs) -> None:
        """Start this site's kernel on `grid` (what the launchers call instead of kernel[grid](...)); inside
        `recording`, record the launch instead."""
        if _recorded is None:
            self.kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
            return
        names = [name for name, _ in _params(self.kernel)]
        values = dict(zip(names, args), **constexprs)
        if len(args) > len(names) or set(values) != set(names):  # a launcher out of step with its kernel
            raise TypeError(f"{self.name}: {self.kernel.__name__} got arguments {sorted(values)}, takes {names}")
        _recorded.append(Launch(self.name, self.kernel, values, num_warps, num_stages))


_SITES: dict[str, LaunchSite] = {}


def declare(*sites: LaunchSite) -> tuple[LaunchSite, ...]:
    """Register an op module's launch sites (in the order given); returns them."""
    for s in sites:
        _SITES[s.name] = s
    return sites


def sites(op: str | None = None) -> list[LaunchSite]:
    """Every declared launch site, or op `op`'s, in declaration order (import `kernels` first: it imports every
    op module)."""
    return [s for s in _SITES.values() if op is None or s.op == op]


def site(name: str) -> LaunchSite:
    if name not in _SITES:
        raise KeyError(f"no launch site {name!r} (have: {', '.join(_SITES)})")
    return _SITES[name]


def grid(**axes) -> tuple[dict, ...]:
    """Every combination of the axes' values, as config dicts (a tuner's candidates)."""
    return tuple(dict(zip(axes, values)) for values in itertools.product(*axes.values()))


# -- recording ------------------------------------------------------------------------------------------------------

class Launch(NamedTuple):
    """One recorded launch: its site, the jit function, every parameter's value as passed, the launch options."""
    site: str
    fn: object
    args: dict
    num_warps: int
    num_stages: int


_recorded: list | None = None


def _params(fn) -> list[tuple[str, bool]]:
    """(name, is constexpr) of each parameter of a jit function, compiled or under the interpreter (whose
    functions keep the Python function and its annotations)."""
    if hasattr(fn, "params"):
        return [(p.name, p.is_constexpr) for p in fn.params]
    return [(name, "constexpr" in str(p.annotation))
            for name, p in inspect.signature(fn.fn).parameters.items()]


def recording_active() -> bool:
    return _recorded is not None


@contextlib.contextmanager
def recording(target: targets.Target):
    """Launches inside the block are recorded, not started (the list it yields fills up), with the launchers
    picking their configs as on GPU family `target`; tensors are CPU tensors, whose contents nobody reads."""
    global _recorded
    if _recorded is not None:
        raise RuntimeError("kernels.launches.recording does not nest")
    _recorded = []
    try:
        with targets.assume(target):
            yield _recorded
    finally:
        _recorded = None


_POINTERS = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
             torch.int64: "*i64", torch.int8: "*i8"}


def signature(recorded: Launch) -> dict:
    """Each parameter of a recorded launch as the JIT specialises it: a torch dtype (a pointer; torch's
    allocations are 16-byte aligned), None (an absent pointer), "i32" or "i32:16" (an integer, marked when
    divisible by 16), "i64" (past 2^31), "fp32" (a float), or the value of a constexpr (and of an integer 1,
    which the JIT makes a constant)."""
    out = {}
    for name, constexpr in _params(recorded.fn):
        value = recorded.args[name]
        if constexpr or value is None or isinstance(value, bool):
            out[name] = value
        elif isinstance(value, torch.Tensor):
            if value.dtype not in _POINTERS:
                raise TypeError(f"{recorded.site}: {name} is a {value.dtype} tensor, which no kernel takes")
            out[name] = value.dtype
        elif isinstance(value, int):
            out[name] = 1 if value == 1 else "i64" if not -2**31 <= value < 2**31 else \
                "i32:16" if value % 16 == 0 else "i32"
        elif isinstance(value, float):
            out[name] = "fp32"
        else:
            raise TypeError(f"{recorded.site}: {name} is a {type(value).__name__}, which no kernel takes")
    return out


def pointer_type(dtype: torch.dtype) -> str:
    """The JIT's name of a pointer to `dtype` ("*bf16")."""
    return _POINTERS[dtype]

"""The GPU families the kernels are built for, and which one a tensor's device is.

A launcher's config depends on the GPU it runs on: how much shared memory (LDS on AMD) one block may use, how
many threads a warp (wavefront) has, which tensor-core instruction Triton lowers half-precision dots to, and
whether bfloat16 dots exist at all. `TARGETS` names each family the kernels are compile-checked for; its name is
the key of the launch-config table `kernels/configs/<name>.json`. A GPU outside the list gets a `Target` built
from its reported properties (and no table: the launchers' defaults).

On a ROCm build of torch, `torch.cuda` is the AMD GPU (`torch.version.hip` set): the device's `gcnArchName`
("gfx942:sramecc+:xnack-") names its target, not the compute capability torch reports for it.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple

import torch

# Read once, as triton does when the kernels are first decorated: CPU tensors only work in the interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


class Target(NamedTuple):
    """One GPU family, as the launchers and the compile check see it."""
    name: str            # "sm_80", "gfx942": the launch-config table's name
    backend: str         # triton's backend: "cuda" or "hip"
    arch: int | str      # triton's GPUTarget arch: 80, "gfx942"
    warp_size: int       # threads per warp (a wavefront of 64 on AMD's CDNA)
    shared_bytes: int    # shared memory (LDS) one block may use
    bf16: bool           # bfloat16 tensor-core dots
    dot: str             # half-precision dots' instruction: "mma" (mma.sync), "wgmma", "tcgen05", "mfma", "wmma"
                         # (RDNA3 and newer), or
                         # "fma": Triton has no tensor-core lowering there (Turing), dots run on the CUDA cores
    gpus: str            # what users know it as

    @property
    def registers(self) -> int:
        """32-bit registers one thread may hold: 255 on NVIDIA; 512 on AMD (256 vector + 256 accumulation)."""
        return 255 if self.backend == "cuda" else 512

    @property
    def tensor_core_dots(self) -> bool:
        """Whether Triton runs half-precision tl.dot on this family's tensor cores. Where it does not, a kernel
        built on dots (attention, the fused MLM loss) is slower than PyTorch's cuBLAS and SDPA, which do: the
        model runs those ops in PyTorch there."""
        return self.dot != "fma"


def _cuda(major: int, minor: int, shared_kb: int, dot: str, gpus: str) -> Target:
    return Target(f"sm_{major}{minor}", "cuda", major * 10 + minor, 32, shared_kb * 1024, major >= 8, dot, gpus)


def _hip(gfx: str, gpus: str) -> Target:
    return Target(gfx, "hip", gfx, 64, 64 * 1024, True, "mfma", gpus)


# Shared memory per block: the opt-in maximum of each compute capability (CUDA programming guide's table), the
# 64 KB LDS of CDNA2/CDNA3.
TARGETS = {t.name: t for t in (
    _cuda(7, 5, 64, "fma", "T4, RTX 20xx, Quadro RTX"),
    _cuda(8, 0, 163, "mma", "A100, A30"),
    _cuda(8, 6, 99, "mma", "A10, A40, RTX 30xx, RTX A6000"),
    _cuda(8, 9, 99, "mma", "L4, L40S, RTX 40xx, RTX 6000 Ada"),
    _cuda(9, 0, 227, "wgmma", "H100, H200, GH200"),
    _cuda(10, 0, 227, "tcgen05", "B200, GB200"),
    _cuda(12, 0, 99, "mma", "RTX 50xx, RTX PRO 6000 Blackwell"),
    _hip("gfx90a", "MI210, MI250, MI250X"),
    _hip("gfx942", "MI300X, MI300A, MI325X"),
)}
OLDEST_CUDA = (7, 5)  # Triton's NVIDIA backend compiles for Turing and newer


def from_properties(props, hip: bool) -> Target:
    """The target of a device with these torch.cuda.get_device_properties (or any object with the same fields):
    a known family by name, else one built from what the device reports."""
    if hip:
        return _rocm(props)
    major, minor = props.major, props.minor
    if (major, minor) < OLDEST_CUDA:
        raise RuntimeError(f"kernels: {props.name} is sm_{major}{minor}; the Triton kernels need sm_75 (Turing) or "
                           "newer: use the PyTorch path on this GPU")
    name = f"sm_{major}{minor}"
    if name in TARGETS:
        return TARGETS[name]
    dot = "fma" if major < 8 else "wgmma" if major == 9 else "tcgen05" if major == 10 else "mma"
    return Target(name, "cuda", major * 10 + minor, 32, _shared(props, 48 * 1024), major >= 8, dot, props.name)


# CDNA's matrix cores (MFMA): MI100 (gfx908), MI200 (gfx90a), MI300 (gfx94x), MI350 (gfx95x).
_MFMA = ("gfx908", "gfx90a", "gfx94", "gfx95")


def _rocm(props) -> Target:
    """An AMD GPU's target, by the gcnArchName its torch reports: a listed family; RDNA (gfx10xx-gfx12xx) as its
    own family, wave32 with WMMA dots from RDNA3 (gfx11) on, none before; another CDNA or GCN part with MFMA
    dots where it has them. Without a gcnArchName (older torch, or a driver that reports none) its target is
    unknown: a RuntimeError, which the drop-in modules turn into their PyTorch path with one warning."""
    name = str(getattr(props, "gcnArchName", "") or "").split(":")[0].strip()
    if not name.startswith("gfx"):
        raise RuntimeError(f"kernels: torch reports no gcnArchName for the ROCm GPU {props.name!r} (got {name!r}; "
                           "torch older than 2.1 does not): the Triton kernels cannot tell its target; use the "
                           "PyTorch path (backend='torch') or a newer torch")
    if name in TARGETS:
        return TARGETS[name]
    shared = _shared(props, 64 * 1024)
    if name.startswith("gfx1"):  # RDNA: wave32 (Triton's default there); gfx1100 -> generation 11
        generation = int(name[3:5]) if name[3:5].isdigit() else 10
        wmma = generation >= 11
        return Target(name, "hip", name, 32, shared, wmma, "wmma" if wmma else "fma", f"{props.name} (RDNA)")
    mfma = name.startswith(_MFMA)
    return Target(name, "hip", name, int(getattr(props, "warp_size", 64) or 64), shared, mfma,
                  "mfma" if mfma else "fma", props.name)


def _shared(props, fallback: int) -> int:
    return int(getattr(props, "shared_memory_per_block_optin", 0) or fallback)


@functools.lru_cache(maxsize=None)
def _device_target(index: int) -> Target:
    return from_properties(torch.cuda.get_device_properties(index), hip=torch.version.hip is not None)


_assumed: list = []


@contextlib.contextmanager
def assume(target: Target):
    """Inside the block every device is family `target` (kernels.launches.recording: the launchers pick their
    configs as there, with no GPU)."""
    _assumed.append(target)
    try:
        yield target
    finally:
        _assumed.pop()


def of(device: torch.device) -> Target | None:
    """The target of a CUDA (or ROCm) device; None for a CPU tensor or under the interpreter, where the launchers
    use their interpreter configs."""
    if _assumed:
        return _assumed[-1]
    if device.type != "cuda" or INTERPRET:
        return None
    return _device_target(device.index if device.index is not None else torch.cuda.current_device())


def dtype_refusal(op: str, dtype: torch.dtype, target: Target | None) -> str | None:
    """Why `target` cannot run `op` in `dtype` (None when it can): bfloat16 needs bf16 tensor cores."""
    if target is None or dtype != torch.bfloat16 or target.bf16:
        return None
    return (f"{op}: bfloat16 needs a GPU with bfloat16 tensor cores (sm_80+, MI200/MI300); this {target.gpus} GPU "
            f"({target.name}) has none: use float16 (training: --precision fp16, with a gradient scaler) or float32")


def dots_refusal(op: str, dtype: torch.dtype, target: Target | None) -> str | None:
    """Why `target` should not run `op`, a kernel built on half-precision tl.dot, in `dtype` (None when it may):
    where Triton has no tensor-core lowering, its dots would run on the CUDA cores, several times slower than
    PyTorch's cuBLAS and SDPA, which use them. float32 dots are exact products on the CUDA cores everywhere."""
    if target is None or dtype == torch.float32 or target.tensor_core_dots:
        return None
    return (f"{op}: Triton runs no tensor-core dots on {target.name} ({target.gpus}), so in {dtype} this kernel would "
            "run on the CUDA cores, slower than PyTorch: use PyTorch's op on this GPU (bert's model does), or float32")


def refusal(op: str, dtype: torch.dtype, target: Target | None, dots: bool) -> str | None:
    """Why `target` refuses `op` in `dtype` (None when it runs it): `dtype_refusal`, then, for a kernel built on
    half-precision dots (`dots`), `dots_refusal`. The compile check and the compile-only tuner ask this of every
    launch; the launchers raise it on their inputs (`check`)."""
    return dtype_refusal(op, dtype, target) or (dots_refusal(op, dtype, target) if dots else None)


def named(name: str) -> Target:
    """The family called `name` ("sm_80", "gfx942"), or a KeyError listing the families."""
    if name not in TARGETS:
        raise KeyError(f"unknown GPU family {name!r}; have {', '.join(TARGETS)}")
    return TARGETS[name]


class Refused(TypeError):
    """A GPU family refuses an op in a dtype (`check`)."""


def check(op: str, dtype: torch.dtype, device: torch.device, dots: bool = False) -> None:
    """One clear error, before any kernel is compiled, where the device's GPU refuses `op` in `dtype`
    (`refusal`: a dtype it cannot run; with `dots`, a half-precision dot kernel where Triton has no tensor-core
    dots)."""
    reason = refusal(op, dtype, of(device), dots)
    if reason:
        raise Refused(reason)

"""Launcher helpers shared by the kernels: input checks, seeds, grid sizes."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Read once, as triton does when the kernels are first decorated: CPU tensors only work in the interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_device(op: str, **tensors) -> torch.device:
    """All given tensors on one device, and one the kernels can run on."""
    named = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in named.items()}
    first_name, device = next(iter(devices.items()))
    for name, d in devices.items():
        if d != device:
            raise ValueError(f"{op}: {name} is on {d} but {first_name} is on {device}")
    if device.type != "cuda" and not (INTERPRET and device.type == "cpu"):
        raise ValueError(f"{op}: tensors are on {device}; the Triton kernels need a CUDA device "
                         "(or TRITON_INTERPRET=1 set before triton is imported, for CPU tensors)")
    return device


def new_seed() -> int:
    """A Philox seed from torch's CPU generator: reproducible under torch.manual_seed, no device sync."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_wanted(device: torch.device, per_sm: int) -> int:
    """How many programs keep a GPU busy (per_sm per SM); a handful in the interpreter, so that tests on
    small shapes still exercise the multi-program paths."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return per_sm * _sm_count(index)


def row_bands(device: torch.device, n_rows: int, block_m: int) -> tuple[int, int]:
    """(programs, rows per program) for a cross-row reduction: each program sums a contiguous band of rows
    (a multiple of block_m) into its own partial; a few programs per SM on a GPU, few in the interpreter."""
    programs = max(1, min(triton.cdiv(max(n_rows, 1), block_m), programs_wanted(device, 4)))
    rows = triton.cdiv(triton.cdiv(n_rows, programs), block_m) * block_m if n_rows else 0
    return programs, rows


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: exact float32 products for float32 inputs (no TF32), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dimension is contiguous, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [M, N] with unit stride along N (copies only when it must)."""
    return unit_stride(t.reshape(-1, t.shape[-1]))


@triton.jit
def dropout_keep(seed, offsets, p):
    """Philox keep-mask from (seed, element offset): a kernel's forward, its backward and its test helper call
    this with the same offsets and so agree bit for bit, without ever storing the mask."""
    return tl.rand(seed, offsets) >= p


@triton.jit
def _dropout_mask_kernel(Out, numel, p, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + offs, dropout_keep(seed, offs, p).to(tl.int8), mask=offs < numel)


def keep_mask(seed: int, numel: int, p: float, device) -> torch.Tensor:
    """The flat bool keep-mask `dropout_keep` gives elements 0..numel-1; kernels index their elements so that
    this, reshaped, is the mask they applied. For tests."""
    out = torch.empty(numel, dtype=torch.int8, device=device)
    if numel:
        _dropout_mask_kernel[(triton.cdiv(numel, 1024),)](out, numel, float(p), seed, BLOCK=1024)
    return out.bool()

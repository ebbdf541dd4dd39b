"""Launcher helpers shared by the kernels: input checks, seeds, grid sizes."""
from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from . import launches, targets
from .targets import INTERPRET

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# tl.constexpr, so the jit functions may read them (plain float globals only work in the interpreter).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A UserWarning the first time `message` comes up in this process, silence after; none while torch.compile
    traces (dynamo cannot trace warnings.warn, and a graph break for a warning would cost every call)."""
    if message not in _warned and not torch.compiler.is_compiling():
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def exporting_onnx() -> bool:
    """In an ONNX export (either exporter), which has no translation of a Triton kernel: the drop-ins compute
    their plain-PyTorch reference there (outside dynamo, whose own trace of this check would break the graph)."""
    return not torch.compiler.is_dynamo_compiling() and torch.onnx.is_in_onnx_export()


def device_refusal(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` (None where they can): a CUDA or ROCm GPU older than they support,
    a CPU without Triton's interpreter (while launches are recorded, kernels.launches, any CPU tensor does:
    nothing is launched), any other device."""
    if device.type == "cuda":
        try:
            targets.of(device)
        except RuntimeError as e:  # a GPU older than the kernels support
            return str(e)
        return None
    if device.type == "cpu" and (INTERPRET or launches.recording_active()):
        return None
    return ("the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 set before triton is imported, for CPU "
            "tensors)")


def _refusal(device: torch.device, dtype: torch.dtype) -> tuple[str | None, str]:
    """(why the kernels cannot run `dtype` tensors on `device`, or None; "device" or "dtype": which is refused)."""
    why = device_refusal(device)
    if why is not None:
        return why, "device"
    if dtype not in FLOAT_DTYPES:
        return f"the kernels take float32, float16 and bfloat16, not {dtype}", "dtype"
    return (targets.dtype_refusal("fused layers", dtype, targets.of(device)) if device.type == "cuda" else None), \
        "dtype"


def backend_of(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """Which backend a drop-in module takes for `dtype` tensors on `device`, and the words that say so: ("triton",
    "the Triton kernels on cuda:0 (sm_90), bfloat16"), ("triton", "Triton's interpreter on the CPU ...") or
    ("torch", "the PyTorch path: <why the kernels cannot run there>"); by backend_for's rules, outside an ONNX
    export."""
    device = torch.device(device)
    why, _ = _refusal(device, dtype)
    if why is not None:
        return "torch", f"the PyTorch path: {why}"
    if device.type == "cuda":
        return "triton", f"the Triton kernels on {device} ({targets.of(device).name}), {str(dtype)[6:]}"
    return "triton", ("Triton's interpreter on the CPU (TRITON_INTERPRET=1: the kernels' code, slowly), "
                      f"{str(dtype)[6:]}")


def backend_for(t: torch.Tensor) -> str:
    """For a drop-in module, which holds no config: "triton" where the kernels run t's dtype on t's device (a CUDA
    or ROCm GPU the kernels support; the CPU under TRITON_INTERPRET=1), else "torch" (the module computes its op's
    plain-PyTorch reference instead), so a model moved to a device or dtype the kernels cannot use (float64,
    bfloat16 on a GPU without bfloat16 dots) still runs, with one warning. In an ONNX export: "torch"."""
    if exporting_onnx():
        return "torch"
    why, refused = _refusal(t.device, t.dtype)
    if why is None:
        return "triton"
    if refused == "device":
        warn_once(why if t.is_cuda else f"fused layers on {t.device.type} tensors run their PyTorch path: {why}")
    else:
        warn_once(f"fused layers on {t.dtype} tensors run their PyTorch path: {why}")
    return "torch"


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_device(op: str, **tensors) -> torch.device:
    """All given tensors on one device, one the kernels can run on, whose GPU runs their dtypes (bfloat16 needs
    sm_80+ or MI200/MI300: kernels.targets)."""
    named = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in named.items()}
    first_name, device = next(iter(devices.items()))
    for name, d in devices.items():
        if d != device:
            raise ValueError(f"{op}: {name} is on {d} but {first_name} is on {device}")
    if device.type != "cuda" and (why := device_refusal(device)):  # a GPU's own limits: targets, at its launch
        raise ValueError(f"{op}: tensors are on {device}; {why}")
    if any(t.dtype == torch.bfloat16 for t in named.values()):
        targets.check(op, torch.bfloat16, device)
    return device


def new_seed(device: torch.device) -> torch.Tensor:
    """A Philox seed drawn by torch's generator of `device`, as an int64 [1] tensor there that the kernels read:
    reproducible under torch.manual_seed, no host sync, and a fresh draw on every CUDA-graph replay (torch's
    generators advance their graph-safe offset per replay) or compiled call."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


def seed_tensor(seed, device: torch.device, dropout: bool) -> torch.Tensor | None:
    """The seed argument of a launcher as the kernels take it: None without dropout; a new draw for None; an int
    (for tests and tuning: fixed masks) or a one-element integer tensor, as int64 [1] on `device`."""
    if not dropout:
        return None
    if seed is None:
        return new_seed(device)
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.is_floating_point() or seed.is_complex():
            raise ValueError(f"seed must be an int or a one-element integer tensor, got {seed.dtype} "
                             f"{tuple(seed.shape)}")
        return seed.reshape(1).to(device=device, dtype=torch.int64)
    return torch.tensor([int(seed)], dtype=torch.int64, device=device)


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
    """tl.dot's input_precision: "ieee" for every dtype. float32 inputs get exact products (no TF32);
    half-precision inputs go to the tensor cores whatever the setting (the same PTX on sm_90), and AMD's CDNA2
    (gfx90a, no TF32-like mode) rejects any other value at compile time."""
    return "ieee"


def interpreter_upcast(*tensors):
    """Triton's interpreter computes tl.dot on bfloat16 wrongly (relative errors of 1e8), so there the kernels
    that multiply matrices get float32 copies of bfloat16 operands (bfloat16 products are exact in float32) and
    their callers cast the results back: the CPU path gives bfloat16 answers, never garbage. Compiled kernels
    (a GPU) get the tensors unchanged, and so do recorded launches (kernels.launches), which compute nothing."""
    if not INTERPRET or launches.recording_active():
        return tensors
    return tuple(t.float() if t is not None and t.dtype == torch.bfloat16 else t for t in tensors)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dimension is contiguous, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """t itself when contiguous (or None), else a contiguous copy: for the vectors (weights, biases, cu_seqlens)
    whose kernels index them as plain arrays, so a strided or expanded view is never read as raw memory."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [M, N] with unit stride along N (copies only when it must)."""
    return unit_stride(t.reshape(-1, t.shape[-1]))


@triton.jit
def _keep16(r, HIGH: tl.constexpr, threshold):
    """One 16-bit half of a 32-bit random word, compared with the drop threshold."""
    if HIGH:
        u = r >> 16
    else:
        u = r & 0xFFFF
    return u.to(tl.int32) >= threshold


@triton.jit
def dropout_keep(seed, rows, n_cols, col_start, p, BLOCK_N: tl.constexpr):
    """Keep-mask [R, BLOCK_N] of elements (row, col_start + j), j < BLOCK_N, of a logical [rows, n_cols] mask;
    rows is int64 [R, 1], col_start and BLOCK_N are multiples of 8. A kernel's forward, its backward and
    `keep_mask` call this with the same coordinates and so agree bit for bit; no mask is stored.

    Element (r, c) has Philox offset r * n8 + c, n8 = n_cols rounded up to a multiple of 8, so that every group
    of 8 offsets lies within one row. One Philox-4x32-10 call per group: group g = offset // 8 yields words
    r0..r3, cut into sixteen-bit numbers u_0..u_7 = r0 low, r0 high, r1 low, ..., r3 high, and element 8g + s
    is kept when u_s >= round(p * 2^16). So p acts quantised to 2^-16 (the kernels still scale by 1 / (1 - p);
    the kept fraction differs from 1 - p by at most 2^-17). Eight decisions per call rather than one (tl.rand)
    matter on a GPU: the ~10 rounds of 32-bit multiplies per call would otherwise cost more than LayerNorm's
    memory traffic, or than attention's tensor-core work per score."""
    threshold = tl.cast(p * 65536.0 + 0.5, tl.int32)
    groups = rows * ((n_cols + 7) // 8) + (col_start // 8 + tl.arange(0, BLOCK_N // 8))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, groups)
    # Three rounds of interleaving put input t at lane bitreverse3(t), so the inputs go in bit-reversed order
    # (u0, u4, u2, u6, u1, u5, u3, u7) and lane s ends up holding u_s.
    a0 = tl.interleave(_keep16(r0, False, threshold), _keep16(r2, False, threshold))
    a1 = tl.interleave(_keep16(r1, False, threshold), _keep16(r3, False, threshold))
    a2 = tl.interleave(_keep16(r0, True, threshold), _keep16(r2, True, threshold))
    a3 = tl.interleave(_keep16(r1, True, threshold), _keep16(r3, True, threshold))
    return tl.interleave(tl.interleave(a0, a1), tl.interleave(a2, a3))


@triton.jit
def _dropout_mask_kernel(Out, n_rows, n_cols, p, Seed, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    seed = tl.load(Seed)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows64 = rows.to(tl.int64)[:, None]
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, rows64, n_cols, c0, p, BLOCK_N)
        tl.store(Out + rows64 * n_cols + cols[None, :], keep.to(tl.int8),
                 mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


def keep_mask(seed, n_rows: int, n_cols: int, p: float, device) -> torch.Tensor:
    """The bool [n_rows, n_cols] keep-mask `dropout_keep` gives a logical [n_rows, n_cols] mask; kernels
    address their elements so that this is the mask they applied. For tests."""
    out = torch.empty((n_rows, n_cols), dtype=torch.int8, device=device)
    if n_rows and n_cols:
        block_n = max(8, min(1024, triton.next_power_of_2(n_cols)))
        _dropout_mask_kernel[(triton.cdiv(n_rows, 16),)](out, n_rows, n_cols, float(p),
                                                          seed_tensor(seed, torch.device(device), True),
                                                          BLOCK_R=16, BLOCK_N=block_n)
    return out.bool()

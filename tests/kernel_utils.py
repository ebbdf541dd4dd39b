"""Reference checks shared by the kernel tests."""
from __future__ import annotations

import zlib

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def case_seed(*parts) -> int:
    """A seed that names the case and is the same in every process (Python's hash() of a str is salted per
    process, so seeding from it made each run draw other inputs)."""
    return zlib.crc32(repr(parts).encode())


def check_against_reference(name, ours, reference64, torch_same_dtype, dtype, rtol32=1e-5, floor=1e-2,
                            terms=None):
    """float32: relative error <= rtol32 against float64. Half precision: the kernel's error against the float64
    reference is at most twice PyTorch's own error in the same dtype (plus one unit of rounding at the
    reference's scale, for outputs PyTorch happens to get exactly right).

    The scale has a floor (test inputs are O(1)): some gradients are exactly zero in exact arithmetic
    (LayerNorm over one feature, attention over one key), and there both sides hold only rounding noise.
    For a sum over rows (a bias or weight gradient) pass `terms`, the float64 sum of the terms' magnitudes:
    rounding error scales with that, not with the sum, which cancellation can make arbitrarily small."""
    ref = reference64.double()
    scale = max(ref.abs().max().item(), floor) if ref.numel() else 1.0
    if terms is not None and terms.numel():
        scale = max(scale, terms.double().abs().max().item())
    err = (ours.double() - ref).abs().max().item() if ref.numel() else 0.0
    if dtype == torch.float32:
        assert err <= rtol32 * scale, f"{name}: error {err:.3g} vs scale {scale:.3g}"
        return
    base = (torch_same_dtype.double() - ref).abs().max().item() if ref.numel() else 0.0
    slack = torch.finfo(dtype).eps * scale
    assert err <= 2 * base + slack, f"{name} ({dtype}): kernel error {err:.3g}, PyTorch's {base:.3g}"


def binomial_ok(kept: int, total: int, p_keep: float, sigmas: float = 5.0) -> bool:
    mean = total * p_keep
    std = (total * p_keep * (1 - p_keep)) ** 0.5
    return abs(kept - mean) <= sigmas * std

"""Reference checks shared by the kernel tests."""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check_against_reference(name, ours, reference64, torch_same_dtype, dtype, rtol32=1e-5, floor=1e-2):
    """float32: relative error <= rtol32 against float64. Half precision: the kernel's error against the float64
    reference is at most twice PyTorch's own error in the same dtype (plus one unit of rounding at the
    reference's scale, for outputs PyTorch happens to get exactly right).

    The scale has a floor (test inputs are O(1)): some gradients are exactly zero in exact arithmetic
    (LayerNorm over one feature, attention over one key), and there both sides hold only rounding noise."""
    ref = reference64.double()
    scale = max(ref.abs().max().item(), floor) if ref.numel() else 1.0
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

"""Gated linear units: act(a) * b in one pass, forward and backward (GeGLU with the erf or tanh GeLU, SwiGLU with
SiLU), the gated MLP of ModernBERT (one Linear's output split in two), NomicBERT and EuroBERT (two Linears).

    y = act(a) * b,   da = dy * b * act'(a),   db = dy * act(a)
GeLU and its derivative are bias_gelu's (the same saturation and NaN rules); SiLU is a * sigmoid(a), with
derivative s + a s (1 - s), s = sigmoid(a). Nothing is stored: the backward reads a, b and dy and writes da and
db, computing act in float32 again. a and b may be strided views (the two halves of one projection).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from . import launches, targets, tuned
from ._common import as_rows, backend_for, check_device, check_float
from .bias_gelu import TILES, _default_config, _gelu, _gelu_grad, _Launch

__all__ = ["glu", "glu_ref", "GatedLinear", "GLU_ACTIVATIONS"]
# name -> the kernel's ACT: GeLU (erf), GeLU (tanh form), SiLU
GLU_ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "silu": 2}


@triton.jit
def _act(z, ACT: tl.constexpr):
    if ACT == 2:
        return z * tl.sigmoid(z)
    else:
        return _gelu(z, ACT == 1)


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    if ACT == 2:
        s = tl.sigmoid(z)
        return s + z * s * (1.0 - s)
    else:
        return _gelu_grad(z, ACT == 1)


@triton.jit
def _glu_kernel(
    A, B,          # [M, N] the activated and the gating half (unit stride along N)
    DY,            # [M, N] upstream gradient (BACKWARD)
    Y,             # [M, N] forward: act(a) * b; backward: da
    DB,            # [M, N] db (BACKWARD)
    stride_a_m, stride_b_m, stride_dy_m, M, N,
    ACT: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    out = rows64 * N + cols[None, :]  # outputs are contiguous
    a = tl.load(A + rows64 * stride_a_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + rows64 * stride_b_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        dy = tl.load(DY + rows64 * stride_dy_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + out, (dy * b * _act_grad(a, ACT)).to(Y.dtype.element_ty), mask=mask)
        tl.store(DB + out, (dy * _act(a, ACT)).to(DB.dtype.element_ty), mask=mask)
    else:
        tl.store(Y + out, (_act(a, ACT) * b).to(Y.dtype.element_ty), mask=mask)


def _config(kernel: str, dtype: torch.dtype, n: int, target: targets.Target | None) -> _Launch:
    """bias_gelu's tiles (4,096 elements, up to 1,024 columns) unless the target's table says otherwise, sized
    for three live tiles (a, b and dy) where bias_gelu holds one."""
    return tuned.pick(f"glu.{kernel}", _default_config(n), target, dtype, n,
                      need=lambda c, t: tuned.tile_need(3 * c.BLOCK_M * c.BLOCK_N, c, t))


def _site(part: str) -> launches.LaunchSite:
    return launches.LaunchSite(f"glu.{part}", _glu_kernel, lambda dtype, n, target: _default_config(n),
                               lambda dtype, n, target, seqlen=None: _config(part, dtype, n, target), TILES,
                               needs="vectors")


_FWD, _BWD = launches.declare(_site("fwd"), _site("bwd"))


def _launch(site, kernel: str, a, b, dy, y, db, act: str) -> None:
    m, n = a.shape
    block_m, block_n, warps = _config(kernel, a.dtype, n, targets.of(a.device))
    if m and n:
        site.launch((triton.cdiv(m, block_m), triton.cdiv(n, block_n)), a, b, dy, y, db, a.stride(0), b.stride(0),
                    dy.stride(0) if dy is not None else 0, m, n, ACT=GLU_ACTIVATIONS[act], BACKWARD=dy is not None,
                    BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)


@torch.library.custom_op("bertfuse::glu_fwd", mutates_args=())
def _glu_fwd(a2: torch.Tensor, b2: torch.Tensor, act: str) -> torch.Tensor:
    """act(a2) * b2 for rows [M, N] (unit stride along N), contiguous."""
    y = torch.empty(a2.shape, dtype=a2.dtype, device=a2.device)
    _launch(_FWD, "fwd", a2, b2, None, y, None, act)
    return y


@_glu_fwd.register_fake
def _(a2, b2, act):
    return a2.new_empty(a2.shape)


@torch.library.custom_op("bertfuse::glu_bwd", mutates_args=())
def _glu_bwd(dy2: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db), contiguous."""
    da = torch.empty(a2.shape, dtype=a2.dtype, device=a2.device)
    db = torch.empty(b2.shape, dtype=b2.dtype, device=b2.device)
    _launch(_BWD, "bwd", a2, b2, dy2, da, db, act)
    return da, db


@_glu_bwd.register_fake
def _(dy2, a2, b2, act):
    return a2.new_empty(a2.shape), b2.new_empty(b2.shape)


def _setup_context(ctx, inputs, output):
    a2, b2, act = inputs
    ctx.save_for_backward(a2, b2)
    ctx.act = act


def _backward(ctx, dy):
    a2, b2 = ctx.saved_tensors
    da, db = _glu_bwd(as_rows(dy), a2, b2, ctx.act)
    return da, db, None


_glu_fwd.register_autograd(_backward, setup_context=_setup_context)


def glu(a: torch.Tensor, b: torch.Tensor, activation: str = "gelu") -> torch.Tensor:
    """act(a) * b elementwise, a and b of one shape and dtype; activation "gelu" (erf), "gelu_tanh" or "silu".
    a and b may be views, such as the two halves of one Linear's output (`x.chunk(2, -1)`). Runs as the custom
    ops bertfuse::glu_fwd / _bwd, which torch.compile traces through."""
    op = "glu"
    check_float(op, "a", a)
    check_float(op, "b", b)
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {', '.join(GLU_ACTIVATIONS)}, got {activation!r}")
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{op}: a and b must share shape and dtype, got {tuple(a.shape)} {a.dtype} and "
                         f"{tuple(b.shape)} {b.dtype}")
    if a.dim() == 0:
        raise ValueError(f"{op}: a and b need at least one dimension")
    check_device(op, a=a, b=b)
    return _glu_fwd(as_rows(a), as_rows(b), activation).view(a.shape)


def glu_ref(a: torch.Tensor, b: torch.Tensor, activation: str = "gelu") -> torch.Tensor:
    """`glu` in plain PyTorch, for checks and for devices the kernels cannot use."""
    if activation == "silu":
        return F.silu(a) * b
    return F.gelu(a, approximate="tanh" if activation == "gelu_tanh" else "none") * b


class GatedLinear(nn.Linear):
    """Drop-in for a Linear to 2 * out_features whose output is split as (a, b) and gated, act(a) * b (ModernBERT's
    `Wi` then `act(input) * gate`): the same `weight` [2 * out_features, in_features] and `bias`, the gating in
    one kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str = "gelu",
                 device=None, dtype=None):
        super().__init__(in_features, 2 * out_features, bias, device=device, dtype=dtype)
        if activation not in GLU_ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(GLU_ACTIVATIONS)}, got {activation!r}")
        self.activation = activation

    def forward(self, x):
        a, b = F.linear(x, self.weight, self.bias).chunk(2, dim=-1)
        if backend_for(x) == "triton":
            return glu(a, b, self.activation)
        return glu_ref(a, b, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"

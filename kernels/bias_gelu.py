"""Fused GeLU(x + bias): the bias of BERT's intermediate dense layer and its activation in one pass.

With z = x + b, Phi the standard normal CDF and phi its density:
    "none" (erf, BERT's `gelu`):   gelu(z) = z * Phi(z) = 0.5 z (1 + erf(z / sqrt 2))
                                   gelu'(z) = Phi(z) + z * phi(z),  phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
    "tanh" (`gelu_new`):           gelu(z) = 0.5 z (1 + tanh(u)),  u = sqrt(2/pi) (z + 0.044715 z^3)
                                   gelu'(z) = 0.5 (1 + tanh u) + 0.5 z (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 z^2)
Backward: dx = dy * gelu'(x + b), db = sum_rows dx. The activation is not stored: the backward recomputes z from
x and b, so the forward writes one tensor and the backward reads two. db is summed per program over a band of
rows into a [programs, N] float32 buffer, then reduced once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from . import launches, targets, tuned
from ._common import as_rows, backend_for, check_device, check_float, dense, row_bands

__all__ = ["LinearGeLU", "bias_gelu", "bias_gelu_ref"]
APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _tanh_u2(z):
    """2u for the tanh form, clamped to +-40 (tanh is +-1 in float32 long before) so exp never overflows.

    The tanh form is evaluated through sigmoids: 1 + tanh(u) = 2 sigmoid(2u) and 1 - tanh^2(u) =
    4 sigmoid(2u) sigmoid(-2u); the second sigmoid is computed, not taken as 1 - sigmoid(2u), to keep its
    relative precision where sigmoid(2u) rounds to 1. z is clamped to +-8 first: beyond it tanh(u) is +-1 in
    float32 (|2u| > 49), and the cube of a huge z would overflow."""
    zc = tl.minimum(tl.maximum(z, -8.0), 8.0)
    u2 = 1.5957691216057308 * (zc + 0.044715 * zc * zc * zc)
    return tl.minimum(tl.maximum(u2, -40.0), 40.0)


@triton.jit
def _gelu(z, APPROX_TANH: tl.constexpr):
    """Saturates as PyTorch does: -0 below z = -8 (tanh) or where erf is -1, z above. Non-finite z as in
    PyTorch: NaN stays NaN, -inf gives NaN (-inf * 0), +inf gives +inf."""
    if APPROX_TANH:
        return tl.where(z < -8.0, 0.0 * z, tl.where(z > 8.0, z, z * tl.sigmoid(_tanh_u2(z))))
    else:
        return 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))


@triton.jit
def _gelu_grad(z, APPROX_TANH: tl.constexpr):
    """0 and 1 in the saturated tails (the tanh form's z^3 and the erf form's z * exp(-z^2/2) never overflow);
    NaN where z is NaN or infinite, as PyTorch's gradient is (z - z is NaN exactly there), so that a non-finite
    activation is never turned into a finite gradient."""
    if APPROX_TANH:
        zc = tl.minimum(tl.maximum(z, -8.0), 8.0)
        u2 = _tanh_u2(zc)
        s, s_neg = tl.sigmoid(u2), tl.sigmoid(-u2)
        grad = s + 2.0 * zc * s * s_neg * 0.7978845608028654 * (1.0 + 0.134145 * zc * zc)
        grad = tl.where(z < -8.0, 0.0, tl.where(z > 8.0, 1.0, grad))
    else:
        zc = tl.minimum(tl.maximum(z, -40.0), 40.0)
        cdf = 0.5 * (1.0 + tl.erf(zc * 0.7071067811865476))
        grad = cdf + zc * 0.3989422804014327 * tl.exp(-0.5 * zc * zc)
    return tl.where(z - z == 0.0, grad, z - z)


@triton.jit
def _bias_gelu_fwd_kernel(
    X,      # [M, N] matmul output without bias
    B,      # [N] bias
    Y,      # [M, N] gelu(x + b), x's dtype
    stride_x_m, stride_y_m, M, N,
    APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    z = tl.load(X + rows64 * stride_x_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y_m + cols[None, :], _gelu(z, APPROX_TANH).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    X, B,        # as in the forward
    DY,          # [M, N] upstream gradient
    DX,          # [M, N] gradient of x (and, summed over rows, of b)
    DB_partial,  # [programs, N] float32 per-program column sums of dx
    stride_x_m, stride_dy_m, stride_dx_m, M, N, rows_per_program,
    APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        z = tl.load(X + rows64 * stride_x_m + cols[None, :], mask=mask, other=0.0).to(tl.float32) + b[None, :]
        dy = tl.load(DY + rows64 * stride_dy_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dz = tl.where(mask, dy * _gelu_grad(z, APPROX_TANH), 0.0)
        tl.store(DX + rows64 * stride_dx_m + cols[None, :], dz.to(DX.dtype.element_ty), mask=mask)
        db += tl.sum(dz, axis=0)
    tl.store(DB_partial + pid * N + cols, db, mask=col_ok)


class _Launch(NamedTuple):
    BLOCK_M: int     # rows per program (forward) or per loop step (backward)
    BLOCK_N: int     # columns per program
    num_warps: int


def _default_config(n: int) -> _Launch:
    """Tiles of 4,096 elements, up to 1,024 columns wide (on every GPU; a family's table may say otherwise)."""
    block_n = min(1024, triton.next_power_of_2(n))
    return _Launch(max(1, 4096 // block_n), block_n, 8)


def _config(kernel: str, dtype: torch.dtype, n: int, target: targets.Target | None) -> _Launch:
    """The config of kernel "fwd" or "bwd" on `target`: its table's entry (kernels/tuned.py), else the default."""
    return tuned.pick(f"bias_gelu.{kernel}", _default_config(n), target, dtype, n,
                      need=lambda c, t: tuned.tile_need(c.BLOCK_M * c.BLOCK_N, c, t))  # its tile, in float32


# The tuner's candidates: row tiles of up to 8,192 elements (glu's elementwise kernels share them).
TILES = tuple(c for c in launches.grid(BLOCK_M=[2, 4, 8, 16], BLOCK_N=[256, 512, 1024], num_warps=[4, 8])
              if c["BLOCK_M"] * c["BLOCK_N"] <= 8192)


def _site(part: str, kernel) -> launches.LaunchSite:
    return launches.LaunchSite(f"bias_gelu.{part}", kernel, lambda dtype, n, target: _default_config(n),
                               lambda dtype, n, target, seqlen=None: _config(part, dtype, n, target), TILES,
                               needs="vectors")


_FWD, _BWD = launches.declare(_site("fwd", _bias_gelu_fwd_kernel), _site("bwd", _bias_gelu_bwd_kernel))


@torch.library.custom_op("bertfuse::bias_gelu_fwd", mutates_args=())
def _bias_gelu_fwd(x2: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(x2 + bias) for rows x2 [M, N] (unit stride along N)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    block_m, block_n, num_warps = _config("fwd", x2.dtype, n, targets.of(x2.device))
    if m:
        _FWD.launch((triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
            x2, bias, y, x2.stride(0), y.stride(0), m, n,
            APPROX_TANH=approximate == "tanh", BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y


@_bias_gelu_fwd.register_fake
def _(x2, bias, approximate):
    return torch.empty_like(x2)


@torch.library.custom_op("bertfuse::bias_gelu_bwd", mutates_args=())
def _bias_gelu_bwd(dy2: torch.Tensor, x2: torch.Tensor, bias: torch.Tensor, approximate: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) of gelu(x2 + bias)."""
    m, n = x2.shape
    dx = torch.empty_like(x2)
    block_m, block_n, num_warps = _config("bwd", x2.dtype, n, targets.of(x2.device))
    programs, rows_per_program = row_bands(x2.device, m, block_m)
    db_partial = torch.zeros((programs, n), dtype=torch.float32, device=x2.device)
    if m:
        _BWD.launch((programs, triton.cdiv(n, block_n)),
            x2, bias, dy2, dx, db_partial, x2.stride(0), dy2.stride(0), dx.stride(0), m, n, rows_per_program,
            APPROX_TANH=approximate == "tanh", BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return dx, db_partial.sum(0).to(bias.dtype)


@_bias_gelu_bwd.register_fake
def _(dy2, x2, bias, approximate):
    return torch.empty_like(x2), torch.empty_like(bias)


def _setup_context(ctx, inputs, output):
    x2, bias, approximate = inputs
    ctx.save_for_backward(x2, bias)
    ctx.approximate = approximate


def _backward(ctx, dy):
    x2, bias = ctx.saved_tensors
    dx, db = _bias_gelu_bwd(as_rows(dy), x2, bias, ctx.approximate)
    return dx, db, None


_bias_gelu_fwd.register_autograd(_backward, setup_context=_setup_context)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeLU(x + bias) over the last dimension of x; `approximate` is "none" (erf) or "tanh". Runs as the custom
    ops bertfuse::bias_gelu_fwd / _bwd, which torch.compile traces through."""
    op = "bias_gelu"
    check_float(op, "x", x)
    check_float(op, "bias", bias)
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{op}: approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.dim() == 0 or tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected (N,) with N = x's last dimension "
                         f"(x has shape {tuple(x.shape)})")
    check_device(op, x=x, bias=bias)
    return _bias_gelu_fwd(as_rows(x), dense(bias), approximate).view(x.shape)


def bias_gelu_ref(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """`bias_gelu` in plain PyTorch, for checks and for devices the kernels cannot use."""
    return F.gelu(x + bias, approximate=approximate)


class LinearGeLU(nn.Linear):
    """Drop-in for nn.Linear followed by GeLU (same `weight` and `bias`): the matmul runs without bias, then the
    fused kernel adds the bias and applies GeLU in one pass."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, approximate: str = "none",
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    @classmethod
    def from_linear(cls, linear: nn.Linear, approximate: str = "none") -> "LinearGeLU":
        """A LinearGeLU holding `linear`'s own weight and bias Parameters (not copies) and its mode: for a Linear
        whose output goes through GeLU (its activation module is then the caller's to replace by nn.Identity)."""
        fused = cls(linear.in_features, linear.out_features, bias=False, approximate=approximate, device="meta")
        fused.weight, fused.bias = linear.weight, linear.bias
        return fused.train(linear.training)

    def forward(self, x):
        h = F.linear(x, self.weight)  # without its bias: the kernel adds it, reading the matmul's output once
        if self.bias is None:
            return F.gelu(h, approximate=self.approximate)
        if backend_for(x) == "triton":
            return bias_gelu(h, self.bias, self.approximate)
        return bias_gelu_ref(h, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, approximate={self.approximate!r}"

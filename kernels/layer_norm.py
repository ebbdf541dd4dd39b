"""Fused LayerNorm(dropout(x) + residual): BERT's "dense -> dropout -> add residual -> LayerNorm" in one pass;
RMSNorm and the pre-norm form (the sum returned too) by the same kernels.

Forward, per row of N features (statistics in float32):
    s    = dropout(x) + residual,  dropout(x) = x * keep / (1 - p),  keep ~ Bernoulli(1 - p) from Philox(seed, i)
    mean = sum(s) / N,  var = sum((s - mean)^2) / N,  rstd = 1 / sqrt(var + eps)
    xhat = (s - mean) * rstd,  y = xhat * w + b
Only y, mean and rstd are written; the dropout mask is regenerated in the backward from (seed, element index),
eight elements per Philox call (see kernels._common.dropout_keep). RMSNorm is the same kernel with its RMS flag:
mean = 0, so rstd = 1 / sqrt(sum(s^2) / N + eps). A pre-norm layer (x + sublayer(norm(x)), then the next norm
of that sum) also needs s itself, its residual stream: with STORE_SUM the forward writes it.

Backward, with g = dy * w:
    ds         = rstd * (g - mean(g) - xhat * mean(g * xhat))        (means over the N features of the row;
                                                                      RMSNorm: without the mean(g) term)
    ds        += dsum                                                (where s was an output too)
    dresidual  = ds,   dx = ds * keep / (1 - p)
    dw = sum_rows dy * xhat,   db = sum_rows dy
The backward recomputes s from x and residual (same traffic as storing it, less memory). dw and db are summed
per program over a contiguous band of rows into a [programs, N] float32 buffer, then reduced once: no atomics,
no contention.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from . import launches, targets, tuned
from ._common import (as_rows, backend_for, check_device, check_float, dense, dropout_keep, keep_mask, row_bands,
                      seed_tensor)

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "layer_norm_ref", "rms_norm", "rms_norm_ref", "fuse_layer_norms"]
MAX_N = 16384


@triton.jit
def _dropout_add(X, R, rows64, cols, mask, stride_x_m, stride_r_m, N, p, Seed,
                 HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """s = dropout(x) + residual for a [rows, cols] tile, in float32, and the keep mask (all True without
    dropout). The mask is the logical [M, N] one of `dropout_keep`, in the forward and the backward alike."""
    s = tl.load(X + rows64 * stride_x_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    keep = mask
    if HAS_DROPOUT:
        keep = dropout_keep(tl.load(Seed), rows64, N, 0, p, BLOCK_N)
        s = tl.where(keep, s / (1.0 - p), 0.0)
    if HAS_RESIDUAL:
        s += tl.load(R + rows64 * stride_r_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return s, keep


@triton.jit
def _layer_norm_fwd_kernel(
    X,           # [M, N] input (the sublayer's output)
    R,           # [M, N] residual (unused unless HAS_RESIDUAL)
    W, B,        # [N] weight and bias (unused unless HAS_WEIGHT / HAS_BIAS)
    Y,           # [M, N] output, x's dtype
    S,           # [M, N] output dropout(x) + residual, x's dtype (STORE_SUM: a pre-norm layer's residual stream)
    Mean, Rstd,  # [M] float32 statistics for the backward (the mean 0 with RMS)
    Seed,        # [1] int64 Philox seed (unused unless HAS_DROPOUT)
    stride_x_m, stride_r_m, stride_y_m,
    M, N, eps, p,
    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr, STORE_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)[:, None]
    s, _ = _dropout_add(X, R, rows64, cols, mask, stride_x_m, stride_r_m, N, p, Seed, HAS_RESIDUAL, HAS_DROPOUT,
                        BLOCK_N)
    if STORE_SUM:
        tl.store(S + rows64 * N + cols[None, :], s.to(S.dtype.element_ty), mask=mask)
    if RMS:
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    else:
        mean = tl.sum(s, axis=1) / N
    diff = tl.where(mask, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / N + eps)
    y = diff * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y_m + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_bwd_kernel(
    X, R, W,              # as in the forward
    DY,                   # [M, N] upstream gradient
    DS,                   # [M, N] upstream gradient of the stored sum (HAS_SUM_GRAD)
    DX, DR,               # [M, N] gradients of x and residual (DR unused unless HAS_RESIDUAL)
    DW_partial, DB_partial,  # [programs, N] float32 per-program sums of dy * xhat and dy
    Mean, Rstd,           # [M] float32
    Seed,                 # [1] int64, as in the forward
    stride_x_m, stride_r_m, stride_dy_m, stride_ds_m, stride_dx_m, stride_dr_m,
    M, N, p, rows_per_program,
    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, RMS: tl.constexpr,
    HAS_SUM_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # w, dw and db live across the row loop. From 8,192 columns on, w is reloaded (from cache) at every step
    # instead of held: three such rows in registers spill on sm_75 (24 B at 8 warps, more at 16).
    if HAS_WEIGHT and BLOCK_N < 8192:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        s, keep = _dropout_add(X, R, rows64, cols, mask, stride_x_m, stride_r_m, N, p, Seed, HAS_RESIDUAL,
                               HAS_DROPOUT, BLOCK_N)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        dy = tl.load(DY + rows64 * stride_dy_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            if BLOCK_N >= 8192:
                w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
            g = dy * w[None, :]
        else:
            g = dy
        if RMS:  # no mean was subtracted: no mean of g either
            mean_gx = tl.sum(g * xhat, axis=1) / N
            ds = (g - xhat * mean_gx[:, None]) * rstd[:, None]
        else:
            mean_g = tl.sum(g, axis=1) / N
            mean_gx = tl.sum(g * xhat, axis=1) / N
            ds = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd[:, None]
        if HAS_SUM_GRAD:  # the sum is an output too (pre-norm): its own gradient joins
            ds += tl.load(DS + rows64 * stride_ds_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            tl.store(DR + rows64 * stride_dr_m + cols[None, :], ds.to(DR.dtype.element_ty), mask=mask)
        if HAS_DROPOUT:
            ds = tl.where(keep, ds / (1.0 - p), 0.0)
        tl.store(DX + rows64 * stride_dx_m + cols[None, :], ds.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW_partial + pid * N + cols, dw, mask=col_ok)
    tl.store(DB_partial + pid * N + cols, db, mask=col_ok)


class _Launch(NamedTuple):
    BLOCK_M: int     # rows per program (forward) or per loop step (backward)
    BLOCK_N: int     # the whole row, a power of two: fixed by N, never tuned
    num_warps: int


def _default_config(n: int) -> _Launch:
    """A few rows per program when rows are short, more warps for wide rows (the same on every GPU: a family
    whose table says otherwise gets its table's)."""
    block_n = max(8, triton.next_power_of_2(n))      # dropout draws its random bits in groups of 8 columns
    block_m = max(1, min(16, 4096 // block_n))
    return _Launch(block_m, block_n, min(16, max(4, block_m * block_n // 1024)))


def _config(kernel: str, dtype: torch.dtype, n: int, target: targets.Target | None) -> _Launch:
    """The config of kernel "fwd" or "bwd" on `target`: its table's entry (kernels/tuned.py), else the default."""
    return tuned.pick(f"layer_norm.{kernel}", _default_config(n), target, dtype, n, tunable=("BLOCK_M", "num_warps"),
                      need=lambda c, t: tuned.tile_need(c.BLOCK_M * c.BLOCK_N, c, t))  # its rows, in float32


def _site(part: str, kernel) -> launches.LaunchSite:
    return launches.LaunchSite(f"layer_norm.{part}", kernel, lambda dtype, n, target: _default_config(n),
                               lambda dtype, n, target, seqlen=None: _config(part, dtype, n, target),
                               launches.grid(BLOCK_M=[1, 2, 4, 8, 16], num_warps=[2, 4, 8, 16]), needs="vectors")


_FWD, _BWD = launches.declare(_site("fwd", _layer_norm_fwd_kernel), _site("bwd", _layer_norm_bwd_kernel))


def _check(x, weight, bias, residual, p):
    op = "layer_norm"
    check_float(op, "x", x)
    n = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or not 1 <= n <= MAX_N:
        raise ValueError(f"{op}: the normalised (last) dimension must have 1..{MAX_N} features, got shape {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_float(op, name, t)
            if tuple(t.shape) != (n,):
                raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected ({n},) to match x's last dimension")
    if residual is not None:
        check_float(op, "residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {p}")
    check_device(op, x=x, weight=weight, bias=bias, residual=residual)


def _empty(like: torch.Tensor) -> torch.Tensor:
    """The placeholder a custom op returns for an output it does not have (its schema wants a tensor)."""
    return like.new_empty(0)


@torch.library.custom_op("bertfuse::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(x2: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                    bias: torch.Tensor | None, eps: float, p: float, seed: torch.Tensor | None, rms: bool = False,
                    store_sum: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd, sum) for rows x2 [M, N] (unit stride along N), residual like x2 or None; sum =
    dropout(x2) + residual where store_sum, else empty."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    total = torch.empty((m, n) if store_sum else (0,), dtype=x2.dtype, device=x2.device)
    mean = torch.empty(m, dtype=torch.float32, device=x2.device)
    rstd = torch.empty_like(mean)
    block_m, block_n, num_warps = _config("fwd", x2.dtype, n, targets.of(x2.device))
    if m:
        _FWD.launch(
            (triton.cdiv(m, block_m),), x2, residual, weight, bias, y, total if store_sum else None, mean, rstd,
            seed, x2.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), m, n, eps, p,
            HAS_RESIDUAL=residual is not None, HAS_DROPOUT=p > 0, HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, RMS=rms, STORE_SUM=store_sum, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps)
    return y, mean, rstd, total


@_layer_norm_fwd.register_fake
def _(x2, residual, weight, bias, eps, p, seed, rms=False, store_sum=False):
    m = x2.shape[0]
    return (torch.empty_like(x2), x2.new_empty(m, dtype=torch.float32), x2.new_empty(m, dtype=torch.float32),
            torch.empty_like(x2) if store_sum else _empty(x2))


@torch.library.custom_op("bertfuse::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(dy2: torch.Tensor, x2: torch.Tensor, residual: torch.Tensor | None,
                    weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, p: float,
                    seed: torch.Tensor | None, rms: bool = False, dsum2: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dresidual, dweight, dbias float32); dresidual and dweight are empty where the forward had no
    residual or weight (the kernel sums dbias in any case; the autograd wrapper drops it without a bias). dsum2:
    the gradient of the stored sum (None: it had none)."""
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    dr = torch.empty((m, n), dtype=residual.dtype, device=x2.device) if residual is not None else None
    block_m, block_n, num_warps = _config("bwd", x2.dtype, n, targets.of(x2.device))
    programs, rows_per_program = row_bands(x2.device, m, block_m)
    dw_partial = torch.zeros((programs, n), dtype=torch.float32, device=x2.device)
    db_partial = torch.zeros_like(dw_partial)
    if m:
        _BWD.launch(
            (programs,), x2, residual, weight, dy2, dsum2, dx, dr, dw_partial, db_partial, mean, rstd, seed,
            x2.stride(0), residual.stride(0) if residual is not None else 0, dy2.stride(0),
            dsum2.stride(0) if dsum2 is not None else 0, dx.stride(0), dr.stride(0) if dr is not None else 0, m, n,
            p, rows_per_program, HAS_RESIDUAL=residual is not None, HAS_DROPOUT=p > 0, HAS_WEIGHT=weight is not None,
            RMS=rms, HAS_SUM_GRAD=dsum2 is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else _empty(x2)
    return dx, dr if dr is not None else _empty(x2), dw, db_partial.sum(0)


@_layer_norm_bwd.register_fake
def _(dy2, x2, residual, weight, mean, rstd, p, seed, rms=False, dsum2=None):
    n = x2.shape[1]
    dr = torch.empty_like(residual) if residual is not None else _empty(x2)
    dw = x2.new_empty(n, dtype=weight.dtype) if weight is not None else _empty(x2)
    return torch.empty_like(x2), dr, dw, x2.new_empty(n, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x2, residual, weight, bias, eps, p, seed, rms, store_sum = inputs
    _, mean, rstd, _ = output
    ctx.save_for_backward(x2, residual, weight, mean, rstd, seed)
    ctx.p, ctx.bias_dtype, ctx.rms = p, bias.dtype if bias is not None else None, rms


def _backward(ctx, dy, _dmean, _drstd, dsum):
    x2, residual, weight, mean, rstd, seed = ctx.saved_tensors
    dsum = as_rows(dsum) if dsum is not None and dsum.numel() else None
    dx, dr, dw, db = _layer_norm_bwd(as_rows(dy), x2, residual, weight, mean, rstd, ctx.p, seed, ctx.rms, dsum)
    return (dx, dr if residual is not None else None, dw if weight is not None else None,
            db.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None, None, None, None, None, None)


_layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5,
               residual: torch.Tensor | None = None, dropout_p: float = 0.0, training: bool = True,
               seed: int | torch.Tensor | None = None, rms: bool = False, return_sum: bool = False):
    """LayerNorm(dropout(x) + residual) over the last dimension; returns a tensor of x's shape and dtype.

    Dropout applies to x only (not the residual) and only when `training`; `seed` (an int or a one-element
    device tensor) fixes its Philox stream, by default drawn from torch's generator of x's device as a device
    tensor, so that torch.manual_seed makes runs repeatable and no call waits for the device. rms=True
    normalises by the root mean square instead (RMSNorm: no mean subtracted; `rms_norm`). return_sum=True
    returns (y, s) with s = dropout(x) + residual in x's dtype, the residual stream of a pre-norm layer, which
    then needs no separate add (its gradient flows back through the same kernel).
    The kernels run as the custom ops bertfuse::layer_norm_fwd / _bwd, which torch.compile traces through.
    """
    p = float(dropout_p) if training else 0.0
    _check(x, weight, bias, residual, p)
    r2 = as_rows(residual) if residual is not None else None
    y, _, _, total = _layer_norm_fwd(as_rows(x), r2, dense(weight), dense(bias), float(eps), p,
                                     seed_tensor(seed, x.device, p > 0), bool(rms), bool(return_sum))
    return (y.view(x.shape), total.view(x.shape)) if return_sum else y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, residual: torch.Tensor | None = None,
             dropout_p: float = 0.0, training: bool = True, seed: int | torch.Tensor | None = None,
             return_sum: bool = False):
    """RMSNorm(dropout(x) + residual) = s / sqrt(mean(s^2) + eps) * weight over the last dimension (statistics
    in float32), by the LayerNorm kernels with their RMS flag; the arguments as `layer_norm`'s."""
    return layer_norm(x, weight, None, eps, residual, dropout_p, training, seed, rms=True, return_sum=return_sum)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5,
                   residual: torch.Tensor | None = None, dropout_p: float = 0.0,
                   keep: torch.Tensor | None = None, rms: bool = False, return_sum: bool = False):
    """`layer_norm` in plain PyTorch, for checks and for devices the kernels cannot use. Dropout applies the
    given keep-mask (`dropout_mask`'s, to reproduce the kernel's draw) or, without one, F.dropout's own."""
    if dropout_p > 0:
        x = x * keep.to(x.dtype) / (1 - dropout_p) if keep is not None else F.dropout(x, dropout_p)
    if residual is not None:
        x = x + residual
    if rms:
        y = F.rms_norm(x, (x.shape[-1],), weight, eps)
        y = y + bias if bias is not None else y
    else:
        y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return (y, x) if return_sum else y


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
                 residual: torch.Tensor | None = None, dropout_p: float = 0.0, keep: torch.Tensor | None = None,
                 return_sum: bool = False):
    """`rms_norm` in plain PyTorch."""
    return layer_norm_ref(x, weight, None, eps, residual, dropout_p, keep, rms=True, return_sum=return_sum)


def dropout_mask(seed, n_rows: int, n_cols: int, p: float, device) -> torch.Tensor:
    """The keep-mask (bool [n_rows, n_cols]) that `layer_norm` applies for this seed and p; for tests."""
    return keep_mask(seed, n_rows, n_cols, p, device)


class LayerNorm(nn.LayerNorm):
    """Drop-in for nn.LayerNorm (same parameters and state_dict) running the fused kernel.

    `forward(x, residual=None, dropout_p=0.0)` computes LayerNorm(dropout(x) + residual); with the defaults it
    is exactly nn.LayerNorm over the last dimension. Dropout is active only in training mode.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"kernels.LayerNorm normalises over the last dimension only, got {self.normalized_shape}")

    @classmethod
    def from_module(cls, ln: nn.LayerNorm) -> "LayerNorm":
        """A kernels.LayerNorm holding `ln`'s own weight and bias Parameters (not copies) and its mode."""
        fused = cls(ln.normalized_shape, eps=ln.eps, elementwise_affine=False, bias=False)
        fused.elementwise_affine = ln.elementwise_affine
        fused.weight, fused.bias = ln.weight, ln.bias
        return fused.train(ln.training)

    def forward(self, x, residual=None, dropout_p: float = 0.0, return_sum: bool = False):
        p = dropout_p if self.training else 0.0
        if backend_for(x) == "triton":
            return layer_norm(x, self.weight, self.bias, self.eps, residual=residual, dropout_p=p,
                              return_sum=return_sum)
        if residual is None and not p and not return_sum:  # nn.LayerNorm's own code (its static shape: ONNX)
            return super().forward(x)
        return layer_norm_ref(x, self.weight, self.bias, self.eps, residual=residual, dropout_p=p,
                              return_sum=return_sum)


class RMSNorm(nn.RMSNorm):
    """Drop-in for nn.RMSNorm over the last dimension (same `weight` and state_dict) running the fused kernel.

    `forward(x, residual=None, dropout_p=0.0, return_sum=False)` computes RMSNorm(dropout(x) + residual) (and,
    with return_sum, also returns the sum: a pre-norm layer's residual stream); with the defaults it is exactly
    nn.RMSNorm. eps None means torch.finfo(x.dtype).eps, as in nn.RMSNorm.
    """

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"kernels.RMSNorm normalises over the last dimension only, got {self.normalized_shape}")

    def forward(self, x, residual=None, dropout_p: float = 0.0, return_sum: bool = False):
        p = dropout_p if self.training else 0.0
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        if backend_for(x) == "triton":
            return rms_norm(x, self.weight, eps, residual=residual, dropout_p=p, return_sum=return_sum)
        if residual is None and not p and not return_sum:  # nn.RMSNorm's own code (its static shape: ONNX)
            return super().forward(x)
        return rms_norm_ref(x, self.weight, eps, residual=residual, dropout_p=p, return_sum=return_sum)


def fuse_layer_norms(module: nn.Module, retype=None) -> int:
    """Make every nn.LayerNorm inside `module` (over the last dimension) a kernels.LayerNorm, in place: each
    object stays (its parameters, its hooks, its place), only its class changes, which adds no state, so
    optimizers and state_dicts are unaffected and `m.__class__ = nn.LayerNorm` undoes it. `retype(module, cls)`
    does the change (default: set the class; the Hugging Face fuser records it to undo). Returns how many."""
    found = [m for m in module.modules() if type(m) is nn.LayerNorm and len(m.normalized_shape) == 1]
    for m in found:
        if retype is None:
            m.__class__ = LayerNorm
        else:
            retype(m, LayerNorm)
    return len(found)

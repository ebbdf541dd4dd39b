"""Rotary position embeddings (RoPE) on packed tokens: q or k [T, H, D] rotated by each token's position, forward
and backward, cos and sin computed in float32 inside the kernel (no [T, D] table is formed).

Pair i (0 <= i < R/2, R = rotary_dim <= D) of a head holds two features x1, x2: (i, i + R/2) in the half-rotation
layout (transformers' `rotate_half`: ModernBERT, NomicBERT, EuroBERT, ESM, Llama) or (2i, 2i + 1) interleaved
(RoFormer, GPT-J). At position t, with angle a = t * inv_freq[i] (one float32 product, as transformers forms it)
and c = scaling * cos(a), s = scaling * sin(a) (`_sincos`):
    y1 = x1 c - x2 s,   y2 = x2 c + x1 s          (features past R are copied)
The map is scaling times a rotation, so its transpose is scaling times the rotation by -a: the backward is the
same kernel with s negated, dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s. inv_freq carries the family's base, its
dimension split and any static frequency scaling (a model's own `inv_freq` buffer); `scaling` is transformers'
`attention_scaling`. Positions are given per token ([T] int), so any layout works: the position inside each
packed sequence (`rotary_positions`), or a model's own position ids gathered with its tokens.

A model that keeps its own cos and sin rather than frequencies (RoFormer's float64-made sinusoid table, ESM's
cos and sin formed once per forward) gives them as tables [rows, R/2] (`Rotary.cos`, `Rotary.sin`, strided views
welcome): each token then reads row positions[t] of both instead of computing them, so the rotation is the model's
own to the last bit of its table.

A program owns a block of tokens: it computes their cos and sin once and rotates every head with them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import launches, targets, tuned
from ._common import check_device, check_float, dense, unit_stride

__all__ = ["Rotary", "rotary", "rotary_ref", "rotary_positions"]


class Rotary(NamedTuple):
    """A rotary embedding: pair i of the first 2 * len(inv_freq) features of each head turns by position *
    inv_freq[i]; cos and sin are multiplied by `scaling`; `interleaved` pairs features (2i, 2i + 1), else (i,
    i + len(inv_freq)). With tables `cos` and `sin` given, pair i of a token at position t turns by the angle
    whose cos and sin are cos[t, i] and sin[t, i] (inv_freq then None)."""
    inv_freq: torch.Tensor | None  # [rotary_dim // 2] float32
    scaling: float = 1.0
    interleaved: bool = False
    cos: torch.Tensor | None = None  # [rows, rotary_dim // 2]
    sin: torch.Tensor | None = None


@triton.jit
def _sincos(a):
    """(sin a, cos a) of float32 angles, to about one unit in the last place, with no table and no local memory
    (libdevice's sinf and cosf keep a Payne-Hanek path for huge arguments whose scratch array ptxas reports as
    spills). a = k pi/2 + r, k = round(a 2/pi), with r = a - k pi/2 formed in float64 (pi/2 as two float32
    parts, whose sum is pi/2 to 2e-15: r is exact to float32 for any angle a position can make), |r| <= pi/4;
    then sin r and cos r by the minimax polynomials of Cephes' sinf and cosf, and the quadrant k mod 4 picks
    and signs them."""
    k = tl.floor(a * 0.6366197723675814 + 0.5)
    k64 = k.to(tl.float64)
    r = (a.to(tl.float64) - k64 * 1.5707963705062866 - k64 * -4.371138828673793e-08).to(tl.float32)
    z = r * r
    sin_r = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    cos_r = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    q = k.to(tl.int32) & 3  # two's complement: -1 & 3 = 3, the quadrant of negative angles too
    sin = tl.where(q == 0, sin_r, tl.where(q == 1, cos_r, tl.where(q == 2, -sin_r, -cos_r)))
    cos = tl.where(q == 0, cos_r, tl.where(q == 1, -sin_r, tl.where(q == 2, -cos_r, sin_r)))
    return sin, cos


@triton.jit
def _rotary_kernel(
    X,           # [T, H, D] input (unit stride along D)
    Y,           # [T, H, D] output, contiguous
    Positions,   # [T] int32 or int64: each token's position (TABLE: its row of Cos and Sin)
    InvFreq,     # [HALF] float32 (not read with TABLE)
    Cos, Sin,    # TABLE: [ROWS, HALF] cos and sin (unit stride along HALF)
    stride_x_t, stride_x_h, stride_cos, stride_sin, T, H, ROWS, scaling, sin_sign,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, TABLE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    pair_ok = row_ok[:, None] & (i < HALF)[None, :]
    if TABLE:  # the model's own cos and sin, at each token's row (a row outside the table reads nothing)
        r = tl.load(Positions + rows64, mask=row_ok, other=0).to(tl.int64)
        in_table = pair_ok & ((r >= 0) & (r < ROWS))[:, None]
        cos = tl.load(Cos + r[:, None] * stride_cos + i[None, :], mask=in_table, other=0.0).to(tl.float32)
        sin = tl.load(Sin + r[:, None] * stride_sin + i[None, :], mask=in_table, other=0.0).to(tl.float32)
    else:
        pos = tl.load(Positions + rows64, mask=row_ok, other=0).to(tl.float32)
        angle = pos[:, None] * tl.load(InvFreq + i, mask=i < HALF, other=0.0)[None, :]
        sin, cos = _sincos(angle)
    c = cos * scaling
    s = sin * (scaling * sin_sign)
    # Interleaved pairs are read as one contiguous [BLOCK_T, 2 * BLOCK_HALF] tile and split in registers (wide
    # loads, not two strided ones); the half-rotation layout reads its two halves, each contiguous.
    both = tl.arange(0, 2 * BLOCK_HALF)
    both_ok = row_ok[:, None] & (both < 2 * HALF)[None, :]
    tail = 2 * HALF + tl.arange(0, BLOCK_TAIL)
    tail_ok = row_ok[:, None] & (tail < HEAD_DIM)[None, :]
    for h in range(0, H):
        x_row = X + rows64[:, None] * stride_x_t + h * stride_x_h
        y_row = Y + (rows64[:, None] * H + h) * HEAD_DIM
        if INTERLEAVED:
            x = tl.load(x_row + both[None, :], mask=both_ok, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_HALF, 2)))
            y = tl.reshape(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), (BLOCK_T, 2 * BLOCK_HALF))
            tl.store(y_row + both[None, :], y.to(Y.dtype.element_ty), mask=both_ok)
        else:
            x1 = tl.load(x_row + i[None, :], mask=pair_ok, other=0.0).to(tl.float32)
            x2 = tl.load(x_row + HALF + i[None, :], mask=pair_ok, other=0.0).to(tl.float32)
            tl.store(y_row + i[None, :], (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=pair_ok)
            tl.store(y_row + HALF + i[None, :], (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=pair_ok)
        if 2 * HALF < HEAD_DIM:  # features past the rotary dimension pass through
            tl.store(y_row + tail[None, :], tl.load(x_row + tail[None, :], mask=tail_ok), mask=tail_ok)


class _Launch(NamedTuple):
    BLOCK_T: int      # tokens per program
    num_warps: int


def _default_config(half: int) -> _Launch:
    """About 1,024 pairs a program, 4 warps: 8 pairs a thread, whose cos and sin it holds for every head (the
    float32 sin and cos take registers of their own; 2,048 pairs spilled on sm_80)."""
    return _Launch(max(1, min(128, 1024 // triton.next_power_of_2(half))), 4)


def _config(dtype: torch.dtype, half: int, target: targets.Target | None) -> _Launch:
    """The config on `target`: its table's entry (kernels/tuned.py), else the default."""
    return tuned.pick("rotary.apply", _default_config(half), target, dtype, half,
                      need=lambda c, t: tuned.tile_need(4 * c.BLOCK_T * triton.next_power_of_2(half), c, t))


_APPLY, = launches.declare(launches.LaunchSite(
    "rotary.apply", _rotary_kernel, lambda dtype, half, target: _default_config(half),
    lambda dtype, half, target, seqlen=None: _config(dtype, half, target),
    launches.grid(BLOCK_T=[8, 16, 32, 64, 128], num_warps=[2, 4, 8]), needs="vectors"))


@torch.library.custom_op("bertfuse::rotary", mutates_args=())
def _rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None, scaling: float,
            interleaved: bool, inverse: bool, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """y [T, H, D] (contiguous) = x rotated by +angle (inverse: -angle, the backward) at each token's position;
    the angles' cos and sin from inv_freq, or read from the tables cos and sin."""
    total, heads, dim = x.shape
    table = cos is not None
    half = cos.shape[1] if table else inv_freq.numel()
    y = torch.empty((total, heads, dim), dtype=x.dtype, device=x.device)
    block_t, warps = _config(x.dtype, half, targets.of(x.device))
    if total and heads and dim:
        freq = cos if inv_freq is None else inv_freq  # a pointer never read with a table
        cos, sin = (cos, sin) if table else (freq, freq)
        _APPLY.launch((triton.cdiv(total, block_t),), x, y, positions, freq, cos, sin, x.stride(0), x.stride(1),
                      cos.stride(0) if table else 0, sin.stride(0) if table else 0, total, heads,
                      cos.shape[0] if table else 0, float(scaling), -1.0 if inverse else 1.0, HALF=half,
                      HEAD_DIM=dim, INTERLEAVED=interleaved, TABLE=table, BLOCK_T=block_t,
                      BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
                      BLOCK_TAIL=triton.next_power_of_2(max(dim - 2 * half, 1)), num_warps=warps)
    return y


@_rotary.register_fake
def _(x, positions, inv_freq, scaling, interleaved, inverse, cos, sin):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    _, positions, inv_freq, scaling, interleaved, inverse, cos, sin = inputs
    ctx.save_for_backward(positions, inv_freq, cos, sin)
    ctx.scaling, ctx.interleaved, ctx.inverse = scaling, interleaved, inverse


def _backward(ctx, dy):
    positions, inv_freq, cos, sin = ctx.saved_tensors
    dx = _rotary(unit_stride(dy), positions, inv_freq, ctx.scaling, ctx.interleaved, not ctx.inverse, cos, sin)
    return dx, None, None, None, None, None, None, None


_rotary.register_autograd(_backward, setup_context=_setup_context)


def _check(x, positions, rot):
    op = "rotary"
    check_float(op, "x", x)
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [total_tokens, heads, head_dim], got {tuple(x.shape)}")
    if not isinstance(rot, Rotary):
        raise TypeError(f"{op}: rotary must be a kernels.Rotary, got {type(rot).__name__}")
    half = _check_tables(rot) if rot.cos is not None or rot.sin is not None else _check_inv_freq(rot)
    if not 1 <= 2 * half <= x.shape[2]:
        raise ValueError(f"{op}: {half} frequencies, so rotary_dim {2 * half}, which must be 2 .. head_dim = "
                         f"{x.shape[2]}")
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64) \
            or tuple(positions.shape) != (x.shape[0],):
        got = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else \
            type(positions).__name__
        raise ValueError(f"{op}: positions must be an int32 or int64 tensor [total_tokens] = [{x.shape[0]}], got "
                         f"{got}")
    check_device(op, x=x, positions=positions, **{n: t for n in ("inv_freq", "cos", "sin")
                                                   if (t := getattr(rot, n)) is not None})


def _check_inv_freq(rot) -> int:
    inv = rot.inv_freq
    if not isinstance(inv, torch.Tensor) or inv.dim() != 1 or inv.dtype != torch.float32:
        raise TypeError("rotary: inv_freq must be a 1-D float32 tensor [rotary_dim // 2] (or give cos and sin "
                        "tables)")
    return inv.numel()


def _check_tables(rot) -> int:
    for name in ("cos", "sin"):
        t = getattr(rot, name)
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            got = type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} {tuple(t.shape)}"
            raise TypeError(f"rotary: {name} must be a 2-D floating tensor [rows, rotary_dim // 2] (cos and sin "
                            f"come together), got {got}")
    if rot.cos.shape != rot.sin.shape:
        raise ValueError(f"rotary: cos {tuple(rot.cos.shape)} and sin {tuple(rot.sin.shape)} differ in shape")
    if rot.inv_freq is not None:
        raise ValueError("rotary: give inv_freq or the cos and sin tables, not both")
    return rot.cos.shape[1]


def _check_rows(positions, rows: int) -> None:
    """Every token's row inside the tables (one sync)."""
    if positions.numel() and not bool(((positions >= 0) & (positions < rows)).all()):
        raise ValueError(f"rotary: positions must index the cos and sin tables' {rows} rows; got values in "
                         f"[{int(positions.min())}, {int(positions.max())}]")


def rotary(x: torch.Tensor, positions: torch.Tensor, rot: Rotary, validate: bool = True) -> torch.Tensor:
    """x [total_tokens, heads, head_dim] rotated at each token's position (positions [total_tokens], int32 or
    int64): a new contiguous tensor of x's shape and dtype; x may be a strided view (a head slice of a fused q/k/v
    projection). Positions below 2^24 are exact in the float32 angle. With tables (rot.cos, rot.sin), positions
    are rows of them, checked to lie inside unless validate=False (the check syncs once; compiled, it is
    skipped, and a row outside turns the token's pairs to zero). Runs as the custom op bertfuse::rotary, which
    torch.compile traces through; the backward is the inverse rotation."""
    _check(x, positions, rot)
    cos, sin = (unit_stride(t) if t is not None else None for t in (rot.cos, rot.sin))
    if cos is not None and validate and not torch.compiler.is_compiling():
        _check_rows(positions, cos.shape[0])
    inv_freq = dense(rot.inv_freq) if rot.inv_freq is not None else None
    return _rotary(unit_stride(x), dense(positions), inv_freq, float(rot.scaling), bool(rot.interleaved), False,
                   cos, sin)


def rotary_positions(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """int32 [total_tokens]: each token's position inside its packed sequence (cu_seqlens int32 [batch + 1]);
    tokens at or past cu_seqlens[-1] (a packed batch's filler) count on from the last sequence's start. No host
    sync."""
    tokens = torch.arange(total_tokens, device=cu_seqlens.device, dtype=torch.int32)
    starts = cu_seqlens[:-1].contiguous()
    if starts.numel() == 0:
        return tokens
    sequence = torch.searchsorted(starts, tokens, right=True) - 1
    return (tokens - starts[sequence.clamp(min=0)]).to(torch.int32)


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, rot: Rotary) -> torch.Tensor:
    """`rotary` in plain PyTorch, as transformers writes it (cos and sin of the float32 angles, the pairs rotated
    with `rotate_half` or interleaved), in x's dtype (float64 for checks)."""
    if rot.cos is not None:  # the model's own tables, read at each token's row
        half = rot.cos.shape[1]
        cos, sin = (t[positions].to(x.dtype)[:, None, :] * rot.scaling for t in (rot.cos, rot.sin))
    else:
        half = rot.inv_freq.numel()
        angle = positions.float()[:, None] * rot.inv_freq.float()[None, :]
        cos, sin = (f(angle).to(x.dtype)[:, None, :] * rot.scaling for f in (torch.cos, torch.sin))
    if rot.interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, x[..., 2 * half:]], dim=-1)

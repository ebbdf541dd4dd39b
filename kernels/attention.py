"""Variable-length flash attention for BERT (bidirectional, no causal mask), forward and backward, with dropout.

Sequences are packed as [total_tokens, heads, head_dim] and delimited by int32 `cu_seqlens` [batch + 1], as in
FlashAttention's varlen API. Program (i, b, h) handles query block i of sequence b, head h, and returns at once
when that block lies past the sequence's end, so no FLOP is spent on padding: the cost grows with the sum of
squared real lengths.

Forward (FlashAttention-2). Scores are kept in base 2: s = (q . k) * scale * log2(e). Over key blocks j:
    m_new = max(m, rowmax(s_j)),   alpha = 2^(m - m_new),   p_j = 2^(s_j - m_new)
    l     = l * alpha + rowsum(p_j)
    acc   = acc * alpha + (p_j * keep_j) @ v_j               keep_j: dropout_keep(seed, (h, query, key))
    out   = acc / l / (1 - p_drop),   lse = m + log2(l)     (lse saved, float32, for the backward)
Dropout acts on the normalised probabilities P; since normalising divides a whole row by l, it can be applied
to the unnormalised p_j and l left undropped.

Backward. P = 2^(s - lse) is recomputed from the saved lse; no [seq, seq] matrix is stored. With
D = keep / (1 - p_drop) and O = (P * D) V:
    dV = (P * D)^T dO,   dP = (dO V^T) * D,   dS = P * (dP - delta),   delta = rowsum(dO * O)
    dQ = dS K * scale,   dK = dS^T Q * scale
(rowsum(dP * P) = rowsum(dO * O) holds with dropout too, which is why delta needs only O and dO.)
One kernel walks the query blocks for each key block (dK, dV); another walks the key blocks for each query
block (dQ): no atomics, deterministic results.

Grouped-query heads (k and v with fewer heads than q, EuroBERT's num_key_value_heads): query head h reads k/v head
h // group in the forward and dQ kernels; a dK/dV program owns one k/v head and walks the queries of every head
of its group in turn, summing their shares in registers, so k and v are never repeated in memory and the
gradients need no atomics.

Sliding window (optional, window_size = (left, right), ModernBERT's local attention): query i sees keys
i - left .. i + right of its sequence. A program walks only the tiles its block's window reaches (the forward
and dQ from the first key block a query of the block can see to the last; dK/dV the query blocks that see its
keys), so the FLOPs of the tiles outside are never spent, and masks the scores outside the window inside the
tiles it visits. A row may see no key of the first tiles it visits, so the running max is taken as 0 while it
is still -inf (2^(-inf - 0) = 0, never NaN).

Relative-position bias (optional, `RelativePositionBias`: MPNet's and T5's bucketed rule). The score of query i
and key j of a sequence gets table[bucket(j - i), h], positions counted from the sequence's first token. The
rule is constant past max_distance, so the launcher evaluates it once per call on the 2 * max_distance + 1
distances (with the same float32 operations as transformers, hence the same bucket at every boundary) and
gives the kernels each head's bias by clamped distance: one load per score, no [seq, seq] bias formed. Its
gradient is the sum of dS over the pairs of each bucket, dTable[k, h] = sum_{bucket(j - i) = k} dS[h, i, j].
Along a query row the distance grows with the key, and each bucket holds one run of distances (lo_k, hi_k], so
its share of a tile row is the difference of the row's prefix sums of dS at the run's ends: the dQ kernel,
which already holds dS, adds a cumulative sum and two gathers of num_buckets columns per tile, and stores each
program's bucket sums; they are added in a fixed order (no atomics, deterministic).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import launches, targets, tuned
from ._common import (FLOAT_DTYPES, check_device, dense, dot_precision, dropout_keep, interpreter_upcast, keep_mask,
                      seed_tensor, unit_stride)

__all__ = ["varlen_attention", "varlen_attention_ref", "padded_attention", "RelativePositionBias", "window_mask",
           "relative_position_bucket", "relative_bias"]
MAX_HEAD_DIM = 128
HEAD_DIMS = (8, 16, 32, 48, 64, 80, 128)   # the widths compiled for sm_90 and tested; any 1..MAX_HEAD_DIM runs


def block_d(head_dim: int) -> int:
    """The tile width along head_dim: a power of two and at least 16 (tl.dot's smallest K). Narrower or
    non-power-of-two heads (transformers' tiny test models use 8) are zero-padded inside the kernels: the padded
    lanes load as 0, so they add nothing to q.k, and are never stored."""
    return max(16, triton.next_power_of_2(head_dim))


DOTS = True  # built on half-precision tl.dot (kernels.refusal)


def shape_refusal(head_dim: int) -> str | None:
    """Why the kernels cannot take heads of `head_dim` (kernels.refusal)."""
    return None if 1 <= head_dim <= MAX_HEAD_DIM else f"head_dim {head_dim} is not supported; the kernels take 1 " \
                                                          f"to {MAX_HEAD_DIM}"


LOG2E = 1.4426950408889634


@triton.jit
def _sequence(CuSeqlens, b, total_tokens):
    """(first token, length) of sequence b, cut to the tokens [0, total_tokens) whatever cu_seqlens holds: every
    load and store of the kernels then stays inside the buffers, even for cu_seqlens that `validate` would refuse
    (two clamps per program; nothing per element)."""
    start = tl.minimum(tl.maximum(tl.load(CuSeqlens + b), 0), total_tokens)
    end = tl.minimum(tl.maximum(tl.load(CuSeqlens + b + 1), start), total_tokens)
    return start, end - start


@triton.jit
def _key_span(KeyStart, KeyCount, b, seq_len, HAS_KEY_SPAN: tl.constexpr):
    """[lo, hi): the positions of sequence b that are keys, cut to the sequence: the KeyCount[b] positions from
    KeyStart[b] (`seqused_k`, `key_start`), or every position without a key span."""
    if HAS_KEY_SPAN:
        lo = tl.minimum(tl.maximum(tl.load(KeyStart + b), 0), seq_len)
        return lo, tl.minimum(lo + tl.maximum(tl.load(KeyCount + b), 0), seq_len)
    else:
        return 0, seq_len


@triton.jit
def _key_tiles(lo, hi, k_lo, k_hi, BLOCK: tl.constexpr, HAS_KEY_SPAN: tl.constexpr):
    """The walked key range [lo, hi) narrowed to the key span [k_lo, k_hi), its start still a multiple of BLOCK
    (the tiles, and the dropout mask's columns, stay those of a walk from 0)."""
    if HAS_KEY_SPAN:
        return tl.maximum(lo, k_lo // BLOCK * BLOCK), tl.minimum(hi, k_hi)
    else:
        return lo, hi


@triton.jit
def _is_key(ok, pos, k_lo, k_hi, HAS_KEY_SPAN: tl.constexpr):
    """`ok` narrowed to the positions inside the key span."""
    if HAS_KEY_SPAN:
        return ok & (pos >= k_lo) & (pos < k_hi)
    else:
        return ok


@triton.jit
def _span(seq_start, seq_len, start, BLOCK: tl.constexpr):
    """Positions start .. start + BLOCK - 1 of a sequence: (whether each lies inside it, its packed token row
    as int64)."""
    offs = start + tl.arange(0, BLOCK)
    return offs < seq_len, (seq_start + offs).to(tl.int64)


@triton.jit
def _tile_mask(ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """[rows, BLOCK_D] mask of a tile: its rows where `ok`, and only the real head_dim lanes when the tile is
    wider than the head (without padding the lanes need no mask, and get none)."""
    if HEAD_DIM == BLOCK_D:
        return ok[:, None]
    else:
        return ok[:, None] & (offs_d[None, :] < HEAD_DIM)


@triton.jit
def _tile(Ptr, rows, ok, stride_t, head_offset, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The [rows, BLOCK_D] tile of one head of a [T, H, D] tensor; zeros where `ok` is False and past D."""
    return tl.load(Ptr + rows[:, None] * stride_t + head_offset + offs_d[None, :],
                   mask=_tile_mask(ok, offs_d, HEAD_DIM, BLOCK_D), other=0.0)


@triton.jit
def _tile_t(Ptr, rows, ok, stride_t, head_offset, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The same tile transposed, [BLOCK_D, rows]: the right-hand operand of q @ k^T and dO @ v^T."""
    return tl.load(Ptr + rows[None, :] * stride_t + head_offset + offs_d[:, None],
                   mask=tl.trans(_tile_mask(ok, offs_d, HEAD_DIM, BLOCK_D)), other=0.0)


@triton.jit
def _store_tile(Ptr, rows, ok, stride_t, head_offset, offs_d, value, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Writes `value` (float32) as the [rows, head_dim] tile of one head of a [T, H, D] tensor where `ok`."""
    tl.store(Ptr + rows[:, None] * stride_t + head_offset + offs_d[None, :], value.to(Ptr.dtype.element_ty),
             mask=_tile_mask(ok, offs_d, HEAD_DIM, BLOCK_D))


@triton.jit
def _row_stats(LSE, Delta, h, total_tokens, q_rows, ok):
    """The backward's per-query statistics of head h: (log2-sum-exp2, delta), each [rows] float32."""
    lse = tl.load(LSE + h * total_tokens + q_rows, mask=ok, other=0.0)
    return lse, tl.load(Delta + h * total_tokens + q_rows, mask=ok, other=0.0)


@triton.jit
def _mask_rows(h, total_tokens, q_rows):
    """Rows [BLOCK_M, 1] of the logical [H * T, max_seqlen] dropout mask: query token t of head h owns row
    h * T + t, with its sequence's keys in order along it."""
    return (h * total_tokens + q_rows)[:, None]


@triton.jit
def _reach(first, last, seq_len, before, after, BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[lo, hi): the positions of a sequence that the positions first .. last can see, with a window reaching
    `before` positions back and `after` ahead (the whole sequence without one); lo rounded down to a multiple of
    BLOCK, so that the walked blocks are the same tiles as without a window. Tiles outside are never visited."""
    if HAS_WINDOW:
        return tl.maximum(first - before, 0) // BLOCK * BLOCK, tl.minimum(last + after + 1, seq_len)
    else:
        return 0, seq_len


@triton.jit
def _in_window(key_pos, query_pos, window_left, window_right):
    """Whether key and query (broadcast against each other) see each other: query - left <= key <= query + right."""
    d = key_pos - query_pos
    return (d >= -window_left) & (d <= window_right)


@triton.jit
def _seed(Seed, HAS_DROPOUT: tl.constexpr):
    """The Philox seed, read once per program from its device tensor (0, unread, without dropout)."""
    if HAS_DROPOUT:
        return tl.load(Seed)
    else:
        return 0


@triton.jit
def _scores(q, kt, qk_scale, DOT_PRECISION: tl.constexpr):
    return tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale


@triton.jit
def _bias_tile(Bias, h, key_pos, query_pos, max_distance):
    """The relative-position bias of head h at each (key, query) pair of a tile, from their positions in their
    sequence (broadcast against each other): Bias[h, clamp(key - query) + max_distance], every address inside
    the [H, 2 * max_distance + 1] table (the bucket rule is constant past max_distance)."""
    d = tl.minimum(tl.maximum(key_pos - query_pos, -max_distance), max_distance)
    return tl.load(Bias + h * (2 * max_distance + 1) + max_distance + d)


@triton.jit
def _bucket_sums(ds, key_offset, hi, lo, BLOCK_N: tl.constexpr):
    """[BUCKETS] sums of a [BLOCK_M, BLOCK_N] tile of dS over the pairs whose distance key - query lies in each
    bucket's (lo, hi]. Along a query row the distance grows with the key, so a bucket's keys are a run: the
    difference of the row's prefix sums at the run's two ends (key_offset [BLOCK_M]: the first key's position
    minus the query's, so the last key at distance t is column t - key_offset). Deterministic, no atomics."""
    prefix = tl.cumsum(ds, axis=1)
    return tl.sum(_prefix_at(prefix, hi[None, :] - key_offset[:, None], BLOCK_N)
                  - _prefix_at(prefix, lo[None, :] - key_offset[:, None], BLOCK_N), axis=0)


@triton.jit
def _prefix_at(prefix, col, BLOCK_N: tl.constexpr):
    """prefix[row, col] for [rows, BUCKETS] columns: 0 before the tile, the row's total past it."""
    got = tl.gather(prefix, tl.minimum(tl.maximum(col, 0), BLOCK_N - 1), axis=1)
    return tl.where(col >= 0, got, 0.0)


@triton.jit
def _attention_fwd_kernel(
    Q, K, V,       # [T, H, D]
    O,             # [T, H, D] output
    LSE,           # [H, T] float32 log2-sum-exp2 of the scaled scores of each query row
    CuSeqlens,     # [B + 1] int32
    Seed,          # [1] int64 Philox seed (unused unless HAS_DROPOUT)
    Bias,          # [H, 2 * max_distance + 1] float32 bias by key - query distance, times log2(e) (HAS_BIAS)
    KeyStart, KeyCount,  # [B] int32: each sequence's keys are KeyCount positions from KeyStart (HAS_KEY_SPAN)
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h,
    total_tokens, max_seqlen, qk_scale, p_drop, max_distance, kv_group, window_left, window_right,
    HAS_DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KEY_SPAN: tl.constexpr,
):
    start_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_start, seq_len = _sequence(CuSeqlens, b, total_tokens)
    if start_m * BLOCK_M >= seq_len:
        return
    h_kv = h // kv_group  # K and V: [T, H / kv_group, D], one head per group of query heads
    offs_d = tl.arange(0, BLOCK_D)
    seed = _seed(Seed, HAS_DROPOUT)
    m_ok, q_rows = _span(seq_start, seq_len, start_m * BLOCK_M, BLOCK_M)
    q = _tile(Q, q_rows, m_ok, stride_q_t, h * stride_q_h, offs_d, HEAD_DIM, BLOCK_D)
    q_pos = start_m * BLOCK_M + tl.arange(0, BLOCK_M)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    k_lo, k_hi = _key_span(KeyStart, KeyCount, b, seq_len, HAS_KEY_SPAN)
    lo, hi = _reach(start_m * BLOCK_M, start_m * BLOCK_M + BLOCK_M - 1, seq_len, window_left, window_right, BLOCK_N,
                    HAS_WINDOW)
    lo, hi = _key_tiles(lo, hi, k_lo, k_hi, BLOCK_N, HAS_KEY_SPAN)
    for start_n in range(lo, hi, BLOCK_N):
        n_ok, k_rows = _span(seq_start, seq_len, start_n, BLOCK_N)
        k_pos = start_n + tl.arange(0, BLOCK_N)
        n_ok = _is_key(n_ok, k_pos, k_lo, k_hi, HAS_KEY_SPAN)
        kt = _tile_t(K, k_rows, n_ok, stride_k_t, h_kv * stride_k_h, offs_d, HEAD_DIM, BLOCK_D)
        s = _scores(q, kt, qk_scale, DOT_PRECISION)
        if HAS_BIAS:
            s += _bias_tile(Bias, h, k_pos[None, :], q_pos[:, None], max_distance)
        seen = n_ok[None, :]
        if HAS_WINDOW:
            seen = seen & _in_window(k_pos[None, :], q_pos[:, None], window_left, window_right)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if HAS_WINDOW:  # a row may see no key of this tile, nor of any before: its max is still -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, _mask_rows(h, total_tokens, q_rows), max_seqlen, start_n, p_drop,
                                BLOCK_N)
            p = tl.where(keep, p, 0.0)
        v = _tile(V, k_rows, n_ok, stride_v_t, h_kv * stride_v_h, offs_d, HEAD_DIM, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if HAS_WINDOW or HAS_KEY_SPAN:  # a row may see no key at all (a window, an empty key span): its output 0
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    if HAS_DROPOUT:
        out = out / (1.0 - p_drop)
    _store_tile(O, q_rows, m_ok, stride_o_t, h * stride_o_h, offs_d, out, HEAD_DIM, BLOCK_D)
    tl.store(LSE + h * total_tokens + q_rows, m_i + tl.math.log2(l_i), mask=m_ok)


@triton.jit
def _attention_bwd_preprocess_kernel(
    O, DO,          # [T, H, D]
    Delta,          # [H, T] float32: rowsum(dO * O)
    stride_o_t, stride_o_h, stride_do_t, stride_do_h, total_tokens,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < total_tokens
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    o = _tile(O, rows64, ok, stride_o_t, h * stride_o_h, offs_d, HEAD_DIM, BLOCK_D)
    do = _tile(DO, rows64, ok, stride_do_t, h * stride_do_h, offs_d, HEAD_DIM, BLOCK_D)
    tl.store(Delta + h * total_tokens + rows64, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=ok)


@triton.jit
def _dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, Bias, seed, h, start_m, k_pos, n_ok, seq_start, seq_len, offs_d,
               stride_q_t, stride_q_h, stride_do_t, stride_do_h, total_tokens, max_seqlen, qk_scale, p_drop,
               max_distance, window_left, window_right, start_n,
               HAS_DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """One query block of head h against the owned key block: (dk, dv) with its shares added."""
    m_ok, q_rows = _span(seq_start, seq_len, start_m, BLOCK_M)
    qt = _tile_t(Q, q_rows, m_ok, stride_q_t, h * stride_q_h, offs_d, HEAD_DIM, BLOCK_D)
    do = _tile(DO, q_rows, m_ok, stride_do_t, h * stride_do_h, offs_d, HEAD_DIM, BLOCK_D)
    lse, delta = _row_stats(LSE, Delta, h, total_tokens, q_rows, m_ok)
    st = _scores(k, qt, qk_scale, DOT_PRECISION)
    q_pos = start_m + tl.arange(0, BLOCK_M)
    if HAS_BIAS:
        st += _bias_tile(Bias, h, k_pos[:, None], q_pos[None, :], max_distance)
    pt = tl.math.exp2(st - lse[None, :])
    seen = n_ok[:, None] & m_ok[None, :]
    if HAS_WINDOW:
        seen = seen & _in_window(k_pos[:, None], q_pos[None, :], window_left, window_right)
    pt = tl.where(seen, pt, 0.0)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep = tl.trans(dropout_keep(seed, _mask_rows(h, total_tokens, q_rows), max_seqlen, start_n * BLOCK_N,
                                     p_drop, BLOCK_N))
        pt_dropped = tl.where(keep, pt / (1.0 - p_drop), 0.0)
        dpt = tl.where(keep, dpt / (1.0 - p_drop), 0.0)
    else:
        pt_dropped = pt
    dv += tl.dot(pt_dropped.to(do.dtype), do, input_precision=DOT_PRECISION)
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q, DO,          # [T, H, D]
    K, V,           # [T, H / kv_group, D]
    DK, DV,         # [T, H / kv_group, D] outputs
    LSE, Delta,     # [H, T] float32
    CuSeqlens,      # [B + 1] int32
    Seed,           # [1] int64, as in the forward
    Bias,           # [H, 2 * max_distance + 1] float32, as in the forward (HAS_BIAS)
    KeyStart, KeyCount,  # [B] int32, as in the forward (HAS_KEY_SPAN)
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_do_t, stride_do_h,
    stride_dk_t, stride_dk_h, stride_dv_t, stride_dv_h,
    total_tokens, max_seqlen, qk_scale, softmax_scale, p_drop, max_distance, kv_group, window_left, window_right,
    HAS_DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUPED: tl.constexpr, HAS_KEY_SPAN: tl.constexpr,
):
    start_n, b, h_kv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_start, seq_len = _sequence(CuSeqlens, b, total_tokens)
    k_lo, k_hi = _key_span(KeyStart, KeyCount, b, seq_len, HAS_KEY_SPAN)
    # No key of the sequence in the owned block: its dK and dV stay 0 (keys outside the span are never read)
    if (start_n * BLOCK_N >= k_hi) | (start_n * BLOCK_N + BLOCK_N <= k_lo):
        return
    offs_d = tl.arange(0, BLOCK_D)
    seed = _seed(Seed, HAS_DROPOUT)
    n_ok, k_rows = _span(seq_start, seq_len, start_n * BLOCK_N, BLOCK_N)
    k_pos = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = _is_key(n_ok, k_pos, k_lo, k_hi, HAS_KEY_SPAN)
    # Tiles transposed to [keys, queries], so that the owned key block is the M side of every dot (tensor-core
    # instructions want M >= 64; the walked query block is narrower): S^T = K Q^T, dP^T = V dO^T.
    k = _tile(K, k_rows, n_ok, stride_k_t, h_kv * stride_k_h, offs_d, HEAD_DIM, BLOCK_D)
    v = _tile(V, k_rows, n_ok, stride_v_t, h_kv * stride_v_h, offs_d, HEAD_DIM, BLOCK_D)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # The queries that see this key block: keys reach back `right` queries and ahead `left`.
    lo, hi = _reach(start_n * BLOCK_N, start_n * BLOCK_N + BLOCK_N - 1, seq_len, window_right, window_left, BLOCK_M,
                    HAS_WINDOW)
    if GROUPED:  # every query head of the group in turn, summed here (no atomics), as one flat loop over
        # (head, query block), which software-pipelines as the plain loop does (a nested loop spilled on sm_80)
        blocks = tl.cdiv(hi - lo, BLOCK_M)
        for step in range(0, kv_group * blocks):
            dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, Bias, seed, h_kv * kv_group + step // blocks,
                                lo + (step % blocks) * BLOCK_M, k_pos, n_ok, seq_start, seq_len, offs_d,
                                stride_q_t, stride_q_h, stride_do_t, stride_do_h, total_tokens, max_seqlen,
                                qk_scale, p_drop, max_distance, window_left, window_right, start_n,
                                HAS_DROPOUT, HAS_BIAS, HAS_WINDOW, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_D,
                                HEAD_DIM)
    else:
        for start_m in range(lo, hi, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, Bias, seed, h_kv, start_m, k_pos, n_ok, seq_start,
                                seq_len, offs_d, stride_q_t, stride_q_h, stride_do_t, stride_do_h, total_tokens,
                                max_seqlen, qk_scale, p_drop, max_distance, window_left, window_right, start_n,
                                HAS_DROPOUT, HAS_BIAS, HAS_WINDOW, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_D,
                                HEAD_DIM)
    dk *= softmax_scale
    _store_tile(DK, k_rows, n_ok, stride_dk_t, h_kv * stride_dk_h, offs_d, dk, HEAD_DIM, BLOCK_D)
    _store_tile(DV, k_rows, n_ok, stride_dv_t, h_kv * stride_dv_h, offs_d, dv, HEAD_DIM, BLOCK_D)


@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V, DO,    # [T, H, D]
    DQ,             # [T, H, D] output
    LSE, Delta,     # [H, T] float32
    CuSeqlens,      # [B + 1] int32
    Seed,           # [1] int64, as in the forward
    Bias,           # [H, 2 * max_distance + 1] float32, as in the forward (HAS_BIAS)
    KeyStart, KeyCount,  # [B] int32, as in the forward (HAS_KEY_SPAN)
    BucketHi, BucketLo,  # [BUCKETS] int32: each bucket's distances are (lo, hi] (BIAS_GRAD)
    DBias,          # [H, B, cdiv(max_seqlen, BLOCK_M), BUCKETS] float32 output: each program's bucket sums of
                    # dS, the table's gradient (BIAS_GRAD)
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_do_t, stride_do_h,
    stride_dq_t, stride_dq_h,
    total_tokens, max_seqlen, qk_scale, softmax_scale, p_drop, max_distance, kv_group, window_left, window_right,
    HAS_DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    BIAS_GRAD: tl.constexpr, BUCKETS: tl.constexpr, HAS_KEY_SPAN: tl.constexpr,
):
    start_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_start, seq_len = _sequence(CuSeqlens, b, total_tokens)
    if start_m * BLOCK_M >= seq_len:
        return
    h_kv = h // kv_group
    offs_d = tl.arange(0, BLOCK_D)
    seed = _seed(Seed, HAS_DROPOUT)
    m_ok, q_rows = _span(seq_start, seq_len, start_m * BLOCK_M, BLOCK_M)
    q = _tile(Q, q_rows, m_ok, stride_q_t, h * stride_q_h, offs_d, HEAD_DIM, BLOCK_D)
    do = _tile(DO, q_rows, m_ok, stride_do_t, h * stride_do_h, offs_d, HEAD_DIM, BLOCK_D)
    lse, delta = _row_stats(LSE, Delta, h, total_tokens, q_rows, m_ok)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    q_pos = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if BIAS_GRAD:
        bucket_hi = tl.load(BucketHi + tl.arange(0, BUCKETS))
        bucket_lo = tl.load(BucketLo + tl.arange(0, BUCKETS))
        dbias = tl.zeros((BUCKETS,), dtype=tl.float32)
    k_lo, k_hi = _key_span(KeyStart, KeyCount, b, seq_len, HAS_KEY_SPAN)
    lo, hi = _reach(start_m * BLOCK_M, start_m * BLOCK_M + BLOCK_M - 1, seq_len, window_left, window_right, BLOCK_N,
                    HAS_WINDOW)
    lo, hi = _key_tiles(lo, hi, k_lo, k_hi, BLOCK_N, HAS_KEY_SPAN)
    for start_n in range(lo, hi, BLOCK_N):
        n_ok, k_rows = _span(seq_start, seq_len, start_n, BLOCK_N)
        k_pos = start_n + tl.arange(0, BLOCK_N)
        n_ok = _is_key(n_ok, k_pos, k_lo, k_hi, HAS_KEY_SPAN)
        kt = _tile_t(K, k_rows, n_ok, stride_k_t, h_kv * stride_k_h, offs_d, HEAD_DIM, BLOCK_D)
        vt = _tile_t(V, k_rows, n_ok, stride_v_t, h_kv * stride_v_h, offs_d, HEAD_DIM, BLOCK_D)
        s = _scores(q, kt, qk_scale, DOT_PRECISION)
        if HAS_BIAS:
            s += _bias_tile(Bias, h, k_pos[None, :], q_pos[:, None], max_distance)
        p = tl.math.exp2(s - lse[:, None])
        seen = m_ok[:, None] & n_ok[None, :]
        if HAS_WINDOW:
            seen = seen & _in_window(k_pos[None, :], q_pos[:, None], window_left, window_right)
        p = tl.where(seen, p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, _mask_rows(h, total_tokens, q_rows), max_seqlen, start_n, p_drop,
                                BLOCK_N)
            dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PRECISION)
        if BIAS_GRAD:
            dbias += _bucket_sums(ds, start_n - q_pos, bucket_hi, bucket_lo, BLOCK_N)
    dq *= softmax_scale
    _store_tile(DQ, q_rows, m_ok, stride_dq_t, h * stride_dq_h, offs_d, dq, HEAD_DIM, BLOCK_D)
    if BIAS_GRAD:
        slot = ((h * tl.num_programs(1) + b).to(tl.int64) * tl.num_programs(0) + start_m) * BUCKETS
        tl.store(DBias + slot + tl.arange(0, BUCKETS), dbias)


class _Launch(NamedTuple):
    BLOCK_M: int      # query rows of a tile
    BLOCK_N: int      # key rows of a tile
    num_warps: int
    num_stages: int


def _default_config(kernel: str, head_dim: int, dtype: torch.dtype, target: targets.Target | None) -> _Launch:
    """The built-in config of kernel "fwd", "dkdv", "dq" (or the fixed "preprocess") on `target` (None: the
    interpreter, whose small tiles let short test sequences span several blocks). On a GPU, tiles made for
    sm_90: a program owns a wide block (128 queries in "fwd" and "dq", 128 keys in "dkdv"), the M side of its
    tensor-core dots, and walks the other side in narrower ones; float32 uses exact products on the CUDA cores,
    whose accumulators need much smaller tiles. Where these spill or overflow shared memory on another family,
    that family's table (kernels/configs/<name>.json, compile-checked by bench.tune --compile-only) replaces
    them; tests/compile_gpus.py checks what each family ends up with."""
    if kernel == "preprocess":
        # A row sum of o * do, memory-bound: 16 elements a thread (on 4 warps ptxas spills on sm_100 in bf16).
        return _Launch(64, 64, 8, 1)
    if target is None:  # owned blocks narrower than walked ones: a grid sized by the wrong block misses rows
        return _Launch(*{"fwd": (16, 16, 4, 1), "dkdv": (32, 16, 4, 1), "dq": (16, 32, 4, 1)}[kernel])
    if dtype == torch.float32:
        return _Launch(16, 16, 4, 1)
    if kernel == "fwd":
        return _Launch(128, 64, 8, 3) if head_dim <= 64 else _Launch(128, 64, 8, 2)
    if kernel == "dkdv":
        return _Launch(32, 128, 8, 2) if head_dim <= 64 else _Launch(16, 128, 8, 2)
    return _Launch(128, 32, 8, 2)


def _config(kernel: str, head_dim: int, dtype: torch.dtype, target: targets.Target | None,
            max_seqlen: int | None) -> _Launch:
    """The launch config on `target`: its table's entry (kernels/tuned.py), else the default. Dropout draws its
    bits in groups of 8 keys, so every block is at least 16 wide."""
    default = _default_config(kernel, head_dim, dtype, target)
    if kernel == "preprocess":
        return default
    walked, owned = ("BLOCK_M", "BLOCK_N") if kernel == "dkdv" else ("BLOCK_N", "BLOCK_M")
    accumulators = 2 if kernel == "dkdv" else 1  # dk and dv

    def need(c: _Launch, t: targets.Target) -> tuned.Need:
        """Two tiles of the walked side per pipeline stage in shared memory; a thread's share of the scores
        and of its accumulators."""
        size = getattr(c, walked) * head_dim * dtype.itemsize * 2 * max(1, c.num_stages - 1)
        return tuned.tile_need(c.BLOCK_M * c.BLOCK_N + accumulators * getattr(c, owned) * head_dim, c, t, size)
    return tuned.pick(f"attention.{kernel}", default, target, dtype, head_dim, max_seqlen, need=need)


def _bias_config(kernel: str, c: _Launch, head_dim: int, target: targets.Target | None) -> _Launch:
    """The config of a launch with the relative-position bias, from the one without: the bias tile (float32,
    one per score) is one more buffer per pipeline stage and one more score-sized tile of registers, so the
    forward pipelines at most 2 stages (and, for heads over 64, walks narrower key blocks where shared memory is
    small) and the backward's widest tiles take half the queries (dK/dV's, unpipelined, on the registers the
    prefetch held). float32 and the interpreter's tiles are small already."""
    if target is None or c.BLOCK_M * c.BLOCK_N <= 256:
        return c
    if kernel == "fwd":
        # A wavefront of 64 holds twice the scores per lane group: half the queries there.
        c = c._replace(num_stages=min(c.num_stages, 2),
                       BLOCK_M=max(16, c.BLOCK_M // 2) if target.warp_size == 64 else c.BLOCK_M)
        # Wide heads' key tiles are large too: walk narrower key blocks until the bias buffers take at most a
        # third of the family's shared memory.
        def bias_buffers(c):
            return c.BLOCK_M * c.BLOCK_N * 4 * c.num_stages
        while head_dim > 64 and c.BLOCK_N > 32 and bias_buffers(c) > target.shared_bytes / 3:
            c = c._replace(BLOCK_N=c.BLOCK_N // 2)
        return c
    if kernel == "dkdv" and c.BLOCK_M * c.BLOCK_N > 2048:
        return c._replace(BLOCK_M=max(16, c.BLOCK_M // 2), num_stages=1)
    if kernel == "dq" and head_dim > 64:  # its bucket sums gather along the keys: at most 32 of them
        return c._replace(BLOCK_M=max(16, c.BLOCK_M // 2), BLOCK_N=min(c.BLOCK_N, 32))
    return c


def _launch_config(kernel: str, head_dim: int, dtype: torch.dtype, target: targets.Target | None,
                   max_seqlen: int, bias: bool, window: bool = False) -> _Launch:
    """The config of a launch: the table's or default one, narrowed for the bias's tiles, and for a window's on
    a wavefront of 64 (its masks are one more score-sized tile of registers, which spilled on gfx90a and gfx942
    at heads of 128)."""
    c = _config(kernel, head_dim, dtype, target, max_seqlen)
    if bias or (window and target is not None and target.warp_size == 64):
        return _bias_config(kernel, c, head_dim, target)
    return c


def _site(part: str, kernel, candidates=()) -> launches.LaunchSite:
    return launches.LaunchSite(f"attention.{part}", kernel,
                               lambda dtype, d, target: _default_config(part, d, dtype, target),
                               lambda dtype, d, target, seqlen=None: _config(part, d, dtype, target, seqlen),
                               candidates, needs=None if part == "preprocess" else "tensor_cores")


_FWD, _PREPROCESS, _DKDV, _DQ = launches.declare(
    _site("fwd", _attention_fwd_kernel, launches.grid(BLOCK_M=[64, 128], BLOCK_N=[32, 64, 128], num_warps=[4, 8],
                                                      num_stages=[2, 3])),
    _site("preprocess", _attention_bwd_preprocess_kernel),  # memory-bound, fixed
    _site("dkdv", _attention_bwd_dkdv_kernel, launches.grid(BLOCK_M=[16, 32, 64], BLOCK_N=[64, 128],
                                                            num_warps=[4, 8], num_stages=[1, 2])),
    _site("dq", _attention_bwd_dq_kernel, launches.grid(BLOCK_M=[64, 128], BLOCK_N=[16, 32, 64], num_warps=[4, 8],
                                                        num_stages=[1, 2])))


class RelativePositionBias(NamedTuple):
    """A bucketed relative-position bias (T5's bidirectional rule, which MPNet uses): the score of query i and
    key j of a sequence gets table[relative_position_bucket(j - i, num_buckets, max_distance), head], positions
    counted from each sequence's first token. The table's gradient is computed too."""
    table: torch.Tensor        # [num_buckets, heads], float32, float16 or bfloat16
    num_buckets: int = 32
    max_distance: int = 128


def relative_position_bucket(distance: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """The bucket (int64) of each key - query distance: half the buckets for keys after the query, half for the
    rest; within a half, distances below max_exact = num_buckets // 4 have a bucket each and longer ones share
    log-spaced buckets up to max_distance, past which all share the last. Computed in float32 with the same
    operations, in the same order, as transformers' MPNet and T5 code, so a boundary distance falls into the
    same bucket on the same device."""
    half = num_buckets // 2
    max_exact = half // 2
    n = -distance
    bucket = (n < 0).to(torch.long) * half
    n = torch.abs(n)
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (half - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, half - 1))
    return bucket + torch.where(n < max_exact, n, large)


def _check_bias(op, bias, heads, device):
    if not isinstance(bias, RelativePositionBias):
        raise TypeError(f"{op}: position_bias must be a kernels.RelativePositionBias, got {type(bias).__name__}")
    nb, md, table = bias.num_buckets, bias.max_distance, bias.table
    if not isinstance(nb, int) or nb < 4 or nb % 2:
        raise ValueError(f"{op}: num_buckets must be an even int of at least 4 (half for each direction, and "
                         f"num_buckets // 4 >= 1 exact distances), got {nb!r}")
    if not isinstance(md, int) or not nb // 4 < md < 2 ** 24:
        raise ValueError(f"{op}: max_distance must be an int above num_buckets // 4 = {nb // 4} (and below 2^24), "
                         f"got {md!r}")
    if not isinstance(table, torch.Tensor) or tuple(table.shape) != (nb, heads):
        got = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"{op}: position_bias.table must be [num_buckets, heads] = {[nb, heads]}, got {got}")
    if table.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: position_bias.table must be float16, bfloat16 or float32, got {table.dtype}")
    if table.device != device:
        raise ValueError(f"{op}: position_bias.table is on {table.device}, q on {device}")


def _check(q, k, v, cu_seqlens, max_seqlen, dropout_p, validate, position_bias=None, window_size=(-1, -1)):
    """Every input's layout and value; returns the window as (left, right)."""
    op = "varlen_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{op}: {name} must be [total_tokens, heads, head_dim], "
                             f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    if k.shape != v.shape or k.shape[::2] != q.shape[::2]:
        raise ValueError(f"{op}: q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (k and "
                         "v must match, and share q's token count and head_dim)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{op}: q has {q.shape[1]} heads, which is not a multiple of k and v's {k.shape[1]} "
                         "(grouped-query attention)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if why := shape_refusal(q.shape[2]):
        raise ValueError(f"{op}: {why}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 1:
        raise TypeError(f"{op}: cu_seqlens must be a 1-D int32 tensor [batch + 1]")
    if cu_seqlens.numel() - 1 > 65535:
        raise ValueError(f"{op}: at most 65535 sequences per call, got {cu_seqlens.numel() - 1}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p}")
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else ()
    if len(window) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window):
        raise ValueError(f"{op}: window_size must be (left, right), ints >= 0 or -1 (unbounded), got {window_size!r}")
    check_device(op, q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    if position_bias is not None:
        _check_bias(op, position_bias, q.shape[1], q.device)
    targets.check(op, q.dtype, q.device, dots=DOTS)
    if validate:
        _validate(op, cu_seqlens, q.shape[0], max_seqlen)
    return window


def _validate(op, cu_seqlens, total, max_seqlen):
    """cu_seqlens' values (one sync): from 0, non-decreasing, within the tokens, no sequence over max_seqlen."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    first, last = cu_seqlens[0], cu_seqlens[-1]
    longest = lens.max() if lens.numel() else first * 0
    first, last, decreasing, longest = torch.stack([first, last, (lens < 0).sum(), longest]).tolist()
    if first != 0:
        raise ValueError(f"{op}: cu_seqlens must start at 0, starts at {first}")
    if decreasing:
        raise ValueError(f"{op}: cu_seqlens must be non-decreasing")
    if last > total:
        raise ValueError(f"{op}: cu_seqlens ends at {last} but there are only {total} tokens (total_tokens)")
    if longest > max_seqlen:
        raise ValueError(f"{op}: max_seqlen={max_seqlen} but a sequence has {longest} tokens")


_FAR = 2 ** 30  # a distance past every sequence (sequences are shorter than 2^30 tokens)


@functools.lru_cache(maxsize=64)
def _distance_buckets(num_buckets: int, max_distance: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(distances -max_distance .. max_distance, the bucket of each): the rule evaluated once per rule and
    device (every longer distance has its end's bucket)."""
    d = torch.arange(-max_distance, max_distance + 1, device=device)
    return d, relative_position_bucket(d, num_buckets, max_distance)


def _bias_by_distance(table: torch.Tensor, max_distance: int) -> torch.Tensor:
    """[H, 2 * max_distance + 1] float32: head h's bias at each distance -max_distance .. max_distance, times
    log2(e), as the kernels' scores are."""
    _, buckets = _distance_buckets(table.shape[0], max_distance, table.device)
    return (table.float()[buckets] * LOG2E).t().contiguous()


@functools.lru_cache(maxsize=64)
def _bucket_bounds(num_buckets: int, max_distance: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo), int32 [next power of two of num_buckets]: bucket k holds the distances in (lo[k], hi[k]] (each
    bucket's distances are one run, the rule being monotone on each side of 0); the end buckets reach +-_FAR;
    an empty bucket, and the padding, get (0, 0]."""
    d, b = _distance_buckets(num_buckets, max_distance, device)
    hi = torch.full((num_buckets,), -_FAR, device=device).scatter_reduce(0, b, d, "amax")
    lo = torch.full((num_buckets,), _FAR, device=device).scatter_reduce(0, b, d, "amin") - 1
    hi.scatter_(0, b[-1:], _FAR)
    lo.scatter_(0, b[:1], -_FAR)
    empty = hi == -_FAR
    size = triton.next_power_of_2(num_buckets)
    hi, lo = (F.pad(torch.where(empty, 0, t), (0, size - num_buckets)).to(torch.int32) for t in (hi, lo))
    return hi, lo


def _window(left: int, right: int, max_seqlen: int) -> tuple[int, int]:
    """The window's reach on each side as the kernels take it: an unbounded side (-1), or one past every
    sequence, reaches max_seqlen (so the window is (max_seqlen, max_seqlen) exactly when it cuts nothing)."""
    return tuple(max_seqlen if w < 0 else min(w, max_seqlen) for w in (left, right))


def row_deltas(o: torch.Tensor, do: torch.Tensor, target: targets.Target | None, max_seqlen: int) -> torch.Tensor:
    """delta = rowsum(dO * O), [H, T] float32, for o and do [T, H, D] with unit stride along D: the backward's
    first step, shared by the attention ops of this package."""
    total, heads, dim = o.shape
    delta = torch.empty((heads, total), dtype=torch.float32, device=o.device)
    pre = _config("preprocess", dim, o.dtype, target, max_seqlen)
    _PREPROCESS.launch((triton.cdiv(total, pre.BLOCK_M), heads),
        o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), total, BLOCK_M=pre.BLOCK_M,
        BLOCK_D=block_d(dim), HEAD_DIM=dim, num_warps=pre.num_warps, num_stages=pre.num_stages)
    return delta


@torch.library.custom_op("bertfuse::varlen_attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                   dropout_p: float, softmax_scale: float, seed: torch.Tensor | None,
                   bias_table: torch.Tensor | None = None, max_distance: int = 0, window_left: int = -1,
                   window_right: int = -1, key_start: torch.Tensor | None = None,
                   seqused_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, D], lse [H, T] float32) for q [T, H, D] and k, v [T, H / group, D] with unit stride along D;
    bias_table [num_buckets, H] (None: no bias) by the bucket rule with max_distance; a window of
    (window_left, window_right) positions around each query (-1: unbounded on that side); each sequence's keys
    the seqused_k positions from key_start (int32 [B] both, or both None: every position)."""
    dtype = q.dtype
    q, k, v = interpreter_upcast(q, k, v)
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    # Zeros, not empty: tokens past cu_seqlens[-1] (the filler of a packed batch) belong to no sequence and are
    # never written; they must stay finite, or 0 * NaN poisons the weight gradients. Their lse is 0 too: a defined
    # value (garbage there made results differ from call to call).
    o = torch.zeros_like(q)
    lse = torch.zeros((heads, total), dtype=torch.float32, device=q.device)
    bias = None if bias_table is None else _bias_by_distance(bias_table, max_distance)
    window = _window(window_left, window_right, max_seqlen)
    block_m, block_n, warps, stages = _launch_config("fwd", dim, q.dtype, targets.of(q.device), max_seqlen,
                                                     bias is not None, window != (max_seqlen, max_seqlen))
    if total and batch and max_seqlen:
        _FWD.launch((triton.cdiv(max_seqlen, block_m), batch, heads),
            q, k, v, o, lse, cu_seqlens, seed, bias, key_start, seqused_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
            total, max_seqlen, softmax_scale * LOG2E, dropout_p, max_distance, heads // k.shape[1], *window,
            HAS_DROPOUT=dropout_p > 0, HAS_BIAS=bias is not None, HAS_WINDOW=window != (max_seqlen, max_seqlen),
            DOT_PRECISION=dot_precision(q.dtype),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d(dim), HEAD_DIM=dim, num_warps=warps,
            num_stages=stages, HAS_KEY_SPAN=seqused_k is not None)
    return o.to(dtype), lse


@_attention_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed, bias_table=None, max_distance=0,
      window_left=-1, window_right=-1, key_start=None, seqused_k=None):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("bertfuse::varlen_attention_bwd", mutates_args=())
def _attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float,
                   softmax_scale: float, seed: torch.Tensor | None, bias_table: torch.Tensor | None = None,
                   max_distance: int = 0, bias_grad: bool = False, window_left: int = -1, window_right: int = -1,
                   key_start: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dtable); zero at filler tokens and at keys outside their sequence's key span; dtable
    [num_buckets, H] in the table's dtype where bias_grad, else empty."""
    dtype = q.dtype
    do, q, k, v, o = interpreter_upcast(unit_stride(do), q, k, v, o)
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dtable = q.new_zeros(0) if not bias_grad else torch.zeros_like(bias_table)
    if not (total and batch and max_seqlen):
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), dtable
    target = targets.of(q.device)
    delta = row_deltas(o, do, target, max_seqlen)
    bias = None if bias_table is None else _bias_by_distance(bias_table, max_distance)
    window = _window(window_left, window_right, max_seqlen)
    flags = dict(HAS_DROPOUT=dropout_p > 0, HAS_BIAS=bias is not None, HAS_WINDOW=window != (max_seqlen, max_seqlen),
                 DOT_PRECISION=dot_precision(q.dtype), BLOCK_D=block_d(dim), HEAD_DIM=dim,
                 HAS_KEY_SPAN=seqused_k is not None)

    def launch(kernel: str):
        block_m, block_n, warps, stages = _launch_config(kernel, dim, q.dtype, target, max_seqlen, bias is not None,
                                                         flags["HAS_WINDOW"])
        owned = block_n if kernel == "dkdv" else block_m
        grid = (triton.cdiv(max_seqlen, owned), batch, k.shape[1] if kernel == "dkdv" else heads)
        return grid, dict(flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)

    scalars = (total, max_seqlen, softmax_scale * LOG2E, softmax_scale, dropout_p, max_distance, heads // k.shape[1],
               *window)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               do.stride(0), do.stride(1))
    grid, meta = launch("dkdv")
    _DKDV.launch(grid,
        q, do, k, v, dk, dv, lse, delta, cu_seqlens, seed, bias, key_start, seqused_k, *strides,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *scalars, GROUPED=k.shape[1] != heads, **meta)
    grid, meta = launch("dq")
    hi = lo = sums = None
    buckets = 1
    if bias_grad:
        hi, lo = _bucket_bounds(bias_table.shape[0], max_distance, q.device)
        buckets = hi.numel()
        sums = torch.zeros((heads, batch, grid[0], buckets), dtype=torch.float32, device=q.device)
    _DQ.launch(grid,
        q, k, v, do, dq, lse, delta, cu_seqlens, seed, bias, key_start, seqused_k, hi, lo, sums, *strides,
        dq.stride(0), dq.stride(1),
        *scalars, BIAS_GRAD=bias_grad, BUCKETS=buckets, **meta)
    if bias_grad:  # per-program sums, added in a fixed order: deterministic; laid out as the table (the fake's)
        dtable = torch.empty_like(bias_table).copy_(sums.sum((1, 2))[:, :bias_table.shape[0]].t())
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), dtable


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed, bias_table=None,
      max_distance=0, bias_grad=False, window_left=-1, window_right=-1, key_start=None, seqused_k=None):
    dtable = torch.empty_like(bias_table) if bias_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dtable


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed, bias_table, max_distance, window_left,
     window_right, key_start, seqused_k) = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens, seed, bias_table, key_start, seqused_k)
    ctx.max_seqlen, ctx.dropout_p, ctx.softmax_scale = max_seqlen, dropout_p, softmax_scale
    ctx.max_distance, ctx.window = max_distance, (window_left, window_right)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_seqlens, seed, bias_table, key_start, seqused_k = ctx.saved_tensors
    bias_grad = bias_table is not None and ctx.needs_input_grad[8]
    dq, dk, dv, dtable = _attention_bwd(do, q, k, v, o, lse, cu_seqlens, ctx.max_seqlen, ctx.dropout_p,
                                        ctx.softmax_scale, seed, bias_table, ctx.max_distance, bias_grad, *ctx.window,
                                        key_start, seqused_k)
    return dq, dk, dv, None, None, None, None, None, dtable if bias_grad else None, None, None, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     dropout_p: float = 0.0, softmax_scale: float | None = None,
                     seed: int | torch.Tensor | None = None, validate: bool = True,
                     position_bias: RelativePositionBias | None = None,
                     window_size: tuple[int, int] = (-1, -1), seqused_k: torch.Tensor | None = None,
                     key_start: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ bias]) v within each packed sequence; returns a tensor of q's shape.

    q: [total_tokens, heads, head_dim] (head_dim 1 to 128; see block_d); k, v: [total_tokens, kv_heads,
    head_dim], kv_heads dividing heads (grouped-query attention: query head h reads k/v head h // (heads /
    kv_heads), k and v never repeated in memory); cu_seqlens: int32 [batch + 1]; max_seqlen: the longest
    sequence. window_size = (left, right): query i of a sequence sees the keys i - left .. i + right only
    (sliding-window, local attention; -1: unbounded on that side, the default), and the kernels skip the tiles
    outside the window, forward and backward. Tokens at or past cu_seqlens[-1] (the filler of a packed batch of fixed
    size) belong to no sequence: their output and gradients are zero, whatever they hold. Dropout on the
    attention probabilities uses Philox with `seed` (an int or a one-element device tensor; default: drawn by
    torch's generator of q's device, on the device). position_bias (a RelativePositionBias) adds a bucketed
    relative-position bias to every score inside the kernels, forward and backward (its table gets a gradient);
    no [seq, seq] bias is formed. `validate=False` skips the checks of cu_seqlens' values, which need a device
    sync; pass it only for cu_seqlens built by trusted code (the model does). seqused_k (int32 [batch], as
    FlashAttention-3's): every token of sequence b is a query, but only its seqused_k[b] tokens from position
    key_start[b] (int32 [batch]; default 0: the first ones) are keys, so padded positions kept as queries attend
    to the real tokens only (a Hugging Face model's padded positions, which heads may read); positions for the
    window and the bias still count from the sequence's first token. A sequence with no key (seqused_k 0) gives
    its queries an output of 0 and no gradient; keys outside a span get none either. Spans are cut to their
    sequence inside the kernels (validate checks they lie inside it). Runs as the custom ops
    bertfuse::varlen_attention_fwd / _bwd, which torch.compile traces through. Unvalidated cu_seqlens never make
    the kernels read or write outside q, k, v and the output: each sequence is cut to the tokens [0,
    total_tokens) inside the kernels.
    """
    left, right = _check(q, k, v, cu_seqlens, int(max_seqlen), float(dropout_p), validate, position_bias,
                         window_size)
    key_start, seqused_k = _key_spans(cu_seqlens, seqused_k, key_start, validate)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    table, max_distance = (None, 0) if position_bias is None else (position_bias.table, position_bias.max_distance)
    out, _ = _attention_fwd(q, k, v, dense(cu_seqlens), int(max_seqlen), float(dropout_p), scale,
                            seed_tensor(seed, q.device, dropout_p > 0), table, max_distance, left, right,
                            key_start, seqused_k)
    return out


def _key_spans(cu_seqlens, seqused_k, key_start, validate: bool):
    """(key_start, seqused_k) as the kernels read them, checked: both None (every token a key), or int32 [batch]
    each (key_start zeros where not given); with `validate`, their values too (one sync): each span inside its
    sequence."""
    op = "varlen_attention"
    if seqused_k is None:
        if key_start is not None:
            raise ValueError(f"{op}: key_start describes the keys seqused_k counts: pass seqused_k with it")
        return None, None
    batch = cu_seqlens.numel() - 1
    for name, t in (("seqused_k", seqused_k), ("key_start", key_start)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32
                              or tuple(t.shape) != (batch,)):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be an int32 tensor [batch] = [{batch}], got {got}")
    key_start = torch.zeros_like(seqused_k) if key_start is None else key_start
    check_device(op, cu_seqlens=cu_seqlens, seqused_k=seqused_k, key_start=key_start)
    if validate:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        bad = ((seqused_k < 0) | (key_start < 0) | (key_start.long() + seqused_k > lens)).sum()
        if int(bad):
            raise ValueError(f"{op}: {int(bad)} key span(s) (key_start, seqused_k) reach outside their sequence")
    return dense(key_start), dense(seqused_k)


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor,
                     dropout_p: float = 0.0, softmax_scale: float | None = None,
                     seed: int | torch.Tensor | None = None, window_size: tuple[int, int] = (-1, -1)
                     ) -> torch.Tensor:
    """Attention on q [batch, heads, seq, head_dim] and k, v [batch, kv_heads, seq, head_dim] (kv_heads
    dividing heads) with a key-padding mask [batch, seq] (nonzero = keep).

    The kept tokens are packed, run through `varlen_attention`, and scattered back; padded query rows are 0.
    Any mask pattern works (right or left padding, holes): kept tokens attend to the kept tokens of their row,
    and a window_size counts positions among those kept tokens.
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[::2] != q.shape[::2]:
        raise ValueError("padded_attention: q must be [batch, heads, seq, head_dim] and k, v [batch, kv_heads, seq, "
                         f"head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, seqlen, dim = q.shape
    if tuple(attention_mask.shape) != (batch, seqlen):
        raise ValueError(f"padded_attention: attention_mask has shape {tuple(attention_mask.shape)}, "
                         f"expected {(batch, seqlen)}")
    check_device("padded_attention", q=q, attention_mask=attention_mask)
    keep = attention_mask != 0
    seqlens = keep.sum(1, dtype=torch.int32)
    index = keep.reshape(-1).nonzero().squeeze(1)  # the kept tokens, row by row (one sync: their count)
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if batch else 0

    def unpad(t):  # [batch, heads, seq, dim] -> [kept tokens, heads, dim]
        return t.transpose(1, 2).reshape(batch * seqlen, t.shape[1], dim)[index]

    out = varlen_attention(unpad(q), unpad(k), unpad(v), cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed,
                           validate=False, window_size=window_size)
    padded = out.new_zeros(batch * seqlen, heads, dim).index_put((index,), out)
    return padded.view(batch, seqlen, heads, dim).transpose(1, 2)


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         dropout_p: float = 0.0, softmax_scale: float | None = None,
                         keep: torch.Tensor | None = None,
                         position_bias: RelativePositionBias | None = None,
                         window_size: tuple[int, int] = (-1, -1), seqused_k: torch.Tensor | None = None,
                         key_start: torch.Tensor | None = None) -> torch.Tensor:
    """`varlen_attention` in plain PyTorch, for checks: each sequence's softmax(q k^T * scale + bias) v in turn,
    in the inputs' dtype, the [seq, seq] probabilities (and bias) formed, k and v repeated for grouped-query
    heads, the scores outside the window or the key span -inf. Dropout applies `keep` (bool [heads, total_tokens,
    max_seqlen], `attention_dropout_mask`'s) and needs it. Tokens past cu_seqlens[-1], and queries that see no
    key, get zeros."""
    if dropout_p > 0 and keep is None:
        raise ValueError("varlen_attention_ref: dropout needs the keep-mask (attention_dropout_mask)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    group = q.shape[1] // k.shape[1]
    bounds = [int(b) for b in cu_seqlens]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qq, kk, vv = (t[start:end].transpose(0, 1) for t in (q, k, v))
        kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
        scores = qq @ kk.transpose(-1, -2) * scale
        if position_bias is not None:
            scores = scores + relative_bias(position_bias, torch.arange(end - start, device=q.device)).to(scores)
        seen = window_mask(end - start, window_size, q.device)
        if seqused_k is not None:
            first = 0 if key_start is None else int(key_start[len(outs)])
            pos = torch.arange(end - start, device=q.device)
            seen = seen & ((pos >= first) & (pos < first + int(seqused_k[len(outs)])))[None, :]
        sees = seen.any(-1, keepdim=True)  # a query that sees no key: probabilities 0 (no NaN, forward or back)
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")).masked_fill(~sees, 0.0), dim=-1) * sees
        if dropout_p > 0:
            probs = probs * keep[:, start:end, :end - start].to(probs.dtype) / (1 - dropout_p)
        outs.append((probs @ vv).transpose(0, 1))
    return torch.cat(outs + [q.new_zeros(q.shape[0] - bounds[-1], *q.shape[1:])])


def window_mask(seqlen: int, window_size: tuple[int, int], device=None) -> torch.Tensor:
    """bool [seqlen, seqlen]: where query i (row) sees key j under window_size = (left, right), i - left <= j <=
    i + right (-1: unbounded on that side)."""
    pos = torch.arange(seqlen, device=device)
    d = pos[None, :] - pos[:, None]
    left, right = window_size
    return ((d >= -left) | (left < 0)) & ((d <= right) | (right < 0))


def relative_bias(position_bias: RelativePositionBias, positions: torch.Tensor) -> torch.Tensor:
    """The bias [..., heads, L, L] between tokens at `positions` [..., L] (query i, key j: the bucket of
    positions[j] - positions[i]), formed in full: for references and for paths without the kernels."""
    distance = positions[..., None, :] - positions[..., :, None]
    buckets = relative_position_bucket(distance, position_bias.num_buckets, position_bias.max_distance)
    return position_bias.table[buckets].movedim(-1, -3)


def attention_dropout_mask(cu_seqlens: torch.Tensor, heads: int, max_seqlen: int, dropout_p: float,
                           seed, total_tokens: int | None = None) -> torch.Tensor:
    """The keep-mask varlen_attention applies for this seed: bool [heads, total_tokens, max_seqlen], where entry
    (h, t, j) belongs to query token t and the j-th key of t's sequence. total_tokens: q's token count, filler
    included (default cu_seqlens[-1]: none). For tests."""
    total = int(cu_seqlens[-1]) if total_tokens is None else total_tokens
    keep = keep_mask(seed, heads * total, max_seqlen, dropout_p, cu_seqlens.device)
    return keep.view(heads, total, max_seqlen)

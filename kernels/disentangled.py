"""DeBERTa's disentangled attention (v2 and v3), variable-length, forward and backward, with dropout.

Sequences are packed as [total_tokens, heads, head_dim] and delimited by int32 `cu_seqlens`, as in
kernels.attention, whose tiles, masks, dropout and statistics this op shares. Beside the content score q_i . k_j
a pair (query i, key j) of a sequence gets two position terms, read from two projected tables of relative
positions [2 * span, heads, head_dim] (the model's relative embeddings through its key and query projections):
    content-to-position  q_i . Kr[r(i - j)]        position-to-content  k_j . Qr[r(i - j)]
    s_ij = (q_i . k_j + q_i . Kr[r(i - j)] + k_j . Qr[r(i - j)]) * scale,    scale = 1 / sqrt(D * (1 + terms))
where r(d) = clamp(bucket(d) + span, 0, 2 span - 1) is the table row of distance d = i - j, bucket the
log-bucket rule (identity without position_buckets). DeBERTa forms q . Kr^T and k . Qr^T for every token and
row and gathers the [L, L] terms; here no such tensor exists.

Tiles are square (BLOCK queries x BLOCK keys), so the distances of tile (m0, n0) are the 2 BLOCK - 1 values
d_min + e, d_min = m0 - n0 - (BLOCK - 1), e = (i - m0) - (j - n0) + BLOCK - 1. A tile loads the table rows of
those distances, Kr_e = Kr[r(d_min + e)] (rows repeat where buckets are shared), and forms
    C = q Kr_e^T,  c2p_ij = C[i, e(i, j)]          P = Qr_e k^T,  p2c_ij = P[e(i, j), j]
dots and register gathers, taken one half of the window (BLOCK columns e) at a time, so that one [BLOCK, BLOCK]
dot of table rows is alive at once: any bucket rule, no [T, H, 2 span] scores in memory. In float32 the dots
over head_dim (the scores' three and the backward's dO v^T) read their operands 32 lanes at a time
(_chunked_dot): on the CUDA cores a thread holds whole rows of both operands.

Forward and the softmax: as kernels.attention (base-2 scores, running max, dropout on the unnormalised
probabilities, the log-sum-exp saved). Backward, with dS = P * (dP - delta) as there:
    dq_i  = scale (sum_j dS_ij k_j + sum_j dS_ij Kr[r(i - j)])      dKr[r] = scale sum_{r(i - j) = r} dS_ij q_i
    dk_j  = scale (sum_i dS_ij q_i + sum_i dS_ij Qr[r(i - j)])      dQr[r] = scale sum_{r(i - j) = r} dS_ij k_j
In a tile the position sums are dots with dS re-indexed by distance: X[i, e] = dS[i, j(i, e)] gives
dq += X Kr_e and, summed over i, the tile's per-distance sums X^T q; Y[e, j] = dS[i(e, j), j] gives
dk += Y^T Qr_e and Y k. dq (a program per query block, walking the keys) and dk, dv (a program per key block,
walking the queries) are stored directly. The table gradients need every tile's per-distance sums: a third
kernel gives a program one block diagonal (m0 - n0 fixed: the same 2 BLOCK - 1 distances in every tile) and a
head, walks that diagonal's tiles in every sequence of its share, and keeps the sums in registers; the launcher
adds the overlapping windows of neighbouring diagonals and folds distances into table rows by one matrix
product with the 0/1 matrix of r: fixed order, no atomics, deterministic. Its partial sums take at most
twice q's size in float32.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import launches, targets, tuned
from ._common import (FLOAT_DTYPES, check_device, dense, dot_precision, dropout_keep, interpreter_upcast, seed_tensor,
                      unit_stride)
from .attention import (LOG2E, MAX_HEAD_DIM, _is_key, _key_span, _key_spans, _key_tiles, _mask_rows, _row_stats,
                        _seed, _sequence, _span, _store_tile, _tile, _tile_t, _validate, attention_dropout_mask,
                        block_d, row_deltas)

__all__ = ["disentangled_attention", "disentangled_attention_ref", "DisentangledPositions",
           "relative_position_rows", "disentangled_dropout_mask"]
DOTS = True  # built on half-precision tl.dot (kernels.refusal)


def shape_refusal(head_dim: int) -> str | None:
    """Why the kernels cannot take heads of `head_dim` (kernels.refusal)."""
    return None if 1 <= head_dim <= MAX_HEAD_DIM else f"head_dim {head_dim} is not supported; the kernels take 1 " \
                                                          f"to {MAX_HEAD_DIM}"


class DisentangledPositions(NamedTuple):
    """The relative positions of DeBERTa's attention: the projected tables and the bucket rule.

    pos_key: [2 * span, heads, head_dim], the relative embeddings through the key projection (content-to-position,
    "c2p"; None: no such term); pos_query: the same through the query projection (position-to-content, "p2c");
    span = position_buckets if position_buckets > 0 else max_relative_positions. Both get gradients."""
    pos_key: torch.Tensor | None
    pos_query: torch.Tensor | None
    position_buckets: int = -1
    max_relative_positions: int = 512

    @property
    def span(self) -> int:
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions


def relative_position_rows(distance: torch.Tensor, position_buckets: int, max_relative_positions: int
                           ) -> torch.Tensor:
    """The table row (int64) of each distance query - key: clamp(bucket + span, 0, 2 span - 1). With
    position_buckets > 0, distances up to half of them keep their value and longer ones share log-spaced
    buckets (reaching span - 1 at max_relative_positions - 1); computed in float32 with the same operations as
    transformers' DeBERTa-v2, so a boundary distance falls into the same bucket."""
    span = position_buckets if position_buckets > 0 else max_relative_positions
    bucket = distance
    if position_buckets > 0:
        mid = position_buckets // 2
        far = distance.abs()
        ratio = torch.log(far.clamp(min=mid) / mid) / torch.log(torch.tensor((max_relative_positions - 1) / mid))
        spread = torch.ceil(ratio * (mid - 1)) + mid
        bucket = torch.where(far <= mid, distance.float(), spread * torch.sign(distance)).long()
    return (bucket + span).clamp(0, 2 * span - 1)


def rule_refusal(position_buckets: int, max_relative_positions: int) -> str | None:
    """Why the kernels cannot take this bucket rule (None where they can): fewer than 2 buckets, a
    max_relative_positions inside the log rule's exact range (its logarithm would be of a ratio <= 1), a span
    over 2^20 rows."""
    buckets, max_rel = position_buckets, max_relative_positions
    if max_rel < 1:
        return f"max_relative_positions must be at least 1, got {max_rel}"
    if buckets > 0 and (buckets < 2 or max_rel - 1 <= buckets // 2):
        return (f"position_buckets={buckets} needs at least 2 buckets and max_relative_positions above "
                f"position_buckets // 2 + 1 (the log rule's range), got {max_rel}")
    if (buckets if buckets > 0 else max_rel) > 2 ** 20:
        return f"a span of {buckets if buckets > 0 else max_rel} positions is over 2^20"
    return None


def _check_rule(op: str, buckets, max_rel) -> None:
    for name, value in (("position_buckets", buckets), ("max_relative_positions", max_rel)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    if why := rule_refusal(buckets, max_rel):
        raise ValueError(f"{op}: {why}")


@functools.lru_cache(maxsize=64)
def _row_index(buckets: int, max_rel: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(rows, far): int32 [2 far + 1], the table row of each distance -far .. far; every longer distance has its
    end's row (the rule is monotone and clamped, and both ends are reached by far)."""
    span = buckets if buckets > 0 else max_rel
    far = 2 * max(span, max_rel) + 2
    while True:
        rows = relative_position_rows(torch.arange(-far, far + 1, device=device), buckets, max_rel)
        if int(rows[0]) == 0 and int(rows[-1]) == 2 * span - 1:
            return rows.to(torch.int32), far
        far *= 2


@triton.jit
def _table_rows(Rows, d_min, far, W: tl.constexpr):
    """[W] int32: the table rows of the distances d_min .. d_min + W - 1 (clamped to the index's -far .. far); a
    table's offsets fit in int32 (the launcher checks), which keeps its tiles' addresses in 32-bit registers."""
    d = tl.minimum(tl.maximum(d_min + tl.arange(0, W), -far), far)
    return tl.load(Rows + far + d)


@triton.jit
def _distance_of(BLOCK: tl.constexpr):
    """[BLOCK, BLOCK]: e(i, j) = i - j + BLOCK - 1, the column of each pair of a tile in its distance window."""
    return tl.arange(0, BLOCK)[:, None] - tl.arange(0, BLOCK)[None, :] + (BLOCK - 1)


@triton.jit
def _half_rows(Rows, d_min, far, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """[BLOCK] int32: the table rows of window columns HALF * BLOCK .. HALF * BLOCK + BLOCK - 1 of a tile whose
    first distance is d_min. A tile's window is taken in two halves, one after the other, so that at most one
    [BLOCK, BLOCK] dot of table rows is alive at a time (a [BLOCK, 2 BLOCK] one spilled registers)."""
    return _table_rows(Rows, d_min + HALF * BLOCK, far, BLOCK)


@triton.jit
def _pick(x, col, AXIS: tl.constexpr, BLOCK: tl.constexpr):
    """x gathered along AXIS at `col` ([BLOCK, BLOCK]) where 0 <= col < BLOCK, else 0."""
    got = tl.gather(x, tl.minimum(tl.maximum(col, 0), BLOCK - 1), axis=AXIS)
    return tl.where((col >= 0) & (col < BLOCK), got, 0.0)


@triton.jit
def _row_tile(src, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The tile of a source = (Ptr, rows, ok, stride_t, head_offset): one head's rows of a [T, H, D] tensor (or
    of a table), at lanes offs_d."""
    ptr, rows, ok, stride_t, head_offset = src
    return _tile(ptr, rows, ok, stride_t, head_offset, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _chunked_dot(a_src, b_src, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """a b^T over the head's lanes, [rows of a, rows of b] float32, for two sources read CHUNK_D lanes at a
    time in a loop. float32's dots run on the CUDA cores, where a thread holds whole rows of the reduced
    dimension of both operands: at heads of 128, with a tile's three such dots (content, c2p, p2c) and q held
    across the loop, ptxas spilled kilobytes whatever the config (and as much with register tiles split by
    tl.split); slices read from memory (L1) keep a slice alive at a time."""
    out = tl.zeros((a_src[1].shape[0], b_src[1].shape[0]), dtype=tl.float32)
    for d0 in tl.range(0, BLOCK_D, CHUNK_D, loop_unroll_factor=1):
        offs = d0 + tl.arange(0, CHUNK_D)
        out += tl.dot(_row_tile(a_src, offs, HEAD_DIM, BLOCK_D), tl.trans(_row_tile(b_src, offs, HEAD_DIM, BLOCK_D)),
                      input_precision=DOT_PRECISION)
    return out


@triton.jit
def _head_dot(a, bt, a_src, b_src, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """a b^T over the head's lanes, [rows of a, rows of b] float32: from the register tiles a [rows, BLOCK_D] and
    bt [BLOCK_D, rows] (None: loaded here from its source, a table's rows) where the whole head is one slice,
    else from the sources, CHUNK_D lanes at a time (_chunked_dot)."""
    if CHUNK_D == BLOCK_D:
        if a is None:
            left = _row_tile(a_src, offs_d, HEAD_DIM, BLOCK_D)
        else:
            left = a
        if bt is None:
            right = tl.trans(_row_tile(b_src, offs_d, HEAD_DIM, BLOCK_D))
        else:
            right = bt
        return tl.dot(left, right, input_precision=DOT_PRECISION)
    return _chunked_dot(a_src, b_src, HEAD_DIM, BLOCK_D, CHUNK_D, DOT_PRECISION)


@triton.jit
def _tile_scores(q, kt, q_src, k_src, PosKey, PosQuery, Rows, d_min, far, h, stride_pk_r, stride_pk_h, stride_pq_r,
                 stride_pq_h, offs_d, qk_scale, C2P: tl.constexpr, P2C: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The [BLOCK, BLOCK] scores of a tile (base 2, scaled): q kt, plus c2p and p2c gathered, half a window at a
    time, from the dots of the tile's table rows (q_src, k_src: where q and k are, for _head_dot)."""
    s = _head_dot(q, kt, q_src, k_src, offs_d, HEAD_DIM, BLOCK_D, CHUNK_D, DOT_PRECISION)
    e = _distance_of(BLOCK)
    for half in tl.static_range(2):
        rows = _half_rows(Rows, d_min, far, half, BLOCK)
        if C2P:
            kr_src = (PosKey, rows, rows >= 0, stride_pk_r, h * stride_pk_h)
            c2p = _head_dot(q, None, q_src, kr_src, offs_d, HEAD_DIM, BLOCK_D, CHUNK_D, DOT_PRECISION)
            s += _pick(c2p, e - half * BLOCK, 1, BLOCK)
        if P2C:
            qr_src = (PosQuery, rows, rows >= 0, stride_pq_r, h * stride_pq_h)
            p2c = _head_dot(None, kt, qr_src, k_src, offs_d, HEAD_DIM, BLOCK_D, CHUNK_D, DOT_PRECISION)
            s += _pick(p2c, e - half * BLOCK, 0, BLOCK)
    return s * qk_scale


@triton.jit
def _by_distance_rows(ds, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """X [BLOCK, BLOCK]: X[i, e] = dS[i, j] for the key j at window column HALF * BLOCK + e of query i (0 where
    that key is outside the tile)."""
    col = tl.arange(0, BLOCK)[:, None] - tl.arange(0, BLOCK)[None, :] + ((1 - HALF) * BLOCK - 1)
    return _pick(ds, col, 1, BLOCK)


@triton.jit
def _by_distance_cols(ds, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Y [BLOCK, BLOCK]: Y[e, j] = dS[i, j] for the query i at window column HALF * BLOCK + e of key j (0 outside)."""
    row = tl.arange(0, BLOCK)[:, None] + tl.arange(0, BLOCK)[None, :] + ((HALF - 1) * BLOCK + 1)
    return _pick(ds, row, 0, BLOCK)


@triton.jit
def _sources(Q, K, V, DO, q_rows, m_ok, k_rows, n_ok, h, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t,
             stride_v_h, stride_do_t, stride_do_h):
    """Where a tile's q, k, v and do are: (Ptr, rows, ok, stride_t, head_offset) each (_row_tile)."""
    return ((Q, q_rows, m_ok, stride_q_t, h * stride_q_h), (K, k_rows, n_ok, stride_k_t, h * stride_k_h),
            (V, k_rows, n_ok, stride_v_t, h * stride_v_h), (DO, q_rows, m_ok, stride_do_t, h * stride_do_h))


@triton.jit
def _tile_grads(q, kt, vt, do, sources, lse, delta, PosKey, PosQuery, Rows, d_min, far, seed, h, m_ok, n_ok, q_rows,
                start_n, stride_pk_r, stride_pk_h, stride_pq_r, stride_pq_h, offs_d, total_tokens, max_seqlen,
                qk_scale, p_drop, C2P: tl.constexpr, P2C: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """(dS, the dropped-out probabilities) of a tile, from the saved statistics: both [BLOCK, BLOCK] float32.
    sources: where q, k, v and do are (_sources), for _chunked_dot."""
    q_src, k_src, v_src, do_src = sources
    s = _tile_scores(q, kt, q_src, k_src, PosKey, PosQuery, Rows, d_min, far, h, stride_pk_r, stride_pk_h,
                     stride_pq_r, stride_pq_h, offs_d, qk_scale, C2P, P2C, DOT_PRECISION, BLOCK, BLOCK_D, CHUNK_D,
                     HEAD_DIM)
    p = tl.where(m_ok[:, None] & n_ok[None, :], tl.math.exp2(s - lse[:, None]), 0.0)
    dp = _head_dot(do, vt, do_src, v_src, offs_d, HEAD_DIM, BLOCK_D, CHUNK_D, DOT_PRECISION)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, _mask_rows(h, total_tokens, q_rows), max_seqlen, start_n, p_drop, BLOCK)
        dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
        p_dropped = tl.where(keep, p / (1.0 - p_drop), 0.0)
    else:
        p_dropped = p
    return p * (dp - delta[:, None]), p_dropped


@triton.jit
def _disentangled_fwd_kernel(
    Q, K, V,            # [T, H, D]
    O,                  # [T, H, D] output
    LSE,                # [H, T] float32 log2-sum-exp2 of each query row's scores
    CuSeqlens,          # [B + 1] int32
    Seed,               # [1] int64 Philox seed (HAS_DROPOUT)
    PosKey, PosQuery,   # [2 span, H, D] projected relative tables (C2P, P2C)
    Rows,               # [2 far + 1] int32 table row of each distance -far .. far
    KeyStart, KeyCount,  # [B] int32: each sequence's keys, as kernels.attention's (HAS_KEY_SPAN)
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h,
    stride_pk_r, stride_pk_h, stride_pq_r, stride_pq_h,
    total_tokens, max_seqlen, qk_scale, p_drop, far,
    C2P: tl.constexpr, P2C: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KEY_SPAN: tl.constexpr,
):
    start_m, b, h = tl.program_id(0) * BLOCK, tl.program_id(1), tl.program_id(2)
    seq_start, seq_len = _sequence(CuSeqlens, b, total_tokens)
    if start_m >= seq_len:
        return
    offs_d = tl.arange(0, BLOCK_D)
    seed = _seed(Seed, HAS_DROPOUT)
    m_ok, q_rows = _span(seq_start, seq_len, start_m, BLOCK)
    q = _tile(Q, q_rows, m_ok, stride_q_t, h * stride_q_h, offs_d, HEAD_DIM, BLOCK_D)
    m_i = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK,), dtype=tl.float32)
    acc = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    k_lo, k_hi = _key_span(KeyStart, KeyCount, b, seq_len, HAS_KEY_SPAN)
    lo, hi = _key_tiles(0, seq_len, k_lo, k_hi, BLOCK, HAS_KEY_SPAN)
    for start_n in range(lo, hi, BLOCK):
        n_ok, k_rows = _span(seq_start, seq_len, start_n, BLOCK)
        n_ok = _is_key(n_ok, start_n + tl.arange(0, BLOCK), k_lo, k_hi, HAS_KEY_SPAN)
        kt = _tile_t(K, k_rows, n_ok, stride_k_t, h * stride_k_h, offs_d, HEAD_DIM, BLOCK_D)
        s = _tile_scores(q, kt, (Q, q_rows, m_ok, stride_q_t, h * stride_q_h),
                         (K, k_rows, n_ok, stride_k_t, h * stride_k_h), PosKey, PosQuery, Rows,
                         start_m - start_n - (BLOCK - 1), far, h, stride_pk_r, stride_pk_h, stride_pq_r, stride_pq_h,
                         offs_d, qk_scale, C2P, P2C, DOT_PRECISION, BLOCK, BLOCK_D, CHUNK_D, HEAD_DIM)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, _mask_rows(h, total_tokens, q_rows), max_seqlen, start_n, p_drop, BLOCK)
            p = tl.where(keep, p, 0.0)
        v = _tile(V, k_rows, n_ok, stride_v_t, h * stride_v_h, offs_d, HEAD_DIM, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if HAS_KEY_SPAN:  # a sequence with no key: its queries' output 0
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    if HAS_DROPOUT:
        out = out / (1.0 - p_drop)
    _store_tile(O, q_rows, m_ok, stride_o_t, h * stride_o_h, offs_d, out, HEAD_DIM, BLOCK_D)
    tl.store(LSE + h * total_tokens + q_rows, m_i + tl.math.log2(l_i), mask=m_ok)


@triton.jit
def _disentangled_bwd_dq_kernel(
    Q, K, V, DO,        # [T, H, D]
    DQ,                 # [T, H, D] output
    LSE, Delta,         # [H, T] float32
    CuSeqlens, Seed, PosKey, PosQuery, Rows, KeyStart, KeyCount,   # as in the forward
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_do_t, stride_do_h,
    stride_dq_t, stride_dq_h, stride_pk_r, stride_pk_h, stride_pq_r, stride_pq_h,
    total_tokens, max_seqlen, qk_scale, softmax_scale, p_drop, far,
    C2P: tl.constexpr, P2C: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KEY_SPAN: tl.constexpr,
):
    start_m, b, h = tl.program_id(0) * BLOCK, tl.program_id(1), tl.program_id(2)
    seq_start, seq_len = _sequence(CuSeqlens, b, total_tokens)
    if start_m >= seq_len:
        return
    offs_d = tl.arange(0, BLOCK_D)
    seed = _seed(Seed, HAS_DROPOUT)
    m_ok, q_rows = _span(seq_start, seq_len, start_m, BLOCK)
    q = _tile(Q, q_rows, m_ok, stride_q_t, h * stride_q_h, offs_d, HEAD_DIM, BLOCK_D)
    do = _tile(DO, q_rows, m_ok, stride_do_t, h * stride_do_h, offs_d, HEAD_DIM, BLOCK_D)
    lse, delta = _row_stats(LSE, Delta, h, total_tokens, q_rows, m_ok)
    dq = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    k_lo, k_hi = _key_span(KeyStart, KeyCount, b, seq_len, HAS_KEY_SPAN)
    lo, hi = _key_tiles(0, seq_len, k_lo, k_hi, BLOCK, HAS_KEY_SPAN)
    for start_n in range(lo, hi, BLOCK):
        n_ok, k_rows = _span(seq_start, seq_len, start_n, BLOCK)
        n_ok = _is_key(n_ok, start_n + tl.arange(0, BLOCK), k_lo, k_hi, HAS_KEY_SPAN)
        kt = _tile_t(K, k_rows, n_ok, stride_k_t, h * stride_k_h, offs_d, HEAD_DIM, BLOCK_D)
        vt = _tile_t(V, k_rows, n_ok, stride_v_t, h * stride_v_h, offs_d, HEAD_DIM, BLOCK_D)
        d_min = start_m - start_n - (BLOCK - 1)
        sources = _sources(Q, K, V, DO, q_rows, m_ok, k_rows, n_ok, h, stride_q_t, stride_q_h, stride_k_t, stride_k_h,
                           stride_v_t, stride_v_h, stride_do_t, stride_do_h)
        ds, _ = _tile_grads(q, kt, vt, do, sources, lse, delta, PosKey, PosQuery, Rows, d_min, far, seed, h, m_ok,
                            n_ok, q_rows, start_n, stride_pk_r, stride_pk_h, stride_pq_r, stride_pq_h, offs_d,
                            total_tokens, max_seqlen, qk_scale, p_drop, C2P, P2C, HAS_DROPOUT, DOT_PRECISION, BLOCK,
                            BLOCK_D, CHUNK_D, HEAD_DIM)
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PRECISION)
        if C2P:  # sum_j dS_ij Kr[r(i - j)]: dS by distance times the tile's table rows, half a window at a time
            for half in tl.static_range(2):
                rows = _half_rows(Rows, d_min, far, half, BLOCK)
                kr = _tile(PosKey, rows, rows >= 0, stride_pk_r, h * stride_pk_h, offs_d, HEAD_DIM, BLOCK_D)
                dq += tl.dot(_by_distance_rows(ds, half, BLOCK).to(kr.dtype), kr, input_precision=DOT_PRECISION)
    _store_tile(DQ, q_rows, m_ok, stride_dq_t, h * stride_dq_h, offs_d, dq * softmax_scale, HEAD_DIM, BLOCK_D)


@triton.jit
def _disentangled_bwd_dkdv_kernel(
    Q, K, V, DO,        # [T, H, D]
    DK, DV,             # [T, H, D] outputs
    LSE, Delta,         # [H, T] float32
    CuSeqlens, Seed, PosKey, PosQuery, Rows, KeyStart, KeyCount,   # as in the forward
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_do_t, stride_do_h,
    stride_dk_t, stride_dk_h, stride_dv_t, stride_dv_h, stride_pk_r, stride_pk_h, stride_pq_r, stride_pq_h,
    total_tokens, max_seqlen, qk_scale, softmax_scale, p_drop, far,
    C2P: tl.constexpr, P2C: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KEY_SPAN: tl.constexpr,
):
    start_n, b, h = tl.program_id(0) * BLOCK, tl.program_id(1), tl.program_id(2)
    seq_start, seq_len = _sequence(CuSeqlens, b, total_tokens)
    k_lo, k_hi = _key_span(KeyStart, KeyCount, b, seq_len, HAS_KEY_SPAN)
    if (start_n >= k_hi) | (start_n + BLOCK <= k_lo):  # no key here: dK and dV stay 0
        return
    offs_d = tl.arange(0, BLOCK_D)
    seed = _seed(Seed, HAS_DROPOUT)
    n_ok, k_rows = _span(seq_start, seq_len, start_n, BLOCK)
    n_ok = _is_key(n_ok, start_n + tl.arange(0, BLOCK), k_lo, k_hi, HAS_KEY_SPAN)
    kt = _tile_t(K, k_rows, n_ok, stride_k_t, h * stride_k_h, offs_d, HEAD_DIM, BLOCK_D)
    vt = _tile_t(V, k_rows, n_ok, stride_v_t, h * stride_v_h, offs_d, HEAD_DIM, BLOCK_D)
    dk = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    for start_m in range(0, seq_len, BLOCK):
        m_ok, q_rows = _span(seq_start, seq_len, start_m, BLOCK)
        q = _tile(Q, q_rows, m_ok, stride_q_t, h * stride_q_h, offs_d, HEAD_DIM, BLOCK_D)
        do = _tile(DO, q_rows, m_ok, stride_do_t, h * stride_do_h, offs_d, HEAD_DIM, BLOCK_D)
        lse, delta = _row_stats(LSE, Delta, h, total_tokens, q_rows, m_ok)
        d_min = start_m - start_n - (BLOCK - 1)
        sources = _sources(Q, K, V, DO, q_rows, m_ok, k_rows, n_ok, h, stride_q_t, stride_q_h, stride_k_t, stride_k_h,
                           stride_v_t, stride_v_h, stride_do_t, stride_do_h)
        ds, p_dropped = _tile_grads(q, kt, vt, do, sources, lse, delta, PosKey, PosQuery, Rows, d_min, far, seed, h,
                                    m_ok, n_ok, q_rows, start_n, stride_pk_r, stride_pk_h, stride_pq_r, stride_pq_h,
                                    offs_d, total_tokens, max_seqlen, qk_scale, p_drop, C2P, P2C, HAS_DROPOUT,
                                    DOT_PRECISION, BLOCK, BLOCK_D, CHUNK_D, HEAD_DIM)
        dv += tl.dot(tl.trans(p_dropped.to(do.dtype)), do, input_precision=DOT_PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
        if P2C:  # sum_i dS_ij Qr[r(i - j)]
            for half in tl.static_range(2):
                rows = _half_rows(Rows, d_min, far, half, BLOCK)
                qr = _tile(PosQuery, rows, rows >= 0, stride_pq_r, h * stride_pq_h, offs_d, HEAD_DIM, BLOCK_D)
                dk += tl.dot(tl.trans(_by_distance_cols(ds, half, BLOCK).to(qr.dtype)), qr,
                             input_precision=DOT_PRECISION)
    _store_tile(DK, k_rows, n_ok, stride_dk_t, h * stride_dk_h, offs_d, dk * softmax_scale, HEAD_DIM, BLOCK_D)
    _store_tile(DV, k_rows, n_ok, stride_dv_t, h * stride_dv_h, offs_d, dv, HEAD_DIM, BLOCK_D)


@triton.jit
def _disentangled_bwd_tables_kernel(
    Q, K, V, DO,        # [T, H, D]
    LSE, Delta,         # [H, T] float32
    CuSeqlens, Seed, PosKey, PosQuery, Rows, KeyStart, KeyCount,   # as in the forward
    SumKey, SumQuery,   # [splits, diagonals, H, 2 BLOCK, D] float32 outputs: per distance of each block
                        # diagonal's window, sum dS_ij q_i (C2P) and sum dS_ij k_j (P2C)
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_do_t, stride_do_h,
    stride_pk_r, stride_pk_h, stride_pq_r, stride_pq_h,
    total_tokens, max_seqlen, qk_scale, p_drop, far, batch, blocks,
    C2P: tl.constexpr, P2C: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_KEY_SPAN: tl.constexpr,
):
    diag, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    shift = diag - (blocks - 1)          # query block - key block along this diagonal
    offs_d = tl.arange(0, BLOCK_D)
    seed = _seed(Seed, HAS_DROPOUT)
    # Each half of the window's sums: key (C2P) and query (P2C) sums of window columns 0 .. BLOCK - 1 and
    # BLOCK .. 2 BLOCK - 1.
    key_lo = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    key_hi = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    query_lo = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    query_hi = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    d_min = shift * BLOCK - (BLOCK - 1)  # the same in every tile of this diagonal
    for b in range(split, batch, tl.num_programs(2)):
        seq_start, seq_len = _sequence(CuSeqlens, b, total_tokens)
        k_lo, k_hi = _key_span(KeyStart, KeyCount, b, seq_len, HAS_KEY_SPAN)
        n_blocks = tl.cdiv(seq_len, BLOCK)
        for block_m in range(tl.maximum(shift, 0), tl.minimum(n_blocks, n_blocks + shift)):
            start_m, start_n = block_m * BLOCK, (block_m - shift) * BLOCK
            m_ok, q_rows = _span(seq_start, seq_len, start_m, BLOCK)
            n_ok, k_rows = _span(seq_start, seq_len, start_n, BLOCK)
            n_ok = _is_key(n_ok, start_n + tl.arange(0, BLOCK), k_lo, k_hi, HAS_KEY_SPAN)  # else dS is 0
            q = _tile(Q, q_rows, m_ok, stride_q_t, h * stride_q_h, offs_d, HEAD_DIM, BLOCK_D)
            do = _tile(DO, q_rows, m_ok, stride_do_t, h * stride_do_h, offs_d, HEAD_DIM, BLOCK_D)
            lse, delta = _row_stats(LSE, Delta, h, total_tokens, q_rows, m_ok)
            kt = _tile_t(K, k_rows, n_ok, stride_k_t, h * stride_k_h, offs_d, HEAD_DIM, BLOCK_D)
            vt = _tile_t(V, k_rows, n_ok, stride_v_t, h * stride_v_h, offs_d, HEAD_DIM, BLOCK_D)
            sources = _sources(Q, K, V, DO, q_rows, m_ok, k_rows, n_ok, h, stride_q_t, stride_q_h, stride_k_t,
                               stride_k_h, stride_v_t, stride_v_h, stride_do_t, stride_do_h)
            ds, _ = _tile_grads(q, kt, vt, do, sources, lse, delta, PosKey, PosQuery, Rows, d_min, far, seed, h, m_ok,
                                n_ok, q_rows, start_n, stride_pk_r, stride_pk_h, stride_pq_r, stride_pq_h, offs_d,
                                total_tokens, max_seqlen, qk_scale, p_drop, C2P, P2C, HAS_DROPOUT, DOT_PRECISION,
                                BLOCK, BLOCK_D, CHUNK_D, HEAD_DIM)
            if C2P:
                key_lo += tl.dot(tl.trans(_by_distance_rows(ds, 0, BLOCK).to(q.dtype)), q,
                                 input_precision=DOT_PRECISION)
                key_hi += tl.dot(tl.trans(_by_distance_rows(ds, 1, BLOCK).to(q.dtype)), q,
                                 input_precision=DOT_PRECISION)
            if P2C:
                query_lo += tl.dot(_by_distance_cols(ds, 0, BLOCK).to(kt.dtype), tl.trans(kt),
                                   input_precision=DOT_PRECISION)
                query_hi += tl.dot(_by_distance_cols(ds, 1, BLOCK).to(kt.dtype), tl.trans(kt),
                                   input_precision=DOT_PRECISION)
    slot = ((split * tl.num_programs(0) + diag) * tl.num_programs(1) + h).to(tl.int64) * (2 * BLOCK * HEAD_DIM)
    offs_e = tl.arange(0, BLOCK)
    where = slot + offs_e[:, None] * HEAD_DIM + offs_d[None, :]
    lanes = (offs_e[:, None] >= 0) & (offs_d[None, :] < HEAD_DIM)
    if C2P:
        tl.store(SumKey + where, key_lo, mask=lanes)
        tl.store(SumKey + where + BLOCK * HEAD_DIM, key_hi, mask=lanes)
    if P2C:
        tl.store(SumQuery + where, query_lo, mask=lanes)
        tl.store(SumQuery + where + BLOCK * HEAD_DIM, query_hi, mask=lanes)


class _Launch(NamedTuple):
    BLOCK: int        # queries and keys of a (square) tile
    num_warps: int
    num_stages: int


def _default_config(kernel: str, head_dim: int, dtype: torch.dtype, target: targets.Target | None) -> _Launch:
    """The built-in config of kernel "fwd", "dq", "dkdv" or "tables" on `target` (None: the interpreter, whose
    small tiles let short test sequences span several blocks). A tile holds its scores, a window half's position
    dot and its gather, so tiles are 32 wide in half precision: at 64, every kernel spilled registers on sm_90
    (so its dots run as per-warp mma.sync there, not warpgroup wgmma: compile-checked as "warp_dots"); float32's
    exact products on the CUDA cores take 16, head_dim in slices of 32. The backward's two accumulators (dkdv) or
    four window sums (tables), and heads over 64, take 8 warps. Where these still spill on a family, its table
    (kernels/configs/<name>.json, bench.tune --compile-only) holds a clean one."""
    if target is None or dtype == torch.float32:
        return _Launch(16, 4, 1)
    return _Launch(32, 8 if head_dim > 64 or kernel in ("dkdv", "tables") else 4, 1)


def _config(kernel: str, head_dim: int, dtype: torch.dtype, target: targets.Target | None,
            max_seqlen: int | None) -> _Launch:
    """The launch config on `target`: its table's entry (kernels/tuned.py), else the default. Dropout draws its
    bits in groups of 8 keys and tl.dot wants 16 rows, so every tile is at least 16 wide."""
    default = _default_config(kernel, head_dim, dtype, target)

    def need(c: _Launch, t: targets.Target) -> tuned.Need:
        """The walked tiles (q or k and v) and the 2 BLOCK table rows in shared memory per stage; a thread's
        share of the scores, the two position dots and the accumulators."""
        size = (2 * c.BLOCK + 4 * c.BLOCK) * head_dim * dtype.itemsize * max(1, c.num_stages - 1)
        return tuned.tile_need(5 * c.BLOCK * c.BLOCK + 2 * c.BLOCK * head_dim, c, t, size)
    c = tuned.pick(f"disentangled.{kernel}", default, target, dtype, head_dim, max_seqlen, need=need)
    return c if c.BLOCK >= 16 else c._replace(BLOCK=16)


def _site(part: str, kernel) -> launches.LaunchSite:
    return launches.LaunchSite(f"disentangled.{part}", kernel,
                               lambda dtype, d, target: _default_config(part, d, dtype, target),
                               lambda dtype, d, target, seqlen=None: _config(part, d, dtype, target, seqlen),
                               launches.grid(BLOCK=[16, 32, 64], num_warps=[4, 8], num_stages=[1, 2]),
                               needs="warp_dots")


_FWD, _DQ, _DKDV, _TABLES = launches.declare(
    _site("fwd", _disentangled_fwd_kernel), _site("dq", _disentangled_bwd_dq_kernel),
    _site("dkdv", _disentangled_bwd_dkdv_kernel), _site("tables", _disentangled_bwd_tables_kernel))


def _check(q, k, v, cu_seqlens, max_seqlen, positions, dropout_p, validate):
    op = "disentangled_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{op}: {name} must be [total_tokens, heads, head_dim], "
                             f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"{op}: q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if why := shape_refusal(q.shape[2]):
        raise ValueError(f"{op}: {why}")
    if not isinstance(positions, DisentangledPositions):
        raise TypeError(f"{op}: positions must be a kernels.DisentangledPositions, got {type(positions).__name__}")
    _check_rule(op, positions.position_buckets, positions.max_relative_positions)
    want = (2 * positions.span, q.shape[1], q.shape[2])
    for name, t in (("pos_key", positions.pos_key), ("pos_query", positions.pos_query)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: positions.{name} must be [2 * span, heads, head_dim] = {list(want)}, got {got}")
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: positions.{name} is {t.dtype}, q is {q.dtype}")
        if max((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) * 3 >= 2 ** 31:
            raise ValueError(f"{op}: positions.{name} spans over 2^31 elements; the kernels address tables in int32")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 1:
        raise TypeError(f"{op}: cu_seqlens must be a 1-D int32 tensor [batch + 1]")
    if cu_seqlens.numel() - 1 > 65535:
        raise ValueError(f"{op}: at most 65535 sequences per call, got {cu_seqlens.numel() - 1}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p}")
    check_device(op, q=q, k=k, v=v, cu_seqlens=cu_seqlens, pos_key=positions.pos_key, pos_query=positions.pos_query)
    targets.check(op, q.dtype, q.device, dots=DOTS)
    if validate:
        _validate(op, cu_seqlens, q.shape[0], max_seqlen)


class _Args(NamedTuple):
    """What every launch of one call shares: the tables' pointers and strides, the distance index, the flags."""
    pos_key: torch.Tensor | None
    pos_query: torch.Tensor | None
    rows: torch.Tensor
    far: int
    strides: tuple
    flags: dict


def _chunk_d(dtype: torch.dtype, block_d: int) -> int:
    """The lanes the head_dim dots take at a time (_chunked_dot): float32's, on the CUDA cores, 32; half
    precision's, on the tensor cores, the whole head from registers."""
    return min(block_d, 32) if dtype == torch.float32 else block_d


def _args(q, pos_key, pos_query, buckets, max_rel, dropout_p) -> _Args:
    rows, far = _row_index(buckets, max_rel, q.device)
    strides = tuple(s for t in (pos_key, pos_query) for s in ((t.stride(0), t.stride(1)) if t is not None else (0, 0)))
    flags = dict(C2P=pos_key is not None, P2C=pos_query is not None, HAS_DROPOUT=dropout_p > 0,
                 DOT_PRECISION=dot_precision(q.dtype), BLOCK_D=block_d(q.shape[2]), HEAD_DIM=q.shape[2])
    flags["CHUNK_D"] = _chunk_d(q.dtype, flags["BLOCK_D"])
    return _Args(pos_key, pos_query, rows, far, strides, flags)


@torch.library.custom_op("bertfuse::disentangled_attention_fwd", mutates_args=())
def _disentangled_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                      pos_key: torch.Tensor | None, pos_query: torch.Tensor | None, position_buckets: int,
                      max_relative_positions: int, dropout_p: float, softmax_scale: float, seed: torch.Tensor | None,
                      key_start: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, D], lse [H, T] float32) for q, k, v [T, H, D] and tables [2 span, H, D] with unit stride along
    D (None: no such term); each sequence's keys the seqused_k positions from key_start (both None: all)."""
    dtype = q.dtype
    q, k, v, pos_key, pos_query = interpreter_upcast(q, k, v, pos_key, pos_query)
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    o = torch.zeros_like(q)   # filler tokens past cu_seqlens[-1] stay 0 (see kernels.attention)
    lse = torch.zeros((heads, total), dtype=torch.float32, device=q.device)
    a = _args(q, pos_key, pos_query, position_buckets, max_relative_positions, dropout_p)
    c = _config("fwd", dim, q.dtype, targets.of(q.device), max_seqlen)
    if total and batch and max_seqlen:
        _FWD.launch((triton.cdiv(max_seqlen, c.BLOCK), batch, heads),
            q, k, v, o, lse, cu_seqlens, seed, a.pos_key, a.pos_query, a.rows, key_start, seqused_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
            *a.strides, total, max_seqlen, softmax_scale * LOG2E, dropout_p, a.far,
            BLOCK=c.BLOCK, num_warps=c.num_warps, num_stages=c.num_stages, HAS_KEY_SPAN=seqused_k is not None,
            **a.flags)
    return o.to(dtype), lse


@_disentangled_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions, dropout_p,
      softmax_scale, seed, key_start=None, seqused_k=None):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _table_grads(q, k, v, do, lse, delta, cu_seqlens, seed, a: _Args, max_seqlen, scalars, strides, spans
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dPosKey, dPosQuery), float32 [2 span, H, D] (empty where that table is absent): the tables kernel's
    per-diagonal sums, their overlapping windows added, each distance's sum folded onto its table row."""
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    c = _config("tables", dim, q.dtype, targets.of(q.device), max_seqlen)
    block = c.BLOCK
    blocks = triton.cdiv(max_seqlen, block)
    diagonals = 2 * blocks - 1
    splits = max(1, min(batch, total // max(1, 4 * blocks * block)))  # partial sums at most ~ q's size, twice
    sums = [torch.zeros((splits, diagonals, heads, 2 * block, dim), dtype=torch.float32, device=q.device)
            if t is not None else None for t in (a.pos_key, a.pos_query)]
    _TABLES.launch((diagonals, heads, splits),
        q, k, v, do, lse, delta, cu_seqlens, seed, a.pos_key, a.pos_query, a.rows, *spans, *sums, *strides,
        *a.strides, *scalars, batch, blocks, BLOCK=block, num_warps=c.num_warps, num_stages=c.num_stages,
        HAS_KEY_SPAN=spans[1] is not None, **a.flags)
    span2 = next(t for t in (a.pos_key, a.pos_query) if t is not None).shape[0]
    # Distance of window column e of diagonal g: (g - blocks + 1) * block - block + 1 + e; column e >= block of
    # diagonal g is column e - block of diagonal g + 1's first half.
    d0 = -blocks * block + 1
    distances = torch.arange(d0, d0 + (diagonals + 1) * block, device=q.device)
    table_rows = a.rows[(distances.clamp(-a.far, a.far) + a.far)].long()
    fold = (table_rows[None, :] == torch.arange(span2, device=q.device)[:, None]).float()  # [2 span, distances]
    grads = []
    for s in sums:
        if s is None:
            grads.append(q.new_zeros(0, dtype=torch.float32))
            continue
        s = s.sum(0)                                          # over the splits, in order
        by_distance = q.new_zeros((diagonals + 1, block, heads, dim), dtype=torch.float32)
        by_distance[:-1] += s[:, :, :block].transpose(1, 2)
        by_distance[1:] += s[:, :, block:].transpose(1, 2)
        grads.append((fold @ by_distance.reshape(-1, heads * dim)).view(span2, heads, dim))
    return grads[0], grads[1]


@torch.library.custom_op("bertfuse::disentangled_attention_bwd", mutates_args=())
def _disentangled_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, pos_key: torch.Tensor | None,
                      pos_query: torch.Tensor | None, position_buckets: int, max_relative_positions: int,
                      dropout_p: float, softmax_scale: float, seed: torch.Tensor | None,
                      key_start: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dpos_key, dpos_query); zero at filler tokens and keys outside their span; a table's gradient
    is empty where it is None."""
    dtype, table_dtype = q.dtype, next((t.dtype for t in (pos_key, pos_query) if t is not None), q.dtype)
    do, q, k, v, o, pos_key, pos_query = interpreter_upcast(unit_stride(do), q, k, v, o, pos_key, pos_query)
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dtables = [torch.zeros_like(t) if t is not None else q.new_zeros(0) for t in (pos_key, pos_query)]
    if not (total and batch and max_seqlen):
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), *(t.to(table_dtype) for t in dtables)
    target = targets.of(q.device)
    delta = row_deltas(o, do, target, max_seqlen)
    a = _args(q, pos_key, pos_query, position_buckets, max_relative_positions, dropout_p)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1))
    scalars = (total, max_seqlen, softmax_scale * LOG2E, softmax_scale, dropout_p, a.far)
    common = (lse, delta, cu_seqlens, seed, a.pos_key, a.pos_query, a.rows, key_start, seqused_k)
    spanned = seqused_k is not None
    c = _config("dq", dim, q.dtype, target, max_seqlen)
    _DQ.launch((triton.cdiv(max_seqlen, c.BLOCK), batch, heads), q, k, v, do, dq, *common, *strides,
               dq.stride(0), dq.stride(1), *a.strides, *scalars, BLOCK=c.BLOCK, num_warps=c.num_warps,
               num_stages=c.num_stages, HAS_KEY_SPAN=spanned, **a.flags)
    c = _config("dkdv", dim, q.dtype, target, max_seqlen)
    _DKDV.launch((triton.cdiv(max_seqlen, c.BLOCK), batch, heads), q, k, v, do, dk, dv, *common, *strides,
                 dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *a.strides, *scalars, BLOCK=c.BLOCK,
                 num_warps=c.num_warps, num_stages=c.num_stages, HAS_KEY_SPAN=spanned, **a.flags)
    if pos_key is not None or pos_query is not None:
        grads = _table_grads(q, k, v, do, lse, delta, cu_seqlens, seed, a, max_seqlen,
                             (total, max_seqlen, softmax_scale * LOG2E, dropout_p, a.far), strides,
                             (key_start, seqused_k))
        dtables = [g * softmax_scale if g.numel() else g for g in grads]
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), *(t.to(table_dtype) for t in dtables)


@_disentangled_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions,
      dropout_p, softmax_scale, seed, key_start=None, seqused_k=None):
    tables = [torch.empty_like(t) if t is not None else q.new_empty(0) for t in (pos_key, pos_query)]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *tables


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, buckets, max_rel, dropout_p, softmax_scale, seed, key_start,
     seqused_k) = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens, pos_key, pos_query, seed, key_start, seqused_k)
    ctx.meta = (max_seqlen, buckets, max_rel, dropout_p, softmax_scale)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_seqlens, pos_key, pos_query, seed, key_start, seqused_k = ctx.saved_tensors
    max_seqlen, buckets, max_rel, dropout_p, softmax_scale = ctx.meta
    dq, dk, dv, dpk, dpq = _disentangled_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query, buckets,
                                             max_rel, dropout_p, softmax_scale, seed, key_start, seqused_k)
    return (dq, dk, dv, None, None, dpk if pos_key is not None else None, dpq if pos_query is not None else None,
            None, None, None, None, None, None, None)


_disentangled_fwd.register_autograd(_backward, setup_context=_setup_context)


def disentangled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, positions: DisentangledPositions, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, seed: int | torch.Tensor | None = None,
                           validate: bool = True, seqused_k: torch.Tensor | None = None,
                           key_start: torch.Tensor | None = None) -> torch.Tensor:
    """DeBERTa's attention within each packed sequence: softmax((q k^T + c2p + p2c) * scale) v, a tensor of q's
    shape, the position terms read from `positions`' tables inside the kernels (no [seq, seq] or [tokens, 2 span]
    tensor formed), forward and backward; the tables get gradients.

    q, k, v: [total_tokens, heads, head_dim] (head_dim 1 to 128); cu_seqlens: int32 [batch + 1]; max_seqlen: the
    longest sequence; positions: the projected tables and the bucket rule (DisentangledPositions), positions
    counted from each sequence's first token. softmax_scale: default 1 / sqrt(head_dim * (1 + number of position
    terms)), DeBERTa's. Dropout on the probabilities uses Philox with `seed` (an int or a one-element device
    tensor; default: drawn on q's device), the same mask as kernels.varlen_attention's for the same seed
    (`disentangled_dropout_mask`). Tokens at or past cu_seqlens[-1] get zero output and gradients. seqused_k and
    key_start: each sequence's keys, as kernels.varlen_attention's (every token a query; distances counted from
    the sequence's first token). validate=False
    skips the checks of cu_seqlens' values (a device sync); the kernels still never read or write outside the
    tensors. Runs as the custom ops bertfuse::disentangled_attention_fwd / _bwd, which torch.compile traces
    through."""
    max_seqlen = int(max_seqlen)
    _check(q, k, v, cu_seqlens, max_seqlen, positions, float(dropout_p), validate)
    key_start, seqused_k = _key_spans(cu_seqlens, seqused_k, key_start, validate)
    terms = (positions.pos_key is not None) + (positions.pos_query is not None)
    scale = 1.0 / math.sqrt(q.shape[-1] * (1 + terms)) if softmax_scale is None else float(softmax_scale)
    tables = [None if t is None else unit_stride(t) for t in (positions.pos_key, positions.pos_query)]
    out, _ = _disentangled_fwd(unit_stride(q), unit_stride(k), unit_stride(v), dense(cu_seqlens), max_seqlen,
                               *tables, positions.position_buckets, positions.max_relative_positions,
                               float(dropout_p), scale, seed_tensor(seed, q.device, dropout_p > 0), key_start,
                               seqused_k)
    return out


def disentangled_dropout_mask(cu_seqlens: torch.Tensor, heads: int, max_seqlen: int, dropout_p: float, seed,
                              total_tokens: int | None = None) -> torch.Tensor:
    """The keep-mask disentangled_attention applies for this seed, bool [heads, total_tokens, max_seqlen]
    (kernels.attention's layout and bits). For tests."""
    return attention_dropout_mask(cu_seqlens, heads, max_seqlen, dropout_p, seed, total_tokens)


def disentangled_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               positions: DisentangledPositions, dropout_p: float = 0.0,
                               softmax_scale: float | None = None, keep: torch.Tensor | None = None,
                               seqused_k: torch.Tensor | None = None, key_start: torch.Tensor | None = None
                               ) -> torch.Tensor:
    """`disentangled_attention` in plain PyTorch, for checks and for paths without the kernels: per sequence,
    DeBERTa's way: q Kr^T and k Qr^T against every table row, gathered at each pair's row, the [seq, seq] scores
    formed, those outside the key span -inf. Dropout applies `keep` (`disentangled_dropout_mask`'s) and needs it.
    Tokens past cu_seqlens[-1], and queries of a sequence with no key, get zeros."""
    if dropout_p > 0 and keep is None:
        raise ValueError("disentangled_attention_ref: dropout needs the keep-mask (disentangled_dropout_mask)")
    pos_key, pos_query = positions.pos_key, positions.pos_query
    terms = (pos_key is not None) + (pos_query is not None)
    scale = 1.0 / math.sqrt(q.shape[-1] * (1 + terms)) if softmax_scale is None else float(softmax_scale)
    bounds = [int(b) for b in cu_seqlens]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qq, kk, vv = (t[start:end].transpose(0, 1) for t in (q, k, v))          # [H, L, D]
        pos = torch.arange(end - start, device=q.device)
        rows = relative_position_rows(pos[:, None] - pos[None, :], positions.position_buckets,
                                      positions.max_relative_positions)        # [L, L]: query, key
        scores = qq @ kk.transpose(-1, -2)
        index = rows.expand(qq.shape[0], -1, -1)
        if pos_key is not None:
            scores = scores + torch.gather(qq @ pos_key.transpose(0, 1).transpose(-1, -2), -1, index)
        if pos_query is not None:  # key j's row r(i - j), then transposed to [query, key]
            by_key = torch.gather(kk @ pos_query.transpose(0, 1).transpose(-1, -2), -1, index.transpose(-1, -2))
            scores = scores + by_key.transpose(-1, -2)
        if seqused_k is not None:
            first = 0 if key_start is None else int(key_start[len(outs)])
            seen = (pos >= first) & (pos < first + int(seqused_k[len(outs)]))
            scores = scores.masked_fill(~seen, float("-inf")) if seen.any() else scores * 0
        probs = torch.softmax(scores * scale, dim=-1) * (seqused_k is None or bool(seen.any()))
        if dropout_p > 0:
            probs = probs * keep[:, start:end, :end - start].to(probs.dtype) / (1 - dropout_p)
        outs.append((probs @ vv).transpose(0, 1))
    return torch.cat(outs + [q.new_zeros(q.shape[0] - bounds[-1], *q.shape[1:])])

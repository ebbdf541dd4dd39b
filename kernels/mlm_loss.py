"""Masked-LM loss fused with the decoder: cross_entropy(hidden @ weight^T + bias, labels) over labelled rows
only, in bounded memory, by one of two strategies.

Only labelled rows are computed: the launcher gathers the rows whose label is not ignore_index (in BERT
pre-training about 15% of tokens), so ignored rows cost nothing. A packed batch of fixed shapes passes its
labelled rows already gathered, with a few unused slots: `validate=False` then computes every row and zeroes the
unused ones, so that no host sync (the gather's count) stops the device.

With M rows, V = vocabulary, H = hidden, a "logit-sized matmul" is 2 M V H FLOPs.

Strategy "chunked": the rows in chunks of at most CHUNK_BYTES of logits. Per chunk, h @ W^T by cuBLAS in the compute
dtype (rows padded to 16 elements), then one Triton program per row (_ce_rows_kernel), z being that product + b in
float32: pass 1 the online max / sum of exponentials, the label's logit and the first argmax (loss =
lse - z[label]); pass 2 writes dz = (softmax(z) - onehot(label)) * s over the product, s being 1 for a row that
counts and 0 for one that counts for nothing. Then d h = dz @ W and d W += dz^T @ h by cuBLAS and d b += colsum(dz):
3 logit-sized matmuls in all, the gradients of the plain sum computed in the forward (the logits are at hand there;
Liger-Kernel's fused linear cross-entropy does the same) and scaled in the backward by the upstream scalar times
1/count for "mean", in float32, then rounded once. Dividing by the count in the forward instead would put a
float16 dz of 4,096 rows x 30,522 entries (~1e-8) below float16's range before a gradient scaler's 2^16 arrives.
reduction="none" has a per-row upstream gradient, known only in the backward: there
the logits are recomputed (4 matmuls). Extra memory: one chunk of logits, the gradients from forward to backward,
and with several chunks a float32 [V, H] sum of d W.

Strategy "fused" (the kernels below, up to _ce_rows_kernel): no logits in memory at all.

Forward, per block of rows and per split of the vocabulary, over vocabulary tiles j (logits z computed tile by
tile, contraction over hidden in chunks, float32 accumulation; base-2 exponentials):
    m_new = max(m, rowmax(z_j)),   l = l * 2^((m - m_new) log2 e) + rowsum(2^((z_j - m_new) log2 e))
    lse_s = m + ln(l),   target_s = z[label] if the label is in split s else 0,   best_s, argmax_s
The splits (only as many as it takes to fill the GPU) are merged on [splits, rows] float32 partials:
    lse = logsumexp_s(lse_s),   loss_row = lse - sum_s target_s,   hit_row = (argmax over all splits == label)
Only lse (float32, [rows]) is kept for the backward.

Backward, with g_row the upstream gradient of each row's loss (1/n for "mean"):
    dz = (softmax(z) - onehot(label)) * g_row,   softmax(z) = exp(z - lse)
    d hidden = dz @ weight,   d weight = dz^T @ hidden,   d bias = sum_rows dz
Two kernels recompute the logit tiles they need: one owns a [rows, hidden-chunk] block of d hidden and walks the
vocabulary; the other owns a [vocab-tile, hidden-chunk] block of d weight (and d bias) and walks the rows.
Each output block has exactly one owner: no atomics, no float32 [V, H] accumulation buffer, deterministic.
The price is recomputation: a logit tile is rebuilt once per hidden chunk (BLOCK_HO = 256 on a GPU) of the
output, so the backward does 2 * (ceil(H / BLOCK_HO) + 1) logit-sized matmuls (8 at H = 768, 10 at H = 1024;
with the forward 9 and 11) against 2 for a materialised-logits implementation; the saving is the [rows, vocab]
memory and its traffic. The tuner also tries BLOCK_HO = 512 (with narrower vocabulary tiles, the widest that
compile for sm_90 without spills), which cuts the backward to 6 at both sizes, if it runs faster.

Strategy "auto" runs what the launch-config table measured faster for this GPU, dtype, hidden size and row-count
bucket (pick_strategy), else "chunked".
"""
from __future__ import annotations

import json
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import targets, tuned
from ._common import check_device, check_float, dense, dot_precision, interpreter_upcast, programs_wanted, unit_stride

__all__ = ["labelled_rows", "masked_lm_loss", "masked_lm_loss_ref"]
# tl.constexpr, so the jit functions may read them (plain float globals only work in the interpreter).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
REDUCTIONS = ("mean", "sum", "none")
STRATEGIES = ("auto", "chunked", "fused")


class MLMLossOutput(NamedTuple):
    loss: torch.Tensor      # scalar for "mean"/"sum", [N] for "none"
    correct: torch.Tensor   # int64 scalar: labelled rows whose top-1 logit is the label


@triton.jit
def _block_ptrs(Ptr, rows, row_ok, stride, cols, col_ok):
    """Pointers and mask of the [rows, cols] block of a row-major matrix (unit stride along cols)."""
    return Ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], row_ok[:, None] & col_ok[None, :]


@triton.jit
def _load_block(Ptr, rows, row_ok, stride, cols, col_ok):
    ptrs, mask = _block_ptrs(Ptr, rows, row_ok, stride, cols, col_ok)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_block(Ptr, rows, row_ok, stride, cols, col_ok, value):
    ptrs, mask = _block_ptrs(Ptr, rows, row_ok, stride, cols, col_ok)
    tl.store(ptrs, value.to(Ptr.dtype.element_ty), mask=mask)


@triton.jit
def _logit_tile(Hid, W, B, rows64, row_ok, vocab, v_ok, stride_h_n, stride_w_v, H,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """z[rows, vocab] = hidden[rows] @ weight[vocab]^T + bias[vocab] in float32; -inf outside the vocabulary."""
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    vocab64 = vocab.to(tl.int64)
    for k in range(0, H, BLOCK_H):
        cols = k + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        h = _load_block(Hid, rows64, row_ok, stride_h_n, cols, col_ok)
        wt = tl.load(W + vocab64[None, :] * stride_w_v + cols[:, None], mask=v_ok[None, :] & col_ok[:, None],
                     other=0.0)
        acc = tl.dot(h, wt, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + vocab, mask=v_ok, other=0.0).to(tl.float32)[None, :]
    return tl.where(v_ok[None, :], acc, float("-inf"))


@triton.jit
def _mlm_loss_fwd_kernel(
    Hid,        # [N, H] labelled rows only
    W,          # [V, H] decoder weight (tied word embeddings)
    B,          # [V] decoder bias (unused unless HAS_BIAS)
    Labels,     # [N] int64, all in [0, V)
    Lse,        # [S, N] float32 log-sum-exp over each vocabulary split
    Target,     # [S, N] float32 the label's logit, in the split that holds it (0 in the others)
    Best,       # [S, N] float32 the split's largest logit
    BestIdx,    # [S, N] int64 its first index
    stride_h_n, stride_w_v, N, V, H, vocab_per_split,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    v_begin = split * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, V)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    label = tl.load(Labels + rows, mask=row_ok, other=-1)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    target = tl.zeros((BLOCK_M,), dtype=tl.float32)
    best = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros((BLOCK_M,), dtype=tl.int64)
    for v0 in range(v_begin, v_end, BLOCK_V):
        vocab = v0 + tl.arange(0, BLOCK_V)
        v_ok = vocab < v_end
        z = _logit_tile(Hid, W, B, rows64, row_ok, vocab, v_ok, stride_h_n, stride_w_v, H,
                        HAS_BIAS, BLOCK_M, BLOCK_V, BLOCK_H, DOT_PRECISION)
        tile_max = tl.max(z, axis=1)
        m_new = tl.maximum(m, tile_max)
        l = l * tl.math.exp2((m - m_new) * LOG2E) + tl.sum(tl.math.exp2((z - m_new[:, None]) * LOG2E), axis=1)
        m = m_new
        target += tl.sum(tl.where(vocab[None, :] == label[:, None], z, 0.0), axis=1)
        # First index of the maximum, as torch.argmax: a later tile wins only if strictly larger.
        tile_idx = tl.min(tl.where(z == tile_max[:, None], vocab[None, :], V), axis=1).to(tl.int64)
        better = tile_max > best
        best_idx = tl.where(better, tile_idx, best_idx)
        best = tl.where(better, tile_max, best)
    out = split.to(tl.int64) * N + rows64
    tl.store(Lse + out, m + tl.math.log2(l) * LN2, mask=row_ok)
    tl.store(Target + out, target, mask=row_ok)
    tl.store(Best + out, best, mask=row_ok)
    tl.store(BestIdx + out, best_idx, mask=row_ok)


@triton.jit
def _dlogit_tile(Hid, W, B, Labels, Lse, G, rows, row_ok, vocab, v_ok, stride_h_n, stride_w_v, H,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """dz = (softmax(z) - onehot(label)) * g for one tile, recomputed; zero outside rows and vocabulary."""
    rows64 = rows.to(tl.int64)
    z = _logit_tile(Hid, W, B, rows64, row_ok, vocab, v_ok, stride_h_n, stride_w_v, H,
                    HAS_BIAS, BLOCK_M, BLOCK_V, BLOCK_H, DOT_PRECISION)
    lse = tl.load(Lse + rows, mask=row_ok, other=0.0)
    g = tl.load(G + rows, mask=row_ok, other=0.0)
    label = tl.load(Labels + rows, mask=row_ok, other=-1)
    prob = tl.math.exp2((z - lse[:, None]) * LOG2E)
    dz = (prob - tl.where(vocab[None, :] == label[:, None], 1.0, 0.0)) * g[:, None]
    return tl.where(row_ok[:, None] & v_ok[None, :], dz, 0.0)


@triton.jit
def _mlm_loss_bwd_dhidden_kernel(
    Hid, W, B, Labels, Lse,   # as in the forward
    G,                        # [N] float32 upstream gradient of each row's loss
    DHid,                     # [N, H] output
    stride_h_n, stride_w_v, stride_dh_n, N, V, H,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HO: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    out_cols = tl.program_id(1) * BLOCK_HO + tl.arange(0, BLOCK_HO)
    row_ok = rows < N
    out_ok = out_cols < H
    acc = tl.zeros((BLOCK_M, BLOCK_HO), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        vocab = v0 + tl.arange(0, BLOCK_V)
        v_ok = vocab < V
        dz = _dlogit_tile(Hid, W, B, Labels, Lse, G, rows, row_ok, vocab, v_ok, stride_h_n, stride_w_v, H,
                          HAS_BIAS, BLOCK_M, BLOCK_V, BLOCK_H, DOT_PRECISION)
        w = _load_block(W, vocab, v_ok, stride_w_v, out_cols, out_ok)
        acc = tl.dot(dz.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
    _store_block(DHid, rows, row_ok, stride_dh_n, out_cols, out_ok, acc)


@triton.jit
def _mlm_loss_bwd_dweight_kernel(
    Hid, W, B, Labels, Lse, G,   # as in the d hidden kernel
    DW,                          # [V, H] output
    DB,                          # [V] float32 output (written by the programs of hidden chunk 0)
    stride_h_n, stride_w_v, stride_dw_v, N, V, H,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HO: tl.constexpr,
):
    vocab = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    out_cols = tl.program_id(1) * BLOCK_HO + tl.arange(0, BLOCK_HO)
    v_ok = vocab < V
    out_ok = out_cols < H
    acc = tl.zeros((BLOCK_V, BLOCK_HO), dtype=tl.float32)
    db = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for r0 in range(0, N, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        dz = _dlogit_tile(Hid, W, B, Labels, Lse, G, rows, row_ok, vocab, v_ok, stride_h_n, stride_w_v, H,
                          HAS_BIAS, BLOCK_M, BLOCK_V, BLOCK_H, DOT_PRECISION)
        h = _load_block(Hid, rows, row_ok, stride_h_n, out_cols, out_ok)
        acc = tl.dot(tl.trans(dz.to(h.dtype)), h, acc, input_precision=DOT_PRECISION)
        db += tl.sum(dz, axis=0)
    _store_block(DW, vocab, v_ok, stride_dw_v, out_cols, out_ok, acc)
    if tl.program_id(1) == 0:
        tl.store(DB + vocab, db, mask=v_ok)


@triton.jit
def _row_logits(base, B, cols, stride_z, V, HAS_BIAS: tl.constexpr):
    """float32 logits of one row's columns `cols`: the product (+ bias), -inf past the vocabulary."""
    in_row = cols < stride_z
    z = tl.load(base + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + cols, mask=in_row, other=0.0)
    return tl.where(cols < V, z, float("-inf"))


@triton.jit
def _ce_rows_kernel(
    Z,          # [C, stride_z] one chunk's h @ W^T in the first V columns of each row (compute dtype), overwritten
                # with the logits' gradient when WRITE_GRAD; the padding columns [V, stride_z) are read and written too
    B,          # [stride_z] float32 the decoder bias, zero-padded (unused unless HAS_BIAS)
    Labels,     # [C] int64; a label outside [0, V) matches no logit
    Scale,      # [C] float32 the weight of each row's loss in what is differentiated (read when WRITE_GRAD)
    Loss,       # [C] float32 out: lse - z[label] (lse alone for a label outside [0, V))
    Hit,        # [C] int8 out: 1 where the first index of the row's largest logit is the label
    stride_z, V,
    HAS_BIAS: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One row per program, two passes over its logits z = h @ W^T + b (the bias added here, in float32, so that
    cuBLAS writes a plain product into the padded rows): online max / sum of exponentials / label logit / first
    argmax, then (WRITE_GRAD) dz = (exp(z - lse) - onehot(label)) * scale written over the product. Memory is
    touched up to the padded row end (stride_z, a multiple of 16) and the vocabulary bound applied to the values,
    so that every access is a 16-byte vector; the padding gets dz = 0."""
    row = tl.program_id(0)
    base = Z + row.to(tl.int64) * stride_z
    label = tl.load(Labels + row)
    m = -float("inf")
    l = 0.0
    target = 0.0
    best = -float("inf")
    best_idx = 0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = _row_logits(base, B, cols, stride_z, V, HAS_BIAS)
        tile_max = tl.max(z, axis=0)
        m_new = tl.maximum(m, tile_max)
        l = l * tl.math.exp2((m - m_new) * LOG2E) + tl.sum(tl.math.exp2((z - m_new) * LOG2E), axis=0)
        m = m_new
        target += tl.sum(tl.where(cols == label, z, 0.0), axis=0)
        # First index of the maximum, as torch.argmax: a later tile wins only if strictly larger.
        tile_idx = tl.min(tl.where(z == tile_max, cols, V), axis=0)
        best_idx = tl.where(tile_max > best, tile_idx, best_idx)
        best = tl.maximum(best, tile_max)
    lse = m + tl.math.log2(l) * LN2
    tl.store(Loss + row, lse - target)
    tl.store(Hit + row, (best_idx == label).to(tl.int8))
    if WRITE_GRAD:
        scale = tl.load(Scale + row)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = _row_logits(base, B, cols, stride_z, V, HAS_BIAS)  # the padding: -inf, exp -> 0, so dz = 0 there
            dz = (tl.math.exp2((z - lse) * LOG2E) - tl.where(cols == label, 1.0, 0.0)) * scale
            tl.store(base + cols, dz.to(Z.dtype.element_ty), mask=cols < stride_z)


class _Tiles(NamedTuple):
    BLOCK_M: int     # labelled rows
    BLOCK_V: int     # vocabulary entries
    BLOCK_H: int     # hidden features per step of the logit contraction
    BLOCK_HO: int    # hidden features of the d hidden / d weight block a backward program owns
    num_warps: int
    num_stages: int


def _tiles(kernel: str, h: int, dtype: torch.dtype, target: targets.Target | None) -> _Tiles:
    """Tiles per kernel ("fwd", "dhidden", "dweight") on `target`. The interpreter's (None) cost is per tile:
    wide vocabulary tiles, small everything else. On a GPU, the widest output chunks that compile for sm_90
    without register spills: the backward's recomputation falls as BLOCK_HO grows. float32 uses exact products
    on the CUDA cores and needs smaller tiles. A family where these spill has its table's instead
    (tests/compile_gpus.py checks what each family ends up with)."""
    if target is None:
        return _Tiles(16, 128, 16, 32, 4, 1)
    if dtype == torch.float32:
        return _Tiles(32, 64, 32, min(64, triton.next_power_of_2(h)), 4, 2)
    block_ho = min(256, triton.next_power_of_2(h))
    return {"fwd": _Tiles(64, 128, 64, block_ho, 8, 3),
            "dhidden": _Tiles(64, 128, 64, block_ho, 8, 3),
            "dweight": _Tiles(64, 64, 64, block_ho, 8, 3)}[kernel]


def _config(kernel: str, dtype: torch.dtype, h: int, target: targets.Target | None, rows: int | None) -> _Tiles:
    """The tiles of `kernel` on `target`: its table's entry (kernels/tuned.py), else the defaults of `_tiles`.
    Every mlm_loss launch site is keyed by hidden size and the bucket of the labelled row count."""
    def need(c: _Tiles, t: targets.Target) -> tuned.Need:
        """A row and a vocabulary tile of the contraction per pipeline stage in shared memory; a thread's share
        of the logit tile and of the d hidden (BLOCK_M rows) or d weight (BLOCK_V rows) block it owns."""
        owned = {"fwd": 0, "dhidden": c.BLOCK_M, "dweight": c.BLOCK_V}[kernel] * c.BLOCK_HO
        size = (c.BLOCK_M + c.BLOCK_V) * c.BLOCK_H * dtype.itemsize * max(1, c.num_stages - 1)
        return tuned.tile_need(c.BLOCK_M * c.BLOCK_V + owned, c, t, size)
    return tuned.pick(f"mlm_loss.{kernel}", _tiles(kernel, h, dtype, target), target, dtype, h, seqlen=rows,
                      need=need)


def _vocab_splits(device, n_row_blocks: int, vocab: int, block_v: int) -> tuple[int, int]:
    """(splits, vocabulary entries per split, a multiple of block_v) for the forward: with few labelled rows
    the row blocks alone leave SMs idle (4,915 rows at BERT pre-training shapes are 77 blocks of 64 for 132
    SMs), so the vocabulary is cut into splits whose partial log-sum-exps are merged afterwards."""
    tiles = triton.cdiv(vocab, block_v)
    splits = max(1, min(tiles, triton.cdiv(programs_wanted(device, 2), max(n_row_blocks, 1))))
    tiles_per_split = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split * block_v


@torch.library.custom_op("bertfuse::masked_lm_loss_fwd", mutates_args=())
def _mlm_loss_fwd(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per row [N] float32, hit per row [N] bool, lse [N] float32) of rows hidden [N, H]; a row whose label
    lies outside [0, V) matches no logit: its loss is its lse (callers zero it) and it never hits."""
    hidden, weight, bias = interpreter_upcast(hidden, weight, bias)
    n, h = hidden.shape
    v = weight.shape[0]
    t = _config("fwd", hidden.dtype, h, targets.of(hidden.device), n)
    row_blocks = triton.cdiv(n, t.BLOCK_M)
    splits, per_split = _vocab_splits(hidden.device, row_blocks, v, t.BLOCK_V)
    lse_parts, target_parts, best_parts = (torch.empty((splits, n), dtype=torch.float32, device=hidden.device)
                                           for _ in range(3))
    best_idx_parts = torch.empty((splits, n), dtype=torch.int64, device=hidden.device)
    if n:
        _mlm_loss_fwd_kernel[(row_blocks, splits)](
            hidden, weight, bias, labels, lse_parts, target_parts, best_parts, best_idx_parts,
            hidden.stride(0), weight.stride(0), n, v, h, per_split,
            HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(hidden.dtype),
            BLOCK_M=t.BLOCK_M, BLOCK_V=t.BLOCK_V, BLOCK_H=t.BLOCK_H, num_warps=t.num_warps,
            num_stages=t.num_stages)
    # Merge the splits: [S, N] float32, tiny next to the matmuls. argmax takes the first split on ties, and
    # splits are in vocabulary order, so the first index overall wins, as in torch.argmax.
    lse = torch.logsumexp(lse_parts, dim=0)
    top = best_idx_parts.gather(0, best_parts.argmax(dim=0, keepdim=True)).squeeze(0)
    return lse - target_parts.sum(dim=0), top == labels, lse


@_mlm_loss_fwd.register_fake
def _(hidden, weight, bias, labels):
    n = hidden.shape[0]
    return (hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.bool),
            hidden.new_empty(n, dtype=torch.float32))


@torch.library.custom_op("bertfuse::masked_lm_loss_bwd", mutates_args=())
def _mlm_loss_bwd(dloss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  labels: torch.Tensor, lse: torch.Tensor, need_hidden: bool, need_weight: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d weight, d bias float32 [V]) for the upstream gradient dloss [N] of each row's loss."""
    dtypes = hidden.dtype, weight.dtype
    hidden, weight, bias = interpreter_upcast(hidden, weight, bias)
    n, h = hidden.shape
    v = weight.shape[0]
    g = dloss.float().contiguous()
    dhidden = torch.zeros_like(hidden)
    dweight = torch.zeros_like(weight)
    dbias = torch.zeros(v, dtype=torch.float32, device=hidden.device)
    common = dict(HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(hidden.dtype))
    if n and need_hidden:
        t = _config("dhidden", hidden.dtype, h, targets.of(hidden.device), n)
        _mlm_loss_bwd_dhidden_kernel[(triton.cdiv(n, t.BLOCK_M), triton.cdiv(h, t.BLOCK_HO))](
            hidden, weight, bias, labels, lse, g, dhidden, hidden.stride(0), weight.stride(0),
            dhidden.stride(0), n, v, h, **common, **t._asdict())
    if n and need_weight:
        t = _config("dweight", hidden.dtype, h, targets.of(hidden.device), n)
        _mlm_loss_bwd_dweight_kernel[(triton.cdiv(v, t.BLOCK_V), triton.cdiv(h, t.BLOCK_HO))](
            hidden, weight, bias, labels, lse, g, dweight, dbias, hidden.stride(0), weight.stride(0),
            dweight.stride(0), n, v, h, **common, **t._asdict())
    return dhidden.to(dtypes[0]), dweight.to(dtypes[1]), dbias


@_mlm_loss_bwd.register_fake
def _(dloss, hidden, weight, bias, labels, lse, need_hidden, need_weight):
    return torch.empty_like(hidden), torch.empty_like(weight), weight.new_empty(weight.shape[0], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, labels = inputs
    ctx.save_for_backward(hidden, weight, bias, labels, output[2])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dloss, _dhit, _dlse):
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    dhidden, dweight, dbias = _mlm_loss_bwd(dloss, hidden, weight, bias, labels, lse, ctx.needs_input_grad[0],
                                            ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
    return dhidden, dweight, dbias.to(bias.dtype) if bias is not None else None, None


_mlm_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- strategy "chunked": logits by cuBLAS, one chunk of labelled rows at a time -------------------------------------

# The logits of one chunk: 320 MiB runs BERT-base at 256 x 128 tokens (~4,900 labelled rows, 300 MB of bfloat16
# logits) in one chunk, and keeps BERT-large at 256 x 512 (~19,700 rows: four chunks of 300 MB) well under 1 GB
# of extra memory with d weight's float32 sum (125 MB), a chunk's d weight product and the gathered rows.
CHUNK_BYTES = 320 * 2**20


class _CE(NamedTuple):
    BLOCK_V: int     # vocabulary entries per step of a row's two passes
    num_warps: int


def _ce_default(dtype: torch.dtype, target: targets.Target | None) -> _CE:
    """The interpreter (None) pays per operation, not per element: there a whole BERT row (30,522) is one
    tile."""
    return _CE(32768, 4) if target is None else _CE(4096, 8 if dtype == torch.float32 else 16)


def _ce_config(dtype: torch.dtype, h: int, target: targets.Target | None, rows: int | None) -> _CE:
    """The row kernel's config on `target`: its table's entry (keyed by hidden size and row bucket), else the
    default."""
    return tuned.pick("mlm_loss.ce", _ce_default(dtype, target), target, dtype, h, seqlen=rows,
                      need=lambda c, t: tuned.tile_need(c.BLOCK_V, c, t))  # one row's tile, in float32


def _chunk_bounds(n: int, vocab: int, itemsize: int, chunk_rows: int | None) -> list[tuple[int, int]]:
    """Equal chunks of at most chunk_rows rows (default: CHUNK_BYTES of logits each)."""
    most = chunk_rows or max(1, CHUNK_BYTES // (vocab * itemsize))
    size = triton.cdiv(n, triton.cdiv(n, most)) if n else 1
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _padded(v: int) -> int:
    return triton.cdiv(v, 16) * 16


def _product(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h @ weight^T by cuBLAS, in rows padded to a multiple of 16 elements (30,522 -> 30,528), so that every row
    starts 16-byte aligned and the row kernel moves it in 16-byte vectors (cuBLAS writes with that row stride;
    the bias is the row kernel's, since a bias epilogue needs contiguous rows)."""
    z = h.new_empty(h.shape[0], _padded(weight.shape[0]))[:, :weight.shape[0]]
    return torch.mm(h, weight.t(), out=z)


class _Grads(NamedTuple):
    dhidden: torch.Tensor    # [N, H], or [0] when not wanted
    dweight: torch.Tensor    # [V, H], or [0]
    dbias: torch.Tensor      # [V] float32, or [0]


def _new_grads(hidden, weight, bias, need_hidden, need_weight, accumulate=False) -> _Grads:
    """Gradient buffers, [0] where not wanted; `accumulate`: d weight in float32 (summed over chunks). d hidden is
    left uninitialised (each chunk writes its rows), the sums start at zero (no rows: zero gradients)."""
    def tensor(wanted, shape, dtype, make=hidden.new_zeros):
        return make(shape, dtype=dtype) if wanted else hidden.new_empty(0, dtype=dtype)

    return _Grads(tensor(need_hidden, hidden.shape, hidden.dtype, hidden.new_empty),
                  tensor(need_weight, weight.shape, torch.float32 if accumulate else weight.dtype),
                  tensor(need_weight and bias is not None, weight.shape[:1], torch.float32))


class _Pass(NamedTuple):
    loss: torch.Tensor       # [N] float32: lse - z[label]
    hit: torch.Tensor        # [N] bool
    grads: _Grads


def _chunked_pass(hidden, weight, bias, labels, scale, chunk_rows, need_hidden=False, need_weight=False) -> _Pass:
    """Per chunk of rows: hidden @ weight^T by cuBLAS in the compute dtype, the row kernel over it (+ bias), and,
    given the per-row weights `scale` of the differentiated sum, d hidden = dz @ weight, d weight += dz^T @ hidden,
    d bias += colsum(dz) (cuBLAS again, dz written over z)."""
    n, v = hidden.shape[0], weight.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    hit = torch.empty(n, dtype=torch.int8, device=hidden.device)
    chunks = _chunk_bounds(n, v, hidden.element_size(), chunk_rows)
    write = scale is not None and (need_hidden or need_weight)
    grads = _new_grads(hidden, weight, bias, write and need_hidden, write and need_weight, len(chunks) > 1)
    t = _ce_config(hidden.dtype, hidden.shape[1], targets.of(hidden.device), n)
    padded_bias = None if bias is None else F.pad(bias.float(), (0, _padded(v) - v))
    for start, end in chunks:
        h = hidden[start:end]
        z = _product(h, weight)
        _ce_rows_kernel[(end - start,)](  # without WRITE_GRAD, Scale is never read: any float32 pointer
            z, padded_bias, labels[start:end], scale[start:end] if write else loss, loss[start:end], hit[start:end],
            z.stride(0), v, HAS_BIAS=bias is not None, WRITE_GRAD=write, BLOCK_V=t.BLOCK_V, num_warps=t.num_warps)
        if not write:
            continue
        if need_hidden:
            torch.mm(z, weight, out=grads.dhidden[start:end])
        if need_weight:  # one chunk: cuBLAS's float32 sum rounded once, as eager PyTorch; more: summed in float32
            if len(chunks) == 1:
                torch.mm(z.t(), h, out=grads.dweight)
            else:
                grads.dweight.add_(z.t() @ h)
            if bias is not None:
                grads.dbias.add_(z.sum(dim=0, dtype=torch.float32))
    return _Pass(loss, hit.bool(), grads._replace(dweight=grads.dweight.to(weight.dtype)))


@torch.library.custom_op("bertfuse::masked_lm_loss_chunked", mutates_args=())
def _mlm_loss_chunked(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                      scale: torch.Tensor, norm: torch.Tensor, chunk_rows: int, need_hidden: bool, need_weight: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total = norm * sum(loss * scale) float32 [], loss [N] float32, hit [N] bool, and the gradients of
    sum(loss * scale): d hidden, d weight, d bias float32), the gradients computed here, in the forward, where the
    logits are at hand. `norm` (1/count for a mean) is applied in the backward, with the upstream gradient."""
    p = _chunked_pass(hidden, weight, bias, labels, scale, chunk_rows, need_hidden, need_weight)
    return ((p.loss * scale).sum() * norm, p.loss, p.hit, *p.grads)


@_mlm_loss_chunked.register_fake
def _(hidden, weight, bias, labels, scale, norm, chunk_rows, need_hidden, need_weight):
    n = hidden.shape[0]
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32),
            hidden.new_empty(n, dtype=torch.bool), *_new_grads(hidden, weight, bias, need_hidden, need_weight))


def _chunked_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[5], *output[3:])
    ctx.bias_dtype = inputs[2].dtype if inputs[2] is not None else None
    ctx.mark_non_differentiable(*output[1:])


def _times(grad: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad * factor rounded once to `dtype`, the product taken in float32: a gradient scaler's factor (2^16)
    or a mean's 1/count is not representable in float16, and float16 gradients would over- or underflow if
    multiplied by it there."""
    if grad.dtype == torch.float16 or dtype == torch.float16:
        return (grad.float() * factor).to(dtype)
    return (grad * factor).to(dtype)


def _chunked_backward(ctx, dtotal, *_):
    """The upstream gradient of the (scalar) total, times `norm`, scales what the forward computed: the gradients
    of the plain sum (each row's dz = softmax - onehot, up to 1 in size; the module docstring says why)."""
    norm, dhidden, dweight, dbias = ctx.saved_tensors
    factor, need = dtotal.float() * norm, ctx.needs_input_grad
    return (_times(dhidden, factor, dhidden.dtype) if need[0] else None,
            _times(dweight, factor, dweight.dtype) if need[1] else None,
            _times(dbias, factor, ctx.bias_dtype) if need[2] and ctx.bias_dtype else None,
            None, None, None, None, None, None)


_mlm_loss_chunked.register_autograd(_chunked_backward, setup_context=_chunked_setup_context)


@torch.library.custom_op("bertfuse::masked_lm_loss_chunked_rows", mutates_args=())
def _mlm_loss_chunked_rows(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           labels: torch.Tensor, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [N] float32, hit [N] bool), for reduction="none": each row's upstream gradient is known only in the
    backward, which recomputes the logits (4 logit-sized matmuls in all instead of 3)."""
    p = _chunked_pass(hidden, weight, bias, labels, None, chunk_rows)
    return p.loss, p.hit


@_mlm_loss_chunked_rows.register_fake
def _(hidden, weight, bias, labels, chunk_rows):
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.bool)


@torch.library.custom_op("bertfuse::masked_lm_loss_chunked_bwd", mutates_args=())
def _mlm_loss_chunked_bwd(dloss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          labels: torch.Tensor, chunk_rows: int, need_hidden: bool, need_weight: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = _chunked_pass(hidden, weight, bias, labels, dloss.float().contiguous(), chunk_rows, need_hidden, need_weight)
    return tuple(p.grads)


@_mlm_loss_chunked_bwd.register_fake
def _(dloss, hidden, weight, bias, labels, chunk_rows, need_hidden, need_weight):
    return tuple(_new_grads(hidden, weight, bias, need_hidden, need_weight))


def _rows_setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, chunk_rows = inputs
    ctx.save_for_backward(hidden, weight, bias, labels)
    ctx.chunk_rows = chunk_rows
    ctx.mark_non_differentiable(output[1])


def _rows_backward(ctx, dloss, _dhit):
    hidden, weight, bias, labels = ctx.saved_tensors
    need = ctx.needs_input_grad
    dhidden, dweight, dbias = _mlm_loss_chunked_bwd(dloss, hidden, weight, bias, labels, ctx.chunk_rows, need[0],
                                                    need[1] or need[2])
    return (dhidden if need[0] else None, dweight if need[1] else None,
            dbias.to(bias.dtype) if need[2] else None, None, None)


_mlm_loss_chunked_rows.register_autograd(_rows_backward, setup_context=_rows_setup_context)


def _check(hidden, weight, bias, labels, reduction):
    op = "masked_lm_loss"
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{op}: {name} must be a 2-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        check_float(op, name, t)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{op}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: hidden has {hidden.shape[1]} features but weight is {tuple(weight.shape)} [V, H]")
    if bias is not None:
        check_float(op, "bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"{op}: labels must be an integer tensor")
    if tuple(labels.shape) != (hidden.shape[0],):
        raise ValueError(f"{op}: labels has shape {tuple(labels.shape)}, expected ({hidden.shape[0]},)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_device(op, hidden=hidden, weight=weight, bias=bias, labels=labels)


class _Strategy(NamedTuple):
    strategy: str


def _strategy_config(dtype: torch.dtype, h: int, target: targets.Target | None, rows: int | None) -> _Strategy:
    """The strategy entry of `target`'s table (keyed by hidden size and row bucket), else "chunked"."""
    return tuned.pick("mlm_loss.strategy", _Strategy("chunked"), target, dtype, h, seqlen=rows)


def pick_strategy(hidden: torch.Tensor, rows: int) -> str:
    """What strategy="auto" runs for `rows` labelled rows of hidden's width and dtype on hidden's device: the
    committed launch-config table's choice for this GPU ("mlm_loss.strategy", measured by the tuner, keyed by
    the row count's bucket), else "chunked" (the CPU, or a GPU or shape the table lacks)."""
    choice = _strategy_config(hidden.dtype, hidden.shape[1], targets.of(hidden.device), rows).strategy
    if choice not in STRATEGIES[1:]:
        tuned.warn_ignored("mlm_loss.strategy", "table", json.dumps({"strategy": choice}),
                           f"not one of {', '.join(STRATEGIES[1:])}")
        return "chunked"
    return choice


class _Rows(NamedTuple):
    """The rows the kernels compute, one concern: gathering (validate=True) or masking (validate=False), in the
    layouts the ops take."""
    hidden: torch.Tensor             # [N', H], unit stride along H
    labels: torch.Tensor             # [N'] int64, contiguous; -1 where a row counts for nothing (validate=False)
    used: torch.Tensor | None        # [N'] bool (validate=False), else None: every row counts
    count: int | torch.Tensor        # labelled rows, at least 1 (the mean's divisor)
    index: torch.Tensor | None       # [N'] positions in the caller's rows (validate=True)


@torch.library.custom_op("bertfuse::labelled_rows", mutates_args=())
def _labelled_rows(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (labels != ignore_index).nonzero().squeeze(1)


@_labelled_rows.register_fake
def _(labels, ignore_index):
    return labels.new_empty(_data_dependent_size(torch.library.get_ctx()), dtype=torch.int64)


def _data_dependent_size(ctx) -> torch.SymInt:
    """A size only the data knows (the labelled count), as an unbacked symbol in the traced graph. The public
    ctx.new_dynamic_size refuses unless the trace allows every dynamic-shape op (fullgraph=True, or the global
    capture_dynamic_output_shape_ops): otherwise a plain torch.compile would break the graph here, around the
    whole MLM head. This op's consumers (the gather, the head, the loss ops) are written for such a size, so it
    is allocated the way new_dynamic_size allocates it, for this op alone; where that internal function is
    missing (another torch), the public call decides."""
    env = getattr(ctx, "_shape_env", None)
    try:
        from torch._library.fake_impl import allocate_size
    except ImportError:
        allocate_size = None
    if env is None or allocate_size is None or env.allow_dynamic_output_shape_ops:
        return ctx.new_dynamic_size()
    return allocate_size(env)


def labelled_rows(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The positions [R] int64 of labels [N] (integer) that are not ignore_index, in order: (labels !=
    ignore_index).nonzero() in eager mode, and an op of data-dependent size under torch.compile, so that a
    compiled model gathers its labelled rows without a graph break (and fullgraph=True works)."""
    if labels.dim() != 1 or labels.is_floating_point():
        raise ValueError(f"labelled_rows: labels must be a 1-D integer tensor, got {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if torch.compiler.is_compiling():
        return _labelled_rows(labels, ignore_index)
    return (labels != ignore_index).nonzero().squeeze(1)


def _check_picked(picked: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The gathered labels lie in [0, vocab): one sync in eager mode (the error names the range found); under
    torch.compile an asynchronous device assertion, which needs no sync and stops the step just the same."""
    message = f"masked_lm_loss: labels must be in [0, {vocab}) or ignore_index={ignore_index}"
    if torch.compiler.is_compiling():
        torch._assert_async(((picked >= 0) & (picked < vocab)).all(), message)
    elif picked.numel():
        lo, hi = torch.stack([picked.min(), picked.max()]).tolist()
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{message}; got values in [{lo}, {hi}]")


def _rows(hidden, labels, vocab: int, ignore_index: int, validate: bool) -> _Rows:
    used = labels != ignore_index
    if not validate:  # a label outside [0, V) is treated as ignored, as documented
        used = used & (labels >= 0) & (labels < vocab)
        return _Rows(unit_stride(hidden), labels.masked_fill(~used, -1).to(torch.int64).contiguous(), used,
                     used.sum().clamp_min(1), None)
    index = labelled_rows(labels, ignore_index)
    picked = labels[index]
    _check_picked(picked, vocab, ignore_index)
    count = used.sum().clamp_min(1) if torch.compiler.is_compiling() else max(index.numel(), 1)
    return _Rows(hidden[index], picked.to(torch.int64).contiguous(), None, count, index)


def _check_strategy(strategy, chunk_rows) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"masked_lm_loss: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"masked_lm_loss: chunk_rows must be a positive int or None, got {chunk_rows!r}")


def _row_loss(r: _Rows, weight, bias, strategy: str, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [N'] float32 with 0 where a row counts for nothing, hit [N'] bool), differentiable per row."""
    if strategy == "fused":
        per_row, hit, _ = _mlm_loss_fwd(r.hidden, weight, bias, r.labels)
    else:
        per_row, hit = _mlm_loss_chunked_rows(r.hidden, weight, bias, r.labels, chunk_rows)
    return (per_row if r.used is None else per_row * r.used), hit


def _reduced_loss(r: _Rows, weight, bias, reduction: str, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean or sum, hit [N']) by the chunked strategy, its gradients computed in the forward: the weight of each
    row in the differentiated sum (1/count or 1, 0 where a row counts for nothing) is known there."""
    scale = (torch.ones(r.hidden.shape[0], dtype=torch.float32, device=r.hidden.device) if r.used is None
             else r.used.float())
    norm = torch.ones((), dtype=torch.float32, device=r.hidden.device)
    if reduction == "mean":
        norm = norm / r.count
    grad = torch.is_grad_enabled()
    need_hidden = grad and r.hidden.requires_grad
    need_weight = grad and (weight.requires_grad or (bias is not None and bias.requires_grad))
    total, _, hit, *_ = _mlm_loss_chunked(r.hidden, weight, bias, r.labels, scale, norm, chunk_rows, need_hidden,
                                          need_weight)
    return total, hit


def masked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   ignore_index: int = -100, reduction: str = "mean", return_correct: bool = False,
                   validate: bool = True, strategy: str = "auto", chunk_rows: int | None = None):
    """cross_entropy(hidden @ weight^T + bias, labels) over the labelled rows only, in bounded memory.

    hidden [N, H], weight [V, H], bias [V] or None, labels [N] (ignore_index rows contribute nothing).
    Returns the loss ("mean" over labelled rows, 0 when there are none; "sum"; or "none": [N] with 0 at
    ignored rows), or with return_correct=True an MLMLossOutput(loss, correct), `correct` counting labelled
    rows whose top-1 logit is the label.

    strategy: "chunked" (logits of at most `chunk_rows` rows at a time by cuBLAS, default CHUNK_BYTES of them;
    gradients computed in the forward), "fused" (no logits in memory at all; Triton matmuls, recomputed in the
    backward) or "auto" (the GPU's measured choice, pick_strategy; "chunked" on the CPU). The module docstring
    gives each one's FLOPs and memory.

    validate=True (the default) checks that labels lie in [0, V) and skips ignored rows, which takes one host
    sync. validate=False takes none, for fixed-shape batches whose labels are checked where they are made
    (a packer's): every row is computed and the ignored ones are zeroed, loss and gradients; a label
    outside [0, V) then acts like an ignored row's (no error, no NaN). Runs as custom ops
    (bertfuse::masked_lm_loss_*), which torch.compile traces through in one graph with either validate: compiled,
    validate=True gathers the labelled rows by an op of data-dependent size (labelled_rows) and checks their
    labels by a device assertion instead of a sync, and strategy="auto" picks for N rows (the count is not known
    while tracing).
    """
    _check(hidden, weight, bias, labels, reduction)
    _check_strategy(strategy, chunk_rows)
    r = _rows(hidden, labels, weight.shape[0], ignore_index, validate)
    weight, bias = unit_stride(weight), dense(bias)  # the layouts the kernels index
    if strategy == "auto":  # compiled, the labelled count is data: the pick is for its bound, all N rows
        strategy = pick_strategy(r.hidden, labels.shape[0] if torch.compiler.is_compiling() else r.hidden.shape[0])
    if strategy == "fused":
        targets.check("masked_lm_loss(strategy='fused')", hidden.dtype, hidden.device, dots=True)
    if strategy == "chunked" and reduction != "none":
        loss, hit = _reduced_loss(r, weight, bias, reduction, chunk_rows or 0)
    else:
        per_row, hit = _row_loss(r, weight, bias, strategy, chunk_rows or 0)
        if reduction == "mean":
            loss = per_row.sum() / r.count
        elif reduction == "sum":
            loss = per_row.sum()
        else:
            loss = per_row if r.index is None else per_row.new_zeros(labels.shape[0]).index_put((r.index,), per_row)
    if return_correct:
        return MLMLossOutput(loss, hit.sum(dtype=torch.int64))
    return loss


def masked_lm_loss_ref(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                       ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """`masked_lm_loss` in plain PyTorch, for checks: every row's logits in the inputs' dtype, the softmax in
    float32 at least (as under autocast); "mean" over the labelled rows, 0 when there are none."""
    logits = F.linear(hidden, weight, bias)
    per_row = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels,
                              ignore_index=ignore_index, reduction="none")
    if reduction == "none":
        return per_row
    return per_row.sum() if reduction == "sum" else per_row.sum() / (labels != ignore_index).sum().clamp_min(1)

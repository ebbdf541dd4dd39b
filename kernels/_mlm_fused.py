"""Strategy "fused" of the masked-LM loss (kernels/mlm_loss.py): no logits in memory at all.

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
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import launches, targets, tuned
from ._common import LN2, LOG2E, dot_precision, interpreter_upcast, programs_wanted


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


def _fused_site(part: str, kernel, candidates) -> launches.LaunchSite:
    return launches.LaunchSite(f"mlm_loss.{part}", kernel, lambda dtype, h, target: _tiles(part, h, dtype, target),
                               lambda dtype, h, target, rows=None: _config(part, dtype, h, target, rows), candidates,
                               needs="tensor_cores")


_FWD, _DHIDDEN, _DWEIGHT = launches.declare(
    _fused_site("fwd", _mlm_loss_fwd_kernel, launches.grid(BLOCK_M=[64, 128], BLOCK_V=[64, 128, 256], BLOCK_H=[64],
                                                           num_warps=[4, 8], num_stages=[3])),
    _fused_site("dhidden", _mlm_loss_bwd_dhidden_kernel,
                launches.grid(BLOCK_M=[64, 128], BLOCK_V=[64, 128], BLOCK_HO=[128, 256], num_warps=[8],
                              num_stages=[2, 3])
                + launches.grid(BLOCK_M=[64], BLOCK_V=[32], BLOCK_HO=[512], num_warps=[8], num_stages=[2])
                # float32's exact products on the CUDA cores hold their accumulators in registers
                + launches.grid(BLOCK_M=[16, 32], BLOCK_V=[32, 64], BLOCK_HO=[32, 64], num_warps=[4], num_stages=[2])),
    _fused_site("dweight", _mlm_loss_bwd_dweight_kernel,
                launches.grid(BLOCK_M=[32, 64], BLOCK_V=[64, 128], BLOCK_HO=[128, 256], num_warps=[8],
                              num_stages=[2, 3])
                + launches.grid(BLOCK_M=[64], BLOCK_V=[64], BLOCK_HO=[512], num_warps=[8], num_stages=[2])))


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
        _FWD.launch((row_blocks, splits),
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
        _DHIDDEN.launch((triton.cdiv(n, t.BLOCK_M), triton.cdiv(h, t.BLOCK_HO)),
            hidden, weight, bias, labels, lse, g, dhidden, hidden.stride(0), weight.stride(0),
            dhidden.stride(0), n, v, h, **common, **t._asdict())
    if n and need_weight:
        t = _config("dweight", hidden.dtype, h, targets.of(hidden.device), n)
        _DWEIGHT.launch((triton.cdiv(v, t.BLOCK_V), triton.cdiv(h, t.BLOCK_HO)),
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

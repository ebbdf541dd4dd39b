"""Strategy "chunked" of the masked-LM loss (kernels/mlm_loss.py), its default: the rows in chunks of at most
CHUNK_BYTES of logits. Per chunk, h @ W^T by cuBLAS in the compute dtype (rows padded to 16 elements), then one
Triton program per row (_ce_rows_kernel), z being that product + b in float32: pass 1 the online max / sum of
exponentials, the label's logit and the first argmax (loss = lse - z[label]); pass 2 writes dz = (softmax(z) -
onehot(label)) * s over the product, s being 1 for a row that counts and 0 for one that counts for nothing. Then d h
= dz @ W and d W += dz^T @ h by cuBLAS and d b += colsum(dz): 3 logit-sized matmuls in all, the gradients of the
plain sum computed in the forward (the logits are at hand there; Liger-Kernel's fused linear cross-entropy does the
same) and scaled in the backward by the upstream scalar times 1/count for "mean", in float32, then rounded once.
Dividing by the count in the forward instead would put a float16 dz of 4,096 rows x 30,522 entries (~1e-8) below
float16's range before a gradient scaler's 2^16 arrives. reduction="none" has a per-row upstream gradient, known
only in the backward: there the logits are recomputed (4 matmuls). Extra memory: one chunk of logits, the gradients
from forward to backward, and with several chunks a float32 [V, H] sum of d W.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import launches, targets, tuned
from ._common import LN2, LOG2E


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


_CE_ROWS, = launches.declare(launches.LaunchSite(
    "mlm_loss.ce", _ce_rows_kernel, lambda dtype, h, target: _ce_default(dtype, target),
    lambda dtype, h, target, rows=None: _ce_config(dtype, h, target, rows),
    launches.grid(BLOCK_V=[1024, 2048, 4096, 8192], num_warps=[4, 8, 16]), needs="vectors"))


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
        _CE_ROWS.launch((end - start,),  # without WRITE_GRAD, Scale is never read: any float32 pointer
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

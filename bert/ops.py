"""The one boundary where the model's hot ops switch between PyTorch and the fused Triton kernels.

Every function takes `backend` ("torch" or "triton", already resolved) and computes the same thing either way.
`kernels` (and so triton) is imported only when the Triton path is taken, so the PyTorch path runs anywhere.
"""
from __future__ import annotations

import importlib.util
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .padding import Unpadded


# Looked up once, without importing triton (a constant, so torch.compile traces resolve_backend away).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def resolve_backend(name: str) -> str:
    """'auto' -> 'triton' when CUDA and triton are available, else 'torch'."""
    has_triton = _HAS_TRITON
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if has_triton and torch.cuda.is_available() else "torch"
    if name == "triton":
        if not has_triton:
            raise RuntimeError("backend='triton' needs the triton package; install it or use backend='torch'")
        return "triton"
    raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {name!r}")


def _kernels():
    import kernels  # lazy: pulls in triton

    return kernels


# ---- LayerNorm(dropout(x) + residual) ------------------------------------------------------------
def layer_norm(x, weight, bias, eps, residual=None, dropout_p=0.0, backend="torch"):
    if backend == "triton":
        return _kernels().layer_norm(x, weight, bias, eps, residual=residual, dropout_p=dropout_p)
    if dropout_p > 0:
        x = F.dropout(x, dropout_p)
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# ---- GeLU(x + bias) ------------------------------------------------------------------------------
def bias_gelu(x, bias, approximate="none", backend="torch"):
    if backend == "triton":
        return _kernels().bias_gelu(x, bias, approximate=approximate)
    return F.gelu(x + bias, approximate=approximate)


# ---- attention over packed sequences ------------------------------------------------------------
_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A UserWarning the first time `message` comes up in this process, silence after."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def project_qkv(x, query, key, value, heads: int, head_dim: int):
    """q, k, v ([tokens, heads, head_dim] views) from one matmul over three Linears' concatenated weights."""
    projs = (query, key, value)
    qkv = F.linear(x, torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs]))
    return qkv.view(x.shape[0], 3, heads, head_dim).unbind(1)


def self_attention(x, u: Unpadded, query, key, value, heads: int, head_dim: int, dropout_p=0.0, backend="torch"):
    """Multi-head self-attention of packed tokens x [tokens, hidden] within their own sequences, before the
    output projection: one BERT layer's attention, for our model and the fused Hugging Face layers alike."""
    q, k, v = project_qkv(x, query, key, value, heads, head_dim)
    return varlen_attention(q, k, v, u, dropout_p=dropout_p, backend=backend).reshape(x.shape[0], heads * head_dim)


def varlen_attention(q, k, v, u: Unpadded, dropout_p=0.0, backend="torch"):
    """q, k, v: [total_tokens, heads, head_dim]; each token attends to the tokens of its own sequence."""
    if backend == "triton" and q.shape[-1] not in _kernels().attention.HEAD_DIMS:
        warn_once(f"the Triton attention kernel does not support head_dim {q.shape[-1]}; "
                   "this model's attention runs in PyTorch")
        backend = "torch"
    if backend == "triton":
        # cu_seqlens comes from bert.padding, so the value checks (a device sync) are skipped.
        return _kernels().varlen_attention(q, k, v, u.cu_seqlens, u.max_seqlen, dropout_p=dropout_p, validate=False)
    return _torch_varlen_attention(q, k, v, u, dropout_p)


def _torch_varlen_attention(q, k, v, u: Unpadded, dropout_p):
    if u.rows:
        return _torch_rows_attention(q, k, v, u, dropout_p)
    # Pads to [batch, max_seqlen] (the longest real sequence, not the input's length) and runs SDPA with a
    # key mask. A finite fill instead of -inf keeps rows of empty sequences finite; they are dropped anyway.
    total, heads, dim = q.shape
    batch, length = u.batch, max(u.max_seqlen, 1)
    slot = u.seq * length + u.pos

    def to_batch(t):
        out = t.new_zeros(batch * length, heads, dim).index_put((slot,), t)
        return out.view(batch, length, heads, dim).transpose(1, 2)

    seqlens = u.cu_seqlens[1:] - u.cu_seqlens[:-1]
    keep = torch.arange(length, device=q.device)[None, :] < seqlens[:, None]
    mask = torch.zeros(batch, 1, 1, length, dtype=q.dtype, device=q.device)
    mask.masked_fill_(~keep[:, None, None, :], torch.finfo(q.dtype).min)
    out = F.scaled_dot_product_attention(to_batch(q), to_batch(k), to_batch(v), attn_mask=mask, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(batch * length, heads, dim)[slot]


def _torch_rows_attention(q, k, v, u: Unpadded, dropout_p):
    # A packed batch: rows of max_seqlen tokens that no sequence crosses, so SDPA runs on [rows, max_seqlen]
    # with a block-diagonal mask (same sequence id). Every token sees at least itself (filler tokens share the
    # id one past the last sequence), so no row of the softmax is empty.
    total, heads, dim = q.shape
    length = total // u.rows
    seq = u.seq.view(u.rows, length)
    mask = (seq[:, :, None] == seq[:, None, :])[:, None]

    def rows(t):
        return t.view(u.rows, length, heads, dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), attn_mask=mask, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(total, heads, dim)


# ---- masked-LM loss at labelled rows only --------------------------------------------------------
class MLMLoss(NamedTuple):
    loss: torch.Tensor              # scalar, mean over labelled rows (0 when there are none)
    correct: torch.Tensor           # number of rows whose top-1 prediction equals the label
    logits: torch.Tensor | None     # [rows, vocab] on the torch path; None where the kernel never forms them


def masked_lm_loss(hidden, weight, bias, labels, backend="torch") -> MLMLoss:
    """hidden [rows, H] (already gathered at labelled positions), weight [V, H], bias [V], labels [rows], checked
    by the caller; rows labelled -100 (a packed batch's unused slots), or outside [0, V), count for nothing on
    both backends. No host sync."""
    if backend == "triton":
        # Under autocast the head's output is half precision while the tied weight is float32.
        weight = weight.to(hidden.dtype)
        loss, correct = _kernels().masked_lm_loss(hidden, weight, bias, labels, return_correct=True,
                                                  validate=False)
        return MLMLoss(loss, correct, None)
    logits = F.linear(hidden, weight, bias)
    # Rows labelled -100 (a packed batch's unused slots) are ignored; no labelled row gives 0, not F.cross_entropy's
    # NaN mean over nothing, without a sync.
    used = (labels >= 0) & (labels < weight.shape[0])
    labels = labels.masked_fill(~used, -100)
    loss = F.cross_entropy(logits.float(), labels, reduction="sum") / used.sum().clamp_min(1)
    correct = ((logits.argmax(-1) == labels) & used).sum()
    return MLMLoss(loss, correct, logits)

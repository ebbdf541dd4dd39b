"""The one boundary where the model's hot ops switch between PyTorch and the fused Triton kernels.

Every function takes `backend` ("torch" or "triton", already resolved) and computes the same thing either way: its
Triton path is one public entry point of `kernels`, its PyTorch path plain torch. `kernels` (and so triton) is
imported only when the Triton path is taken, so the PyTorch path runs anywhere; that is also why the PyTorch paths
of layer_norm and bias_gelu are written here rather than calling `kernels.layer_norm_ref` / `bias_gelu_ref`, whose
modules import triton. Fused Hugging Face layers (bert.hf) reach the kernels through this module only.
"""
from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F

from bertfuse.bert.data.batch import Packed

# Looked up once, without importing triton (a constant, so torch.compile traces resolve_backend away).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kernels_gpu() -> bool:
    """A GPU the kernels support: a ROCm one, or NVIDIA sm_75 (Turing) and newer."""
    if not torch.cuda.is_available():
        return False
    return torch.version.hip is not None or torch.cuda.get_device_capability() >= (7, 5)


def resolve_backend(name: str) -> str:
    """'auto' -> 'triton' when triton and a GPU the kernels support (CUDA sm_75+, or ROCm) are here, else
    'torch'."""
    has_triton = _HAS_TRITON
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if has_triton and _kernels_gpu() else "torch"
    if name == "triton":
        if not has_triton:
            raise RuntimeError("backend='triton' needs the triton package; install it or use backend='torch'")
        return "triton"
    raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {name!r}")


# The Triton path of each op: the public entry point of `kernels` it calls, by the op's module there (the
# trainer's optimizer included: --optimizer lamb).
TRITON = {"attention": "varlen_attention", "bias_gelu": "bias_gelu", "disentangled": "disentangled_attention",
          "glu": "glu", "lamb": "Lamb", "layer_norm": "layer_norm", "mlm_loss": "masked_lm_loss", "rotary": "rotary"}


def _triton(op: str):
    return getattr(kernels_package(), TRITON[op])


def kernels_package():
    """`bertfuse.kernels`, imported at first use (it imports triton)."""
    from bertfuse import kernels

    return kernels


def backend_for(t: torch.Tensor) -> str:
    """For a fused Hugging Face model, which holds no config: the kernels' own choice for drop-in modules
    (kernels.backend_for: 'triton' where they run on t's device, else 'torch', warned once)."""
    return kernels_package().backend_for(t)


def exporting_onnx() -> bool:
    """In an ONNX export (kernels.exporting_onnx), where fused modules run their original code."""
    return kernels_package().exporting_onnx()


def attention_refusal(head_dim: int, device=None, dtype=None) -> str | None:
    """Why the Triton attention cannot run heads of head_dim (on device, in dtype, where given): None where it
    can (kernels.refusal)."""
    return kernels_package().refusal("attention", device, dtype, head_dim=head_dim)


# ---- LayerNorm / RMSNorm(dropout(x) + residual) --------------------------------------------------
def layer_norm(x, weight, bias, eps, residual=None, dropout_p=0.0, backend="torch", rms=False, return_sum=False):
    """rms: RMSNorm (no mean subtracted); return_sum: (y, dropout(x) + residual), a pre-norm layer's residual
    stream returned with its norm."""
    if backend == "triton":
        return _triton("layer_norm")(x, weight, bias, eps, residual=residual, dropout_p=dropout_p, rms=rms,
                                     return_sum=return_sum)
    if dropout_p > 0:
        x = F.dropout(x, dropout_p)
    if residual is not None:
        x = x + residual
    if rms:
        y = F.rms_norm(x, (x.shape[-1],), weight, eps)
        y = y if bias is None else y + bias
    else:
        y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return (y, x) if return_sum else y


# ---- GeLU(x + bias) ------------------------------------------------------------------------------
def bias_gelu(x, bias, approximate="none", backend="torch"):
    if backend == "triton":
        return _triton("bias_gelu")(x, bias, approximate=approximate)
    return F.gelu(x + bias, approximate=approximate)


def linear_gelu(x, weight, bias, approximate="none", backend="torch"):
    """GeLU(x W^T + b): the matmul without its bias, then bias + GeLU in one kernel, which reads the matmul's
    output once."""
    return bias_gelu(F.linear(x, weight), bias, approximate, backend=backend)


# ---- act(a) * b: gated units (GeGLU, SwiGLU) -------------------------------------------------------
def glu(a, b, activation="gelu", backend="torch"):
    """activation: "gelu" (erf), "gelu_tanh" or "silu"."""
    if backend == "triton":
        return _triton("glu")(a, b, activation)
    act = F.silu(a) if activation == "silu" else F.gelu(a, approximate="tanh" if activation == "gelu_tanh" else "none")
    return act * b


# ---- rotary position embeddings -----------------------------------------------------------------
class Rotation(NamedTuple):
    """What rotates q and k: pair i of the first 2 * len(inv_freq) features turns by position * inv_freq[i];
    cos and sin times `scaling`; `interleaved` pairs (2i, 2i + 1), else (i, i + len(inv_freq)). Or a model's
    own tables: cos and sin [rows, rotary_dim // 2] read at each token's row (inv_freq None)."""
    inv_freq: torch.Tensor | None  # [rotary_dim // 2] float32
    scaling: float = 1.0
    interleaved: bool = False
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def rotary(x, positions, rotation: Rotation, backend="torch"):
    """x [tokens, heads, head_dim] rotated by each token's position (positions [tokens], int), as transformers
    rotates q and k: the float32 angles' cos and sin, in x's dtype on the PyTorch path."""
    if backend == "triton":  # the rows of a table are the caller's (the fused models' own gathers): not re-checked
        k = kernels_package()
        return k.rotary(x, positions, k.Rotary(*rotation), validate=False)
    if rotation.cos is not None:
        half = rotation.cos.shape[1]
        cos, sin = ((t[positions] * rotation.scaling).to(x.dtype)[:, None, :] for t in (rotation.cos, rotation.sin))
    else:
        half = rotation.inv_freq.numel()
        angle = positions.float()[:, None] * rotation.inv_freq.float()[None, :]
        cos, sin = ((f(angle) * rotation.scaling).to(x.dtype)[:, None, :] for f in (torch.cos, torch.sin))
    if rotation.interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        turned = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
        turned = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([turned, x[..., 2 * half:]], dim=-1)


# ---- attention over packed sequences ------------------------------------------------------------
def warn_once(message: str) -> None:
    """The kernels' warning channel (a UserWarning the first time `message` comes up in this process): only on
    paths that have imported them."""
    kernels_package().warn_once(message)


def hub_kernel(module):
    """The hub kernel whose forward transformers' `kernelize` put on `module` (the `kernels` library binds the
    kernel layer's forward to the instance and records its repository as `_kernel_repo`), else None. Such a
    forward is a declared implementation of the function of the module's class (its layer name, e.g. "GeLU",
    "RMSNorm"), not code of the user's."""
    state = vars(module)
    forward = state.get("forward")
    if "_kernel_repo" in state and getattr(forward, "__self__", None) is module:
        return state["_kernel_repo"]
    return None


def hookless(module) -> bool:
    """Nothing runs around `module`'s own forward when it is called: no hook of its own or global (forward,
    pre-forward, backward), and no forward replaced on the instance (as accelerate's hooks do) other than a hub
    kernel's (`hub_kernel`: another implementation of the same function). A fused op may then compute what the
    call would, without making it; otherwise the module is called."""
    from torch.nn.modules import module as m

    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return not any(getattr(module, h, None) or getattr(m, f"_global{h}", None) for h in hooks) \
        and ("forward" not in vars(module) or hub_kernel(module) is not None)


def plain(module, *classes: type) -> bool:
    """`module` is exactly of one of `classes` (not a wrapper or a subclass: a LoRA layer, a quantised Linear)
    and hookless: a fused op may read its parameters instead of calling it."""
    return type(module) in classes and hookless(module)


def project_qkv(x, query, key, value, heads: int, head_dim: int):
    """q, k, v ([tokens, heads, head_dim] views) from three projection modules: one matmul over their
    concatenated weights where all three are plain biased nn.Linear, else each module called (a LoRA adapter, a
    quantised Linear, a hook: whatever the user put there computes its projection)."""
    projs = (query, key, value)
    if all(plain(p, torch.nn.Linear) and p.bias is not None for p in projs):
        qkv = F.linear(x, torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs]))
        return qkv.view(x.shape[0], 3, heads, head_dim).unbind(1)
    return tuple(p(x).view(x.shape[0], heads, head_dim) for p in projs)


def self_attention(x, p: Packed, query, key, value, heads: int, head_dim: int, dropout_p=0.0, backend="torch",
                   position_bias=None):
    """Multi-head self-attention of packed tokens x [tokens, hidden] within their own sequences, before the
    output projection: one BERT layer's attention, for our model and the fused Hugging Face layers alike."""
    q, k, v = project_qkv(x, query, key, value, heads, head_dim)
    out = varlen_attention(q, k, v, p, dropout_p=dropout_p, backend=backend, position_bias=position_bias)
    return out.reshape(x.shape[0], heads * head_dim)


def varlen_attention(q, k, v, p: Packed, dropout_p=0.0, backend="torch", position_bias=None, window_size=(-1, -1)):
    """q: [total_tokens, heads, head_dim], k and v: [total_tokens, kv_heads, head_dim] (kv_heads dividing heads:
    grouped-query attention); each token attends to the tokens of its own sequence, within window_size = (left,
    right) positions of it (-1: unbounded), and only to its sequence's keys where the layout says which those are
    (`p.keys`; a query that sees none gets zeros); filler tokens (past cu_seqlens[-1]) get zeros. position_bias: a
    kernels.RelativePositionBias added to the scores by the distance of two tokens within their sequence (only
    fused Hugging Face models pass one; they have imported the kernels already), or None."""
    if backend == "triton" and (why := attention_refusal(q.shape[-1], q.device, q.dtype)):
        warn_once(f"{why}; this model's attention runs in PyTorch (SDPA) instead")
        backend = "torch"
    if backend == "triton":
        # The model checked cu_seqlens (or was told not to); the kernels clamp every sequence to the tokens.
        return _triton("attention")(q, k, v, p.cu_seqlens, p.max_seqlen, dropout_p=dropout_p, validate=False,
                                    position_bias=position_bias, window_size=tuple(window_size), **_key_spans(p))
    if k.shape[1] != q.shape[1]:  # SDPA's grouped heads need torch 2.5: the k/v heads repeated instead
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if p.rows:  # a packed pre-training batch: every token a key
        return _torch_rows_attention(q, k, v, p, dropout_p, position_bias, window_size)
    return _torch_sequence_attention(q, k, v, p, dropout_p, position_bias, window_size)


def disentangled_attention(q, k, v, p: Packed, positions, softmax_scale: float, dropout_p=0.0, backend="torch"):
    """DeBERTa's attention of packed tokens q, k, v [total_tokens, heads, head_dim] within their sequences, the
    content-to-position and position-to-content terms read from `positions` (a kernels.DisentangledPositions:
    only fused Hugging Face models pass one, and they have imported the kernels already); filler tokens get
    zeros, and so do the queries of a sequence with no key (`p.keys`). The PyTorch path forms DeBERTa's
    [sequences, heads, L, L] scores, as its own code does."""
    if backend == "triton" and (why := kernels_package().refusal("disentangled", q.device, q.dtype,
                                                                 head_dim=q.shape[-1])):
        warn_once(f"{why}; this model's attention runs in PyTorch instead")
        backend = "torch"
    if backend == "triton":
        return _triton("disentangled")(q, k, v, p.cu_seqlens, p.max_seqlen, positions, dropout_p=dropout_p,
                                       softmax_scale=softmax_scale, validate=False, **_key_spans(p))
    s = _Sequences.of(p)
    qb, kb, vb = s.batched(q), s.batched(k), s.batched(v)
    pos = torch.arange(s.length, device=q.device)
    rows = kernels_package().relative_position_rows(pos[:, None] - pos[None, :], positions.position_buckets,
                                                    positions.max_relative_positions).expand(*qb.shape[:2], -1, -1)
    scores = qb @ kb.transpose(-1, -2)
    if positions.pos_key is not None:  # q_i . Kr[r(i - j)]
        scores = scores + torch.gather(qb @ positions.pos_key.permute(1, 2, 0), -1, rows)
    if positions.pos_query is not None:  # k_j . Qr[r(i - j)]: gathered per key, then transposed
        scores = scores + torch.gather(kb @ positions.pos_query.permute(1, 2, 0), -1, rows.transpose(-1, -2)
                                       ).transpose(-1, -2)
    keys = s.keys(pos)
    scores = (scores * softmax_scale).masked_fill(~keys, torch.finfo(scores.dtype).min)
    return s.packed(F.dropout(torch.softmax(scores, dim=-1), dropout_p) @ vb * keys.any(-1, keepdim=True))


def _key_spans(p: Packed) -> dict:
    """The kernels' key-span arguments of a layout (none where every token is a key)."""
    return {} if p.keys is None else dict(key_start=p.keys.start, seqused_k=p.keys.count)


def _window_keep(keep, positions, window_size):
    """`keep` [..., 1, L or 1, L] narrowed to the key positions within window_size = (left, right) of each query's
    (positions [..., L]); unchanged without a window."""
    left, right = window_size
    if left < 0 and right < 0:
        return keep
    d = positions[..., None, :] - positions[..., :, None]  # key - query
    return keep & (((d >= -left) | (left < 0)) & ((d <= right) | (right < 0))).unsqueeze(-3)


def _bias_mask(keep, position_bias, positions, dtype):
    """SDPA's attention mask: a boolean `keep` where there is no bias, else the bias [..., heads, L, L] of the
    tokens at `positions` [..., L] where keep, the dtype's minimum elsewhere."""
    if position_bias is None:
        return keep
    bias = kernels_package().relative_bias(position_bias, positions).to(dtype)
    return torch.where(keep, bias, torch.finfo(dtype).min)


class _Sequences(NamedTuple):
    """Packed tokens laid out as [sequences, max_seqlen], each sequence padded. Tokens outside every sequence
    (filler, or past max_seqlen when cu_seqlens was not checked) go to one spare slot that the batched tensors
    never hold, so they read and write nothing real, and get zeros back."""
    batch: int
    length: int
    slot: torch.Tensor             # [total_tokens] each token's row in the [batch * length + 1] layout
    first: torch.Tensor            # [sequences] the position of each one's first key
    end: torch.Tensor              # [sequences] past its last key (its length where every token is a key)

    @classmethod
    def of(cls, p: Packed) -> "_Sequences":
        batch, length = p.sequences, max(p.max_seqlen, 1)
        inside = (p.seq < batch) & (p.pos >= 0) & (p.pos < length)
        slot = torch.where(inside, p.seq * length + p.pos, batch * length)
        if p.keys is None:
            return cls(batch, length, slot, torch.zeros_like(p.cu_seqlens[1:]), p.cu_seqlens[1:] - p.cu_seqlens[:-1])
        return cls(batch, length, slot, p.keys.start, p.keys.start + p.keys.count)

    def batched(self, t: torch.Tensor) -> torch.Tensor:
        """[total, heads, dim] -> [sequences, heads, length, dim], zeros at padding."""
        heads, dim = t.shape[1:]
        out = t.new_zeros(self.batch * self.length + 1, heads, dim).index_put((self.slot,), t)[:-1]
        return out.view(self.batch, self.length, heads, dim).transpose(1, 2)

    def packed(self, out: torch.Tensor) -> torch.Tensor:
        """[sequences, heads, length, dim] -> [total, heads, dim], zeros at tokens outside every sequence."""
        heads, dim = out.shape[1], out.shape[3]
        rows = out.transpose(1, 2).reshape(self.batch * self.length, heads, dim)
        return torch.cat([rows, rows.new_zeros(1, heads, dim)])[self.slot]

    def keys(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [sequences, 1, 1, length]: the positions (arange(length)) that are keys of each sequence."""
        return ((positions[None, :] >= self.first[:, None]) & (positions[None, :] < self.end[:, None]))[:, None, None]


def _torch_sequence_attention(q, k, v, p: Packed, dropout_p, position_bias=None, window_size=(-1, -1)):
    # Each sequence padded to max_seqlen (`_Sequences`) and SDPA with a key mask. A finite fill instead of -inf
    # keeps empty sequences finite.
    s = _Sequences.of(p)
    positions = torch.arange(s.length, device=q.device)
    keep = _window_keep(s.keys(positions), positions, window_size)
    if position_bias is None:  # additive and finite: a row that sees no key (padding) stays finite
        mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, torch.finfo(q.dtype).min)
    else:
        mask = _bias_mask(keep, position_bias, positions, q.dtype)
    # A query that sees no key (an empty key span, or none inside its window) gets 0, as from the kernels.
    return s.packed(F.scaled_dot_product_attention(s.batched(q), s.batched(k), s.batched(v), attn_mask=mask,
                                                   dropout_p=dropout_p) * keep.any(-1, keepdim=True))


def _torch_rows_attention(q, k, v, p: Packed, dropout_p, position_bias=None, window_size=(-1, -1)):
    # The packer's promise (row_aligned): rows of max_seqlen tokens that no sequence crosses, so SDPA runs on
    # [rows, max_seqlen] with a block-diagonal mask (same sequence id), at the cost of one padded slot per row,
    # not per sequence. Every token sees at least itself (filler tokens share the id S), so no softmax row is empty.
    total, heads, dim = q.shape
    length = total // p.rows
    seq = p.seq.view(p.rows, length)
    pos = p.pos.view(p.rows, length)
    keep = _window_keep((seq[:, :, None] == seq[:, None, :])[:, None], pos, window_size)
    mask = _bias_mask(keep, position_bias, pos, q.dtype)

    def rows(t):
        return t.view(p.rows, length, heads, dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), attn_mask=mask, dropout_p=dropout_p)
    return torch.where((p.seq < p.sequences)[:, None, None], out.transpose(1, 2).reshape(total, heads, dim), 0)


# ---- masked-LM loss at labelled rows only --------------------------------------------------------
def labelled_rows(labels, ignore_index=-100):
    """The positions of labels [N] that are not ignore_index: nonzero, or under torch.compile the kernels' op of
    data-dependent size, which keeps the gather inside one graph."""
    if torch.compiler.is_compiling() and _HAS_TRITON:
        return kernels_package().labelled_rows(labels, ignore_index)
    return (labels != ignore_index).nonzero().squeeze(1)


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
        loss, correct = _triton("mlm_loss")(hidden, weight, bias, labels, return_correct=True, validate=False)
        return MLMLoss(loss, correct, None)
    logits = F.linear(hidden, weight, bias)
    # Rows labelled -100 (a packed batch's unused slots) are ignored; no labelled row gives 0, not F.cross_entropy's
    # NaN mean over nothing, without a sync.
    used = (labels >= 0) & (labels < weight.shape[0])
    labels = labels.masked_fill(~used, -100)
    # float32 at least (float64 stays float64: a float64 model's loss is computed in its precision)
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(wide, labels, reduction="sum") / used.sum().clamp_min(1)
    correct = ((logits.argmax(-1) == labels) & used).sum()
    return MLMLoss(loss, correct, logits)

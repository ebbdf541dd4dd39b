"""Fuse a Hugging Face BERT in place: `fuse_hf_bert(model)` and `unfuse_hf_bert(model)`.

Only the given model instance changes; transformers' classes and other instances are untouched. The fused
modules hold the very Parameter objects of the modules they replace, so state_dict keys and values, optimizers
and save_pretrained keep working, and unfusing restores the original modules with whatever they learned.

What is fused, per BertModel found inside the model (BertModel itself, the BertFor* heads, a
sentence-transformers wrapper...):
  * every LayerNorm -> kernels.LayerNorm; "dense -> dropout -> + residual -> LayerNorm" (BertSelfOutput,
    BertOutput) -> one fused LayerNorm call;
  * intermediate dense + GeLU -> the matmul without bias, then kernels.bias_gelu;
  * the encoder: padding removed once per forward, every layer's attention run by kernels.varlen_attention on
    the packed tokens, padding restored at the end (padded positions of last_hidden_state are then 0);
  * BertForMaskedLM / BertForPreTraining given labels: the MLM loss by kernels.masked_lm_loss on the labelled
    positions only; the vocabulary logits are then not formed (their `logits` / `prediction_logits` are None).
What cannot be fused keeps the original module, with one warning naming the reason; a call that asks for
output_attentions or output_hidden_states runs the original encoder code path.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .config import ACTIVATIONS
from .padding import pad, unpad, unpad_mask

_ORIGINALS = "_bertfuse_originals"


def _warn(reason: str) -> None:
    ops.warn_once(f"fuse_hf_bert: {reason}")


def _backend(t: torch.Tensor) -> str:
    """'triton' where the kernels run on t's device (CUDA; the CPU under TRITON_INTERPRET=1); else 'torch', so a
    fused model moved to the CPU still runs (the same math, in PyTorch), with one warning."""
    if t.is_cuda or (t.device.type == "cpu" and ops._kernels().attention.INTERPRET):
        return "triton"
    _warn(f"tensors on {t.device.type}: the fused layers run their PyTorch path there (the Triton kernels need a "
          "CUDA device)")
    return "torch"


class FusedLayerNorm(nn.LayerNorm):
    """nn.LayerNorm holding the original module's own Parameters; LayerNorm(dropout(x) + residual) in one
    kernel where the kernels run."""

    @classmethod
    def from_module(cls, ln: nn.LayerNorm) -> "FusedLayerNorm":
        fused = cls(ln.normalized_shape, eps=ln.eps, elementwise_affine=False, bias=False)
        fused.elementwise_affine, fused.weight, fused.bias = ln.elementwise_affine, ln.weight, ln.bias
        return fused.train(ln.training)

    def forward(self, x, residual=None, dropout_p: float = 0.0):
        return ops.layer_norm(x, self.weight, self.bias, self.eps, residual=residual,
                              dropout_p=dropout_p if self.training else 0.0, backend=_backend(x))


class FusedSelfOutput(nn.Module):
    """BertSelfOutput / BertOutput: LayerNorm(dropout(dense(x)) + residual) with one fused kernel."""

    def __init__(self, orig: nn.Module):
        super().__init__()
        self.dense, self.dropout = orig.dense, orig.dropout
        self.LayerNorm = FusedLayerNorm.from_module(orig.LayerNorm)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states), residual=input_tensor, dropout_p=self.dropout.p)


class FusedIntermediate(nn.Module):
    """BertIntermediate: the matmul without bias, then GeLU(x + bias) in one kernel."""

    def __init__(self, orig: nn.Module, approximate: str):
        super().__init__()
        self.dense, self.approximate = orig.dense, approximate

    def forward(self, hidden_states):
        return ops.bias_gelu(F.linear(hidden_states, self.dense.weight), self.dense.bias, self.approximate,
                             backend=_backend(hidden_states))


class FusedPredictionHeadTransform(FusedIntermediate):
    """BertPredictionHeadTransform: dense + GeLU fused, then the fused LayerNorm."""

    def __init__(self, orig: nn.Module, approximate: str):
        super().__init__(orig, approximate)
        self.LayerNorm = FusedLayerNorm.from_module(orig.LayerNorm)

    def forward(self, hidden_states):
        return self.LayerNorm(super().forward(hidden_states))


def _key_mask(attention_mask, batch: int, seqlen: int, device) -> torch.Tensor | None:
    """[batch, seq] key mask from whatever BertModel handed its encoder: None, a 2-D mask, or a 3-D/4-D boolean
    or additive mask. None when the mask is not one key mask shared by every query and head (a causal or
    per-query mask): the fused attention cannot express it."""
    if attention_mask is None:
        return torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    if attention_mask.dim() == 2:
        return attention_mask != 0
    m = attention_mask
    allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    if allowed.dim() == 3:
        allowed = allowed[:, None]
    if allowed.dim() != 4 or allowed.shape[-1] != seqlen:
        return None
    allowed = allowed.expand(batch, -1, -1, seqlen)
    keys = allowed[:, :1, :1, :]
    if allowed.shape[1] * allowed.shape[2] > 1 and not bool((allowed == keys).all()):  # one sync, padded inputs
        return None
    return keys[:, 0, 0, :]


class FusedBertEncoder(nn.Module):
    """BertEncoder on packed tokens with the varlen attention kernel; same `layer` ModuleList (same keys)."""

    def __init__(self, orig: nn.Module, config):
        super().__init__()
        self.layer = orig.layer
        self.config = config
        self._original_forward = type(orig).forward

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                **kwargs):
        wants = {k for k in ("output_attentions", "output_hidden_states")
                 if kwargs.get(k, getattr(self.config, k, False))}
        batch, seqlen, hidden = hidden_states.shape
        keys = _key_mask(attention_mask, batch, seqlen, hidden_states.device)
        if keys is None:
            wants.add("an attention mask that differs between queries (not a key-padding mask)")
        if wants or encoder_hidden_states is not None or kwargs.get("use_cache"):
            _warn(f"{', '.join(sorted(wants)) or 'cross-attention/cache'} requested: this call runs the original "
                  "(unfused) attention code")
            return self._original_forward(self, hidden_states, attention_mask, encoder_hidden_states,
                                          encoder_attention_mask, **kwargs)
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        u = unpad_mask(keys)
        x = unpad(hidden_states, u)
        for layer in self.layer:
            sa = layer.attention.self
            q, k, v = ops.project_qkv(x, sa.query, sa.key, sa.value, sa.num_attention_heads, sa.attention_head_size)
            p = sa.dropout.p if self.training else 0.0
            ctx = ops.varlen_attention(q, k, v, u, dropout_p=p, backend=_backend(x))
            x = layer.attention.output(ctx.reshape(x.shape[0], hidden), x)
            x = layer.output(layer.intermediate(x), x)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=pad(x, u))


def _replace(record: list, parent: nn.Module, name: str, new: nn.Module) -> None:
    old = getattr(parent, name)
    new.train(old.training)
    record.append((parent, name, old))
    setattr(parent, name, new)


def _fuse_bert_model(bert: nn.Module, record: list) -> None:
    cfg = bert.config
    approximate = ACTIVATIONS.get(cfg.hidden_act) if isinstance(cfg.hidden_act, str) else None
    _replace(record, bert.embeddings, "LayerNorm", FusedLayerNorm.from_module(bert.embeddings.LayerNorm))
    for layer in bert.encoder.layer:
        _replace(record, layer.attention, "output", FusedSelfOutput(layer.attention.output))
        _replace(record, layer, "output", FusedSelfOutput(layer.output))
        if approximate is None:
            _warn(f"hidden_act {cfg.hidden_act!r} has no fused kernel; the intermediate layers stay unfused")
        else:
            _replace(record, layer, "intermediate", FusedIntermediate(layer.intermediate, approximate))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    reasons = []
    if head_dim not in ops._kernels().attention.HEAD_DIMS:
        reasons.append(f"head_dim {head_dim} is not supported by the attention kernel")
    if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
        reasons.append(f"position_embedding_type={cfg.position_embedding_type!r} (relative positions)")
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        reasons.append("a decoder / cross-attention configuration")
    if reasons:
        _warn("attention stays unfused: " + "; ".join(reasons))
    else:
        _replace(record, bert, "encoder", FusedBertEncoder(bert.encoder, cfg))


def _fused_mlm_forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                       labels=None, next_sentence_label=None, **kwargs):
    """BertForMaskedLM / BertForPreTraining forward that, given labels, never forms the vocabulary logits."""
    original = self._bertfuse_forward
    if labels is None:
        kw = dict(kwargs, next_sentence_label=next_sentence_label) if next_sentence_label is not None else kwargs
        return original(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                        position_ids=position_ids, **kw)
    out = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                    position_ids=position_ids, return_dict=True, **kwargs)
    labels = labels.view(-1)
    rows = (labels != -100).nonzero().squeeze(1)
    head = self.cls.predictions
    h = head.transform(out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[rows])
    loss = ops.masked_lm_loss(h, head.decoder.weight, head.decoder.bias, labels[rows], backend=_backend(h)).loss
    if hasattr(self.cls, "seq_relationship"):
        from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

        nsp_logits = self.cls.seq_relationship(out.pooler_output)
        total = None
        if next_sentence_label is not None:
            total = loss + F.cross_entropy(nsp_logits.view(-1, 2).float(), next_sentence_label.view(-1))
        return BertForPreTrainingOutput(loss=total, prediction_logits=None, seq_relationship_logits=nsp_logits)
    from transformers.modeling_outputs import MaskedLMOutput

    return MaskedLMOutput(loss=loss, logits=None)


def fuse_hf_bert(model: nn.Module) -> nn.Module:
    """Fuse the transformers BERT(s) inside `model` in place (see the module docstring); returns `model`."""
    from transformers.models.bert import modeling_bert as hf

    if getattr(model, _ORIGINALS, None):
        return model  # already fused
    record: list = []
    found = [m for m in model.modules() if isinstance(m, hf.BertModel)]
    if not found:
        raise ValueError(f"fuse_hf_bert: no transformers BertModel inside {type(model).__name__}")
    for bert in found:
        _fuse_bert_model(bert, record)
    for m in model.modules():
        if isinstance(m, hf.BertPredictionHeadTransform):
            act = getattr(m.transform_act_fn, "approximate", None)
            name = type(m.transform_act_fn).__name__
            approximate = ACTIVATIONS.get(getattr(found[0].config, "hidden_act", ""), None)
            if approximate is None or (act is not None and act != approximate):
                _warn(f"prediction head activation {name} has no fused kernel; the head transform stays unfused")
                continue
            parent = next(p for p in model.modules() if any(c is m for c in p.children()))
            _replace(record, parent, "transform", FusedPredictionHeadTransform(m, approximate))
    heads = [m for m in model.modules() if isinstance(m, (hf.BertForMaskedLM, hf.BertForPreTraining))]
    for head in heads:
        head._bertfuse_forward = head.forward
        head.forward = types.MethodType(_fused_mlm_forward, head)
    object.__setattr__(model, _ORIGINALS, (record, heads))
    return model


def unfuse_hf_bert(model: nn.Module) -> nn.Module:
    """Put back the original modules (which share the fused ones' Parameters); returns `model`."""
    saved = getattr(model, _ORIGINALS, None)
    if not saved:
        return model
    record, heads = saved
    for parent, name, old in reversed(record):
        old.train(getattr(parent, name).training)
        setattr(parent, name, old)
    for head in heads:
        del head.forward
        del head._bertfuse_forward
    object.__delattr__(model, _ORIGINALS)
    return model

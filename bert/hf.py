"""Fuse Hugging Face encoders in place: `fuse(model)`, `unfuse(model)`, `fuse_report(model)`.

`fuse` finds every encoder inside any model (a bare BertModel, a task model, a sentence-transformers wrapper, a
PEFT model) and gives the modules it fuses fused forwards, in this model instance only: each module stays the
same object, its class a subclass of its own (`fused_class`, pickled as "this class, fused"), so its place,
Parameters, buffers and hooks are untouched; transformers' classes and other instances are too. state_dict
keys and values, optimizers and save_pretrained keep working, and `unfuse` puts the classes back, with whatever
the model learned.

Encoders are found by structure (an encoder model is a module with `embeddings` and an `encoder` or
`transformer` holding a `layer` list, or a model holding its `layers` itself beside `embeddings` or, in a known
encoder's class, `embed_tokens`), and a module is fused only where its class is known to compute the fused op's
math: a class of the model types a `Layers` record names (transformers' copies of BERT's layer, DistilBERT's...),
or a subclass adding nothing but __init__ (`unknown_code`); look-alikes with BERT's submodule names around other
attention (MRA, Nystromformer, YOSO) keep their code, with the reason in `fuse_report`. What the
drop-in knows about each Hugging Face family is one `Family` record in `FAMILIES` (its layer structure, the
Linear + activation pairs, the MLM head, the padding id), read by the fuser, its tests and bench.hf_parity; a new
family is one record. The layer structures (`Layers`) are
  * BERT-like (BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA...): attention.self.{query,key,value},
    attention.output.{dense,dropout,LayerNorm}, intermediate.{dense,intermediate_act_fn},
    output.{dense,dropout,LayerNorm};
  * DistilBERT-like: attention.{q_lin,k_lin,v_lin,out_lin}, sa_layer_norm, ffn.{lin1,activation,lin2,dropout},
    output_layer_norm;
  * MPNet: attention.attn.{q,k,v,o,dropout}, attention.{dropout,LayerNorm}, intermediate, output as BERT's, and
    a relative-position bias (encoder.relative_attention_bias, 32 buckets) the encoder computes once for all
    layers, which the fused attention looks up inside its kernel (`Layers.relative`);
  * ALBERT: attention.{query,key,value,dense,attention_dropout,output_dropout,LayerNorm}, ffn, activation,
    ffn_output, full_layer_layer_norm; held not in a `layer` list but in `albert_layer_groups[g].albert_layers`,
    one set of parameters that num_hidden_layers passes share (`Stack`): each shared layer is fused once, and the
    fused encoder runs the passes through the groups as ALBERT's code does, after projecting the factorised
    embedding (a Linear) up to the hidden size on the real tokens only;
  * ModernBERT (pre-norm, rotary): attn_norm, attn.{Wqkv,Wo,out_drop}, mlp_norm, mlp.{Wi,act,drop,Wo}, held by the
    model itself in `layers` beside `embeddings`, `final_norm` and `rotary_emb`: the model is fused whole
    (`Layers.encoder_forward`). q and k are rotated by each token's position id (`kernels.rotary`, cos and sin in
    the kernel) with its layer type's inv_freq and scaling, local layers attend within sliding_window positions
    each side (the varlen kernel's window, the tiles outside skipped), the gated MLP's act(a) * b is one kernel
    (`kernels.glu`), and each residual add before mlp_norm is in that LayerNorm's kernel (`return_sum`);
  * NomicBERT (post-norm, rotary, no biases) and EuroBERT (pre-norm RMSNorm, rotary, grouped-query heads, its
    model holding `embed_tokens`): self_attn.{q_proj,k_proj,v_proj,o_proj}, mlp.{gate_proj,up_proj,down_proj,
    act_fn}, and post_attention_layernorm with post_mlp_layernorm (NomicBERT) or input_layernorm (EuroBERT),
    held by the model in `layers` and fused whole as ModernBERT is; k and v keep their num_key_value_heads heads
    in the kernel, and each EuroBertRMSNorm runs the RMSNorm kernel;
  * ESM (pre-norm BERT: attention.LayerNorm before attention.self, the layer's LayerNorm before intermediate,
    encoder.emb_layer_norm_after) and RoFormer (BERT's layer): each rotates q and k (RoFormer's rotary_value:
    v too) by the cos and sin its model keeps, ESM's formed once per forward from the position ids and handed to
    its encoder, RoFormer's the encoder's float64-made sinusoid table; the kernel reads those tables at each
    token's row (`ops.Rotation.cos`/`.sin`), so the rotation is the model's own to the bit.
  * DeBERTa-v2/v3: BERT's layer around DisentangledSelfAttention.{query_proj,key_proj,value_proj[,pos_key_proj,
    pos_query_proj]}, the encoder's rel_embeddings (and their LayerNorm) handed to every layer: each layer projects
    them (`Layers.relative`) and the disentangled kernel adds the c2p and p2c terms inside its tiles; the model,
    whose code asks the encoder for every hidden state, is fused too (`Layers.model_forward`).
What is fused:
  * every LayerNorm; "dense -> dropout -> + residual -> LayerNorm" in one kernel;
  * a Linear followed by its GeLU (intermediate layers, DistilBERT's FFN, head transforms, ELECTRA's heads): the
    matmul without bias, then bias + GeLU in one kernel, where the Linear is a plain biased nn.Linear without
    hooks; any other module there (a LoRA layer, a quantised Linear) is called, and the GeLU applied to what it
    returns;
  * the encoder: padding removed once per forward, every layer's attention run by the varlen kernel on packed
    tokens, padding restored at the end (padded positions of last_hidden_state are then 0). Every submodule is
    called through its own __call__ (q, k and v in one matmul only when all three are plain nn.Linears), so its
    hooks fire, on packed [tokens, features] tensors inside the encoder, and gradient checkpointing recomputes
    each layer. Under torch.compile and torch.export a static layout replaces unpadding (no host sync, one graph
    whatever the padding); an ONNX export exports each module's original code;
  * with fuse(model, mlm_logits=False), masked-LM heads given labels (BERT's cls.predictions, RoBERTa's lm_head,
    ELECTRA's generator, DistilBERT's vocab_*, ALBERT's predictions, ModernBERT's, NomicBERT's, RoFormer's and
    DeBERTa-v2's BERT-style heads, DeBERTa-v2's enhanced mask decoder (the word embeddings as decoder), ESM's
    lm_head with its own bias, EuroBERT's bare lm_head): the loss by the masked-only kernel at labelled positions,
    the vocabulary logits never formed; pre-training models add their sentence-pair head's loss (BERT's
    next-sentence, ALBERT's sentence-order: `PairHead`). By default (mlm_logits=True) the head returns
    transformers' full logits.
The rule is that fusing changes speed, never meaning (bench/hf_suite.py runs transformers' own model tests on
fused models; bench/hf_fuzz.py draws random configurations and calls). What cannot be fused keeps the original
module with one warning naming the reason, and `fuse_report` lists it: attention the kernel cannot express
(DeBERTa v1's talking heads, DeBERTa-v2's convolution, a relative-position rule other than MPNet's, a distance
embedding, a rope type whose frequencies change with the length, a rotation that is not the whole head, a head_dim
over 128, decoders and their causal-LM heads), an activation without a kernel, layers of an unknown structure. A
call asking for output_attentions, output_hidden_states, cross-attention or a cache, with a mask the kernel
cannot express as its attention implementation reads it (bert.masks.mask_reading: eager adds a 4-D mask to the
scores, sdpa keeps a boolean one, DeBERTa reads mask.bool(), flex hands a BlockMask: a mask that differs between
queries, additive values other than 0 and the minimum, a boolean mask eager adds), with padding where a head
reads it (`padded_reads`: question answering, a pooler or classifier over a padded first position; a
token-level label on a padded position, which a forward pre-hook on the task model sees; unless
fuse(..., padded_positions="zero")), or whose attention dropout holds a hook or was replaced (or, for MPNet, a
mask with holes, whose padded slots its relative positions count, or a hook on its bias; for ModernBERT, a 2-D
mask with holes, whose padded slots its sliding windows count: a 4-D mask is every layer's, windows none), runs
the original encoder code, and fuse_report counts it; compiled, such a mask stops the call with an error instead
(its values cannot choose the code inside a graph). The fused modules pick the kernels by device and dtype
(float64 runs their PyTorch path).
Beside transformers' kernelize (hub kernels' forwards bound over decorated layers: activations, RMSNorm, the
rotary function) the fused code wins: fuse sets aside the hub forward of each module it changes and the fused
kernels compute the functions of those inside fused blocks (ops.hookless accepts a hub forward), while a fused
class has no kernel_layer_name, so kernelize (or train()/eval() re-kernelizing) binds nothing over it.
"""
from __future__ import annotations

import collections
import contextvars
import functools
import importlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from bertfuse.bert.masks import ADDED, FLASH_PACKING, NONZERO, packed_rows
from bertfuse.bert.model import ops
from bertfuse.bert.model.modeling import check_labels
from bertfuse.bert.model.padding import pad, static_layout, unpad, unpad_mask

_ORIGINALS = "_bertfuse_originals"
_REPORT = "_bertfuse_report"


class _Saved(NamedTuple):
    """What fuse changed in a model, kept on it (under _ORIGINALS) for unfuse, and how it was fused."""
    record: list                   # _Fuser.record: the class changes and attributes, in order
    heads: list                    # task models whose forward was patched
    mlm_logits: bool
    padded_positions: str = "exact"
    labelled: tuple = ()           # token-level task models whose calls check their labels (`_labels_pre_hook`)


def _warn(reason: str) -> None:
    ops.warn_once(f"fuse: {reason}")


def _get(module, path: str):
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _has(module, *paths: str) -> bool:
    return all(_get(module, p) is not None for p in paths)


def gelu_kind(act) -> str | None:
    """'none' (erf) or 'tanh' for a GeLU activation module of transformers or torch; None for anything else."""
    name = type(act).__name__
    if isinstance(act, nn.GELU):
        return act.approximate
    if name == "GELUActivation" and not getattr(act, "use_gelu_python", False):
        return "none"
    if name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh"):  # not FastGELU: other constants
        return "tanh"
    return None


def glu_kind(act) -> str | None:
    """The kernels' name of a gated unit's activation module ("gelu", "gelu_tanh", "silu"), None for another."""
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(gelu_kind(act))


# ---- the fused computations: each calls the modules the user put there, and reads around a module only where
# it is plain (ops.plain: exactly the expected class, no hooks, its own forward) ----------------------------------
def _linear_gelu(linear, act, x):
    """act(linear(x)), act None meaning the erf GeLU function (RoBERTa's lm_head): the matmul without its bias,
    then bias + GeLU in one kernel, where the Linear is a plain biased nn.Linear and the activation a hookless
    GeLU; otherwise both modules are called, so the activation applies to whatever the Linear module returns (a
    LoRA layer's sum, a quantised Linear's output)."""
    kind = "none" if act is None else gelu_kind(act) if ops.hookless(act) else None
    if kind and ops.plain(linear, nn.Linear) and linear.bias is not None:
        return ops.linear_gelu(x, linear.weight, linear.bias, kind, backend=ops.backend_for(x))
    h = linear(x)
    return F.gelu(h) if act is None else act(h)


def _add_norm(norm, dropout, h, residual):
    """norm(dropout(h) + residual) (dropout None: none) in one LayerNorm kernel where both modules are plain; a
    dropout or LayerNorm that is not (hooks, another class) is called as the unfused code calls it."""
    p = 0.0
    if dropout is not None:
        if ops.plain(dropout, nn.Dropout):
            p = dropout.p if dropout.training else 0.0
        else:
            h = dropout(h)
    if (eps := _layer_norm_eps(norm)) is not None:
        return ops.layer_norm(h, norm.weight, norm.bias, eps, residual, p, backend=ops.backend_for(h))
    return norm((F.dropout(h, p) if p else h) + residual)


def _add_then_norm(norm, h, residual):
    """(norm(h + residual), h + residual), a pre-norm layer's next input and its residual stream, from one
    LayerNorm or RMSNorm kernel where the norm is plain; else the add, then the norm called."""
    if (eps := _layer_norm_eps(norm)) is not None:
        return ops.layer_norm(h, norm.weight, norm.bias, eps, residual, backend=ops.backend_for(h),
                              return_sum=True)
    if _plain_rms_norm(norm):
        return _rms_norm(norm, h, residual)
    total = h + residual
    return norm(total), total


def _layer_norm_eps(norm) -> float | None:
    """The epsilon of a LayerNorm whose parameters a fused op may read instead of calling it: a plain nn.LayerNorm
    (or the kernels') over one dimension, or a family's own LayerNorm class made the kernel's (DebertaLayerNorm:
    the same function, its epsilon `variance_epsilon`); None for any other norm, which is called."""
    if ops.plain(norm, nn.LayerNorm, ops.kernels_package().LayerNorm) and len(norm.normalized_shape) == 1:
        return norm.eps
    if getattr(type(norm), "_bertfuse_forward", None) is _family_layer_norm_forward and ops.hookless(norm):
        return norm.variance_epsilon
    return None


def _plain_rms_norm(norm) -> bool:
    """An RMSNorm module fuse made a kernel's (a known family's class: EuroBertRMSNorm), without hooks."""
    return getattr(type(norm), "_bertfuse_forward", None) is _rms_norm_forward and ops.hookless(norm)


def _rms_norm(norm, x, residual=None):
    """norm(x) (residual given: (norm(x + residual), x + residual)) for a family's RMSNorm module, in one
    kernel."""
    return ops.layer_norm(x, norm.weight, None, norm.variance_epsilon, residual, backend=ops.backend_for(x),
                          rms=True, return_sum=residual is not None)


def _gate(act, a, b):
    """act(a) * b in one kernel where the activation is a hookless GeLU or SiLU; else the module called."""
    kind = glu_kind(act) if ops.hookless(act) else None
    if kind:
        return ops.glu(a, b, kind, backend=ops.backend_for(a))
    return act(a) * b


def _attend(attention, query, key, value, dropout, x, p, bias=None):
    """The attention context [tokens, hidden] of packed tokens x, before any output projection; q, k and v by
    their modules (ops.project_qkv), the dropout on the probabilities (`dropout`, a plain nn.Dropout: the encoder
    checks) and the relative-position bias (a kernels.RelativePositionBias, or None) inside the kernel."""
    heads = getattr(attention, "num_attention_heads", None) or attention.n_heads
    dropout_p = dropout.p if attention.training else 0.0
    return ops.self_attention(x, p, query, key, value, heads, attention.attention_head_size, dropout_p,
                              ops.backend_for(x), position_bias=bias)


# ---- the fused forwards: fuse keeps every module object (its hooks, its place, its parameters) and gives it a
# subclass of its own class with one of these as forward (`fused_class`); called without `packed`, or in an ONNX
# export (fused_class checks), a module computes what its own class computes ------------------------------------
def _original(module):
    """The module's own class's methods (its fused class's base), bound to it."""
    return super(type(module), module)


def _output_block_forward(self, hidden_states, input_tensor):
    """BertSelfOutput / BertOutput and their copies: LayerNorm(dropout(dense(x)) + residual)."""
    return _add_norm(self.LayerNorm, self.dropout, self.dense(hidden_states), input_tensor)


def _intermediate_forward(self, hidden_states):
    """BertIntermediate and its copies: intermediate_act_fn(dense(x))."""
    return _linear_gelu(self.dense, self.intermediate_act_fn, hidden_states)


def _head_transform_forward(self, hidden_states):
    """BertPredictionHeadTransform and its copies: LayerNorm(transform_act_fn(dense(x)))."""
    return self.LayerNorm(_linear_gelu(self.dense, self.transform_act_fn, hidden_states))


def _nomicbert_head_transform_forward(self, hidden_states):
    """NomicBertPredictionHeadTransform: layer_norm(transform_act_fn(dense(x)))."""
    return self.layer_norm(_linear_gelu(self.dense, self.transform_act_fn, hidden_states))


def _deberta_lm_head_forward(self, hidden_states, word_embeddings):
    """DebertaV2LMPredictionHead (the enhanced mask decoder's): LayerNorm(act(dense(x))) @ E^T + bias."""
    h = self.LayerNorm(_linear_gelu(self.dense, self.transform_act_fn, hidden_states))
    return torch.matmul(h, word_embeddings.weight.t()) + self.bias


def _generator_head_forward(self, hidden_states):
    """ElectraGeneratorPredictions: LayerNorm(activation(dense(x)))."""
    return self.LayerNorm(_linear_gelu(self.dense, self.activation, hidden_states))


# Given packed tokens, a layer's fused forwards pass on `packed` (the layout) and `position`, how positions enter
# its attention: the encoder's relative-position bias (a kernels.RelativePositionBias), the rotary encoders'
# positions and rotations (`Rotary`), or None for absolute-position families (in the embeddings).
def _bert_self_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    return _attend(self, self.query, self.key, self.value, self.dropout, hidden_states, packed, position), None


def _bert_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    context, _ = self.self(hidden_states, packed=packed, position=position)
    return self.output(context, hidden_states), None


def _distilbert_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    return self.out_lin(_attend(self, self.q_lin, self.k_lin, self.v_lin, self.dropout, hidden_states, packed,
                                 position)), None


def _mpnet_self_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """MPNetSelfAttention: o(softmax(q k^T / sqrt(d) + relative bias) v)."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    return self.o(_attend(self, self.q, self.k, self.v, self.dropout, hidden_states, packed, position)), None


def _mpnet_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """MPNetAttention: LayerNorm(dropout(attn(x)) + x)."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    attended, _ = self.attn(hidden_states, packed=packed, position=position)
    return _add_norm(self.LayerNorm, self.dropout, attended, hidden_states), None


def _bert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """BertLayer and MPNetLayer: output(intermediate(a), a) for a = attention(x)."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    attended, _ = self.attention(hidden_states, packed=packed, position=position)
    return self.output(self.intermediate(attended), attended)


def _distilbert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    attended, _ = self.attention(hidden_states, packed=packed, position=position)
    x = _add_norm(self.sa_layer_norm, None, attended, hidden_states)
    ffn = self.ffn
    if getattr(type(ffn), "_bertfuse_forward", None) is _ffn_forward and ops.hookless(ffn):  # its dropout into the LayerNorm kernel
        return _add_norm(self.output_layer_norm, ffn.dropout, ffn.lin2(_linear_gelu(ffn.lin1, ffn.activation, x)), x)
    return _add_norm(self.output_layer_norm, None, ffn(x), x)


def _ffn_forward(self, input):
    """DistilBERT's FFN: dropout(lin2(activation(lin1(x)))) (its chunking along the sequence changes nothing)."""
    return self.dropout(self.lin2(_linear_gelu(self.lin1, self.activation, input)))


def _albert_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """AlbertAttention: LayerNorm(x + output_dropout(dense(softmax(q k^T / sqrt(d)) v))), its probabilities'
    dropout being attention_dropout."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    context = _attend(self, self.query, self.key, self.value, self.attention_dropout, hidden_states, packed, position)
    return _add_norm(self.LayerNorm, self.output_dropout, self.dense(context), hidden_states), None


def _albert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """AlbertLayer: full_layer_layer_norm(ffn_output(activation(ffn(a))) + a) for a = attention(x); no dropout
    after ffn_output (the layer's `dropout` is unused by its code), and the feed-forward's chunking along the
    sequence changes nothing."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    attended, _ = self.attention(hidden_states, packed=packed, position=position)
    ffn = self.ffn_output(_linear_gelu(self.ffn, self.activation, attended))
    return _add_norm(self.full_layer_layer_norm, None, ffn, attended)


def _albert_group_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """AlbertLayerGroup: its albert_layers in turn."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    for layer in self.albert_layers:
        hidden_states = layer(hidden_states, packed=packed, position=position)
    return hidden_states


def _albert_mlm_head_forward(self, hidden_states):
    """AlbertMLMHead: decoder(LayerNorm(activation(dense(x))))."""
    return self.decoder(self.LayerNorm(_linear_gelu(self.dense, self.activation, hidden_states)))


class Rotary(NamedTuple):
    """How a rotary encoder's layers see positions: each packed token's position (the model's position ids,
    gathered with the tokens) and, per layer type, the rotation of q and k and the attention window."""
    positions: torch.Tensor        # [tokens] int64
    rotations: dict                # layer type -> ops.Rotation
    windows: dict                  # layer type -> (left, right), (-1, -1) for global attention


# A rotary model with one kind of layer (NomicBERT, EuroBERT) has this layer type; ModernBERT's config lists its own.
GLOBAL = "full_attention"


def _layer_type(attention) -> str:
    types = getattr(attention.config, "layer_types", None)
    return types[attention.layer_idx] if types else GLOBAL


def _rotary_attention(self, x, q, k, v, packed, position):
    """The context [tokens, heads * head_dim] of q [tokens, heads, head_dim] and k, v [tokens, kv_heads,
    head_dim] rotated by the layer type's rotation, within its window; the dropout on the probabilities in the
    kernel."""
    backend, kind = ops.backend_for(x), _layer_type(self)
    q, k = (ops.rotary(t, position.positions, position.rotations[kind], backend) for t in (q, k))
    context = ops.varlen_attention(q, k, v, packed, self.attention_dropout if self.training else 0.0,
                                   backend, window_size=position.windows[kind])
    return context.flatten(1)


def _split_heads(t: torch.Tensor, head_dim: int, parts: int = 1) -> torch.Tensor:
    """[tokens, parts * heads * head_dim] -> [tokens, (parts,) heads, head_dim], by sizes (no -1: a call may pack
    no token at all)."""
    heads = t.shape[-1] // (parts * head_dim)
    return t.view(t.shape[0], parts, heads, head_dim) if parts > 1 else t.view(t.shape[0], heads, head_dim)


def _modernbert_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """ModernBertAttention: out_drop(Wo(attention of RoPE(q), RoPE(k), v)), its layer type's rotation and window
    (a local layer sees sliding_window positions each side)."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    x = hidden_states
    q, k, v = _split_heads(self.Wqkv(x), self.head_dim, 3).unbind(1)
    return self.out_drop(self.Wo(_rotary_attention(self, x, q, k, v, packed, position))), None


def _projected_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """NomicBertAttention, EuroBertAttention: o_proj(attention of RoPE(q_proj(x)), RoPE(k_proj(x)), v_proj(x)),
    k and v with num_key_value_heads heads (grouped-query attention: the kernel reads each k/v head for its
    group, never repeated in memory)."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    x, d = hidden_states, self.head_dim
    q, k, v = (_split_heads(proj(x), d) for proj in (self.q_proj, self.k_proj, self.v_proj))
    return self.o_proj(_rotary_attention(self, x, q, k, v, packed, position)), None


def _pre_norm_layer(x, attention, attention_norm, mlp_norm, mlp, packed, position):
    """a = x + attention(attention_norm(x)); a + mlp(mlp_norm(a)), the residual add and mlp_norm in one kernel."""
    attended, _ = attention(attention_norm(x), packed=packed, position=position)
    normed, total = _add_then_norm(mlp_norm, attended, x)
    return total + mlp(normed)


def _modernbert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """ModernBertEncoderLayer: pre-norm (`_pre_norm_layer`), LayerNorms attn_norm and mlp_norm."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    return _pre_norm_layer(hidden_states, self.attn, self.attn_norm, self.mlp_norm, self.mlp, packed, position)


def _eurobert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """EuroBertDecoderLayer (bidirectional): pre-norm (`_pre_norm_layer`), RMSNorms input_layernorm and
    post_attention_layernorm."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    return _pre_norm_layer(hidden_states, self.self_attn, self.input_layernorm, self.post_attention_layernorm,
                           self.mlp, packed, position)


def _nomicbert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """NomicBertLayer (post-norm): a = post_attention_layernorm(x + dropout(self_attn(x)));
    post_mlp_layernorm(a + dropout(mlp(a))), each dropout, add and LayerNorm in one kernel."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    attended, _ = self.self_attn(hidden_states, packed=packed, position=position)
    x = _add_norm(self.post_attention_layernorm, self.post_attention_dropout, attended, hidden_states)
    return _add_norm(self.post_mlp_layernorm, self.post_mlp_dropout, self.mlp(x), x)


def _gated_mlp_forward(self, hidden_states):
    """ModernBertMLP: Wo(drop(act(a) * b)) for (a, b) the halves of Wi(x); the gating in one kernel."""
    a, b = self.Wi(hidden_states).chunk(2, dim=-1)
    return self.Wo(self.drop(_gate(self.act, a, b)))


def _gate_up_mlp_forward(self, x):
    """NomicBertMLP, EuroBertMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)); the gating in one kernel."""
    return self.down_proj(_gate(self.act_fn, self.gate_proj(x), self.up_proj(x)))


def _rms_norm_forward(self, hidden_states):
    """EuroBertRMSNorm: weight * x / sqrt(mean(x^2) + variance_epsilon), in one kernel."""
    return _rms_norm(self, hidden_states)


def _family_layer_norm_forward(self, hidden_states):
    """DebertaLayerNorm: weight * (x - mean) / sqrt(var + variance_epsilon) + bias, statistics in float32, in one
    kernel."""
    return ops.layer_norm(hidden_states, self.weight, self.bias, self.variance_epsilon,
                          backend=ops.backend_for(hidden_states))


def _rope_parameters(emb) -> dict:
    """layer type -> (rope type, inv_freq, attention scaling) of a model's rotary embedding module, as its forward
    reads them: ModernBERT's per layer type, the others' one set."""
    if isinstance(emb.rope_type, dict):
        return {k: (t, getattr(emb, f"{k}_inv_freq", None), getattr(emb, f"{k}_attention_scaling", None))
                for k, t in emb.rope_type.items()}
    return {GLOBAL: (emb.rope_type, emb.inv_freq, emb.attention_scaling)}


def _rope_positions(model, positions, windowed: bool = True) -> Rotary:
    """The rotations of each layer type from the model's rotary embedding module, and the windows its config
    sets (ModernBERT's local layers: sliding_window positions each side; none where not `windowed`: a 4-D mask
    given to the model is every layer's mask, the windows' masks never built)."""
    rotations, windows = {}, {}
    for kind, (_, inv_freq, scaling) in _rope_parameters(model.rotary_emb).items():
        rotations[kind] = ops.Rotation(inv_freq.float(), float(scaling))
        local = windowed and kind == "sliding_attention"
        windows[kind] = (model.config.sliding_window,) * 2 if local else (-1, -1)
    return Rotary(positions, rotations, windows)


class _ModelCall(NamedTuple):
    """One call of a rotary model fused whole, as its own forward was given it."""
    given: torch.Tensor | None     # input_ids, or inputs_embeds where those are given instead
    both_or_neither: bool          # input_ids and inputs_embeds both given, or neither: the original code raises
    attention_mask: object
    position_ids: torch.Tensor | None
    kwargs: dict
    embed: Callable                # () -> [batch, seq, hidden]: the embeddings as the model's code computes them
    original: Callable             # () -> the original forward's output


def _rotary_model_run(self, call: _ModelCall, final_norm: str | None):
    """A rotary model fused whole: the embeddings as its code runs them, padding removed once, every layer on
    packed tokens (RoPE by each token's position id, local layers' windows inside the attention kernel), the
    final norm (`final_norm`, None: none), padding restored (as 0), the pooler where the model has one. A call
    the fused layers do not compute runs the original code, counted in fuse_report."""
    state: _EncoderState = self._bertfuse_encoder
    as_tuple = call.kwargs.get("return_dict", getattr(self.config, "return_dict", True)) is False
    mask = call.attention_mask
    # transformers' mask functions take a 2-D mask, or a 4-D one as it is (for every layer, windows or not), and
    # raise for other ranks: the original code runs for those, as for inputs it refuses.
    if call.both_or_neither or isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() not in (2, 4)):
        return _run_original(state, "inputs or masks given as the original code alone reads them", call.original)
    batch, seqlen = call.given.shape[:2]
    # The model's own mask and attention read no position ids (its code builds the mask from attention_mask
    # alone): only a flash call's cu_seq_lens split a row.
    rows = packed_rows(self.config, mask, call.kwargs, None, batch, seqlen, call.given.device)
    windowed = not (isinstance(mask, torch.Tensor) and mask.dim() == 4)
    if why := rows.why or _original_code_reason(self, state, rows.keys, None, call.kwargs, windowed):
        return _run_original(state, why, call.original)
    from transformers import modeling_outputs as outputs

    keys, p = rows.keys, _layout(rows.keys, rows.segments)
    x = unpad(call.embed(), p)
    ids = torch.arange(seqlen, device=x.device) if call.position_ids is None else call.position_ids
    x = state.layers.stack.run(self, x, p, _rope_positions(self, unpad(ids.expand(batch, seqlen), p), windowed))
    out = _padded(x if final_norm is None else getattr(self, final_norm)(x), p, keys)
    fields = {"last_hidden_state": out}
    if getattr(self, "pooler", None) is not None:
        fields["pooler_output"] = self.pooler(out)
    result = getattr(outputs, state.layers.output)(**fields)
    return result.to_tuple() if as_tuple else result


def _modernbert_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                              **kwargs):
    """ModernBertModel fused whole (`_rotary_model_run`), final_norm after the layers."""
    def original():
        return _original(self).forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       inputs_embeds=inputs_embeds, **kwargs)

    def embed():
        return self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds)

    call = _ModelCall(input_ids if input_ids is not None else inputs_embeds, (input_ids is None) == (inputs_embeds
                      is None), attention_mask, position_ids, kwargs, embed, original)
    return _rotary_model_run(self, call, "final_norm")


def _nomicbert_model_forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                             inputs_embeds=None, **kwargs):
    """NomicBertModel fused whole (`_rotary_model_run`): post-norm layers, no final norm, its pooler if any."""
    def original():
        return _original(self).forward(input_ids=input_ids, attention_mask=attention_mask,
                                       token_type_ids=token_type_ids, position_ids=position_ids,
                                       inputs_embeds=inputs_embeds, **kwargs)

    def embed():
        return self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                               inputs_embeds=inputs_embeds)

    call = _ModelCall(input_ids if input_ids is not None else inputs_embeds, (input_ids is None) == (inputs_embeds
                      is None), attention_mask, position_ids, kwargs, embed, original)
    return _rotary_model_run(self, call, None)


def _eurobert_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                            **kwargs):
    """EuroBertModel fused whole (`_rotary_model_run`): embed_tokens, pre-norm layers, the final RMSNorm `norm`."""
    def original():
        return _original(self).forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       inputs_embeds=inputs_embeds, **kwargs)

    def embed():
        return self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds

    call = _ModelCall(input_ids if input_ids is not None else inputs_embeds, (input_ids is None) == (inputs_embeds
                      is None), attention_mask, position_ids, kwargs, embed, original)
    return _rotary_model_run(self, call, "norm")


def _prediction_head_forward(self, hidden_states):
    """ModernBertPredictionHead: norm(act(dense(x)))."""
    return self.norm(_linear_gelu(self.dense, self.act, hidden_states))


# ---- the rotary encoders of BERT's shape (ESM, RoFormer): an encoder given hidden states, which rotates q and k
# by the cos and sin its model keeps (read from the tables in the kernel: `Rotation.cos`, `Rotation.sin`) -------
def _rotated_self_attention(self, x, packed, position, rotate_value=False):
    """The context [tokens, hidden] of BERT-like q, k, v projections, q and k (and v, RoFormer's rotary_value)
    rotated where the encoder has rotary positions (`position`, None: absolute positions, in the embeddings)."""
    heads, d, backend = self.num_attention_heads, self.attention_head_size, ops.backend_for(x)
    q, k, v = ops.project_qkv(x, self.query, self.key, self.value, heads, d)
    if position is not None:
        rotation = position.rotations[GLOBAL]
        q, k, v = (ops.rotary(t, position.positions, rotation, backend) if turn else t
                   for t, turn in ((q, True), (k, True), (v, rotate_value)))
    dropout = self.dropout if isinstance(self.dropout, float) else self.dropout.p
    context = ops.varlen_attention(q, k, v, packed, dropout if self.training else 0.0, backend)
    return context.reshape(x.shape[0], heads * d)


def _esm_self_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """EsmSelfAttention: softmax(RoPE(q / sqrt(d)) RoPE(k)^T) v; RoPE is linear, so q's scaling is the
    kernel's."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    return _rotated_self_attention(self, hidden_states, packed, position), None


def _roformer_self_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """RoFormerSelfAttention: softmax(RoPE(q) RoPE(k)^T / sqrt(d)) RoPE(v) (v only with rotary_value), RoPE
    interleaved from the encoder's sinusoid table."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    return _rotated_self_attention(self, hidden_states, packed, position, self.rotary_value), None


def _esm_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """EsmAttention (pre-norm): output(self(LayerNorm(x)), x), the output block adding the residual."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    context, _ = self.self(self.LayerNorm(hidden_states), packed=packed, position=position)
    return self.output(context, hidden_states)


def _esm_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """EsmLayer (pre-norm): a = attention(x); output(intermediate(LayerNorm(a)), a)."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    attended = self.attention(hidden_states, packed=packed, position=position)
    return self.output(self.intermediate(self.LayerNorm(attended)), attended)


def _esm_intermediate_forward(self, hidden_states):
    """EsmIntermediate: the erf GeLU (its own function, the same formula) of dense(x)."""
    return _linear_gelu(self.dense, None, hidden_states)


def _deberta_self_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """DisentangledSelfAttention (DeBERTa-v2/v3): softmax((q k^T + c2p + p2c) / sqrt(d * (1 + terms))) v, the
    position terms read from this layer's projections of the encoder's relative embeddings (`position`, after
    its LayerNorm; pos_dropout applied here, as its code does) inside the disentangled kernel."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    heads, dim = self.num_attention_heads, self.attention_head_size
    q, k, v = ops.project_qkv(hidden_states, self.query_proj, self.key_proj, self.value_proj, heads, dim)
    tables, rule = [None, None], (-1, 1)
    if self.relative_attention:
        rel = self.pos_dropout(position)[:2 * self.pos_ebd_size]
        keyer, querier = (self.key_proj, self.query_proj) if self.share_att_key else \
            (getattr(self, "pos_key_proj", None), getattr(self, "pos_query_proj", None))
        tables = [proj(rel).view(rel.shape[0], heads, dim) if term in self.pos_att_type else None
                  for term, proj in (("c2p", keyer), ("p2c", querier))]
        rule = (self.position_buckets, self.max_relative_positions)
    terms = sum(t in self.pos_att_type for t in ("c2p", "p2c"))
    return _disentangled_context(self, hidden_states, q, k, v, packed, tables, rule, terms), None


def _deberta_v1_self_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """DisentangledSelfAttention (DeBERTa): the same attention, with q, k, v from one bias-free in_proj (each
    head's rows [q | k | v]) plus q_bias and v_bias, the position query table through pos_q_proj, the key table
    through pos_proj, plain distances clamped to max_relative_positions (its span-sliced table gives the same rows:
    a distance of a sequence of L tokens is under L), and a scale counting every entry of pos_att_type."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    heads, dim = self.num_attention_heads, self.attention_head_size
    qkv = self.in_proj(hidden_states).view(hidden_states.shape[0], heads, 3 * dim)
    q, k, v = qkv.split(dim, dim=-1)
    # A float32 bias promotes autocast's half-precision q and v; the matmuls after it run in half precision.
    q, v = (q + self.q_bias.view(heads, dim)).to(qkv.dtype), (v + self.v_bias.view(heads, dim)).to(qkv.dtype)
    tables, rule = [None, None], (-1, 1)
    if self.relative_attention:
        rel = self.pos_dropout(position)
        tables = [getattr(self, proj)(rel).view(rel.shape[0], heads, dim) if term in self.pos_att_type else None
                  for term, proj in (("c2p", "pos_proj"), ("p2c", "pos_q_proj"))]
        rule = (-1, self.max_relative_positions)
    return _disentangled_context(self, hidden_states, q, k, v, packed, tables, rule, len(self.pos_att_type)), None


def _disentangled_context(self, x, q, k, v, packed, tables, rule, terms: int):
    """The context [tokens, hidden] of DeBERTa's attention from q, k, v [tokens, heads, head_dim], the projected
    tables (c2p's, p2c's; None: no such term) and the bucket rule (position_buckets, max_relative_positions).
    DeBERTa's scale is a float32 square root of head_dim * (1 + terms), rounded to the activations' dtype
    before it divides: `terms` counts the position terms its config names, with relative attention or without."""
    heads, dim = q.shape[1], q.shape[2]
    positions = ops.kernels_package().DisentangledPositions(*tables, *rule)
    root = torch.sqrt(torch.tensor(dim * (1 + terms), dtype=torch.float)).to(q.dtype)
    out = ops.disentangled_attention(q, k, v, packed, positions, 1.0 / float(root),
                                     self.dropout.p if self.training else 0.0, ops.backend_for(x))
    return out.reshape(x.shape[0], heads * dim)


def _deberta_relative(encoder):
    """The relative embeddings a DeBERTa encoder hands every layer (v2: after its LayerNorm where norm_rel_ebd
    says so), or None without relative attention."""
    return encoder.get_rel_embedding()


def _deberta_model_forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                           inputs_embeds=None, output_attentions=None, output_hidden_states=None, return_dict=None,
                           **kwargs):
    """DebertaModel and DebertaV2Model, whose code asks its encoder for every layer's hidden states on every call:
    asked for none (nor for attentions, nor z_steps), the fused encoder is asked for the last one only, the rest
    as its code does. Otherwise its own code runs, and the encoder's own code with it (counted in fuse_report)."""
    cfg = self.config
    wants = (cfg.output_attentions if output_attentions is None else output_attentions) or \
        (cfg.output_hidden_states if output_hidden_states is None else output_hidden_states)
    if wants or self.z_steps > 1 or (input_ids is None) == (inputs_embeds is None):
        return _original(self).forward(input_ids=input_ids, attention_mask=attention_mask,
                                       token_type_ids=token_type_ids, position_ids=position_ids,
                                       inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                                       output_hidden_states=output_hidden_states, return_dict=return_dict, **kwargs)
    from transformers.modeling_outputs import BaseModelOutput

    given = input_ids if input_ids is not None else inputs_embeds
    shape, device = given.shape[:2], given.device
    mask = torch.ones(shape, device=device) if attention_mask is None else attention_mask
    segments = torch.zeros(shape, dtype=torch.long, device=device) if token_type_ids is None else token_type_ids
    x = self.embeddings(input_ids=input_ids, token_type_ids=segments, position_ids=position_ids, mask=mask,
                        inputs_embeds=inputs_embeds)
    out = BaseModelOutput(last_hidden_state=self.encoder(x, mask, output_hidden_states=False,
                                                         output_attentions=False, return_dict=True)[0])
    return out if (cfg.return_dict if return_dict is None else return_dict) else out.to_tuple()


def _table_rows(rows: int, batch: int, seqlen: int, p) -> torch.Tensor:
    """Each packed token's row of a [rows * seqlen] table of its (batch row, position): rows == batch, one
    table row per token; rows == 1, the same rows for every batch row."""
    index = torch.arange(rows * seqlen, device=p.cu_seqlens.device).view(rows, seqlen)
    return unpad(index.expand(batch, seqlen), p)


def _esm_rotary(encoder, kwargs, batch, seqlen, p) -> Rotary | None:
    """ESM's rotary positions: the cos and sin [1 or batch, seq, head_dim] its model forms once per forward (from
    the position ids), each token reading its row's first half (the second repeats it), half rotation."""
    embeddings = kwargs.get("position_embeddings")
    if embeddings is None:  # absolute positions, in the embeddings
        return None
    cos, sin = (t.reshape(-1, t.shape[-1]) for t in embeddings)
    half = cos.shape[1] // 2
    rows = _table_rows(embeddings[0].shape[0], batch, seqlen, p)
    return Rotary(rows, {GLOBAL: ops.Rotation(None, 1.0, False, cos[:, :half], sin[:, :half])}, {GLOBAL: (-1, -1)})


def _roformer_rotary(encoder, kwargs, batch, seqlen, p) -> Rotary:
    """RoFormer's rotary positions: its sinusoid table [max_position_embeddings, head_dim] (sin, then cos, made in
    float64) read at each token's position in its row, pairs interleaved."""
    weight = encoder.embed_positions.weight
    half = weight.shape[1] // 2
    rows = _table_rows(1, batch, seqlen, p)
    return Rotary(rows, {GLOBAL: ops.Rotation(None, 1.0, True, weight[:, half:], weight[:, :half])}, {GLOBAL: (-1, -1)})


# ---- how an encoder holds its layers, and runs them on packed tokens ----------------------------------------
def _module_list(module, name: str) -> list[nn.Module]:
    """The modules of `module.<name>` where it is an nn.ModuleList; [] where it is absent or anything else."""
    found = getattr(module, name, None)
    return list(found) if isinstance(found, nn.ModuleList) else []


def _no_groups(encoder) -> list[nn.Module]:
    return []


class Stack(NamedTuple):
    """Where an encoder's layers are and how its code runs them: a `layer` list run in order, or ALBERT's groups
    of shared layers. The modules between the encoder and its layers (ALBERT's layer groups) are fused too, so
    that their hooks fire; they must be of a class `group_classes` names."""
    layers: Callable               # (encoder) -> its layer modules, each once ([] where it has none of this kind)
    run: Callable                  # (encoder, x, packed, position) -> x: every layer on packed tokens, as its code does
    groups: Callable = _no_groups  # (encoder) -> the modules between it and its layers
    group_forward: Callable | None = None
    group_classes: tuple[str, ...] = ()


def _layer_list(encoder) -> list[nn.Module]:
    return _module_list(encoder, "layer")


def _run_layer_list(encoder, x, p, position):
    for layer in encoder.layer:
        x = _run_layer(encoder, layer, x, p, position)
    return x


def _albert_groups(encoder) -> list[nn.Module]:
    return _module_list(encoder, "albert_layer_groups")


def _albert_layers(encoder) -> list[nn.Module]:
    return [layer for group in _albert_groups(encoder) for layer in _module_list(group, "albert_layers")]


def _run_albert_groups(encoder, x, p, position):
    """AlbertTransformer on packed tokens: the factorised embedding's projection up to the hidden size (called
    as its module, on the real tokens only), then num_hidden_layers passes through the shared layer groups, each
    picked by the index its code computes."""
    x = encoder.embedding_hidden_mapping_in(x)
    n, groups = encoder.config.num_hidden_layers, encoder.config.num_hidden_groups
    for i in range(n):
        x = encoder.albert_layer_groups[int(i / (n / groups))](x, packed=p, position=position)
    return x


def _model_layers(encoder) -> list[nn.Module]:
    return _module_list(encoder, "layers")


def _run_model_layers(encoder, x, p, position):
    for layer in encoder.layers:
        x = _run_layer(encoder, layer, x, p, position)
    return x


LAYER_LIST = Stack(_layer_list, _run_layer_list)
# The rotary encoders' models hold their `layers` themselves, beside the embeddings, and are fused whole.
MODEL_LAYERS = Stack(_model_layers, _run_model_layers)
ALBERT_GROUPS = Stack(_albert_layers, _run_albert_groups, _albert_groups, _albert_group_forward, ("{P}LayerGroup",))


class _NotAHubLayer:
    """A fused class's `kernel_layer_name`, read as absent (AttributeError, so hasattr is False): transformers'
    kernelize (kernels.kernelize, also run by `model.train()`/`eval()` on a model with kernels in use) looks for
    that name on each module's class, and so never binds a hub kernel's forward over the fused one."""
    def __get__(self, obj, cls=None):
        raise AttributeError("kernel_layer_name: a fused module is not for kernelize")


_NOT_A_HUB_LAYER = _NotAHubLayer()


@functools.cache
def fused_class(base: type, forward: Callable) -> type:
    """`base` (a transformers module class) with `forward` (one of this module's fused forwards) as its forward:
    fuse sets it as one module object's __class__, and unfuse puts base back. It pickles (and deep-copies) as
    "this base class, fused with this forward", not by a dynamic name."""
    def fused_or_original(self, *args, **kwargs):  # an ONNX export exports the original code
        return (base.forward if ops.exporting_onnx() else forward)(self, *args, **kwargs)

    def reduce(self, protocol):
        return _new_fused, (base, forward), self.__dict__

    fused_or_original.__signature__ = inspect.signature(base.forward)  # what callers introspect (inputs_embeds...)
    namespace = {"forward": fused_or_original, "__reduce_ex__": reduce, "__module__": __name__,
                 "_bertfuse_base": base, "_bertfuse_forward": forward}
    if hasattr(base, "kernel_layer_name"):
        namespace["kernel_layer_name"] = _NOT_A_HUB_LAYER
    if hasattr(base, "is_custom_code"):
        # A model fused whole is still transformers' code to transformers (which initialises the weights of code
        # from elsewhere differently, judging by the class's module).
        namespace["is_custom_code"] = classmethod(lambda cls: base.is_custom_code())
    return type(f"Fused{base.__name__}", (base,), namespace)


def _new_fused(base: type, forward: Callable):
    return object.__new__(fused_class(base, forward))


# ---- one record per layer structure and per model family ------------------------------------------
class Layers(NamedTuple):
    """A layer structure the fused encoder runs: recognised by its submodule paths, and fused only where every
    module on the way (the encoder, each layer and the modules its run replaces) is of a class whose code is
    known to compute this math: a class of `models` named by `roles`, or a subclass adding nothing but __init__.
    The layer and its attention modules, given packed tokens (`packed=`), run `forwards`."""
    name: str
    paths: tuple[str, ...]         # submodules every such layer has
    attention: str                 # the module holding q, k, v, the head size and the scaling
    forwards: tuple[tuple[str, Callable], ...]  # (path in the layer, "" itself): the fused forward its module gets
    output: str                    # the transformers.modeling_outputs class the original encoder returns
    roles: tuple[tuple[str, tuple[str, ...]], ...]  # (path in the layer, "" itself, ".." the encoder): names
    models: tuple[tuple[str, str], ...]             # (transformers modeling module, class-name prefix "{P}")
    # Relative positions the encoder computes once for all its layers: (the encoder) -> what its layers' attention
    # reads (MPNet's bias, the kernels.RelativePositionBias its code computes; DeBERTa's relative embeddings, each
    # layer projecting them itself); None for absolute positions (in the embeddings) and the rotary families.
    relative: Callable | None = None
    stack: Stack = LAYER_LIST      # where the encoder holds its layers
    # The attention module's dropout on the probabilities: an nn.Dropout child, or a float attribute (the rate
    # its code passes to the attention function).
    probs_dropout: str = "dropout"
    # The fused forward of the encoder module (None: `_encoder_forward`, for an encoder given hidden states); the
    # rotary encoders' models, fused whole, have their own.
    encoder_forward: Callable | None = None
    # (encoder model) -> why its configuration asks for math the fused layers do not compute ([] where none).
    problems: Callable | None = None
    fused: str = "attention (varlen, padding removed once)"   # what fuse_report says the layers run fused
    # (encoder, key mask) -> why this call needs the original code ([] where it does not).
    call_problems: Callable | None = None
    # Rotary positions an encoder given hidden states knows (RoFormer's sinusoid table, ESM's cos and sin):
    # (encoder, its call's arguments, batch, seqlen, packed layout) -> a `Rotary`, or None (no rotation).
    rotary: Callable | None = None
    reads: tuple[str, ...] = ()    # the encoder arguments its fused forward reads (ESM's position_embeddings)
    # (the attention module) -> the scale its code gives q k^T: `scaling`, else 1/sqrt(head_dim); ESM scales q by
    # 1/sqrt(head_dim) before RoPE (a linear map, so the same) and then by `scaling` (1).
    scale: Callable | None = None
    final_norm: str | None = None  # a norm the encoder applies after its layers (ESM's emb_layer_norm_after)
    # A fused forward for the encoder model, whose own code asks the encoder for what the fused one does not
    # compute on every call (DeBERTa's: every hidden state); its class is among the roles, as "...".
    model_forward: Callable | None = None
    # How the attention reads a 3-D/4-D mask where the family's own code reads it one way whatever the configured
    # implementation (bert.masks.mask_reading): MPNet and RoFormer add it, DeBERTa reads mask.bool().
    mask_reading: str | None = None


class MLMHead(NamedTuple):
    """Paths, inside the task model, of a family's MLM head: dense -> GeLU -> LayerNorm -> decoder (tied), or the
    decoder alone (dense and norm None: EuroBERT's lm_head). The decoder is an nn.Linear, or the input embedding
    itself (DeBERTa-v2's enhanced mask decoder multiplies by the word embeddings' weight: an nn.Embedding, no
    bias of its own)."""
    dense: str | None
    act: str | None          # None: the head calls an erf GeLU function, not a module (RoBERTa's lm_head)
    norm: str | None
    decoder: str
    bias: str | None = None  # a vocabulary bias the head adds after the decoder (ESM's lm_head.bias)


class Family(NamedTuple):
    """Everything the drop-in, its tests and the parity benchmark need to know about a Hugging Face family."""
    name: str                      # "bert", "roberta", ...
    prefix: str                    # transformers' class-name prefix: BertConfig, BertForMaskedLM, ...
    layers: Layers
    mlm_head: MLMHead
    pad_token_id: int              # the RoBERTa family pads with 1 and counts positions after it
    # The family's config field names where they are not BERT's (DistilBERT: dim, n_layers...), and what its small
    # test configuration sets besides the shared sizes (ELECTRA: an embedding narrower than the hidden size).
    config_names: tuple[tuple[str, str], ...] = ()
    test_config: tuple[tuple[str, object], ...] = ()
    segments: bool = True          # the models take token_type_ids (DistilBERT's and ModernBERT's do not)


# The modeling modules whose classes are BERT's code (transformers generates them from BERT's): only the
# embeddings differ, and the fused encoder leaves those alone. Any other model type is unknown, however alike its
# submodule names (RoFormer's rotary, MRA's, Nystromformer's and YOSO's approximate attention).
_BERT_MODELS = (("bert.modeling_bert", "Bert"), ("bert_generation.modeling_bert_generation", "BertGeneration"),
                ("roberta.modeling_roberta", "Roberta"), ("xlm_roberta.modeling_xlm_roberta", "XLMRoberta"),
                ("camembert.modeling_camembert", "Camembert"), ("data2vec.modeling_data2vec_text", "Data2VecText"),
                ("electra.modeling_electra", "Electra"), ("ernie.modeling_ernie", "Ernie"),
                ("layoutlm.modeling_layoutlm", "LayoutLM"), ("markuplm.modeling_markuplm", "MarkupLM"),
                ("roc_bert.modeling_roc_bert", "RoCBert"), ("splinter.modeling_splinter", "Splinter"),
                ("tapas.modeling_tapas", "Tapas"), ("visual_bert.modeling_visual_bert", "VisualBert"))
_DISTILBERT_MODELS = (("distilbert.modeling_distilbert", "DistilBert"),)
BERT_LAYERS = Layers("bert", ("attention.self.query", "attention.self.key", "attention.self.value",
                              "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                              "output.dense", "output.LayerNorm"),
                     "attention.self", (("", _bert_layer_forward), ("attention", _bert_attention_forward),
                                        ("attention.self", _bert_self_attention_forward)),
                     "BaseModelOutputWithPastAndCrossAttentions",
                     (("attention.self", ("{P}SelfAttention", "{P}SdpaSelfAttention")),
                      ("attention", ("{P}Attention",)), ("", ("{P}Layer",)), ("..", ("{P}Encoder", "BertEncoder")),
                      ("attention.output", ("{P}SelfOutput",)), ("intermediate", ("{P}Intermediate",)),
                      ("output", ("{P}Output",))), _BERT_MODELS)
DISTILBERT_LAYERS = Layers("distilbert", ("attention.q_lin", "attention.k_lin", "attention.v_lin",
                                          "attention.out_lin", "sa_layer_norm", "ffn.lin1", "ffn.lin2",
                                          "output_layer_norm"),
                           "attention", (("", _distilbert_layer_forward), ("attention", _distilbert_attention_forward),
                                         ("ffn", _ffn_forward)),
                           "BaseModelOutput",
                           (("attention", ("{P}SelfAttention", "MultiHeadSelfAttention", "{P}SdpaAttention",
                                           "{P}FlashAttention2")), ("", ("TransformerBlock",)),
                            ("..", ("Transformer",)), ("ffn", ("FFN",))), _DISTILBERT_MODELS)
_MPNET_MODELS = (("mpnet.modeling_mpnet", "MPNet"),)
# MPNet's encoder computes its bias with relative_position_bucket's defaults (32 buckets, max_distance 128),
# whatever relative_attention_num_buckets says: rows past the 32nd are never read.
MPNET_BUCKETS, MPNET_MAX_DISTANCE = 32, 128


def _mpnet_problems(model) -> list[str]:
    """A bias table with fewer rows than MPNet's rule reads."""
    rows = model.encoder.relative_attention_bias.num_embeddings
    return [f"a relative-position bias of {rows} buckets, fewer than the {MPNET_BUCKETS} its rule reads"] \
        if rows < MPNET_BUCKETS else []


def _mpnet_call_problems(encoder, keys) -> list[str]:
    """Why this call's relative-position bias is not what the kernel computes: a bias module that is not a plain
    nn.Embedding (its lookup would be skipped), or a mask with holes (`_relative_call_problems`)."""
    why = []
    if not ops.plain(encoder.relative_attention_bias, nn.Embedding):
        why.append("a hook on (or a replacement of) the relative-position bias, which the fused attention reads "
                   "inside its kernel")
    return why + _relative_call_problems(encoder, keys)


def _relative_call_problems(encoder, keys) -> list[str]:
    """Relative positions within the packed sequence are the original code's only where the mask has no holes."""
    return _holes(keys, "relative positions")


def _mpnet_position_bias(encoder):
    return ops.kernels_package().RelativePositionBias(encoder.relative_attention_bias.weight[:MPNET_BUCKETS],
                                                      MPNET_BUCKETS, MPNET_MAX_DISTANCE)


MPNET_LAYERS = Layers("mpnet", ("attention.attn.q", "attention.attn.k", "attention.attn.v", "attention.attn.o",
                                "attention.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm"),
                      "attention.attn", (("", _bert_layer_forward), ("attention", _mpnet_attention_forward),
                                         ("attention.attn", _mpnet_self_attention_forward)),
                      "BaseModelOutput",
                      (("attention.attn", ("{P}SelfAttention",)), ("attention", ("{P}Attention",)),
                       ("", ("{P}Layer",)), ("..", ("{P}Encoder",)), ("intermediate", ("{P}Intermediate",)),
                       ("output", ("{P}Output",))), _MPNET_MODELS, relative=_mpnet_position_bias,
                      problems=_mpnet_problems, call_problems=_mpnet_call_problems, mask_reading=ADDED)
_ALBERT_MODELS = (("albert.modeling_albert", "Albert"),)
ALBERT_LAYERS = Layers("albert", ("attention.query", "attention.key", "attention.value", "attention.dense",
                                  "attention.LayerNorm", "ffn", "ffn_output", "full_layer_layer_norm"),
                       "attention", (("", _albert_layer_forward), ("attention", _albert_attention_forward)),
                       "BaseModelOutput",
                       (("attention", ("{P}Attention",)), ("", ("{P}Layer",)), ("..", ("{P}Transformer",))),
                       _ALBERT_MODELS, stack=ALBERT_GROUPS, probs_dropout="attention_dropout")
_MODERNBERT_MODELS = (("modernbert.modeling_modernbert", "ModernBert"),)
_NOMICBERT_MODELS = (("nomic_bert.modeling_nomic_bert", "NomicBert"),)
_EUROBERT_MODELS = (("eurobert.modeling_eurobert", "EuroBert"),)
_ROTARY_MODELS = (*_MODERNBERT_MODELS, *_NOMICBERT_MODELS, *_EUROBERT_MODELS)
_RMS_NORM_CLASSES = ("{P}RMSNorm",)  # weight * x / sqrt(mean(x^2) + variance_epsilon)
# Rope types whose inv_freq and scaling are fixed at construction (a dynamic one changes them with the length).
# ("proportional": zero frequencies past the rotated share, which rotate by nothing.)
STATIC_ROPE = ("default", "linear", "yarn", "llama3", "proportional")


def _rotary_width_problem(inv_freq, head_dim: int) -> list[str]:
    """[why] where the rotation is not over the whole head in pairs (the kernels' rotation): an odd head_dim, whose
    1-wide head transformers broadcasts against 2-wide cos and sin (and raises for wider ones), or frequencies
    for part of the head (partial_rotary_factor < 1), where transformers' code raises."""
    width = 2 * inv_freq.numel()
    if width == head_dim:
        return []
    return [f"a rotation {width} wide for head_dim {head_dim}, which the fused kernels do not compute (they rotate "
            "the whole head in pairs)"]


def _rope_problems(model) -> list[str]:
    """Why a rotary model's configuration asks for what the fused layers do not compute: a layer type other than
    global and local attention, a rope type whose frequencies change with the length, a rotation not as wide as
    the head, a layer count other than the layers held (NomicBERT and EuroBERT run the first num_hidden_layers of
    them)."""
    cfg, params = model.config, _rope_parameters(model.rotary_emb)
    kinds = set(getattr(cfg, "layer_types", None) or [GLOBAL])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    why = [f"layer type {k!r}" for k in sorted(kinds - {GLOBAL, "sliding_attention"})]
    why += [f"rope type {t!r}, whose frequencies change with the length" for k, (t, _, _) in sorted(params.items())
            if t not in STATIC_ROPE]
    why += [f"no rotary parameters for layer type {k!r}" for k in sorted(kinds)
            if k not in params or params[k][1] is None]
    why += _unique(w for _, inv_freq, _ in params.values() if inv_freq is not None
                   for w in _rotary_width_problem(inv_freq, head_dim))
    if len(model.layers) != cfg.num_hidden_layers:
        why.append(f"{len(model.layers)} layers held for num_hidden_layers={cfg.num_hidden_layers}")
    return why


def _holes(keys, what: str) -> list[str]:
    """[why] where the mask has holes (padding between tokens): the original code counts the padded slots between
    two tokens, the kernel their distance within the packed sequence (left or right padding is the same either
    way), so `what` (relative positions, windows) would differ. One sync, as for the mask; compiled, the program
    checks it when it runs."""
    if keys is None or keys.shape[1] < 2:
        return []
    runs = (keys[:, 1:] & ~keys[:, :-1]).sum(1) + keys[:, 0]  # runs of kept tokens in each row
    contiguous = (runs <= 1).all()
    hole = f"an attention mask with holes (padding between tokens), whose {what} the fused attention does not count"
    if torch.compiler.is_compiling():
        torch._assert_async(contiguous, f"bert.hf.fuse: {hole}; compile the unfused model for such masks")
        return []
    return [] if bool(contiguous) else [hole]


def _modernbert_call_problems(encoder, keys) -> list[str]:
    """Local layers' windows count positions within the packed sequence; the original code, padded slots too."""
    return _holes(keys, "sliding windows") if "sliding_attention" in encoder.config.layer_types else []


_ROTARY_FUSED = "attention (varlen, padding removed once; RoPE by each token's position id in the kernels{}), the " \
                "gated MLP's act(a) * b in one kernel, {}"
MODERNBERT_LAYERS = Layers("modernbert", ("attn_norm", "attn.Wqkv", "attn.Wo", "mlp_norm", "mlp.Wi", "mlp.Wo"),
                           "attn", (("", _modernbert_layer_forward), ("attn", _modernbert_attention_forward),
                                    ("mlp", _gated_mlp_forward)),
                           "BaseModelOutput",
                           (("attn", ("{P}Attention",)), ("", ("{P}EncoderLayer",)), ("..", ("{P}Model",)),
                            ("mlp", ("{P}MLP",))), _MODERNBERT_MODELS, stack=MODEL_LAYERS,
                           probs_dropout="attention_dropout", encoder_forward=_modernbert_model_forward,
                           problems=_rope_problems, call_problems=_modernbert_call_problems,
                           fused=_ROTARY_FUSED.format(", local windows skipping the tiles outside them",
                                                      "each residual add before mlp_norm in its LayerNorm kernel"))
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")
NOMICBERT_LAYERS = Layers("nomicbert", (*_PROJECTIONS, "post_attention_layernorm", "post_mlp_layernorm"),
                          "self_attn", (("", _nomicbert_layer_forward), ("self_attn", _projected_attention_forward),
                                        ("mlp", _gate_up_mlp_forward)),
                          "BaseModelOutputWithPooling",
                          (("self_attn", ("{P}Attention",)), ("", ("{P}Layer",)), ("..", ("{P}Model",)),
                           ("mlp", ("{P}MLP",))), _NOMICBERT_MODELS, stack=MODEL_LAYERS,
                          probs_dropout="attention_dropout", encoder_forward=_nomicbert_model_forward,
                          problems=_rope_problems,
                          fused=_ROTARY_FUSED.format("", "each dropout + residual add in its LayerNorm kernel"))
EUROBERT_LAYERS = Layers("eurobert", (*_PROJECTIONS, "input_layernorm", "post_attention_layernorm"),
                         "self_attn", (("", _eurobert_layer_forward), ("self_attn", _projected_attention_forward),
                                       ("mlp", _gate_up_mlp_forward)),
                         "BaseModelOutput",
                         (("self_attn", ("{P}Attention",)), ("", ("{P}DecoderLayer",)), ("..", ("{P}Model",)),
                          ("mlp", ("{P}MLP",))), _EUROBERT_MODELS, stack=MODEL_LAYERS,
                         probs_dropout="attention_dropout", encoder_forward=_eurobert_model_forward,
                         problems=_rope_problems,
                         fused=_ROTARY_FUSED.format(", grouped-query heads read per group",
                                                    "every RMSNorm a kernel, each residual add before "
                                                    "post_attention_layernorm in its kernel"))
_ESM_MODELS = (("esm.modeling_esm", "Esm"),)
_ROFORMER_MODELS = (("roformer.modeling_roformer", "RoFormer"),)


def _roformer_problems(model) -> list[str]:
    """RoFormer's table must be its sinusoids, [max positions, head_dim], head_dim even (its odd split differs)."""
    cfg, weight = model.config, model.encoder.embed_positions.weight
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    if weight.shape[1] != head_dim or head_dim % 2:
        return [f"a sinusoid table of width {weight.shape[1]} for head_dim {head_dim}, which must be even"]
    return []


def _roformer_call_problems(encoder, keys) -> list[str]:
    """The original code looks the table up at positions 0 .. seq-1 and fails past it; the fused one too."""
    rows = encoder.embed_positions.weight.shape[0]
    too_long = keys is not None and keys.shape[1] > rows
    return [f"a sequence longer than the sinusoid table's {rows} positions"] if too_long else []


def _esm_problems(model) -> list[str]:
    """ESM's rotation (position_embedding_type "rotary") must be as wide as its head."""
    emb = getattr(model, "rotary_embeddings", None)
    if emb is None:
        return []
    return _rotary_width_problem(emb.inv_freq, model.config.hidden_size // model.config.num_attention_heads)


ESM_LAYERS = Layers("esm", ("attention.self.query", "attention.self.key", "attention.self.value",
                            "attention.output.dense", "attention.LayerNorm", "intermediate.dense", "output.dense",
                            "LayerNorm"),
                    "attention.self", (("", _esm_layer_forward), ("attention", _esm_attention_forward),
                                       ("attention.self", _esm_self_attention_forward)),
                    "BaseModelOutputWithCrossAttentions",
                    (("attention.self", ("{P}SelfAttention",)), ("attention", ("{P}Attention",)), ("", ("{P}Layer",)),
                     ("..", ("{P}Encoder",)), ("attention.output", ("{P}SelfOutput",)),
                     ("intermediate", ("{P}Intermediate",)), ("output", ("{P}Output",))), _ESM_MODELS,
                    rotary=_esm_rotary, reads=("position_embeddings",), problems=_esm_problems,
                    scale=lambda at: at.attention_head_size ** -0.5 * at.scaling, final_norm="emb_layer_norm_after",
                    fused="attention (varlen, padding removed once; RoPE in the kernels from the cos and sin the model "
                          "forms), each pre-norm LayerNorm a kernel, Linear + GeLU, emb_layer_norm_after on the real "
                          "tokens")
ROFORMER_LAYERS = BERT_LAYERS._replace(
    name="roformer", forwards=(("", _bert_layer_forward), ("attention", _bert_attention_forward),
                               ("attention.self", _roformer_self_attention_forward)),
    roles=tuple((path, {"attention.self": ("{P}SelfAttention",), "..": ("{P}Encoder",)}.get(path, names))
                for path, names in BERT_LAYERS.roles), models=_ROFORMER_MODELS,
    problems=_roformer_problems, call_problems=_roformer_call_problems, rotary=_roformer_rotary, mask_reading=ADDED,
    fused="attention (varlen, padding removed once; RoPE interleaved in the kernels, read from the model's own "
          "sinusoid table)")
_DEBERTA_V2_MODELS = (("deberta_v2.modeling_deberta_v2", "DebertaV2"),)


def _deberta_problems(model) -> list[str]:
    """What DeBERTa-v2's configuration may ask that the fused layers do not compute: the convolution its encoder
    runs after the first layer (conv_kernel_size, the v2 xlarge models'), a bucket rule the kernels refuse
    (kernels.disentangled.rule_refusal)."""
    cfg, why = model.config, []
    if getattr(cfg, "conv_kernel_size", 0) > 0:
        why.append("a convolution after the first layer (conv_kernel_size), which the fused encoder does not run")
    return why + _rule_problems(model.encoder.layer[0].attention.self)


def _rule_problems(attention) -> list[str]:
    """Why the kernels refuse a relative DeBERTa attention's bucket rule (kernels.disentangled.rule_refusal; v1,
    without position_buckets, takes plain distances: -1); none without relative attention."""
    if not attention.relative_attention:
        return []
    refused = ops.kernels_package().disentangled.rule_refusal(getattr(attention, "position_buckets", -1),
                                                              attention.max_relative_positions)
    return [refused] if refused else []


DEBERTA_V2_LAYERS = Layers(
    "deberta-v2", ("attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj",
                   "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense", "output.dense",
                   "output.LayerNorm"),
    "attention.self", (("", _bert_layer_forward), ("attention", _bert_attention_forward),
                       ("attention.self", _deberta_self_attention_forward)),
    "BaseModelOutput",
    (("attention.self", ("DisentangledSelfAttention",)), ("attention", ("{P}Attention",)), ("", ("{P}Layer",)),
     ("..", ("{P}Encoder",)), ("...", ("{P}Model",)), ("attention.output", ("{P}SelfOutput",)),
     ("intermediate", ("{P}Intermediate",)), ("output", ("{P}Output",))), _DEBERTA_V2_MODELS,
    problems=_deberta_problems, call_problems=_relative_call_problems, relative=_deberta_relative,
    model_forward=_deberta_model_forward, mask_reading=NONZERO,
    fused="attention (varlen, padding removed once; DeBERTa's c2p and p2c terms formed inside the disentangled "
          "kernel from each layer's projections of the relative embeddings, whose LayerNorm is a kernel)")
_DEBERTA_MODELS = (("deberta.modeling_deberta", "Deberta"),)


def _deberta_v1_problems(model) -> list[str]:
    """What DeBERTa's configuration may ask that the fused layers do not compute: talking heads (talking_head:
    scores and probabilities mixed across heads by two more projections), a span the kernels refuse."""
    attention, why = model.encoder.layer[0].attention.self, []
    if attention.head_logits_proj is not None or attention.head_weights_proj is not None:
        why.append("talking heads (talking_head: scores and probabilities mixed across heads), which the fused "
                   "attention does not compute")
    return why + _rule_problems(attention)


DEBERTA_LAYERS = DEBERTA_V2_LAYERS._replace(
    name="deberta", paths=("attention.self.in_proj", *DEBERTA_V2_LAYERS.paths[3:]),
    forwards=(*DEBERTA_V2_LAYERS.forwards[:2], ("attention.self", _deberta_v1_self_attention_forward)),
    models=_DEBERTA_MODELS, problems=_deberta_v1_problems,
    fused="attention (varlen, padding removed once; DeBERTa's c2p and p2c terms formed inside the disentangled "
          "kernel from each layer's projections of the relative embeddings), each DebertaLayerNorm a kernel")
_BERT_MLM = MLMHead("cls.predictions.transform.dense", "cls.predictions.transform.transform_act_fn",
                    "cls.predictions.transform.LayerNorm", "cls.predictions.decoder")
_ROBERTA_MLM = MLMHead("lm_head.dense", None, "lm_head.layer_norm", "lm_head.decoder")
FAMILIES = (
    Family("bert", "Bert", BERT_LAYERS, _BERT_MLM, 0),
    Family("roberta", "Roberta", BERT_LAYERS, _ROBERTA_MLM, 1),
    Family("xlm-roberta", "XLMRoberta", BERT_LAYERS, _ROBERTA_MLM, 1),
    Family("camembert", "Camembert", BERT_LAYERS, _ROBERTA_MLM, 1),
    Family("electra", "Electra", BERT_LAYERS,
           MLMHead("generator_predictions.dense", "generator_predictions.activation",
                   "generator_predictions.LayerNorm", "generator_lm_head"), 0, test_config=(("embedding_size", 32),)),
    Family("distilbert", "DistilBert", DISTILBERT_LAYERS,
           MLMHead("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector"), 0,
           config_names=(("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
                         ("intermediate_size", "hidden_dim"), ("hidden_dropout_prob", "dropout"),
                         ("attention_probs_dropout_prob", "attention_dropout")), segments=False),
    Family("mpnet", "MPNet", MPNET_LAYERS, _ROBERTA_MLM, 1),
    Family("albert", "Albert", ALBERT_LAYERS,
           MLMHead("predictions.dense", "predictions.activation", "predictions.LayerNorm", "predictions.decoder"), 0,
           test_config=(("embedding_size", 16), ("hidden_act", "gelu_new"))),
    # Two layers: the first global, the second local (a window of 4 each side, narrower than the test batch).
    Family("modernbert", "ModernBert", MODERNBERT_LAYERS, MLMHead("head.dense", "head.act", "head.norm", "decoder"), 0,
           config_names=(("attention_probs_dropout_prob", "attention_dropout"), ("hidden_dropout_prob", "mlp_dropout"),
                         ("hidden_act", "hidden_activation")),
           test_config=(("local_attention", 8), ("global_attn_every_n_layers", 2), ("bos_token_id", 1),
                        ("eos_token_id", 2), ("cls_token_id", 1), ("sep_token_id", 2)), segments=False),
    # GeLU in the test models (SiLU by default): the head transform's Linear + GeLU fused too.
    Family("nomicbert", "NomicBert", NOMICBERT_LAYERS,
           MLMHead("cls.predictions.transform.dense", "cls.predictions.transform.transform_act_fn",
                   "cls.predictions.transform.layer_norm", "cls.predictions.decoder"), 0,
           test_config=(("hidden_act", "gelu"),)),
    # Two k/v heads for four query heads (grouped-query attention); the MLM head is the decoder alone.
    # Rotary positions (the ESM-2 models'); the padding id 1, as theirs.
    Family("esm", "Esm", ESM_LAYERS,
           MLMHead("lm_head.dense", None, "lm_head.layer_norm", "lm_head.decoder", "lm_head.bias"), 1,
           test_config=(("position_embedding_type", "rotary"), ("mask_token_id", 4)), segments=False),
    Family("roformer", "RoFormer", ROFORMER_LAYERS, _BERT_MLM, 0),
    # DeBERTa-v3's attention: 8 log buckets up to 12 positions (the test batch's 17 tokens cross both ranges),
    # c2p and p2c through the shared key and query projections, the relative embeddings' LayerNorm, no absolute
    # positions, no segments; its enhanced mask decoder head (legacy=False: the word embeddings' weight as decoder,
    # a bias of its own). A legacy model's head is BERT's (cls.predictions), found by its paths.
    Family("deberta-v2", "DebertaV2", DEBERTA_V2_LAYERS,
           MLMHead("lm_predictions.lm_head.dense", "lm_predictions.lm_head.transform_act_fn",
                   "lm_predictions.lm_head.LayerNorm", "deberta.embeddings.word_embeddings",
                   "lm_predictions.lm_head.bias"), 0,
           test_config=(("legacy", False), ("relative_attention", True), ("position_buckets", 8),
                        ("max_relative_positions", 12), ("pos_att_type", ["p2c", "c2p"]),
                        ("norm_rel_ebd", "layer_norm"), ("share_att_key", True), ("position_biased_input", False)),
           segments=False),
    # DeBERTa (v1) as its released models: c2p and p2c over plain distances up to 12 positions (the test batch's
    # 17 tokens reach past them), no absolute positions, no segments, the enhanced mask decoder head.
    Family("deberta", "Deberta", DEBERTA_LAYERS,
           MLMHead("lm_predictions.lm_head.dense", "lm_predictions.lm_head.transform_act_fn",
                   "lm_predictions.lm_head.LayerNorm", "deberta.embeddings.word_embeddings",
                   "lm_predictions.lm_head.bias"), 0,
           test_config=(("legacy", False), ("relative_attention", True), ("max_relative_positions", 12),
                        ("pos_att_type", ["c2p", "p2c"]), ("position_biased_input", False)),
           segments=False),
    Family("eurobert", "EuroBert", EUROBERT_LAYERS, MLMHead(None, None, None, "lm_head"), 0,
           config_names=(("attention_probs_dropout_prob", "attention_dropout"),),
           test_config=(("num_key_value_heads", 2), ("bos_token_id", 1), ("eos_token_id", 2), ("mask_token_id", 4)),
           segments=False),
)


# The task models whose forward the masked-only MLM loss stands in for: the families' own.
_MLM_MODELS = tuple(m for m in (*_BERT_MODELS, *_DISTILBERT_MODELS, *_MPNET_MODELS, *_ALBERT_MODELS,
                                *_ROTARY_MODELS, *_ESM_MODELS, *_ROFORMER_MODELS, *_DEBERTA_V2_MODELS,
                                *_DEBERTA_MODELS)
                    if m[1] in {f.prefix for f in FAMILIES})


def family(name: str) -> Family:
    found = [f for f in FAMILIES if f.name == name]
    if not found:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")
    return found[0]


def _unique(items) -> tuple:
    return tuple(dict.fromkeys(items))


LAYERS = _unique(f.layers for f in FAMILIES)
STACKS = _unique(kind.stack for kind in LAYERS)
MLM_HEADS = _unique(f.mlm_head for f in FAMILIES)


# ---- whose code is known: a module is fused only where its class computes exactly the fused op's math ---------
# Beyond the fused encoders' models, MPNet's and DeBERTa's intermediate and output blocks are BERT's code too
# (DeBERTa's with its own LayerNorm class).
_BLOCK_MODELS = (*_BERT_MODELS, *_DISTILBERT_MODELS, *_MPNET_MODELS, *_ALBERT_MODELS, *_ROTARY_MODELS,
                 *_ESM_MODELS, *_ROFORMER_MODELS, *_DEBERTA_V2_MODELS, *_DEBERTA_MODELS)


# The families' own norm classes, each run by one kernel: (class names, models), the forward it gets.
_FAMILY_LAYER_NORMS = (("{P}LayerNorm",), _DEBERTA_MODELS)   # DebertaLayerNorm: LayerNorm, eps inside the root
_FAMILY_NORMS = ((*_FAMILY_LAYER_NORMS, _family_layer_norm_forward),
                 (_RMS_NORM_CLASSES, _ROTARY_MODELS, _rms_norm_forward))


class GeluBlock(NamedTuple):
    """A module class computing [norm](act(linear(x))) and nothing else: its children and its fused forward."""
    cls: str              # the class-name template ("{P}" the model's class-name prefix)
    children: tuple[str, ...]   # linear, activation[, norm[, decoder]]
    forward: Callable


_GELU_BLOCKS = (GeluBlock("{P}Intermediate", ("dense", "intermediate_act_fn"), _intermediate_forward),
                GeluBlock("{P}PredictionHeadTransform", ("dense", "transform_act_fn", "LayerNorm"),
                          _head_transform_forward),
                GeluBlock("{P}GeneratorPredictions", ("dense", "activation", "LayerNorm"), _generator_head_forward),
                GeluBlock("{P}MLMHead", ("dense", "activation", "LayerNorm", "decoder"), _albert_mlm_head_forward),
                GeluBlock("{P}PredictionHead", ("dense", "act", "norm"), _prediction_head_forward),
                GeluBlock("{P}PredictionHeadTransform", ("dense", "transform_act_fn", "layer_norm"),
                          _nomicbert_head_transform_forward),
                GeluBlock("{P}Intermediate", ("dense",), _esm_intermediate_forward),
                GeluBlock("Legacy{P}PredictionHeadTransform", ("dense", "transform_act_fn", "LayerNorm"),
                          _head_transform_forward),
                GeluBlock("{P}LMPredictionHead", ("dense", "transform_act_fn", "LayerNorm"), _deberta_lm_head_forward))
# Blocks computing LayerNorm(dropout(dense(x)) + residual).
_OUTPUT_BLOCK_CLASSES = ("{P}SelfOutput", "{P}Output")
# transformers' own attention functions by implementation name: any of them computes softmax(q k^T s + mask) v.
_ATTENTION_FUNCTIONS = {"sdpa": "sdpa_attention.sdpa_attention_forward",
                        "flex_attention": "flex_attention.flex_attention_forward",
                        **{f"flash_attention_{n}": "flash_attention.flash_attention_forward" for n in (2, 3, 4)}}


@functools.cache
def known_classes(names: tuple[str, ...], models: tuple[tuple[str, str], ...]) -> tuple[type, ...]:
    """The classes `names` ("{P}" the model's class-name prefix) in each transformers modeling module of
    `models` this transformers has; a name it lacks (older or newer releases name a few differently) is skipped."""
    import importlib

    found = []
    for module, prefix in models:
        try:
            mod = importlib.import_module(f"transformers.models.{module}")
        except ImportError:
            continue
        for name in names:
            cls = getattr(mod, name.replace("{P}", prefix), None)
            if isinstance(cls, type) and cls not in found:
                found.append(cls)
    return tuple(found)


def unknown_code(module: nn.Module, known: tuple[type, ...]) -> str | None:
    """Why `module` may compute something other than `known`'s code, or None where it cannot: its class is one
    of `known`, or a subclass of one adding nothing but __init__ and data (any method of its own, even a helper
    the forward calls, could change the math), and no method is replaced on the instance (a hub kernel's forward,
    `ops.hub_kernel`, is another implementation of the class's function: fuse sets it aside)."""
    cls = getattr(type(module), "_bertfuse_base", type(module))  # a module fuse gave a fused class: its own
    base = next((c for c in cls.__mro__ if c in known), None)
    if base is None:
        return f"{cls.__name__} is not a class whose math the fused op is known to match"
    for sub in cls.__mro__[:cls.__mro__.index(base)]:
        own = sorted(n for n, v in vars(sub).items() if n != "__init__" and not _checkpointing_wrapper(sub, n, v)
                     and (callable(v) or isinstance(v, (property, staticmethod, classmethod))))
        if own:
            return f"{sub.__name__} overrides {', '.join(own)} of {base.__name__}"
    hub = ops.hub_kernel(module) is not None
    patched = sorted(n for n, v in vars(module).items()
                     if callable(v) and inspect.isfunction(getattr(cls, n, None)) and not (hub and n == "forward"))
    return f"{cls.__name__}.{patched[0]} is replaced on this instance" if patched else None


def _checkpointing_wrapper(sub: type, name: str, value) -> bool:
    """transformers 5's GradientCheckpointingLayer wraps `forward` anew in every subclass, one that defines none
    too: such a wrapper around the inherited forward adds no code of the subclass's own."""
    return getattr(value, "__wrapped__", None) is getattr(super(sub, sub), name, None) and \
        getattr(getattr(value, "__code__", None), "co_name", "") == "forward_with_checkpointing"


def _attention_function_problem(cfg) -> str | None:
    """Why the configured attention implementation may compute something else, or None (eager, or transformers'
    own function under its own name; a function registered in its place is not known)."""
    impl = getattr(cfg, "_attn_implementation", None)
    if impl in (None, "eager"):
        return None
    if impl not in _ATTENTION_FUNCTIONS:
        return f"attention implementation {impl!r}, which the fused attention does not know"
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # transformers before the registry: the implementation picks one of the known classes
        return None
    fn = ALL_ATTENTION_FUNCTIONS.get(impl)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    if name != f"transformers.integrations.{_ATTENTION_FUNCTIONS[impl]}":
        return f"attention implementation {impl!r} is registered to {name}, not transformers' own function"
    return None


def _encoder_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
    """A fused encoder: padding removed once, every layer on packed tokens (its attention by the varlen kernel),
    padding restored (as 0). Where this call asks for something the fused layers do not compute, the encoder's
    own code runs instead, counted in fuse_report. Gradient checkpointing goes through transformers' own
    mechanism (`_run_layer`)."""
    state: _EncoderState = self._bertfuse_encoder
    kind = state.layers
    if hidden_states.dim() != 3:  # what a mask of another rank broadcast into (ESM's embeddings scale by it)
        rows, why = None, f"{hidden_states.dim()}-D hidden states"
    else:
        batch, seqlen, _ = hidden_states.shape
        rows = packed_rows(state.config, attention_mask, kwargs, kwargs.get("position_ids"), batch, seqlen,
                           hidden_states.device, kind.mask_reading)
        why = rows.why or _original_code_reason(self, state, rows.keys, encoder_hidden_states, kwargs)
    if not why and rows.segments is not None and (kind.relative or kind.rotary):
        why = ("sequences packed in one row, whose relative or rotary positions this family's fused encoder "
               "computes per row")
    if why:
        if encoder_hidden_states is not None:  # DistilBERT's encoder takes no such argument: pass it only if set
            kwargs["encoder_hidden_states"] = encoder_hidden_states
        return _run_original(state, why, lambda: _original(self).forward(hidden_states, attention_mask=attention_mask,
                                                                          **kwargs))
    from transformers import modeling_outputs as outputs

    keys = rows.keys
    p = _layout(keys, rows.segments)
    x = unpad(hidden_states, p)
    position = kind.relative(self) if kind.relative else \
        kind.rotary(self, kwargs, batch, seqlen, p) if kind.rotary else None
    x = kind.stack.run(self, x, p, position)
    out = _padded(getattr(self, kind.final_norm)(x) if kind.final_norm else x, p, keys)
    # What the original encoder returns: BERT-like models read `.cache` from it too.
    return getattr(outputs, state.layers.output)(last_hidden_state=out)


def _run_original(state: _EncoderState, why: str, original: Callable):
    """original(): a call the fused layers do not compute, run by the original code, counted in fuse_report."""
    state.report.calls[why] = state.report.calls.get(why, 0) + 1
    _warn(f"{why} requested: this call runs the original (unfused) attention code")
    return original()


def _layout(keys: torch.Tensor, segments: torch.Tensor | None = None):
    """The packed layout of a [batch, seq] key mask, each row one sequence or, given `segments`, the sequences
    packed in it (bert.masks): padding removed; compiled or exported, a layout of static shape instead (no token
    count read from the data)."""
    return static_layout(keys, segments) if torch.compiler.is_compiling() else unpad_mask(keys, segments=segments)


def _padded(x: torch.Tensor, p, keys: torch.Tensor) -> torch.Tensor:
    """Packed tokens back to [batch, seq, ...], padded positions 0 (the static layout computes them: zeroed)."""
    return torch.where(keys[..., None], pad(x, p), 0.0) if torch.compiler.is_compiling() else pad(x, p)


def _original_code_reason(encoder, state: _EncoderState, keys, encoder_hidden_states, kwargs,
                          windowed: bool = True) -> str | None:
    """Why this encoder call must run the original code, or None (`windowed`: whether local layers keep their
    windows in this call)."""
    wants = {k for k in ("output_attentions", "output_hidden_states")
             if kwargs.get(k, getattr(state.config, k, False))}
    unread = _unread_arguments({k: v for k, v in kwargs.items() if k not in state.layers.reads})
    if unread:
        wants.add(f"{', '.join(unread)}, which the fused encoder does not read")
    if keys is None:
        wants.add("an attention mask the fused attention cannot express (per query, additive values other than "
                  "0 and the dtype's minimum, or a boolean or integer mask that eager attention adds to the scores)")
    # The kernel applies the attention dropout to the probabilities inside it: a module there that is not a
    # plain nn.Dropout (a hook on it, another class) is called only by the original code.
    kind = state.layers
    if not all(_plain_probs_dropout(kind, layer) for layer in kind.stack.layers(encoder)):
        wants.add("a hook on (or a replacement of) an attention dropout, which the fused attention applies inside "
                  "its kernel")
    if state.layers.call_problems and windowed:
        wants.update(state.layers.call_problems(encoder, keys))
    wants.update(_padded_read_problems(state.reads, keys))
    if not torch.compiler.is_compiling() and _PADDED_LABELS.get():
        wants.add("labels at padded positions, which the fused encoder leaves 0")
    # use_cache means a cache only in a decoder (ESM's encoder is handed its config's use_cache and ignores it).
    cache = kwargs.get("use_cache") and getattr(state.config, "is_decoder", False)
    if wants or encoder_hidden_states is not None or cache:
        return ", ".join(sorted(wants)) or "cross-attention/cache"
    return None


def _probs_dropout(kind: Layers, layer: nn.Module):
    """The attention's dropout on the probabilities: a module, or the float rate its code passes on."""
    return getattr(_get(layer, kind.attention), kind.probs_dropout)


def _plain_probs_dropout(kind: Layers, layer: nn.Module) -> bool:
    """The kernel may apply the probabilities' dropout itself: a plain nn.Dropout there, or a rate."""
    dropout = _probs_dropout(kind, layer)
    return isinstance(dropout, float) or ops.plain(dropout, nn.Dropout)


def _run_layer(encoder, layer, x, p, position):
    """One layer through its own __call__ (so its hooks fire, and a transformers 5 layer checkpoints itself
    when gradient checkpointing is on); transformers 4 checkpoints from the encoder, so this does too."""
    if getattr(encoder, "gradient_checkpointing", False) and encoder.training and torch.is_grad_enabled() \
            and not _checkpoints_itself(layer):
        return encoder._gradient_checkpointing_func(functools.partial(layer.__call__, packed=p, position=position), x)
    return layer(x, packed=p, position=position)


# Arguments the fused encoder handles itself (the flags, and the position ids and flash packing arguments, which
# bert.masks.packed_rows reads as the original attention would) or that its layers' code ignores: an encoder
# without a cache gets None for one; num_items_in_batch (transformers.Trainer's token count for the loss) passes
# through every model's forward to the attention functions, which ignore it, as they ignore seq_idx (each token's
# sequence, which DataCollatorWithFlattening adds for state-space layers).
_FLAGS = ("output_attentions", "output_hidden_states", "return_dict", "use_cache", "num_items_in_batch",
          "position_ids", "seq_idx", *FLASH_PACKING)


def _unread_arguments(kwargs: dict) -> list[str]:
    """The encoder arguments holding something the original layers would read and the fused ones would drop:
    any value but None/False (or transformers 4's head_mask of Nones). Such a call runs the original code."""
    unread = []
    for name, value in kwargs.items():
        if name in _FLAGS or value is None or value is False:
            continue
        if isinstance(value, (list, tuple)) and all(v is None for v in value):
            continue
        unread.append(name)
    return sorted(unread)


def _checkpoints_itself(layer: nn.Module) -> bool:
    own = _checkpointing_layer_class()
    return own is not None and isinstance(layer, own)


@functools.cache
def _checkpointing_layer_class() -> type | None:
    """transformers 5's self-checkpointing layer base, looked up once; None on transformers 4 (the encoder
    checkpoints its layers there)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


# ---- recognising what is inside a model -------------------------------------------------------
def layer_kind(layer: nn.Module) -> Layers | None:
    """The layer structure of `layer`'s submodules; of several alike (BERT's and RoFormer's), the one whose
    layer class (or a base of it) is known."""
    alike = [kind for kind in LAYERS if _has(layer, *kind.paths)]
    own = [kind for kind in alike if isinstance(layer, known_classes(dict(kind.roles)[""], kind.models))]
    return (own or alike or [None])[0]


def _is_output_block(m: nn.Module) -> bool:
    """dense -> dropout -> + input -> LayerNorm, by its children (BertSelfOutput, BertOutput and their copies;
    the LayerNorm an nn.LayerNorm or a family's own LayerNorm class)."""
    names = {n for n, _ in m.named_children()}
    norms = (nn.LayerNorm, *known_classes(*_FAMILY_LAYER_NORMS))
    return names == {"dense", "dropout", "LayerNorm"} and isinstance(m.dense, nn.Linear) and isinstance(
        m.LayerNorm, norms) and isinstance(m.dropout, nn.Dropout)


def encoder_stack(encoder: nn.Module) -> tuple[Stack, list[nn.Module]] | None:
    """(how it holds its layers, its layer modules each once) for a module holding encoder layers, else None."""
    return next(((stack, layers) for stack in STACKS if (layers := stack.layers(encoder))), None)


def encoder_parts(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, encoder model, name of its encoder child) for every encoder model inside `model`: a module with
    `embeddings` and an `encoder` or `transformer` child holding layers (`encoder_stack`), or with `embeddings`
    and a `layers` list of a layer structure a known model holds so (ModernBERT: the child's name is then "")."""
    found = []
    for path, m in model.named_modules():
        for child in ("encoder", "transformer", ""):
            enc = getattr(m, child, None) if child else m
            if not (isinstance(enc, nn.Module) and (stack := encoder_stack(enc)) and _embeds(m, child, stack[1])):
                continue
            # A model's own `layers` count only where they are of a structure known to be held so (not Swin's
            # stages); an encoder child's only as a `layer` list or ALBERT's groups.
            if (stack[0] is MODEL_LAYERS) != (child == ""):
                continue
            if child or getattr(layer_kind(stack[1][0]), "stack", None) is MODEL_LAYERS:
                found.append((path or type(model).__name__, m, child))
    return found


def _embeds(model: nn.Module, child: str, layers: list[nn.Module]) -> bool:
    """`model` embeds tokens for the layers it holds: an `embeddings` module, or (EuroBERT) `embed_tokens`,
    counted only in a model of a known encoder's class or a subclass (decoders hold the same names)."""
    if _has(model, "embeddings"):
        return True
    kind = layer_kind(layers[0])
    return child == "" and _has(model, "embed_tokens") and kind is not None and \
        isinstance(model, known_classes(dict(kind.roles)[".."], kind.models))


@dataclass
class EncoderReport:
    path: str                        # where the encoder model sits inside the fused model
    family: str                      # its class name
    layers: str                      # "bert", "distilbert" or "unknown"
    fused: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)   # (what, why)
    calls: dict[str, int] = field(default_factory=dict)         # why a call ran the original encoder: how often
    unexpected: list[str] = field(default_factory=list, repr=False, compare=False)  # kept for a reason to warn of

    def keep(self, what: str, why: str) -> None:
        """What stays unfused and why, listed once; fuse warns of them all in one warning per encoder."""
        if (what, why) not in self.kept:
            self.kept.append((what, why))
            self.unexpected.append(what)

    def warn(self) -> None:
        if self.unexpected:
            why = dict(self.kept)
            kept = "; ".join(f"{w} stays unfused: {why[w]}" for w in self.unexpected)
            _warn(f"{self.family} at {self.path}: {kept}")

    def __str__(self):
        kept = "; ".join(f"{w} ({why})" for w, why in self.kept) or "nothing"
        calls = "".join(f"; {n} call(s) ran the original attention ({why})" for why, n in self.calls.items())
        return f"{self.path} ({self.family}, {self.layers} layers): fused {', '.join(self.fused) or 'nothing'}; " \
               f"kept {kept}{calls}"


def _attention_problems(enc_model: nn.Module, kind: Layers, encoder: nn.Module) -> list[str]:
    """Why the fused attention may not compute what this encoder computes ([] where it does)."""
    cfg = getattr(enc_model, "config", None)
    reasons = []
    layers = kind.stack.layers(encoder)
    for path, names in kind.roles:  # every module the fused layer stands in for: of a known class
        known = known_classes(names, kind.models)
        modules = [encoder] if path == ".." else [enc_model] if path == "..." else \
            [_get(layer, path) if path else layer for layer in layers]
        reasons += [why for m in modules if (why := unknown_code(m, known))]
    group_classes = known_classes(kind.stack.group_classes, kind.models)
    reasons += [why for m in kind.stack.groups(encoder) if (why := unknown_code(m, group_classes))]
    if reasons:  # the first (the attention's own module comes first in roles); the rest counted
        others = len(_unique(reasons)) - 1
        return [reasons[0] + (f" (and {others} other module{'s' * (others > 1)} of unknown code)" if others else "")]
    at = _get(layers[0], kind.attention)
    head_dim = getattr(at, "attention_head_size", None) or at.head_dim
    if type(dropout := _probs_dropout(kind, layers[0])) not in (nn.Dropout, float):
        reasons.append(f"attention dropout is a {type(dropout).__name__}, not an nn.Dropout")
    if kind.problems:
        reasons += kind.problems(enc_model)
    if why := ops.attention_refusal(head_dim):
        reasons.append(why)
    scale = kind.scale(at) if kind.scale else getattr(at, "scaling", head_dim ** -0.5)
    if not math.isclose(scale, head_dim ** -0.5):
        reasons.append(f"an attention scale other than 1/sqrt(head_dim) ({scale})")
    # Relative positions as the attention's code reads them (transformers 4's relative_key(_query): a
    # distance_embedding on it); transformers 5's BERT-family code no longer reads position_embedding_type.
    if getattr(at, "distance_embedding", None) is not None:
        reasons.append(f"position_embedding_type={getattr(at, 'position_embedding_type', '?')!r} (relative "
                       "positions, a distance embedding in the attention)")
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        reasons.append("a decoder / cross-attention configuration")
    reasons += filter(None, [_attention_function_problem(cfg)])
    return reasons


# ---- fusing ------------------------------------------------------------------------------------
class _Fuser:
    """Changes module classes in place (every object stays: its hooks, its place in the model, its parameters),
    recording each change so that unfuse can undo it."""

    def __init__(self):
        # (module, "__class__", its class), (module, attribute, None): set by fuse, or (module, attribute, value):
        # removed by fuse (a hub kernel's forward, never None); each undone by unfuse
        self.record: list = []

    def retype(self, module: nn.Module, cls: type) -> None:
        """`module` becomes a `cls`. A hub kernel's forward kernelize bound to it goes (to come back with unfuse):
        the fused class's own forward then runs, and kernelize leaves fused classes alone."""
        if ops.hub_kernel(module) is not None:
            for name in ("forward", "_kernel_repo"):
                self.record.append((module, name, vars(module).pop(name)))
        self.record.append((module, "__class__", type(module)))
        module.__class__ = cls

    def fused(self, module: nn.Module, forward: Callable) -> None:
        """`module` runs `forward`, a fused forward of this module's, as an instance of fused_class."""
        self.retype(module, fused_class(type(module), forward))

    def attach(self, module: nn.Module, name: str, value) -> None:
        """Fuse's state on a module (not a submodule, not in its state_dict), removed by unfuse."""
        self.record.append((module, name, None))
        object.__setattr__(module, name, value)

    def gelu_blocks(self, root: nn.Module, report: EncoderReport) -> int:
        """Every module under root of a class that computes [norm](GeLU(Linear(x))) (`_GELU_BLOCKS`) runs the
        Linear's matmul without bias and bias + GeLU in one kernel (`_linear_gelu`, which decides at each call).
        A GeLU without a kernel, or a look-alike of unknown code, is reported and keeps its code."""
        fused = 0
        for m in list(root.modules()):
            names = {n for n, _ in m.named_children()}
            shaped = [b for b in _GELU_BLOCKS if names == set(b.children)]  # of several, the one of m's class
            block = next((b for b in shaped if not unknown_code(m, known_classes((b.cls,), _BLOCK_MODELS))),
                         shaped[0] if shaped else None)
            if block is None or _is_fused(m) or not isinstance(getattr(m, block.children[0]), nn.Linear):
                continue
            # A block of one Linear calls its GeLU as a function (ESM's): known only by its class, so another
            # class of that shape is no look-alike worth reporting.
            act = getattr(m, block.children[1]) if len(block.children) > 1 else None
            if act is not None and gelu_kind(act) is None:
                if "gelu" in type(act).__name__.lower():
                    report.keep(f"Linear + {type(act).__name__}", "no fused kernel for this activation")
                continue
            if why := unknown_code(m, known_classes((block.cls,), _BLOCK_MODELS)):
                if act is not None:
                    report.keep(f"Linear + GeLU in {type(m).__name__}", why)
                continue
            self.fused(m, block.forward)
            fused += 1
        return fused

    def output_blocks(self, root: nn.Module, report: EncoderReport) -> int:
        """dense -> dropout -> + residual -> LayerNorm blocks of known code: one LayerNorm kernel each, with the
        dropout and the residual add (`_add_norm`). A look-alike of unknown code keeps its own forward (its
        LayerNorm still runs the kernel, alone)."""
        known = known_classes(_OUTPUT_BLOCK_CLASSES, _BLOCK_MODELS)
        fused = 0
        for block in [m for m in root.modules() if _is_output_block(m) and not _is_fused(m)]:
            if why := unknown_code(block, known):
                report.keep(f"dense + dropout + residual in {type(block).__name__}", why)
                continue
            self.fused(block, _output_block_forward)
            fused += 1
        return fused

    def layer_norms(self, root: nn.Module) -> int:
        return ops.kernels_package().fuse_layer_norms(root, retype=self.retype)

    def family_norms(self, root: nn.Module) -> tuple[int, int]:
        """Every norm of a family's own class (`_FAMILY_NORMS`: RMSNorms, DebertaLayerNorm) under root runs the
        kernel: (LayerNorms, RMSNorms) fused."""
        counts = []
        for names, models, forward in _FAMILY_NORMS:
            known = known_classes(names, models)
            found = [m for m in root.modules()
                     if isinstance(m, known) and not _is_fused(m) and not unknown_code(m, known)]
            for m in found:
                self.fused(m, forward)
            counts.append(len(found))
        return counts[0], counts[1]


def _is_fused(module: nn.Module) -> bool:
    return "_bertfuse_base" in vars(type(module))


# Which padded positions of the encoder's output the heads over it read (the fused encoder leaves them 0): none;
# the first (a pooler, a sequence or multiple-choice classifier: left padding pads it); every one (question
# answering: the start and end logits and their loss span every position, padded ones included).
NO_PADDING, FIRST_POSITION, EVERY_POSITION = "none", "first", "every"
PADDED_POSITIONS = ("exact", "zero")


class _EncoderState(NamedTuple):
    """What a fused encoder knows of itself, kept on it (as `_bertfuse_encoder`)."""
    layers: Layers
    config: object                 # the encoder model's config (output flags, the attention implementation)
    report: EncoderReport
    reads: str = NO_PADDING        # which padded positions its model's heads read (`padded_reads`)


def padded_reads(root: nn.Module, enc_model: nn.Module, padded_positions: str) -> str:
    """What the heads over `enc_model` inside `root` read at padded positions (NO_PADDING where
    padded_positions="zero": the caller accepted 0 there)."""
    if padded_positions == "zero":
        return NO_PADDING
    readers = [enc_model, *(m for m in root.modules() if any(c is enc_model for c in m.children()))]
    names = {c.__name__ for m in readers for c in type(m).__mro__}
    if any(n.endswith("ForQuestionAnswering") for n in names):
        return EVERY_POSITION
    if getattr(enc_model, "pooler", None) is not None or \
            any(n.endswith(("ForSequenceClassification", "ForMultipleChoice")) for n in names):
        return FIRST_POSITION
    return NO_PADDING


def _padded_read_problems(reads: str, keys) -> list[str]:
    """[why] where this call's heads read a padded position (`padded_reads`), which only the original code
    computes. Compiled, where no value can be read: every position read, the original code always (returned as a
    reason); the first, the program checks it when it runs and stops rather than compute something else."""
    if reads == NO_PADDING or keys is None:
        return []
    where = "every position: question answering" if reads == EVERY_POSITION else "the first: a pooler or classifier"
    why = (f"padding at a position its heads read ({where}), which the fused encoder leaves 0 "
           "(fuse(..., padded_positions='zero') accepts that)")
    read = keys if reads == EVERY_POSITION else keys[:, :1]
    if torch.compiler.is_compiling():
        if reads == EVERY_POSITION:
            return [why]
        torch._assert_async(read.all(), f"bert.hf.fuse: {why}")
        return []
    return [] if bool(read.all()) else [why]


def _fuse_encoder_model(fuser: _Fuser, path: str, model: nn.Module, child: str, reads: str) -> EncoderReport:
    """Fuse one encoder model; its report also names the hub kernels (bound by transformers' kernelize) whose
    function the fused code now computes: those on modules fuse changed, or inside them."""
    hub = {m: type(m).kernel_layer_name for m in model.modules() if ops.hub_kernel(m) is not None}
    report = _fuse_encoder(fuser, path, model, child, reads)
    parents = {c: m for m in model.modules() for c in m.children()}
    replaced = collections.Counter(name for m, name in hub.items() if _is_fused(m) or _is_fused(parents.get(m, m)))
    if replaced:
        report.fused.append("the function of transformers' hub kernels on or inside fused modules (where a fused "
                            "kernel computes it): " + ", ".join(f"{n} x{k}" for n, k in sorted(replaced.items())))
    return report


def _fuse_encoder(fuser: _Fuser, path: str, model: nn.Module, child: str, reads: str) -> EncoderReport:
    encoder = getattr(model, child) if child else model  # "": the model holds its layers itself
    stack, layers = encoder_stack(encoder)
    kinds = {layer_kind(layer) for layer in layers}
    kind = kinds.pop() if len(kinds) == 1 else None
    kind = kind if kind is not None and kind.stack is stack else None
    report = EncoderReport(path, type(model).__name__, kind.name if kind else "unknown")
    # Judged on the model as it came, before any module of it changes class.
    reasons = ["the layers' structure is not one the fused attention knows"] if kind is None else \
        _attention_problems(model, kind, encoder)
    n_blocks = fuser.output_blocks(model, report)
    n_gelus = fuser.gelu_blocks(model, report)
    n_family, n_rms = fuser.family_norms(model)
    n_norms = fuser.layer_norms(model) + n_family
    report.fused.append(f"{n_norms} LayerNorms ({n_blocks} with dense dropout + residual)"
                        + (f", {n_rms} RMSNorms" if n_rms else ""))
    if n_gelus:
        report.fused.append(f"{n_gelus} Linear + GeLU")
    if reasons:
        report.keep("attention", "; ".join(reasons))
        return report
    for layer in layers:  # each once: ALBERT's layers are shared by the passes its config counts
        for path_in_layer, forward in kind.forwards:
            fuser.fused(_get(layer, path_in_layer) if path_in_layer else layer, forward)
    for group in stack.groups(encoder):
        fuser.fused(group, stack.group_forward)
    fuser.attach(encoder, "_bertfuse_encoder", _EncoderState(kind, getattr(model, "config", None), report, reads))
    fuser.fused(encoder, kind.encoder_forward or _encoder_forward)
    if kind.model_forward:
        fuser.fused(model, kind.model_forward)
    if encoder is model or kind.model_forward:
        _register_recorded_outputs(model)
    report.fused.append(kind.fused)
    return report


def _register_recorded_outputs(model: nn.Module) -> None:
    """transformers 5 looks up which submodules' outputs a model records (output_hidden_states, output_attentions,
    answered by the original code) by the name of the model's class, registered when a model is built: a model
    fused whole has its fused class's name, registered here to the same answer."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # transformers 4: the models return what they record themselves
        return
    if getattr(model, "_can_record_outputs", None):
        _CAN_RECORD_REGISTRY[model] = model._can_record_outputs


# ---- masked-LM heads given labels: the loss at labelled rows only, no vocabulary logits --------------------
def _mlm_head(task: nn.Module) -> MLMHead | None:
    """The MLM head of `task`: its family's own record first (ESM's head has RoBERTa's paths but adds a bias of
    its own after the decoder), then any record whose paths it has."""
    classes = {c.__name__ for c in type(task).__mro__}
    own = [f.mlm_head for f in FAMILIES if classes & {f.prefix + "ForMaskedLM", f.prefix + "ForPreTraining"}]
    for head in (*own, *MLM_HEADS):
        paths = [p for p in (head.dense, head.act, head.norm, head.decoder) if p]
        if _has(task, *paths) and isinstance(_get(task, head.decoder), _DECODERS):
            return head
    return None


_DECODERS = (nn.Linear, nn.Embedding)  # a head's decoder: a Linear, or the tied input embedding (its weight)
_MLM_TASK_CLASSES = ("{P}ForMaskedLM", "{P}ForPreTraining")
_MLM_HEAD_CLASSES = ("{P}OnlyMLMHead", "{P}PreTrainingHeads", "{P}LMPredictionHead", "{P}PredictionHeadTransform",
                     "{P}LMHead", "{P}GeneratorPredictions", "{P}MLMHead", "{P}PredictionHead",
                     # DeBERTa-v2's BERT-style head (its config's `legacy`), BERT's code under these names
                     "Legacy{P}OnlyMLMHead", "Legacy{P}LMPredictionHead", "Legacy{P}PredictionHeadTransform")


def _mlm_code_problem(task: nn.Module, head: MLMHead) -> str | None:
    """Why the masked-only loss may not compute what `task` computes, or None: the task model and every module
    on the way to its head's dense, norm and decoder must be of the families' own classes (FusedMLMForward stands
    in for all their forwards); and a loss over the rows labelled other than -100 (ModernBERT's sparse
    prediction drops the rows of its own sparse_pred_ignore_index, which may be another label)."""
    cfg = getattr(task, "config", None)
    if getattr(cfg, "sparse_prediction", False) and getattr(cfg, "sparse_pred_ignore_index", -100) != -100:
        return (f"sparse_prediction drops the rows labelled {cfg.sparse_pred_ignore_index}, which the masked-only "
                "loss counts")
    why = unknown_code(task, known_classes(_MLM_TASK_CLASSES, _MLM_MODELS))
    # The modules holding the head's parts; an embedding decoder is the encoder's own input embedding, whose
    # weight alone is read (the model around it is not the head's).
    parts = (head.dense, head.norm) if isinstance(_get(task, head.decoder), nn.Embedding) else \
        (head.dense, head.norm, head.decoder)
    owners = {p.rsplit(".", 1)[0] for p in parts if p and "." in p}
    prefixes = sorted({o.rsplit(".", i)[0] for o in owners for i in range(o.count(".") + 1)})
    known = known_classes(_MLM_HEAD_CLASSES, _MLM_MODELS)
    return why or next(filter(None, (unknown_code(_get(task, p), known) for p in prefixes)), None)


def _head_transform(task: nn.Module, head: MLMHead, x: torch.Tensor) -> torch.Tensor:
    if head.dense is None:  # the decoder alone
        return x
    act = _get(task, head.act) if head.act else None
    return _get(task, head.norm)(_linear_gelu(_get(task, head.dense), act, x))


class PairHead(NamedTuple):
    """A pre-training model's sentence-pair head, on the pooled output beside the MLM head: BERT's next-sentence
    prediction, ALBERT's sentence order. transformers' loss is the MLM loss plus this head's cross-entropy,
    given both labels (None otherwise)."""
    module: str                    # its path in the task model
    label: str                     # the task model's argument holding its labels
    logits: str                    # the output field of its logits
    output: str                    # the output class without the vocabulary logits (`_NARROWED`)


PAIR_HEADS = (PairHead("cls.seq_relationship", "next_sentence_label", "seq_relationship_logits",
                        "BertForPreTrainingOutputWithoutLogits"),
               PairHead("sop_classifier", "sentence_order_label", "sop_logits",
                        "AlbertForPreTrainingOutputWithoutLogits"))


def pair_head(task: nn.Module) -> PairHead | None:
    """The sentence-pair head (PAIR_HEADS) a pre-training task model has, or None."""
    return next((h for h in PAIR_HEADS if _has(task, h.module)), None)


class FusedMLMForward:
    """A masked-LM task model's forward that, given labels, never forms the vocabulary logits; set as the task
    model's `forward` attribute. Arguments bind as the model's own forward binds them (so a positional call means
    the same fused and unfused), and it pickles with the model (a plain object, not a bound function)."""

    def __init__(self, task: nn.Module, head: MLMHead, base: str):
        self.task, self.head, self.base = task, head, base
        self.original = task.__dict__.get("forward")  # another wrapper's, if any; else the class's forward
        self.pair = pair_head(task)  # pre-training's second head, if any
        # A head whose forward computes its loss by transformers' loss_function (ModernBERT's, EuroBERT's) sums
        # it and divides by num_items_in_batch where that is given (transformers.Trainer's count of labelled tokens
        # over its accumulated steps); the others take the mean and ignore it.
        self.sums = "loss_function" in inspect.unwrap(type(task).forward).__code__.co_names
        # Its output class, made here: making a class inside a call is not something torch.compile traces.
        self.output = __getattr__(self.pair.output if self.pair else "MaskedLMOutputWithoutLogits")

    def unfused(self, *args, **kwargs):
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.task).forward(self.task, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The unfused forward's: what inspect (transformers.Trainer choosing its input columns...) sees."""
        return inspect.signature(self.original or type(self.task).forward.__get__(self.task))

    def _arguments(self, args, kwargs) -> dict:
        """Every argument by name, as the unfused forward would bind it."""
        bound = self.__signature__.bind(*args, **kwargs)
        named = {}
        for name, value in bound.arguments.items():
            kind = bound.signature.parameters[name].kind
            named.update(value if kind is inspect.Parameter.VAR_KEYWORD else {name: value})
        return named

    def __call__(self, *args, **kwargs):
        kw = self._arguments(args, kwargs)
        pair = self.pair
        labels, pair_label = kw.pop("labels", None), kw.pop(pair.label, None) if pair else None
        # The original code wherever transformers' answer is not the masked-only loss: no labels (the logits are
        # the answer), pre-training without the pair head's label (transformers' loss is then None), a call
        # asking for more than loss and logits, a decoder the kernel cannot read (a quantised Linear, an adapter,
        # a hook on it), or an ONNX export (which exports the original code).
        if labels is None or (pair and pair_label is None) or kw.get("output_attentions") \
                or kw.get("output_hidden_states") or kw.get("return_dict") is False \
                or not ops.plain(_get(self.task, self.head.decoder), *_DECODERS) or ops.exporting_onnx():
            return self.unfused(*args, **kwargs)
        kw.pop("return_dict", None)
        items = kw.pop("num_items_in_batch", None) if self.sums else None
        out = getattr(self.task, self.base)(**{k: v for k, v in kw.items() if v is not None})
        return self._loss(out, labels, pair_label, items)

    def _loss(self, out, labels, pair_label, items=None):
        task, head = self.task, self.head
        hidden, labels = out[0], labels.reshape(-1)
        decoder = _get(task, head.decoder)
        check_labels(labels, decoder.weight.shape[0], "labels", (hidden.shape[0] * hidden.shape[1],))
        rows = ops.labelled_rows(labels)
        h = _head_transform(task, head, hidden.reshape(-1, hidden.shape[-1])[rows])
        bias = getattr(decoder, "bias", None)  # an embedding decoder has none
        if head.bias:  # the head's own bias, added after the decoder
            bias = _get(task, head.bias) if bias is None else bias + _get(task, head.bias)
        loss = ops.masked_lm_loss(h, decoder.weight, bias, labels[rows], backend=ops.backend_for(h)).loss
        if items is not None:  # the sum over the labelled rows, divided by the count given
            loss = loss * rows.numel() / (items.to(loss.device) if torch.is_tensor(items) else items)
        else:  # transformers' mean over no labelled token is NaN (the kernel's 0 is our own models' convention)
            loss = torch.where((labels != -100).any(), loss, torch.nan)
        if pair_label is not None:  # pre-training: the sentence-pair head's loss as well
            pair_logits = _get(task, self.pair.module)(out[1])
            loss = loss + F.cross_entropy(pair_logits.view(-1, 2).float(), pair_label.view(-1))
            return self.output(loss=loss, **{self.pair.logits: pair_logits})
        return self.output(loss=loss)


@functools.cache
def _without_logits(output: type) -> type:
    """`output` (a transformers ModelOutput class) whose vocabulary logits were never formed: fields by name as
    usual (the logits None), but integer indexing and to_tuple() refuse, because with a field missing every later
    position would mean another field than in transformers' output. Registered in this module, so it pickles."""
    def refuse(self, *args):
        raise TypeError(f"{output.__name__} of a model fused with mlm_logits=False holds no vocabulary logits, so "
                        "positional access would not mean what it means in transformers; read fields by name "
                        "(out.loss, ...) or fuse with mlm_logits=True")

    def getitem(self, key):
        return output.__getitem__(self, key) if isinstance(key, str) else refuse(self)

    name = f"{output.__name__}WithoutLogits"
    cls = type(name, (output,), {"__getitem__": getitem, "to_tuple": refuse, "__module__": __name__,
                                 "__qualname__": name})
    globals()[name] = cls
    return cls


# The outputs without logits, by name, with the transformers class each one narrows.
_NARROWED = {"MaskedLMOutputWithoutLogits": ("transformers.modeling_outputs", "MaskedLMOutput"),
             "AlbertForPreTrainingOutputWithoutLogits": ("transformers.models.albert.modeling_albert",
                                                         "AlbertForPreTrainingOutput"),
             "BertForPreTrainingOutputWithoutLogits": ("transformers.models.bert.modeling_bert",
                                                       "BertForPreTrainingOutput")}


def __getattr__(name: str):
    """The output classes without logits, made on first use: unpickling an output or a fused model in a new
    process finds them here by name."""
    if name not in _NARROWED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, base = _NARROWED[name]
    return _without_logits(getattr(importlib.import_module(module), base))


def _is_masked_lm(task: nn.Module) -> bool:
    """A masked-LM or pre-training task model, by class: a decoder's LM head (BertLMHeadModel, RobertaForCausalLM)
    has the same modules but computes the shifted next-token loss."""
    return not getattr(getattr(task, "config", None), "is_decoder", False) and any(
        c.__name__.endswith(("ForMaskedLM", "ForPreTraining")) for c in type(task).__mro__)


# ---- token-level labels on padded positions: that call runs the original encoder code --------------------------
# Set by a token-level task model's forward pre-hook for the length of its call: a label sits where its 2-D mask
# is 0, so its loss reads a position the fused encoder leaves 0 (collators label padding -100: rare).
_PADDED_LABELS = contextvars.ContextVar("bertfuse_padded_labels", default=False)
_TOKEN_LABELS = ("ForMaskedLM", "ForPreTraining", "ForTokenClassification")


def _reads_token_labels(task: nn.Module) -> bool:
    return any(c.__name__.endswith(_TOKEN_LABELS) for c in type(task).__mro__)


def _labels_pre_hook(module, args, kwargs):
    """Whether this call labels a padded position (one sync; not checked inside a compiled graph)."""
    if torch.compiler.is_compiling():
        return None
    try:
        named = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:  # the call itself is wrong: its forward raises
        return None
    named = {**named.pop("kwargs", {}), **named}
    labels, mask = named.get("labels"), named.get("attention_mask")
    padded = torch.is_tensor(labels) and torch.is_tensor(mask) and mask.dim() == 2 and \
        labels.shape == mask.shape and bool(((labels != -100) & (mask == 0)).any())
    _PADDED_LABELS.set(padded)
    return None


def _labels_post_hook(module, args, output):
    if not torch.compiler.is_compiling():
        _PADDED_LABELS.set(False)


def _hook_labels(task: nn.Module) -> None:
    task.register_forward_pre_hook(_labels_pre_hook, with_kwargs=True)
    task.register_forward_hook(_labels_post_hook, always_call=True)


def _unhook_labels(task: nn.Module) -> None:
    """Remove the two hooks by their functions (a deep copy's hooks are the copy's own)."""
    for hooks, fn in ((task._forward_pre_hooks, _labels_pre_hook), (task._forward_hooks, _labels_post_hook)):
        for key in [k for k, f in hooks.items() if f is fn]:
            del hooks[key]
            task._forward_pre_hooks_with_kwargs.pop(key, None)
            task._forward_hooks_always_called.pop(key, None)


def _fuse_heads(fuser: _Fuser, model: nn.Module, encoders, reports, mlm_logits: bool) -> list:
    """The task models around each encoder model: their GeLUs and LayerNorms, and (mlm_logits=False) the
    masked-only MLM loss."""
    patched = []
    for (path, enc_model, _), report in zip(encoders, reports):
        for task in model.modules():
            base = next((name for name, c in task.named_children() if c is enc_model), None)
            if base is None:
                continue
            n = fuser.gelu_blocks(task, report) + fuser.layer_norms(task)
            if n:
                report.fused.append(f"{n} head modules ({type(task).__name__})")
            head = _mlm_head(task) if _is_masked_lm(task) else None
            if head is None or task in patched:
                continue
            if mlm_logits:
                report.kept.append((f"MLM loss ({type(task).__name__})", "mlm_logits=True: the full vocabulary "
                                    "logits are formed, as transformers returns them"))
                continue
            if why := _mlm_code_problem(task, head):
                report.keep(f"MLM loss ({type(task).__name__})", why)
                continue
            task.forward = FusedMLMForward(task, head, base)
            patched.append(task)
            report.fused.append(f"MLM loss at labelled positions, no logits ({type(task).__name__})")
    return patched


# ---- the public calls -------------------------------------------------------------------------
def fuse(model: nn.Module, mlm_logits: bool = True, padded_positions: str = "exact") -> nn.Module:
    """Fuse every encoder inside `model` in place (see the module docstring); returns `model`.

    mlm_logits: True (the default) keeps transformers' contract for masked-LM and pre-training models given
    labels: the full [batch, seq, vocab] logits are formed and returned with the loss. False computes the loss
    at the labelled positions only, by the masked-only kernel, and never forms the logits (memory bounded by the
    labelled tokens): `logits` / `prediction_logits` are then None, and the output refuses integer indexing and
    to_tuple() (positions would shift). The loss itself means the same either way.

    padded_positions: the fused encoder computes real tokens only and leaves padded positions of its output 0.
    "exact" (the default): a call with padding where a head over the encoder reads it (question answering's start
    and end logits, whose loss spans every position; a pooler or classifier reading a padded first position, as
    left padding gives; a masked-LM or token-classification label on a padded position of a 2-D mask, seen by a
    forward pre-hook on the task model that unfuse removes) runs the original code, so every head's answer is
    transformers'. "zero": such calls run fused too, and those heads read 0 there (a QA loss over padded
    positions, a pooled padded first token, then differ from transformers'), for speed."""
    if padded_positions not in PADDED_POSITIONS:
        raise ValueError(f"fuse: padded_positions must be one of {PADDED_POSITIONS}, got {padded_positions!r}")
    saved = getattr(model, _ORIGINALS, None)
    if saved:  # already fused
        if (saved.mlm_logits, saved.padded_positions) != (mlm_logits, padded_positions):
            raise ValueError(f"fuse: this model is already fused with mlm_logits={saved.mlm_logits}, "
                             f"padded_positions={saved.padded_positions!r}; unfuse it first")
        return model
    encoders = encoder_parts(model)
    if not encoders:
        raise ValueError(f"fuse: no encoder inside {type(model).__name__} (looked for a module with `embeddings` "
                         "and an `encoder` or `transformer` holding a `layer` list)")
    fuser = _Fuser()
    reports = [_fuse_encoder_model(fuser, *part, padded_reads(model, part[1], padded_positions))
               for part in encoders]
    heads = _fuse_heads(fuser, model, encoders, reports, mlm_logits)
    labelled = () if padded_positions == "zero" else tuple(m for m in model.modules() if _reads_token_labels(m))
    for task in labelled:
        _hook_labels(task)
    for report in reports:
        report.warn()
    object.__setattr__(model, _ORIGINALS, _Saved(fuser.record, heads, mlm_logits, padded_positions, labelled))
    object.__setattr__(model, _REPORT, reports)
    return model


def unfuse(model: nn.Module) -> nn.Module:
    """Give every module fuse changed its own class back (the objects never changed: what they learned, loaded
    or had registered on them while fused stays); returns `model`."""
    saved = getattr(model, _ORIGINALS, None)
    if not saved:
        return model
    for module, name, old in reversed(saved.record):
        if name == "__class__":
            module.__class__ = old
        elif old is None:
            object.__delattr__(module, name)
        else:
            vars(module)[name] = old
    for task in saved.labelled:
        _unhook_labels(task)
    for task in saved.heads:
        original = task.forward.original
        del task.forward
        if original is not None:
            task.forward = original
    object.__delattr__(model, _ORIGINALS)
    object.__delattr__(model, _REPORT)
    return model


def fuse_report(model: nn.Module) -> list[EncoderReport]:
    """Per encoder of a fused model: what was fused and what was kept, with the reason ([] if not fused)."""
    return list(getattr(model, _REPORT, []))

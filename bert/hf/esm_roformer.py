"""The rotary encoders of BERT's shape, an encoder given hidden states: ESM and RoFormer.

  * ESM (pre-norm BERT): attention.LayerNorm before attention.self, the layer's LayerNorm before intermediate,
    encoder.emb_layer_norm_after;
  * RoFormer: BERT's layer.
Each rotates q and k (RoFormer's rotary_value: v too) by the cos and sin its model keeps: ESM's formed once per
forward from the position ids and handed to its encoder, RoFormer's the encoder's float64-made sinusoid table.
The kernel reads those tables at each token's row (`ops.Rotation.cos`/`.sin`), so the rotation is the model's own
to the bit.
"""
from __future__ import annotations

import torch

from bertfuse.bert.hf.bert import _BERT_MLM, BERT_LAYERS, _bert_attention_forward, _bert_layer_forward
from bertfuse.bert.hf.compute import _dropout_rate, _linear_gelu, _original
from bertfuse.bert.hf.records import GLOBAL, Family, GeluBlock, Group, Layers, MLMHead, Rotary
from bertfuse.bert.hf.rotary import _rotary_width_problem
from bertfuse.bert.masks import ADDED
from bertfuse.bert.model import ops
from bertfuse.bert.model.padding import unpad


def _rotated_self_attention(self, x, packed, position, rotate_value=False):
    """The context [tokens, hidden] of BERT-like q, k, v projections, q and k (and v, RoFormer's rotary_value)
    rotated where the encoder has rotary positions (`position`, None: absolute positions, in the embeddings)."""
    heads, d, backend = self.num_attention_heads, self.attention_head_size, ops.backend_for(x)
    q, k, v = ops.project_qkv(x, self.query, self.key, self.value, heads, d)
    # ESM before transformers moved its rotation to the model: each attention module its own (`_esm_own_rotary`).
    rotation = None if position is None else position.rotations.get(self, position.rotations.get(GLOBAL))
    if rotation is not None:
        q, k, v = (ops.rotary(t, position.positions, rotation, backend) if turn else t
                   for t, turn in ((q, True), (k, True), (v, rotate_value)))
    context = ops.varlen_attention(q, k, v, packed, _dropout_rate(self.dropout) if self.training else 0.0, backend)
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


def _table_rows(rows: int, batch: int, seqlen: int, p) -> torch.Tensor:
    """Each packed token's row of a [rows * seqlen] table of its (batch row, position): rows == batch, one
    table row per token; rows == 1, the same rows for every batch row."""
    index = torch.arange(rows * seqlen, device=p.cu_seqlens.device).view(rows, seqlen)
    return unpad(index.expand(batch, seqlen), p)


def _esm_rotary(encoder, kwargs, batch, seqlen, p) -> Rotary | None:
    """ESM's rotary positions: the cos and sin [1 or batch, seq, head_dim] its model forms once per forward (from
    the position ids), each token reading its row's first half (the second repeats it), half rotation."""
    embeddings = kwargs.get("position_embeddings")
    if embeddings is None:  # absolute positions, in the embeddings, or each attention's own rotation
        return _esm_own_rotary(encoder, batch, seqlen, p)
    cos, sin = (t.reshape(-1, t.shape[-1]) for t in embeddings)
    half = cos.shape[1] // 2
    rows = _table_rows(embeddings[0].shape[0], batch, seqlen, p)
    return Rotary(rows, {GLOBAL: ops.Rotation(None, 1.0, False, cos[:, :half], sin[:, :half])}, {GLOBAL: (-1, -1)})


def _esm_own_rotary(encoder, batch, seqlen, p) -> Rotary | None:
    """ESM's rotary positions where each attention module rotates q and k itself (its `rotary_embeddings`, in
    transformers before the model formed them once): every token at its index in the padded row, whatever the
    position ids, by the cos and sin tables [seq, head_dim] that module's own code forms and caches (called here,
    so its cache is what the original call leaves), each attention module its own. None: absolute positions."""
    rotations = {}
    for layer in encoder.layer:
        attention = layer.attention.self
        own = getattr(attention, "rotary_embeddings", None)
        if own is not None:
            # its tables for a key [..., seq, head_dim] on this device (only the shape and the device are read)
            cos, sin = own._update_cos_sin_tables(p.cu_seqlens.new_empty((seqlen, 0)), seq_dimension=-2)
            cos, sin = (t.reshape(-1, t.shape[-1]) for t in (cos, sin))
            half = cos.shape[1] // 2
            rotations[attention] = ops.Rotation(None, 1.0, False, cos[:, :half], sin[:, :half])
    if not rotations:
        return None
    return Rotary(_table_rows(1, batch, seqlen, p), rotations, {GLOBAL: (-1, -1)})


def _roformer_rotary(encoder, kwargs, batch, seqlen, p) -> Rotary:
    """RoFormer's rotary positions: its sinusoid table [max_position_embeddings, head_dim] (sin, then cos, made in
    float64) read at each token's position in its row, pairs interleaved."""
    weight = encoder.embed_positions.weight
    half = weight.shape[1] // 2
    rows = _table_rows(1, batch, seqlen, p)
    return Rotary(rows, {GLOBAL: ops.Rotation(None, 1.0, True, weight[:, half:], weight[:, :half])}, {GLOBAL: (-1, -1)})


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
    """ESM's rotation (position_embedding_type "rotary": the model's, or each attention module's own) must be as
    wide as its head."""
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    own = [getattr(layer.attention.self, "rotary_embeddings", None) for layer in model.encoder.layer]
    embeddings = [e for e in (getattr(model, "rotary_embeddings", None), *own) if e is not None]
    return next((why for e in embeddings if (why := _rotary_width_problem(e.inv_freq, head_dim))), [])


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

GROUP = Group(
    families=(
        # Rotary positions (the ESM-2 models'); the padding id 1, as theirs.
        Family("esm", "Esm", ESM_LAYERS,
               MLMHead("lm_head.dense", None, "lm_head.layer_norm", "lm_head.decoder", "lm_head.bias"), 1,
               test_config=(("position_embedding_type", "rotary"), ("mask_token_id", 4)), segments=False),
        Family("roformer", "RoFormer", ROFORMER_LAYERS, _BERT_MLM, 0)),
    gelu_blocks=(GeluBlock("{P}Intermediate", ("dense",), _esm_intermediate_forward),))

"""DeBERTa-v2/v3 and DeBERTa (v1): disentangled attention.

BERT's layer around DisentangledSelfAttention.{query_proj,key_proj,value_proj[,pos_key_proj,pos_query_proj]}
(v1: one in_proj with q_bias and v_bias, pos_proj and pos_q_proj), the encoder's rel_embeddings (and their
LayerNorm) handed to every layer: each layer projects them (`Layers.relative`) and the disentangled kernel adds
the c2p and p2c terms inside its tiles. The model, whose code asks the encoder for every hidden state, is fused
too (`Layers.model_forward`). DeBERTa v1's talking heads, DeBERTa-v2's convolution and a bucket rule the kernels
refuse keep the original attention. Each DebertaLayerNorm (DeBERTa v1's own LayerNorm class) runs the
LayerNorm kernel; the enhanced mask decoder's head is fused wherever it appears.
"""
from __future__ import annotations

import torch

from bertfuse.bert.hf.bert import _bert_attention_forward, _bert_layer_forward, _head_transform_forward
from bertfuse.bert.hf.compute import _family_layer_norm_forward, _linear_gelu, _original
from bertfuse.bert.hf.encoder import _relative_call_problems
from bertfuse.bert.hf.records import Family, FamilyNorm, GeluBlock, Group, Layers, MLMHead
from bertfuse.bert.masks import NONZERO
from bertfuse.bert.model import ops


def _deberta_lm_head_forward(self, hidden_states, word_embeddings):
    """DebertaV2LMPredictionHead (the enhanced mask decoder's): LayerNorm(act(dense(x))) @ E^T + bias."""
    h = self.LayerNorm(_linear_gelu(self.dense, self.transform_act_fn, hidden_states))
    return torch.matmul(h, word_embeddings.weight.t()) + self.bias


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
    the fused encoder is asked for them only where the call asks (output_hidden_states), the rest as its code
    does. Asked for attentions, or with z_steps, its own code runs, and the encoder's own code with it (counted in
    fuse_report)."""
    cfg = self.config
    hidden = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
    if (cfg.output_attentions if output_attentions is None else output_attentions) or self.z_steps > 1 or \
            (input_ids is None) == (inputs_embeds is None):
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
    encoded = self.encoder(x, mask, output_hidden_states=bool(hidden), output_attentions=False, return_dict=True)
    out = BaseModelOutput(last_hidden_state=encoded.last_hidden_state, hidden_states=encoded.hidden_states)
    return out if (cfg.return_dict if return_dict is None else return_dict) else out.to_tuple()


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
    model_forward=_deberta_model_forward, mask_reading=NONZERO, padded_queries=False,
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

# The enhanced mask decoder head (legacy=False): the word embeddings' weight as decoder, a bias of its own. A
# legacy model's head is BERT's (cls.predictions), found by its paths.
_DEBERTA_MLM = MLMHead("lm_predictions.lm_head.dense", "lm_predictions.lm_head.transform_act_fn",
                       "lm_predictions.lm_head.LayerNorm", "deberta.embeddings.word_embeddings",
                       "lm_predictions.lm_head.bias")
GROUP = Group(
    families=(
        # DeBERTa-v3's attention: 8 log buckets up to 12 positions (the test batch's 17 tokens cross both ranges),
        # c2p and p2c through the shared key and query projections, the relative embeddings' LayerNorm, no absolute
        # positions, no segments.
        Family("deberta-v2", "DebertaV2", DEBERTA_V2_LAYERS, _DEBERTA_MLM, 0,
               test_config=(("legacy", False), ("relative_attention", True), ("position_buckets", 8),
                            ("max_relative_positions", 12), ("pos_att_type", ["p2c", "c2p"]),
                            ("norm_rel_ebd", "layer_norm"), ("share_att_key", True), ("position_biased_input", False)),
               segments=False),
        # DeBERTa (v1) as its released models: c2p and p2c over plain distances up to 12 positions (the test
        # batch's 17 tokens reach past them), no absolute positions, no segments.
        Family("deberta", "Deberta", DEBERTA_LAYERS, _DEBERTA_MLM, 0,
               test_config=(("legacy", False), ("relative_attention", True), ("max_relative_positions", 12),
                            ("pos_att_type", ["c2p", "p2c"]), ("position_biased_input", False)),
               segments=False)),
    gelu_blocks=(GeluBlock("Legacy{P}PredictionHeadTransform", ("dense", "transform_act_fn", "LayerNorm"),
                           _head_transform_forward),
                 GeluBlock("{P}LMPredictionHead", ("dense", "transform_act_fn", "LayerNorm"),
                           _deberta_lm_head_forward)),
    # DebertaLayerNorm: a LayerNorm, its epsilon inside the root.
    norms=(FamilyNorm(("{P}LayerNorm",), _DEBERTA_MODELS, _family_layer_norm_forward),))

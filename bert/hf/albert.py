"""ALBERT: attention.{query,key,value,dense,attention_dropout,output_dropout,LayerNorm}, ffn, activation,
ffn_output, full_layer_layer_norm.

Its layers are held not in a `layer` list but in `albert_layer_groups[g].albert_layers`, one set of parameters
that num_hidden_layers passes share (`ALBERT_GROUPS`, a `Stack`): each shared layer is fused once, and the fused
encoder runs the passes through the groups as ALBERT's code does, after projecting the factorised embedding (a
Linear) up to the hidden size on the real tokens only. Its MLM head is fused wherever it appears, and its
sentence-order head beside the masked-only loss.
"""
from __future__ import annotations

from torch import nn

from bertfuse.bert.hf.compute import _add_norm, _attend, _forward_parameters, _linear_gelu, _original
from bertfuse.bert.hf.records import (Family, GeluBlock, Group, Layers, MLMHead, PairHead, Stack, _module_list,
                                      passes_padded)


def _albert_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """AlbertAttention: LayerNorm(x + output_dropout(dense(softmax(q k^T / sqrt(d)) v))), its probabilities'
    dropout being attention_dropout (AlbertSdpaAttention, before transformers 5: the rate `dropout_prob`)."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    context = _attend(self, self.query, self.key, self.value, _albert_probs_dropout(self), hidden_states, packed,
                      position)
    return _add_norm(self.LayerNorm, self.output_dropout, self.dense(context), hidden_states), None


def _albert_probs_dropout(attention):
    """The dropout ALBERT's attention applies to its probabilities: its attention_dropout module, or the rate
    AlbertSdpaAttention (transformers before 5) hands scaled_dot_product_attention instead."""
    rate = getattr(attention, "dropout_prob", None)  # set by AlbertSdpaAttention's __init__ only
    return attention.attention_dropout if rate is None else rate


def _albert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """AlbertLayer: full_layer_layer_norm(ffn_output(activation(ffn(a))) + a) for a = attention(x); no dropout
    after ffn_output (the layer's `dropout` is unused by its code), and the feed-forward's chunking along the
    sequence changes nothing."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    attended, _ = self.attention(hidden_states, packed=packed, position=position)
    ffn = self.ffn_output(_linear_gelu(self.ffn, self.activation, attended))
    return _add_norm(self.full_layer_layer_norm, None, ffn, attended)


@passes_padded
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


def _albert_call_problems(encoder, keys) -> list[str]:
    """ALBERT's encoder before transformers 5 hands each group its slice of the head masks, int(layers / groups)
    long, and each group indexes it once per layer it holds: where a group holds more layers than that (more
    groups than layers, or inner_group_num above layers / groups) its code raises IndexError (the original code
    runs, and raises)."""
    if "head_mask" not in _forward_parameters(type(encoder)):
        return []
    per_group = int(encoder.config.num_hidden_layers / encoder.config.num_hidden_groups)
    if any(len(_module_list(g, "albert_layers")) > per_group for g in _albert_groups(encoder)):
        return ["a layer group holding more layers than layers / groups, whose head masks this release's ALBERT "
                "code cannot index (it raises)"]
    return []


ALBERT_GROUPS = Stack(_albert_layers, _run_albert_groups, _albert_groups, _albert_group_forward, ("{P}LayerGroup",))

_ALBERT_MODELS = (("albert.modeling_albert", "Albert"),)

ALBERT_LAYERS = Layers("albert", ("attention.query", "attention.key", "attention.value", "attention.dense",
                                  "attention.LayerNorm", "ffn", "ffn_output", "full_layer_layer_norm"),
                       "attention", (("", _albert_layer_forward), ("attention", _albert_attention_forward)),
                       "BaseModelOutput",
                       (("attention", ("{P}Attention", "{P}SdpaAttention")), ("", ("{P}Layer",)),
                        ("..", ("{P}Transformer",))),
                       _ALBERT_MODELS, stack=ALBERT_GROUPS, probs_dropout="attention_dropout",
                       call_problems=_albert_call_problems)

GROUP = Group(
    families=(Family("albert", "Albert", ALBERT_LAYERS,
                     MLMHead("predictions.dense", "predictions.activation", "predictions.LayerNorm",
                             "predictions.decoder"), 0,
                     test_config=(("embedding_size", 16), ("hidden_act", "gelu_new"))),),
    gelu_blocks=(GeluBlock("{P}MLMHead", ("dense", "activation", "LayerNorm", "decoder"), _albert_mlm_head_forward),),
    pair_heads=(PairHead("sop_classifier", "sentence_order_label", "sop_logits",
                         "AlbertForPreTrainingOutputWithoutLogits"),))

"""MPNet: attention.attn.{q,k,v,o,dropout}, attention.{dropout,LayerNorm}, intermediate and output as BERT's.

Its relative-position bias (encoder.relative_attention_bias, 32 buckets) is computed by the encoder once for
all layers; the fused attention looks it up inside its kernel (`Layers.relative`). Relative positions count
the padded slots between two tokens, so a mask with holes, or a hook on the bias, runs the original code.
"""
from __future__ import annotations

from torch import nn

from bertfuse.bert.hf.bert import _ROBERTA_MLM, _bert_layer_forward
from bertfuse.bert.hf.compute import _add_norm, _attend, _original
from bertfuse.bert.hf.encoder import _relative_call_problems
from bertfuse.bert.hf.records import Family, Group, Layers
from bertfuse.bert.masks import ADDED
from bertfuse.bert.model import ops


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

GROUP = Group(families=(Family("mpnet", "MPNet", MPNET_LAYERS, _ROBERTA_MLM, 1),))

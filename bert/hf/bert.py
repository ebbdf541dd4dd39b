"""BERT and the families transformers generates from its code (RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA...),
and DistilBERT.

  * BERT-like: attention.self.{query,key,value}, attention.output.{dense,dropout,LayerNorm},
    intermediate.{dense,intermediate_act_fn}, output.{dense,dropout,LayerNorm};
  * DistilBERT-like: attention.{q_lin,k_lin,v_lin,out_lin}, sa_layer_norm, ffn.{lin1,activation,lin2,dropout},
    output_layer_norm.
Absolute positions are in the embeddings, which stay unfused. The layer, attention and self-attention forwards
here are the ones MPNet, RoFormer and DeBERTa build on; BERT's intermediate block, prediction-head transform
and ELECTRA's generator head are fused wherever their classes appear, and BERT's next-sentence head beside the
masked-only loss.
"""
from __future__ import annotations

from bertfuse.bert.hf.compute import _add_norm, _attend, _linear_gelu, _original
from bertfuse.bert.hf.encoder import _distilbert_encoder_forward
from bertfuse.bert.hf.records import Family, GeluBlock, Group, Layers, MLMHead, PairHead
from bertfuse.bert.model import ops


def _intermediate_forward(self, hidden_states):
    """BertIntermediate and its copies: intermediate_act_fn(dense(x))."""
    return _linear_gelu(self.dense, self.intermediate_act_fn, hidden_states)


def _head_transform_forward(self, hidden_states):
    """BertPredictionHeadTransform and its copies: LayerNorm(transform_act_fn(dense(x)))."""
    return self.LayerNorm(_linear_gelu(self.dense, self.transform_act_fn, hidden_states))


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


def _distilbert_attention_forward(self, *args, packed=None, position=None, **kwargs):
    """DistilBERT's attention: out_lin(softmax(q k^T / sqrt(d)) v). Its code before transformers 5 is called with
    query=, key=, value= and mask= (hence *args)."""
    if packed is None:
        return _original(self).forward(*args, **kwargs)
    hidden_states = args[0]
    return self.out_lin(_attend(self, self.q_lin, self.k_lin, self.v_lin, self.dropout, hidden_states, packed,
                                 position)), None


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
                            ("..", ("Transformer",)), ("ffn", ("FFN",))), _DISTILBERT_MODELS,
                           encoder_forward=_distilbert_encoder_forward)

_BERT_MLM = MLMHead("cls.predictions.transform.dense", "cls.predictions.transform.transform_act_fn",
                    "cls.predictions.transform.LayerNorm", "cls.predictions.decoder")

_ROBERTA_MLM = MLMHead("lm_head.dense", None, "lm_head.layer_norm", "lm_head.decoder")

GROUP = Group(
    families=(
        Family("bert", "Bert", BERT_LAYERS, _BERT_MLM, 0),
        Family("roberta", "Roberta", BERT_LAYERS, _ROBERTA_MLM, 1),
        Family("xlm-roberta", "XLMRoberta", BERT_LAYERS, _ROBERTA_MLM, 1),
        Family("camembert", "Camembert", BERT_LAYERS, _ROBERTA_MLM, 1),
        Family("electra", "Electra", BERT_LAYERS,
               MLMHead("generator_predictions.dense", "generator_predictions.activation",
                       "generator_predictions.LayerNorm", "generator_lm_head"), 0,
               test_config=(("embedding_size", 32),)),
        Family("distilbert", "DistilBert", DISTILBERT_LAYERS,
               MLMHead("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector"), 0,
               config_names=(("hidden_size", "dim"), ("num_hidden_layers", "n_layers"),
                             ("num_attention_heads", "n_heads"), ("intermediate_size", "hidden_dim"),
                             ("hidden_dropout_prob", "dropout"), ("attention_probs_dropout_prob", "attention_dropout")),
               segments=False)),
    gelu_blocks=(GeluBlock("{P}Intermediate", ("dense", "intermediate_act_fn"), _intermediate_forward),
                 GeluBlock("{P}PredictionHeadTransform", ("dense", "transform_act_fn", "LayerNorm"),
                           _head_transform_forward),
                 GeluBlock("{P}GeneratorPredictions", ("dense", "activation", "LayerNorm"), _generator_head_forward)),
    pair_heads=(PairHead("cls.seq_relationship", "next_sentence_label", "seq_relationship_logits",
                         "BertForPreTrainingOutputWithoutLogits"),))

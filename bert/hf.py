"""Fuse Hugging Face encoders in place: `fuse(model)`, `unfuse(model)`, `fuse_report(model)`.

`fuse` finds every encoder inside any model (a bare BertModel, a task model, a sentence-transformers wrapper)
and swaps its modules for fused ones, in this model instance only: transformers' classes and other instances are
untouched. The fused modules hold the very Parameter objects of the modules they replace, so state_dict keys and
values, optimizers and save_pretrained keep working, and `unfuse` restores the original modules with whatever
they learned.

Encoders are found by structure (an encoder model is a module with `embeddings` and an `encoder` or
`transformer` holding a `layer` list), and a module is fused only where its class is known to compute the fused
op's math: a class of the model types a `Layers` record names (transformers' copies of BERT's layer, DistilBERT's),
or a subclass adding nothing but __init__ (`unknown_code`); look-alikes with BERT's submodule names around other
attention (RoFormer, MRA, Nystromformer, YOSO) keep their code, with the reason in `fuse_report`. What the
drop-in knows about each Hugging Face family is one `Family` record in `FAMILIES` (its layer structure, the
Linear + activation pairs, the MLM head, the padding id), read by the fuser, its tests and bench.hf_parity; a new
family is one record. The layer structures (`Layers`) are
  * BERT-like (BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA...): attention.self.{query,key,value},
    attention.output.{dense,dropout,LayerNorm}, intermediate.{dense,intermediate_act_fn},
    output.{dense,dropout,LayerNorm};
  * DistilBERT-like: attention.{q_lin,k_lin,v_lin,out_lin}, sa_layer_norm, ffn.{lin1,activation,lin2,dropout},
    output_layer_norm.
What is fused:
  * every LayerNorm; "dense -> dropout -> + residual -> LayerNorm" in one kernel;
  * a Linear followed by its GeLU (intermediate layers, DistilBERT's FFN, head transforms, ELECTRA's heads): the
    matmul without bias, then bias + GeLU in one kernel;
  * the encoder: padding removed once per forward, every layer's attention run by the varlen kernel on packed
    tokens, padding restored at the end (padded positions of last_hidden_state are then 0). Each layer stays the
    same object, its class a subclass of its own (`fused_layer_class`), called through its own __call__, so its
    hooks fire and gradient checkpointing recomputes it; under torch.export a static layout replaces unpadding;
  * with fuse(model, mlm_logits=False), masked-LM heads given labels (BERT's cls.predictions, RoBERTa's lm_head,
    ELECTRA's generator, DistilBERT's vocab_*): the loss by the masked-only kernel at labelled positions, the
    vocabulary logits never formed. By default (mlm_logits=True) the head returns transformers' full logits.
The rule is that fusing changes speed, never meaning (bench/hf_suite.py runs transformers' own model tests on
fused models). What cannot be fused keeps the original module with one warning naming the reason, and
`fuse_report` lists it: attention the kernel cannot express (relative or disentangled positions, a head_dim over
128, decoders and their causal-LM heads), an activation without a kernel, layers of an unknown structure. A call
asking for output_attentions, output_hidden_states, cross-attention or a cache, or with a mask the kernel cannot
express (one that differs between queries, or additive values other than 0 and the minimum), runs the original
encoder code, and fuse_report counts it.
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from bert.model import ops
from bert.model.modeling import check_labels
from bert.model.padding import pad, static_layout, unpad, unpad_mask

_ORIGINALS = "_bertfuse_originals"
_REPORT = "_bertfuse_report"


class _Saved(NamedTuple):
    """What fuse changed in a model, kept on it (under _ORIGINALS) for unfuse, and how it was fused."""
    record: list                   # (parent, attribute, original value): replaced modules and changed classes
    heads: list                    # task models whose forward was patched
    mlm_logits: bool


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


# ---- fused modules (the per-op drop-ins are kernels.LayerNorm and kernels.LinearGeLU) ---------------
class FusedSelfOutput(nn.Module):
    """BertSelfOutput / BertOutput and their copies: LayerNorm(dropout(dense(x)) + residual), one fused kernel."""

    def __init__(self, orig: nn.Module):
        super().__init__()
        self.dense, self.dropout = orig.dense, orig.dropout
        self.LayerNorm = ops._kernels().LayerNorm.from_module(orig.LayerNorm)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states), residual=input_tensor, dropout_p=self.dropout.p)


def _key_mask(attention_mask, batch: int, seqlen: int, device) -> torch.Tensor | None:
    """[batch, seq] key mask (True = attend) from whatever the model handed its encoder, read as transformers reads
    it: None; a 2-D mask (0 = padding); a 3-D/4-D boolean mask (True = attend) or float mask, which transformers
    *adds* to the scores, so only its values 0 (attend) and <= the dtype's minimum / 2 (never attended) are a mask.
    None when the fused attention cannot express it: a mask that differs between queries or heads (causal), or
    an additive mask with other values (a bias). Under torch.export no value can be read, so the exported program
    checks this when it runs and stops with that message rather than compute something else."""
    if attention_mask is None:
        return torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    m = attention_mask
    if m.dim() == 2:
        return m != 0
    if m.dim() == 3:
        m = m[:, None]
    if m.dim() != 4 or m.shape[-1] != seqlen or m.shape[0] not in (1, batch):
        return None
    m = m.expand(batch, -1, -1, seqlen)
    # A view expanded along heads and queries is one key mask by construction; anything else is checked.
    shared = all(m.shape[d] == 1 or m.stride(d) == 0 for d in (1, 2))
    keys = m[:, 0, 0, :]
    checks = [] if shared else [(m == keys[:, None, None, :]).all()]
    if m.dtype != torch.bool:
        blocked = keys <= torch.finfo(m.dtype).min / 2
        checks.append(((keys == 0) | blocked).all())
        keys = ~blocked
    if checks:
        ok = torch.stack(checks).all()
        if torch.compiler.is_exporting():
            torch._assert_async(ok, "bert.hf.fuse: this attention mask differs between queries or holds additive "
                                "values other than 0 and the minimum, which the exported fused attention cannot "
                                "express; export the unfused model for such masks")
        elif not bool(ok):  # one sync, for masks transformers built or a user gave
            return None
    return keys


def _bert_layer(layer, x, p, training: bool):
    sa = layer.attention.self
    ctx = ops.self_attention(x, p, sa.query, sa.key, sa.value, sa.num_attention_heads, sa.attention_head_size,
                             sa.dropout.p if training else 0.0, ops.backend_for(x))
    x = layer.attention.output(ctx, x)
    return layer.output(layer.intermediate(x), x)


def _distilbert_layer(layer, x, p, training: bool):
    at, ffn = layer.attention, layer.ffn
    ctx = ops.self_attention(x, p, at.q_lin, at.k_lin, at.v_lin, at.n_heads, at.attention_head_size,
                             at.dropout.p if training else 0.0, ops.backend_for(x))
    x = layer.sa_layer_norm(at.out_lin(ctx), residual=x)
    return layer.output_layer_norm(ffn.lin2(ffn.activation(ffn.lin1(x))), residual=x, dropout_p=ffn.dropout.p)


# ---- one record per layer structure and per model family ------------------------------------------
class Layers(NamedTuple):
    """A layer structure the fused encoder runs: recognised by its submodule paths, and fused only where every
    module on the way (the encoder, each layer and the modules its run replaces) is of a class whose code is
    known to compute this math: a class of `models` named by `roles`, or a subclass adding nothing but __init__."""
    name: str
    paths: tuple[str, ...]         # submodules every such layer has
    attention: str                 # the module holding q, k, v, the head size and the scaling
    run: Callable                  # (layer, packed x, bert.model.padding.Packed, training) -> x
    output: str                    # the transformers.modeling_outputs class the original encoder returns
    roles: tuple[tuple[str, tuple[str, ...]], ...]  # (path in the layer, "" itself, ".." the encoder): names
    models: tuple[tuple[str, str], ...]             # (transformers modeling module, class-name prefix "{P}")


class MLMHead(NamedTuple):
    """Paths, inside the task model, of a family's MLM head: dense -> GeLU -> LayerNorm -> decoder (tied)."""
    dense: str
    act: str | None          # None: the head calls an erf GeLU function, not a module (RoBERTa's lm_head)
    norm: str
    decoder: str


class Family(NamedTuple):
    """Everything the drop-in, its tests and the parity benchmark need to know about a Hugging Face family."""
    name: str                      # "bert", "roberta", ...
    prefix: str                    # transformers' class-name prefix: BertConfig, BertForMaskedLM, ...
    layers: Layers
    linear_act: tuple[tuple[str, str], ...]   # (Linear, activation) children applied in that order, heads too
    mlm_head: MLMHead
    pad_token_id: int              # the RoBERTa family pads with 1 and counts positions after it
    # The family's config field names where they are not BERT's (DistilBERT: dim, n_layers...), and what its small
    # test configuration sets besides the shared sizes (ELECTRA: an embedding narrower than the hidden size).
    config_names: tuple[tuple[str, str], ...] = ()
    test_config: tuple[tuple[str, object], ...] = ()


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
                     "attention.self", _bert_layer, "BaseModelOutputWithPastAndCrossAttentions",
                     (("attention.self", ("{P}SelfAttention", "{P}SdpaSelfAttention")),
                      ("attention", ("{P}Attention",)), ("", ("{P}Layer",)), ("..", ("{P}Encoder", "BertEncoder")),
                      ("attention.output", ("{P}SelfOutput",)), ("intermediate", ("{P}Intermediate",)),
                      ("output", ("{P}Output",))), _BERT_MODELS)
DISTILBERT_LAYERS = Layers("distilbert", ("attention.q_lin", "attention.k_lin", "attention.v_lin",
                                          "attention.out_lin", "sa_layer_norm", "ffn.lin1", "ffn.lin2",
                                          "output_layer_norm"),
                           "attention", _distilbert_layer, "BaseModelOutput",
                           (("attention", ("{P}SelfAttention", "MultiHeadSelfAttention", "{P}SdpaAttention",
                                           "{P}FlashAttention2")), ("", ("TransformerBlock",)),
                            ("..", ("Transformer",)), ("ffn", ("FFN",))), _DISTILBERT_MODELS)
_BERT_MLM = MLMHead("cls.predictions.transform.dense", "cls.predictions.transform.transform_act_fn",
                    "cls.predictions.transform.LayerNorm", "cls.predictions.decoder")
_ROBERTA_MLM = MLMHead("lm_head.dense", None, "lm_head.layer_norm", "lm_head.decoder")
_BERT_ACT = (("dense", "intermediate_act_fn"), ("dense", "transform_act_fn"))
FAMILIES = (
    Family("bert", "Bert", BERT_LAYERS, _BERT_ACT, _BERT_MLM, 0),
    Family("roberta", "Roberta", BERT_LAYERS, _BERT_ACT, _ROBERTA_MLM, 1),
    Family("xlm-roberta", "XLMRoberta", BERT_LAYERS, _BERT_ACT, _ROBERTA_MLM, 1),
    Family("camembert", "Camembert", BERT_LAYERS, _BERT_ACT, _ROBERTA_MLM, 1),
    Family("electra", "Electra", BERT_LAYERS, (*_BERT_ACT, ("dense", "activation")),
           MLMHead("generator_predictions.dense", "generator_predictions.activation",
                   "generator_predictions.LayerNorm", "generator_lm_head"), 0, test_config=(("embedding_size", 32),)),
    Family("distilbert", "DistilBert", DISTILBERT_LAYERS, (("lin1", "activation"), ("vocab_transform", "activation")),
           MLMHead("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector"), 0,
           config_names=(("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
                         ("intermediate_size", "hidden_dim"), ("hidden_dropout_prob", "dropout"),
                         ("attention_probs_dropout_prob", "attention_dropout"))),
)


# The task models whose forward the masked-only MLM loss stands in for: the families' own.
_MLM_MODELS = tuple(m for m in (*_BERT_MODELS, *_DISTILBERT_MODELS) if m[1] in {f.prefix for f in FAMILIES})


def family(name: str) -> Family:
    found = [f for f in FAMILIES if f.name == name]
    if not found:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")
    return found[0]


def _unique(items) -> tuple:
    return tuple(dict.fromkeys(items))


LAYERS = _unique(f.layers for f in FAMILIES)
# (Linear, activation) child pairs whose parent applies the activation right after the Linear.
LINEAR_ACT = _unique(pair for f in FAMILIES for pair in f.linear_act)
MLM_HEADS = _unique(f.mlm_head for f in FAMILIES)


# ---- whose code is known: a module is fused only where its class computes exactly the fused op's math ---------
# Beyond the fused encoders' models, MPNet's and DeBERTa-v2's intermediate and output blocks are BERT's code too.
_BLOCK_MODELS = (*_BERT_MODELS, *_DISTILBERT_MODELS, ("mpnet.modeling_mpnet", "MPNet"),
                 ("deberta_v2.modeling_deberta_v2", "DebertaV2"))
# Modules that apply their GeLU right after the Linear (LINEAR_ACT's pairs), and blocks computing
# LayerNorm(dropout(dense(x)) + residual).
_LINEAR_ACT_CLASSES = ("{P}Intermediate", "{P}PredictionHeadTransform", "{P}GeneratorPredictions",
                       "{P}DiscriminatorPredictions", "{P}ClassificationHead", "FFN", "DistilBertForMaskedLM")
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
    the forward calls, could change the math), and no method is replaced on the instance."""
    cls = type(module)
    base = next((c for c in cls.__mro__ if c in known), None)
    if base is None:
        return f"{cls.__name__} is not a class whose math the fused op is known to match"
    for sub in cls.__mro__[:cls.__mro__.index(base)]:
        own = sorted(n for n, v in vars(sub).items() if n != "__init__" and not _checkpointing_wrapper(sub, n, v)
                     and (callable(v) or isinstance(v, (property, staticmethod, classmethod))))
        if own:
            return f"{sub.__name__} overrides {', '.join(own)} of {base.__name__}"
    patched = sorted(n for n, v in vars(module).items() if callable(v) and inspect.isfunction(getattr(cls, n, None)))
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


class FusedEncoder(nn.Module):
    """An encoder on packed tokens with the varlen attention kernel; the same `layer` ModuleList (same keys).

    Gradient checkpointing goes through transformers' own mechanism: each layer runs under the checkpoint function
    `gradient_checkpointing_enable` installed (on the layers in transformers 5, on the encoder before), with the
    arguments it was given (use_reentrant either way)."""
    gradient_checkpointing = False   # transformers 4 sets this (and _gradient_checkpointing_func) on the encoder

    def __init__(self, orig: nn.Module, layers: Layers, config, report: "EncoderReport"):
        super().__init__()
        self.layer, self.layers, self.config, self.report = orig.layer, layers, config, report
        object.__setattr__(self, "_original", orig)  # not a submodule: its parameters are already ours

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
        wants = {k for k in ("output_attentions", "output_hidden_states")
                 if kwargs.get(k, getattr(self.config, k, False))}
        batch, seqlen, _ = hidden_states.shape
        keys = _key_mask(attention_mask, batch, seqlen, hidden_states.device)
        unread = _unread_arguments(kwargs, self.config)
        if unread:
            wants.add(f"{', '.join(unread)}, which the fused encoder does not read")
        if keys is None:
            wants.add("an attention mask the fused attention cannot express (per query, or additive values "
                      "other than 0 and the dtype's minimum)")
        if wants or encoder_hidden_states is not None or kwargs.get("use_cache"):
            why = ", ".join(sorted(wants)) or "cross-attention/cache"
            self.report.calls[why] = self.report.calls.get(why, 0) + 1  # fuse_report lists them
            _warn(f"{why} requested: this call runs the original (unfused) attention code")
            self._original.train(self.training)
            if encoder_hidden_states is not None:  # DistilBERT's encoder takes no such argument: pass it only if set
                kwargs["encoder_hidden_states"] = encoder_hidden_states
            return self._original(hidden_states, attention_mask=attention_mask, **kwargs)
        from transformers import modeling_outputs as outputs

        # Under torch.export a layout of static shape (no token count read from the data); else padding removed.
        exporting = torch.compiler.is_exporting()
        p = static_layout(keys) if exporting else unpad_mask(keys)
        x = unpad(hidden_states, p)
        for layer in self.layer:
            x = self._run(layer, x, p)
        out = torch.where(keys[..., None], pad(x, p), 0.0) if exporting else pad(x, p)  # padding kept: zero it
        # What the original encoder returns: BERT-like models read `.cache` from it too.
        return getattr(outputs, self.layers.output)(last_hidden_state=out)

    def _run(self, layer, x, p):
        """One layer through its own __call__ (so its hooks fire, and a transformers 5 layer checkpoints itself
        when gradient checkpointing is on); transformers 4 checkpoints from the encoder, so this does too."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() \
                and not _checkpoints_itself(layer):
            return self._gradient_checkpointing_func(functools.partial(layer.__call__, packed=p), x)
        return layer(x, packed=p)


# Arguments the fused encoder handles itself (the flags) or that its layers' code ignores: the embeddings read the
# position ids (only a flash implementation reads them in attention, to find packed sequences); an encoder
# without a cache gets None for one.
_FLAGS = ("output_attentions", "output_hidden_states", "return_dict", "use_cache")


def _unread_arguments(kwargs: dict, config) -> list[str]:
    """The encoder arguments holding something the original layers would read and the fused ones would drop:
    any value but None/False (or transformers 4's head_mask of Nones), position ids under a flash
    implementation. Such a call runs the original code."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    unread = []
    for name, value in kwargs.items():
        if name in _FLAGS or value is None or value is False:
            continue
        if isinstance(value, (list, tuple)) and all(v is None for v in value):
            continue
        if name == "position_ids" and not impl.startswith("flash"):
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


# ---- fused layers: the layer object stays (its hooks, its class for transformers' output capture), its class
# becomes a subclass whose forward, given packed tokens, runs the fused layer ----------------------------------
@functools.cache
def fused_layer_class(base: type, kind: str) -> type:
    """`base` (a transformers layer class) with a forward that, called with `packed=` (bert.model.padding.Packed), runs
    the fused layer on packed tokens, and otherwise is base's own forward (the original encoder's fallback calls).
    Instance-local: fuse sets it as one layer object's __class__, unfuse puts base back."""
    run = next(k.run for k in LAYERS if k.name == kind)

    def forward(self, hidden_states, *args, packed=None, **kwargs):
        if packed is None:
            return base.forward(self, hidden_states, *args, **kwargs)
        return run(self, hidden_states, packed, self.training)

    def reduce(self, protocol):  # pickles (and deep-copies) as "this base class, fused", not by a dynamic name
        return _new_fused_layer, (base, kind), self.__dict__

    return type(f"Fused{base.__name__}", (base,), {"forward": forward, "__reduce_ex__": reduce,
                                                   "__module__": __name__})


def _new_fused_layer(base: type, kind: str):
    return object.__new__(fused_layer_class(base, kind))


# ---- recognising what is inside a model -------------------------------------------------------
def layer_kind(layer: nn.Module) -> Layers | None:
    return next((kind for kind in LAYERS if _has(layer, *kind.paths)), None)


def _is_output_block(m: nn.Module) -> bool:
    """dense -> dropout -> + input -> LayerNorm, by its children (BertSelfOutput, BertOutput and their copies)."""
    names = {n for n, _ in m.named_children()}
    return names == {"dense", "dropout", "LayerNorm"} and isinstance(m.dense, nn.Linear) and isinstance(
        m.LayerNorm, nn.LayerNorm) and isinstance(m.dropout, nn.Dropout)


def encoder_parts(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, encoder model, name of its encoder child) for every encoder model inside `model`."""
    found = []
    for path, m in model.named_modules():
        for child in ("encoder", "transformer"):
            enc = getattr(m, child, None)
            if _has(m, "embeddings") and isinstance(getattr(enc, "layer", None), nn.ModuleList) and len(enc.layer):
                found.append((path or type(model).__name__, m, child))
    return found


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
    for path, names in kind.roles:  # every module the fused layer stands in for: of a known class
        known = known_classes(names, kind.models)
        modules = [encoder] if path == ".." else [_get(layer, path) if path else layer for layer in encoder.layer]
        reasons += [why for m in modules if (why := unknown_code(m, known))]
    if reasons:  # the first (the attention's own module comes first in roles); the rest counted
        others = len(_unique(reasons)) - 1
        return [reasons[0] + (f" (and {others} other module{'s' * (others > 1)} of unknown code)" if others else "")]
    layer = encoder.layer[0]
    at = _get(layer, kind.attention)
    head_dim = at.attention_head_size
    for path in kind.paths[:3]:  # q, k, v: their weights are read, so nothing but a Linear's own forward
        if type(_get(layer, path)) is not nn.Linear:
            cls = type(_get(layer, path))
            reasons.append(f"{path} is a {cls.__module__}.{cls.__name__}, not an nn.Linear")
    if type(at.dropout) is not nn.Dropout:
        reasons.append(f"attention dropout is a {type(at.dropout).__name__}, not an nn.Dropout")
    if not ops._kernels().attention.supports_head_dim(head_dim):
        reasons.append(f"head_dim {head_dim} is not supported by the attention kernel")
    if not math.isclose(getattr(at, "scaling", head_dim ** -0.5), head_dim ** -0.5):
        reasons.append(f"an attention scale other than 1/sqrt(head_dim) ({at.scaling})")
    if getattr(cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
        reasons.append(f"position_embedding_type={cfg.position_embedding_type!r} (relative positions)")
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        reasons.append("a decoder / cross-attention configuration")
    reasons += filter(None, [_attention_function_problem(cfg)])
    return reasons


# ---- fusing ------------------------------------------------------------------------------------
class _Fuser:
    """Swaps modules, recording (parent, name, old) so that unfuse can put every one back."""

    def __init__(self):
        self.record: list = []

    def replace(self, parent: nn.Module, name: str, new: nn.Module) -> None:
        old = getattr(parent, name)
        new.train(old.training)
        self.record.append((parent, name, old))
        setattr(parent, name, new)

    def retype(self, module: nn.Module, cls: type) -> None:
        """The object stays (its hooks, its place in the model); only its class changes, for unfuse to undo."""
        self.record.append((module, "__class__", type(module)))
        module.__class__ = cls

    def linear_gelus(self, root: nn.Module, report: EncoderReport) -> int:
        """Every (Linear, GeLU) child pair of LINEAR_ACT under root whose parent's code is known to apply the GeLU
        right after the Linear: one fused module, the activation an Identity. Other activations (the pooler's
        tanh) are not this kernel's business; a GeLU it lacks, or a parent of unknown code, is reported."""
        known = known_classes(_LINEAR_ACT_CLASSES, _BLOCK_MODELS)
        fused = 0
        for path, m in list(root.named_modules()):
            for lin, act in LINEAR_ACT:
                linear, activation = getattr(m, lin, None), getattr(m, act, None)
                if not (type(linear) is nn.Linear and isinstance(activation, nn.Module)) or linear.bias is None:
                    continue
                kind = gelu_kind(activation)
                if kind is None:
                    if "gelu" in type(activation).__name__.lower():
                        report.keep(f"Linear + {type(activation).__name__}", "no fused kernel for this activation")
                    continue
                if why := unknown_code(m, known):
                    report.keep(f"Linear + GeLU in {type(m).__name__}", why)
                    continue
                self.replace(m, lin, ops._kernels().LinearGeLU.from_linear(linear, kind))
                self.replace(m, act, nn.Identity())
                fused += 1
        return fused

    def output_blocks(self, root: nn.Module, report: EncoderReport) -> int:
        """dense -> dropout -> + residual -> LayerNorm blocks of known code: one fused module each. A look-alike
        of unknown code keeps its own forward (its LayerNorm is still fused, alone)."""
        known = known_classes(_OUTPUT_BLOCK_CLASSES, _BLOCK_MODELS)
        blocks = [(p, name) for p in list(root.modules()) for name, c in p.named_children() if _is_output_block(c)]
        fused = 0
        for parent, name in blocks:
            block = getattr(parent, name)
            if why := unknown_code(block, known):
                report.keep(f"dense + dropout + residual in {type(block).__name__}", why)
                continue
            self.replace(parent, name, FusedSelfOutput(block))
            fused += 1
        return fused

    def layer_norms(self, root: nn.Module) -> int:
        return ops._kernels().fuse_layer_norms(root, swap=self.replace)


def _fuse_encoder_model(fuser: _Fuser, path: str, model: nn.Module, child: str) -> EncoderReport:
    encoder = getattr(model, child)
    kinds = {layer_kind(layer) for layer in encoder.layer}
    kind = kinds.pop() if len(kinds) == 1 else None
    report = EncoderReport(path, type(model).__name__, kind.name if kind else "unknown")
    # Judged on the model as it came, before any module of it is swapped.
    reasons = ["the layers' structure is not one the fused attention knows"] if kind is None else \
        _attention_problems(model, kind, encoder)
    n_blocks = fuser.output_blocks(model, report)
    n_gelus = fuser.linear_gelus(model, report)
    n_norms = fuser.layer_norms(model)
    report.fused.append(f"{n_norms + n_blocks} LayerNorms ({n_blocks} with dense dropout + residual)")
    if n_gelus:
        report.fused.append(f"{n_gelus} Linear + GeLU")
    if reasons:
        report.keep("attention", "; ".join(reasons))
    else:
        for layer in encoder.layer:
            fuser.retype(layer, fused_layer_class(type(layer), kind.name))
        fuser.replace(model, child, FusedEncoder(encoder, kind, getattr(model, "config", None), report))
        report.fused.append("attention (varlen, padding removed once)")
    return report


# ---- masked-LM heads given labels: the loss at labelled rows only, no vocabulary logits --------------------
def _mlm_head(task: nn.Module) -> MLMHead | None:
    for head in MLM_HEADS:
        if _has(task, head.dense, head.norm, head.decoder) and (head.act is None or _has(task, head.act)) \
                and isinstance(_get(task, head.decoder), nn.Linear):
            return head
    return None


_MLM_TASK_CLASSES = ("{P}ForMaskedLM", "{P}ForPreTraining")
_MLM_HEAD_CLASSES = ("{P}OnlyMLMHead", "{P}PreTrainingHeads", "{P}LMPredictionHead", "{P}PredictionHeadTransform",
                     "{P}LMHead", "{P}GeneratorPredictions")


def _mlm_code_problem(task: nn.Module, head: MLMHead) -> str | None:
    """Why the masked-only loss may not compute what `task` computes, or None: the task model and every module
    on the way to its head's dense, norm and decoder must be of the families' own classes (FusedMLMForward stands
    in for all their forwards)."""
    why = unknown_code(task, known_classes(_MLM_TASK_CLASSES, _MLM_MODELS))
    owners = {p.rsplit(".", 1)[0] for p in (head.dense, head.norm, head.decoder) if "." in p}
    prefixes = sorted({o.rsplit(".", i)[0] for o in owners for i in range(o.count(".") + 1)})
    known = known_classes(_MLM_HEAD_CLASSES, _MLM_MODELS)
    return why or next(filter(None, (unknown_code(_get(task, p), known) for p in prefixes)), None)


def _head_transform(task: nn.Module, head: MLMHead, x: torch.Tensor) -> torch.Tensor:
    dense = _get(task, head.dense)
    if isinstance(dense, ops._kernels().LinearGeLU):   # the activation was absorbed (an Identity now)
        x = dense(x)
    elif head.act is None:
        x = ops.linear_gelu(x, dense.weight, dense.bias, "none", backend=ops.backend_for(x))
    else:
        x = _get(task, head.act)(dense(x))
    return _get(task, head.norm)(x)


class FusedMLMForward:
    """A masked-LM task model's forward that, given labels, never forms the vocabulary logits; set as the task
    model's `forward` attribute. Arguments bind as the model's own forward binds them (so a positional call means
    the same fused and unfused), and it pickles with the model (a plain object, not a bound function)."""

    def __init__(self, task: nn.Module, head: MLMHead, base: str):
        self.task, self.head, self.base = task, head, base
        self.original = task.__dict__.get("forward")  # another wrapper's, if any; else the class's forward

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
        labels, nsp_label = kw.pop("labels", None), kw.pop("next_sentence_label", None)
        pretraining = _has(self.task, "cls.seq_relationship")
        # The original code wherever transformers' answer is not the masked-only loss: no labels (the logits are
        # the answer), BERT pre-training without a next-sentence label (transformers' loss is then None), or a
        # call asking for more than loss and logits.
        if labels is None or (pretraining and nsp_label is None) or kw.get("output_attentions") \
                or kw.get("output_hidden_states") or kw.get("return_dict") is False:
            return self.unfused(*args, **kwargs)
        kw.pop("return_dict", None)
        out = getattr(self.task, self.base)(**{k: v for k, v in kw.items() if v is not None})
        return self._loss(out, labels, nsp_label if pretraining else None)

    def _loss(self, out, labels, nsp_label):
        task, head = self.task, self.head
        hidden, labels = out[0], labels.reshape(-1)
        decoder = _get(task, head.decoder)
        check_labels(labels, decoder.weight.shape[0], "labels", (hidden.shape[0] * hidden.shape[1],))
        rows = (labels != -100).nonzero().squeeze(1)
        h = _head_transform(task, head, hidden.reshape(-1, hidden.shape[-1])[rows])
        loss = ops.masked_lm_loss(h, decoder.weight, decoder.bias, labels[rows], backend=ops.backend_for(h)).loss
        if nsp_label is not None:  # BERT pre-training: next-sentence prediction as well
            from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

            nsp_logits = task.cls.seq_relationship(out[1])
            loss = loss + F.cross_entropy(nsp_logits.view(-1, 2).float(), nsp_label.view(-1))
            return _without_logits(BertForPreTrainingOutput)(loss=loss, seq_relationship_logits=nsp_logits)
        from transformers.modeling_outputs import MaskedLMOutput

        return _without_logits(MaskedLMOutput)(loss=loss)


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


def _is_masked_lm(task: nn.Module) -> bool:
    """A masked-LM or pre-training task model, by class: a decoder's LM head (BertLMHeadModel, RobertaForCausalLM)
    has the same modules but computes the shifted next-token loss."""
    return not getattr(getattr(task, "config", None), "is_decoder", False) and any(
        c.__name__.endswith(("ForMaskedLM", "ForPreTraining")) for c in type(task).__mro__)


def _fuse_heads(fuser: _Fuser, model: nn.Module, encoders, reports, mlm_logits: bool) -> list:
    """The task models around each encoder model: their GeLUs and LayerNorms, and (mlm_logits=False) the
    masked-only MLM loss."""
    patched = []
    for (path, enc_model, _), report in zip(encoders, reports):
        for task in model.modules():
            base = next((name for name, c in task.named_children() if c is enc_model), None)
            if base is None:
                continue
            n = fuser.linear_gelus(task, report) + fuser.layer_norms(task)
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
def fuse(model: nn.Module, mlm_logits: bool = True) -> nn.Module:
    """Fuse every encoder inside `model` in place (see the module docstring); returns `model`.

    mlm_logits: True (the default) keeps transformers' contract for masked-LM and pre-training models given
    labels: the full [batch, seq, vocab] logits are formed and returned with the loss. False computes the loss
    at the labelled positions only, by the masked-only kernel, and never forms the logits (memory bounded by the
    labelled tokens): `logits` / `prediction_logits` are then None, and the output refuses integer indexing and
    to_tuple() (positions would shift). The loss itself means the same either way."""
    saved = getattr(model, _ORIGINALS, None)
    if saved:  # already fused
        if saved.mlm_logits != mlm_logits:
            raise ValueError(f"fuse: this model is already fused with mlm_logits={saved.mlm_logits}; unfuse it first")
        return model
    encoders = encoder_parts(model)
    if not encoders:
        raise ValueError(f"fuse: no encoder inside {type(model).__name__} (looked for a module with `embeddings` "
                         "and an `encoder` or `transformer` holding a `layer` list)")
    fuser = _Fuser()
    reports = [_fuse_encoder_model(fuser, *part) for part in encoders]
    heads = _fuse_heads(fuser, model, encoders, reports, mlm_logits)
    for report in reports:
        report.warn()
    object.__setattr__(model, _ORIGINALS, _Saved(fuser.record, heads, mlm_logits))
    object.__setattr__(model, _REPORT, reports)
    return model


def unfuse(model: nn.Module) -> nn.Module:
    """Put back the original modules (which share the fused ones' Parameters); returns `model`."""
    saved = getattr(model, _ORIGINALS, None)
    if not saved:
        return model
    for parent, name, old in reversed(saved.record):
        if name == "__class__":
            parent.__class__ = old
            continue
        current = getattr(parent, name)
        old.train(current.training)
        _take_parameters(old, current)
        setattr(parent, name, old)
    for task in saved.heads:
        original = task.forward.original
        del task.forward
        if original is not None:
            task.forward = original
    object.__delattr__(model, _ORIGINALS)
    object.__delattr__(model, _REPORT)
    return model


def _take_parameters(old: nn.Module, new: nn.Module) -> None:
    """The fused module's Parameters into the original it replaced, where they are no longer the same objects
    (load_state_dict(assign=True) while fused puts new ones on the fused modules): unfuse keeps what was loaded."""
    current = dict(new.named_parameters())
    for name, param in list(old.named_parameters()):
        if name in current and current[name] is not param:
            owner, _, leaf = name.rpartition(".")
            setattr(old.get_submodule(owner), leaf, current[name])


def fuse_report(model: nn.Module) -> list[EncoderReport]:
    """Per encoder of a fused model: what was fused and what was kept, with the reason ([] if not fused)."""
    return list(getattr(model, _REPORT, []))

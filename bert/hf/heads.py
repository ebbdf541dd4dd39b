"""The task models around a fused encoder: masked-LM heads given labels, and the token-level labels a call puts on
padded positions.

With fuse(model, mlm_logits=False), a masked-LM or pre-training model given labels computes its loss at the
labelled positions only, by the masked-only kernel, and never forms the vocabulary logits (`FusedMLMForward`,
its outputs narrowed by `_without_logits`); pre-training models add their sentence-pair head's loss (`PairHead`:
BERT's next-sentence, ALBERT's sentence-order). The heads: BERT's cls.predictions, RoBERTa's lm_head, ELECTRA's
generator, DistilBERT's vocab_*, ALBERT's predictions, ModernBERT's, NomicBERT's, RoFormer's and DeBERTa-v2's
BERT-style heads, DeBERTa's enhanced mask decoder (the word embeddings as decoder), ESM's lm_head with its own
bias, EuroBERT's bare lm_head. A token-level task model gets a forward pre-hook that sees a label on a padded
position, which sends that call to the original encoder code (`_PADDED_LABELS`).
"""
from __future__ import annotations

import functools
import importlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from bertfuse.bert.hf.compute import _get, _has, _linear_gelu
from bertfuse.bert.hf.encoder import _PADDED_LABELS
from bertfuse.bert.hf.families import FAMILIES, MLM_HEADS, MLM_MODELS, PAIR_HEADS
from bertfuse.bert.hf.known import known_classes, unknown_code
from bertfuse.bert.hf.records import MLMHead, PairHead
from bertfuse.bert.model import ops
from bertfuse.bert.model.modeling import check_labels


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
    why = unknown_code(task, known_classes(_MLM_TASK_CLASSES, MLM_MODELS))
    # The modules holding the head's parts; an embedding decoder is the encoder's own input embedding, whose
    # weight alone is read (the model around it is not the head's).
    parts = (head.dense, head.norm) if isinstance(_get(task, head.decoder), nn.Embedding) else \
        (head.dense, head.norm, head.decoder)
    owners = {p.rsplit(".", 1)[0] for p in parts if p and "." in p}
    prefixes = sorted({o.rsplit(".", i)[0] for o in owners for i in range(o.count(".") + 1)})
    known = known_classes(_MLM_HEAD_CLASSES, MLM_MODELS)
    return why or next(filter(None, (unknown_code(_get(task, p), known) for p in prefixes)), None)


def _head_transform(task: nn.Module, head: MLMHead, x: torch.Tensor) -> torch.Tensor:
    if head.dense is None:  # the decoder alone
        return x
    act = _get(task, head.act) if head.act else None
    return _get(task, head.norm)(_linear_gelu(_get(task, head.dense), act, x))


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

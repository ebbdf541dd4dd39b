"""The records the drop-in is built from: how an encoder holds its layers (`Stack`), a layer structure
(`Layers`), a family (`Family`, with its `MLMHead`), the module classes computing [norm](act(linear(x)))
(`GeluBlock`), a family's own norm class (`FamilyNorm`), what one family module registers (`Group`), and what
fuse reports per encoder (`EncoderReport`).

A family module (bert.py, mpnet.py, ...) fills these in for the model types it knows; families.py collects its
`GROUP`; the fuser, the encoder runner, the heads, the tests and bench.hf_parity read them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
from torch import nn

from bertfuse.bert.hf.compute import _warn
from bertfuse.bert.model.padding import pad, unpad


class Rotary(NamedTuple):
    """How a rotary encoder's layers see positions: each packed token's position (the model's position ids,
    gathered with the tokens) and, per layer type, the rotation of q and k and the attention window."""
    positions: torch.Tensor        # [tokens] int64
    rotations: dict                # layer type -> ops.Rotation
    windows: dict                  # layer type -> (left, right), (-1, -1) for global attention


# A rotary model with one kind of layer (NomicBERT, EuroBERT) has this layer type; ModernBERT's config lists its own.
GLOBAL = "full_attention"


class Padded(NamedTuple):
    """The `packed` argument of a call that records every layer's hidden states: the fused encoder hands each
    layer the padded [batch, seq, hidden] states transformers' code would (so that the hooks and wrappers
    recording them, transformers' or the encoder's own, see those), and the layer's fused forward runs on the
    packed tokens in between (`_padded_call`). Every position is in the layout then (`padded_reads`)."""
    layout: object                 # the call's bert.data.batch.Packed


def passes_padded(forward: Callable) -> Callable:
    """Marks a fused forward of a module between the encoder and its layers (ALBERT's layer groups): given
    `Padded`, it passes the padded states on to its layers as they are."""
    forward._bertfuse_passes_padded = True
    return forward


def _padded_call(forward: Callable, module: nn.Module, args, kwargs):
    """forward(module, ...) given padded states and `Padded`: the states packed on entry, the output (or its
    first element) padded on exit; a module marked `passes_padded` gets them as they are."""
    if getattr(forward, "_bertfuse_passes_padded", False):
        return forward(module, *args, **kwargs)
    p = kwargs["packed"].layout
    out = forward(module, unpad(args[0], p), *args[1:], **dict(kwargs, packed=p))
    if isinstance(out, tuple):
        return (pad(out[0], p), *out[1:])
    return pad(out, p)


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


def _run_layer(encoder, layer, x, p, position):
    """One layer through its own __call__ (so its hooks fire, and a transformers 5 layer checkpoints itself
    when gradient checkpointing is on); transformers 4 checkpoints from the encoder, so this does too."""
    if getattr(encoder, "gradient_checkpointing", False) and encoder.training and torch.is_grad_enabled() \
            and not _checkpoints_itself(layer):
        return encoder._gradient_checkpointing_func(functools.partial(layer.__call__, packed=p, position=position), x)
    return layer(x, packed=p, position=position)


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


def _layer_list(encoder) -> list[nn.Module]:
    return _module_list(encoder, "layer")


def _run_layers(encoder, layers, x, p, position):
    for layer in layers:
        x = _run_layer(encoder, layer, x, p, position)
    return x


def _run_layer_list(encoder, x, p, position):
    return _run_layers(encoder, encoder.layer, x, p, position)


def _model_layers(encoder) -> list[nn.Module]:
    return _module_list(encoder, "layers")


def _run_model_layers(encoder, x, p, position):
    return _run_layers(encoder, encoder.layers, x, p, position)


LAYER_LIST = Stack(_layer_list, _run_layer_list)

# The rotary encoders' models hold their `layers` themselves, beside the embeddings, and are fused whole.
MODEL_LAYERS = Stack(_model_layers, _run_model_layers)


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
    # (encoder) -> the (left, right) windows its local layers attend within ([] where none: ModernBERT's sliding
    # windows): like `relative` positions, they read the distance between two tokens of a sequence, which padded
    # positions a head reads then keep in the layout (bert.model.padding.read_layout).
    windows: Callable | None = None
    # Whether a padded query attends to its row's real tokens in the family's own code (eager and sdpa mask keys
    # only). DeBERTa's masks padded queries too: every key of their row masked, which its releases compute
    # differently (uniform over the row from transformers 5, zero before): padded positions its heads read run its
    # original code.
    padded_queries: bool = True


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


class PairHead(NamedTuple):
    """A pre-training model's sentence-pair head, on the pooled output beside the MLM head: BERT's next-sentence
    prediction, ALBERT's sentence order. transformers' loss is the MLM loss plus this head's cross-entropy,
    given both labels (None otherwise)."""
    module: str                    # its path in the task model
    label: str                     # the task model's argument holding its labels
    logits: str                    # the output field of its logits
    output: str                    # the output class without the vocabulary logits (`_NARROWED`)


class GeluBlock(NamedTuple):
    """A module class computing [norm](act(linear(x))) and nothing else: its children and its fused forward."""
    cls: str              # the class-name template ("{P}" the model's class-name prefix)
    children: tuple[str, ...]   # linear, activation[, norm[, decoder]]
    forward: Callable


class FamilyNorm(NamedTuple):
    """A family's own norm class whose math a kernel computes: its class names ("{P}" the model's class-name
    prefix) in `models`, the fused forward it gets, and whether it is an RMSNorm (else a LayerNorm, which the
    output blocks of those models may hold too)."""
    classes: tuple[str, ...]
    models: tuple[tuple[str, str], ...]
    forward: Callable
    rms: bool = False


class Group(NamedTuple):
    """What one family module adds to the drop-in (families.py collects each module's `GROUP`): its families,
    and the module classes of its models the fuser runs by a kernel wherever they are (head transforms,
    intermediate blocks, norms), and its pre-training models' sentence-pair heads."""
    families: tuple[Family, ...]
    gelu_blocks: tuple[GeluBlock, ...] = ()
    norms: tuple[FamilyNorm, ...] = ()
    pair_heads: tuple[PairHead, ...] = ()


@dataclass
class EncoderReport:
    path: str                        # where the encoder model sits inside the fused model
    family: str                      # its class name
    layers: str                      # "bert", "distilbert" or "unknown"
    fused: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)   # (what, why)
    calls: dict[str, int] = field(default_factory=dict)         # why a call ran the original encoder: how often
    unexpected: list[str] = field(default_factory=list, repr=False, compare=False)  # kept for a reason to warn of
    backend: str = ""   # what the fused layers run on now (fuse_report fills it in when read: kernels.backend_of)

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
        runs = f"; runs {self.backend}" if self.backend else ""
        return f"{self.path} ({self.family}, {self.layers} layers): fused {', '.join(self.fused) or 'nothing'}; " \
               f"kept {kept}{calls}{runs}"

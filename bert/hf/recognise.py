"""Recognising what is inside a model: its encoders (`encoder_parts`), each layer's structure (`layer_kind`), and
why the fused attention may not compute what an encoder computes (`_attention_problems`).

Encoders are found by structure: an encoder model is a module with `embeddings` and an `encoder` or
`transformer` holding a `layer` list (or ALBERT's groups), or a model holding its `layers` itself beside
`embeddings` or, in a known encoder's class, `embed_tokens`.
"""
from __future__ import annotations

import math

from torch import nn

from bertfuse.bert.hf.compute import _get, _has, _unique
from bertfuse.bert.hf.encoder import _probs_dropout
from bertfuse.bert.hf.families import FAMILY_NORMS, LAYERS, STACKS
from bertfuse.bert.hf.known import _attention_function_problem, known_classes, unknown_code
from bertfuse.bert.hf.records import MODEL_LAYERS, Layers, Stack
from bertfuse.bert.model import ops


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
    norms = (nn.LayerNorm, *(c for n in FAMILY_NORMS if not n.rms for c in known_classes(n.classes, n.models)))
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

"""The fused encoder: padding removed once, every layer on packed tokens, padding restored, and the rules
for when a call runs the original code instead.

An encoder given hidden states (BERT's, DistilBERT's, ALBERT's, MPNet's, ESM's, RoFormer's, DeBERTa's) gets
`_encoder_forward`; a model holding its layers itself runs its family module's model forward, which uses the
same pieces (`_layout`, `_original_code_reason`, `_run_original`, `_padded`). A call asking for what the fused
layers do not compute (output_attentions or output_hidden_states, cross-attention or a cache, a mask the kernel
cannot express as the attention implementation reads it, padding where a head reads it, labels at padded
positions, a hooked or replaced attention dropout, or a family's own call rules) runs the original encoder
code, and fuse_report counts it; compiled, such a mask stops the call with an error instead (its values cannot
choose the code inside a graph).
"""
from __future__ import annotations

import contextvars
import inspect
from typing import Callable, NamedTuple

import torch
from torch import nn

from bertfuse.bert.hf.compute import _dropout_rate, _forward_parameters, _get, _original, _warn
from bertfuse.bert.hf.records import EncoderReport, Layers
from bertfuse.bert.masks import FLASH_PACKING, packed_rows
from bertfuse.bert.model import ops
from bertfuse.bert.model.padding import pad, static_layout, unpad, unpad_mask

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


# Token-level labels on padded positions: that call runs the original encoder code.
# Set by a token-level task model's forward pre-hook for the length of its call: a label sits where its 2-D mask
# is 0, so its loss reads a position the fused encoder leaves 0 (collators label padding -100: rare).
_PADDED_LABELS = contextvars.ContextVar("bertfuse_padded_labels", default=False)


def _encoder_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
    """A fused encoder: padding removed once, every layer on packed tokens (its attention by the varlen kernel),
    padding restored (as 0). Where this call asks for something the fused layers do not compute, the encoder's
    own code runs instead, counted in fuse_report. Gradient checkpointing goes through transformers' own
    mechanism (`_run_layer`)."""
    def original():
        if encoder_hidden_states is not None:  # DistilBERT's encoder takes no such argument: pass it only if set
            kwargs["encoder_hidden_states"] = encoder_hidden_states
        return _original(self).forward(hidden_states, attention_mask=attention_mask, **kwargs)

    return _fused_encoder(self, hidden_states, attention_mask, encoder_hidden_states, kwargs, original)


def _distilbert_encoder_forward(self, *args, **kwargs):
    """DistilBERT's Transformer. Before transformers 5 its code is called as (x, attn_mask, head_mask,
    output_attentions, output_hidden_states, return_dict), reads a 2-D mask (0 = padding) or the 4-D one its
    model makes for sdpa, and returns a tuple unless return_dict; from 5 on it is called as every other encoder."""
    if "attn_mask" not in _forward_parameters(type(self)):
        return _encoder_forward(self, *args, **kwargs)
    bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs)
    bound.apply_defaults()
    call = dict(bound.arguments)
    del call["self"]
    x, mask = call.pop("x"), call.pop("attn_mask")
    out = _fused_encoder(self, x, mask, None, call, lambda: _original(self).forward(*args, **kwargs))
    if isinstance(out, tuple) or call.get("return_dict"):  # the original code's answer, or asked for as a dict
        return out
    return (out.last_hidden_state,)


def _fused_encoder(self, hidden_states, attention_mask, encoder_hidden_states, kwargs: dict, original: Callable):
    """The fused encoder's work for any encoder given hidden states (see `_encoder_forward`); `original()` runs the
    encoder's own code, with the arguments it was called with."""
    state: _EncoderState = self._bertfuse_encoder
    kind = state.layers
    if hidden_states.dim() != 3:  # what a mask of another rank broadcast into (ESM's embeddings scale by it)
        rows, why = None, f"{hidden_states.dim()}-D hidden states"
    else:
        batch, seqlen, _ = hidden_states.shape
        rows = packed_rows(state.config, attention_mask, kwargs, kwargs.get("position_ids"), batch, seqlen,
                           hidden_states.device, kind.mask_reading)
        why = rows.why or _original_code_reason(self, state, rows.keys, encoder_hidden_states, kwargs)
    if why:
        return _run_original(state, why, original)
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
    if _flex_refuses_dropout(encoder, state):
        wants.add("attention dropout in training, which flex attention refuses (the original code raises)")
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


# Arguments the fused encoder handles itself (the flags, and the position ids and flash packing arguments, which
# bert.masks.packed_rows reads as the original attention would) or that its layers' code ignores: an encoder
# without a cache gets None for one; num_items_in_batch (transformers.Trainer's token count for the loss) passes
# through every model's forward to the attention functions, which ignore it, as they ignore seq_idx (each token's
# sequence, which DataCollatorWithFlattening adds for state-space layers). cache_position (which transformers 4.57
# to 5.x's BERT-family models hand their encoder on every call) indexes a cache only: with past_key_values (which
# the fused encoder does not read, so such a call runs the original code), and never in an encoder without one.
_FLAGS = ("output_attentions", "output_hidden_states", "return_dict", "use_cache", "num_items_in_batch",
          "cache_position", "position_ids", "seq_idx", *FLASH_PACKING)


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


def _probs_dropout(kind: Layers, layer: nn.Module):
    """The attention's dropout on the probabilities: a module, or the float rate its code passes on."""
    return getattr(_get(layer, kind.attention), kind.probs_dropout)


def _plain_probs_dropout(kind: Layers, layer: nn.Module) -> bool:
    """The kernel may apply the probabilities' dropout itself: a plain nn.Dropout there, or a rate."""
    dropout = _probs_dropout(kind, layer)
    return isinstance(dropout, float) or ops.plain(dropout, nn.Dropout)


def _flex_refuses_dropout(encoder, state: _EncoderState) -> bool:
    """transformers' flex attention raises when handed a dropout rate (a training call with attention dropout):
    the original code runs, and raises."""
    if getattr(state.config, "_attn_implementation", None) != "flex_attention" or not encoder.training:
        return False
    kind = state.layers
    rates = (_probs_dropout(kind, layer) for layer in kind.stack.layers(encoder))
    return any(_dropout_rate(d) > 0 for d in rates)


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


def _relative_call_problems(encoder, keys) -> list[str]:
    """Relative positions within the packed sequence are the original code's only where the mask has no holes."""
    return _holes(keys, "relative positions")

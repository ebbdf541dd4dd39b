"""The fused encoder: padding removed once (but for the padded positions a head reads, kept as queries over their
row's real tokens), every layer on packed tokens, padding restored, and the rules for when a call runs the
original code instead.

An encoder given hidden states (BERT's, DistilBERT's, ALBERT's, MPNet's, ESM's, RoFormer's, DeBERTa's) gets
`_encoder_forward`; a model holding its layers itself runs its family module's model forward, which uses the
same pieces (`_call_layout`, `_original_code_reason`, `_run_original`, `_run_stack`, `_padded`). A call recording
every layer's hidden states runs fused at every position, each layer handed padded states (`_run_stack`). A call
asking for what the fused layers do not compute (output_attentions, cross-attention or a cache, a mask the
kernel cannot express as the attention implementation reads it, a padded position read where the layout cannot
keep it, labels at padded positions, a hooked or replaced attention dropout, or a family's own call rules) runs
the original encoder code, and fuse_report counts it; compiled, such a mask stops the call with an error instead
(its values cannot choose the code inside a graph).
"""
from __future__ import annotations

import contextvars
import inspect
import types
from typing import Callable, NamedTuple

import torch
from torch import nn

from bertfuse.bert.data.batch import Packed
from bertfuse.bert.hf.compute import _dropout_rate, _forward_parameters, _get, _original, _warn
from bertfuse.bert.hf.records import EncoderReport, Layers, Padded
from bertfuse.bert.masks import FLASH_PACKING, packed_rows
from bertfuse.bert.model import ops
from bertfuse.bert.model.padding import pad, read_layout, static_layout, unpad, unpad_mask

# Which padded positions of the encoder's output the heads over it read (the fused encoder computes them where
# they are read, and leaves the others 0): none; the first (a pooler, a sequence or multiple-choice classifier:
# left padding pads it); the last (RoFormer's multiple-choice summary: right padding pads it); every one
# (question answering: the start and end logits and their loss span every position, padded ones included; a
# summary taking the mean).
NO_PADDING, FIRST_POSITION, LAST_POSITION, EVERY_POSITION = "none", "first", "last", "every"
_SUMMARY_READS = {"first": FIRST_POSITION, "last": LAST_POSITION}  # a sequence summary's type (else every one)

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
    summaries = {getattr(c, "summary_type", None) for m in readers for c in m.children()} - {None}
    if summaries:  # a sequence summary (RoFormer's multiple choice) reads what its type says
        return _SUMMARY_READS.get(summaries.pop(), EVERY_POSITION) if len(summaries) == 1 else EVERY_POSITION
    if getattr(enc_model, "pooler", None) is not None or \
            any(n.endswith(("ForSequenceClassification", "ForMultipleChoice")) for n in names):
        return FIRST_POSITION
    return NO_PADDING


def _read_mask(reads: str, keys: torch.Tensor) -> torch.Tensor | None:
    """[batch, seq] bool: the positions a call's heads read (`padded_reads`), None where they read no padded one
    by rule."""
    if reads == EVERY_POSITION:
        return torch.ones_like(keys, dtype=torch.bool)
    if reads in (FIRST_POSITION, LAST_POSITION):
        read = torch.zeros_like(keys, dtype=torch.bool)
        read[:, 0 if reads == FIRST_POSITION else -1] = True
        return read
    return None


def _padded_read_problems(state: _EncoderState, keys, segments, hidden: bool = False) -> list[str]:
    """[why] where this call's heads read a padded position (`padded_reads`; `hidden`: the call records every
    layer's hidden states, every position) that the fused encoder does not compute: on packed tokens, the layout
    keeps such positions as queries over their row's real tokens (`_call_layout`), except in rows holding several
    sequences (padding-free) and where the family's code gives padded queries no key (`Layers.padded_queries`).
    Compiled, where no value can be read and the layout's shapes are fixed: every position read, the original code
    always (returned as a reason); the first or the last, the program checks it when it runs and stops rather than
    compute something else."""
    reads = EVERY_POSITION if hidden else state.reads
    read = None if keys is None else _read_mask(reads, keys)
    if read is None:
        return []
    where = "padding in every layer's hidden states (output_hidden_states)" if hidden else \
        "padding at a position its heads read (" + {EVERY_POSITION: "every position: question answering",
                                                    FIRST_POSITION: "the first: a pooler or classifier",
                                                    LAST_POSITION: "the last: a sequence summary"}[reads] + ")"
    what = "which the compiled fused encoder does not compute" if torch.compiler.is_compiling() else \
        "in a row of several sequences (padding-free)" if segments is not None else \
        f"where {state.layers.name}'s own code masks every key of a padded query (its releases differ there)" \
        if not state.layers.padded_queries else None
    if what is None:
        return []
    why = f"{where}, {what}" + ("" if hidden else " (fuse(..., padded_positions='zero') leaves 0 there)")
    if torch.compiler.is_compiling():
        if reads == EVERY_POSITION:
            return [why]
        torch._assert_async((keys | ~read).all(), f"bert.hf.fuse: {why}")
        return []
    return [] if bool((keys | ~read).all()) else [why]


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
    return out.to_tuple()


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
        why = rows.why or _original_code_reason(self, state, rows.keys, encoder_hidden_states, kwargs,
                                                segments=rows.segments)
    every = _wants_hidden_states(state, kwargs)
    p = None if why else _call_layout(self, state, rows, every)
    if not isinstance(p, Packed):
        return _run_original(state, why or p, original)
    from transformers import modeling_outputs as outputs

    position = kind.relative(self) if kind.relative else \
        kind.rotary(self, kwargs, batch, seqlen, p) if kind.rotary else None
    x, states = _run_stack(self, state, hidden_states, p, position, every)
    out = _padded(getattr(self, kind.final_norm)(x) if kind.final_norm else x, p, rows.keys, every)
    # What the original encoder returns: BERT-like models read `.cache` from it too.
    return getattr(outputs, state.layers.output)(last_hidden_state=out, hidden_states=states)


def _wants_hidden_states(state: _EncoderState, kwargs: dict) -> bool:
    """Whether this call records every layer's hidden states (output_hidden_states: True, or in transformers 5 the
    layers it selects, an int or a list; the config's where not given)."""
    return bool(kwargs.get("output_hidden_states", getattr(state.config, "output_hidden_states", False)))


def _with_recording(cls: type, run: Callable) -> Callable | None:
    """`run` (called as the model's forward) inside the code with which the installed transformers records the
    hidden states around the forward of the model class `cls` (transformers 5: a wrapper over the forward,
    holding its function and `tie_last_hidden_states`), that code's own function object made anew around `run`;
    None where the forward has no such wrapper (its code returns the hidden states itself)."""
    wrapper = getattr(cls, "_bertfuse_base", cls).forward
    while wrapper is not None:
        free = wrapper.__code__.co_freevars
        if {"func", "tie_last_hidden_states"} <= set(free):
            cells = tuple(types.CellType(run) if name == "func" else cell
                          for name, cell in zip(free, wrapper.__closure__))
            return types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__,
                                      cells)
        wrapper = getattr(wrapper, "__wrapped__", None)
    return None


def _run_stack(encoder, state: _EncoderState, hidden_states, p, position, every: bool):
    """(the layers' output, the hidden states the encoder's own code returns or None): every layer on the packed
    tokens of `hidden_states` ([batch, seq, hidden]); where the call records hidden states (`every`: each
    position in the layout), each layer handed padded states (`Padded`), so that transformers' hooks or wrappers
    recording them see what they see unfused, and the output padded. An encoder whose own code returns the
    hidden states (transformers 4: `output_hidden_states` among its forward's parameters) gets them from hooks of
    its own on each layer (ALBERT's: each pass of a layer group): the first one's input, then each one's output."""
    kind = state.layers
    if not every:
        return kind.stack.run(encoder, unpad(hidden_states, p), p, position), None
    if "output_hidden_states" not in _forward_parameters(type(encoder)):
        return kind.stack.run(encoder, hidden_states, Padded(p), position), None
    states = []

    def record(module, args, output):
        states.extend([args[0]] if not states else [])
        states.append(output[0] if isinstance(output, tuple) else output)

    units = kind.stack.groups(encoder) or kind.stack.layers(encoder)
    hooks = [unit.register_forward_hook(record) for unit in units]
    try:
        x = kind.stack.run(encoder, hidden_states, Padded(p), position)
    finally:
        for hook in hooks:
            hook.remove()
    return x, tuple(states)


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


def _call_layout(encoder, state: _EncoderState, rows, every: bool = False) -> Packed | str:
    """The packed layout of a call the fused encoder computes (`_original_code_reason` found none to refuse), or
    why the original code runs instead. Where the heads read padded positions (`padded_reads`: question answering
    every one, a pooler or classifier the first; `every`: the call records every layer's hidden states) and some
    are padded, those positions stay in the layout as queries over their row's real tokens (`read_layout`), so
    their values are the original code's; where none is, padding is removed. One sync more than removing padding
    alone (whether a read position is padded)."""
    keys = rows.keys
    reads = EVERY_POSITION if every else state.reads
    read = None if torch.compiler.is_compiling() or rows.segments is not None else _read_mask(reads, keys)
    if read is None or not bool((read & ~keys).any()):
        return _layout(keys, rows.segments)
    kind = state.layers
    windows = kind.windows(encoder) if kind.windows else []
    if windows and _outside_windows(keys, read, windows):
        return ("padding at a position its heads read that sees no real token inside a sliding window, where the "
                "original attention gives what its implementation makes of a row with every key masked")
    found = read_layout(keys, read, distances=kind.relative is not None or bool(windows))
    return found.layout if found.layout is not None else found.why


def _outside_windows(keys: torch.Tensor, read: torch.Tensor, windows) -> bool:
    """Whether a read padded position sees no real token of its row inside one of the (left, right) windows (-1:
    unbounded), the real tokens one run (holes refused before). One sync."""
    position = torch.arange(keys.shape[1], device=keys.device)
    first = torch.where(keys, position, keys.shape[1]).min(1, keepdim=True).values
    last = torch.where(keys, position, -1).max(1, keepdim=True).values
    far = torch.zeros_like(keys, dtype=torch.bool)
    for left, right in windows:
        far |= (position < first) & (right >= 0) & (position + right < first)
        far |= (position > last) & (left >= 0) & (position - left > last)
    return bool((far & read & ~keys).any())


def _padded(x: torch.Tensor, p, keys: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """Packed tokens back to [batch, seq, ...], padded positions 0 (the static layout computes them: zeroed);
    `padded`: x is [batch, seq, ...] already (`_run_stack` recording hidden states)."""
    if padded:
        return x
    return torch.where(keys[..., None], pad(x, p), 0.0) if torch.compiler.is_compiling() else pad(x, p)


def _original_code_reason(encoder, state: _EncoderState, keys, encoder_hidden_states, kwargs,
                          windowed: bool = True, segments=None) -> str | None:
    """Why this encoder call must run the original code, or None (`windowed`: whether local layers keep their
    windows in this call; `segments`: the sequences of each row, None where a row is one)."""
    wants = {"output_attentions"} if kwargs.get("output_attentions", getattr(state.config, "output_attentions",
                                                                             False)) else set()
    # Every layer's hidden states: computed at every position (`_run_stack`); compiled, or in rows of several
    # sequences with padding, the original code computes them.
    hidden = _wants_hidden_states(state, kwargs)
    if hidden and torch.compiler.is_compiling():
        wants.add("output_hidden_states")
    elif hidden:
        wants.update(_padded_read_problems(state, keys, segments, hidden=True))
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
    wants.update(_padded_read_problems(state, keys, segments))
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

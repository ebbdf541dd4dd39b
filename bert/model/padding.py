"""The one conversion from a model call to the packed layout (bert.data.batch.Packed) and back.

A padded Hugging Face-style call ([batch, seq_len] and an attention_mask) is converted at the model's edge
(`to_tokens`) and its outputs padded back at the end (`pad`): tokens keep their order inside a sequence, so any
0/1 mask works (right padding, left padding or holes). A packed call passes `cu_seqlens` and `max_seqlen` itself;
any valid cu_seqlens gives the padded call's results.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from bertfuse.bert.data.batch import (
    KeySpans,
    Origin,
    Packed,
    Tokens,
    check_packed_values,
    checks_are_free,
    packed_layout,
    range_problems,
    static_max_seqlen,
    value_ranges,
)


def unpad_mask(attention_mask: torch.Tensor, max_seqlen: int | None = None,
               segments: torch.Tensor | None = None) -> Packed:
    """The layout of the kept tokens (nonzero) of a [batch, seqlen] mask, one sequence per row, or, given
    `segments` ([batch, seqlen] integers, nondecreasing along each row: several sequences packed in one row), one
    sequence per row and segment; two syncs (the token count, and the longest sequence unless the caller gives
    max_seqlen)."""
    batch, seqlen = attention_mask.shape
    keep = attention_mask != 0
    indices = keep.reshape(-1).nonzero().squeeze(1)
    if segments is None:
        seqlens = keep.sum(1, dtype=torch.int32)
    else:  # each kept token's (row, segment) as one number, in token order; a sequence is a run of one number
        sequence = (torch.arange(batch, device=keep.device)[:, None] * seqlen + segments).reshape(-1)[indices]
        seqlens = torch.unique_consecutive(sequence, return_counts=True)[1].to(torch.int32)
    cu_seqlens = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=attention_mask.device)
    torch.cumsum(seqlens, 0, out=cu_seqlens[1:])
    if max_seqlen is None:
        max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    return packed_layout(cu_seqlens, indices.numel(), max_seqlen, origin=Origin(indices, batch, seqlen))


class ReadLayout(NamedTuple):
    """`read_layout`'s answer: the layout, or why none can be built for this call (`layout` None)."""
    layout: Packed | None
    why: str | None = None


def read_layout(keys: torch.Tensor, read: torch.Tensor, distances: bool = False) -> ReadLayout:
    """The layout of a [batch, seqlen] key mask (True = a real token) whose padded positions in `read` ([batch,
    seqlen] bool) are read by a head: one sequence per row holding its real tokens as keys and those padded
    positions as queries only (`Packed.keys`), each attending to its row's real tokens as the model's own code
    computes it. A row's padded queries before its first real token come first, its real tokens next, the rest
    after, each group in order: the real tokens are one run of keys (`KeySpans`), even where the mask has holes.
    With `distances` (layers that read the distance between two tokens of a sequence: windows, relative
    positions), a row keeps every position from the first it needs to the last, so that distances within the
    sequence are those of the row (where the real tokens are one run: the caller refuses holes for such layers).
    A row that reads a padded position but has no real token gets no layout (the original attention attends
    uniformly over its masked keys there). Two syncs, as unpad_mask."""
    batch, seqlen = keys.shape
    keys = keys != 0
    kept = keys | read
    if distances:  # every position between the first kept and the last
        kept = (kept.cummax(1).values & kept.flip(1).cummax(1).values.flip(1))
    real = keys.sum(1, dtype=torch.int32)
    empty = ((real == 0) & read.any(1)).any()
    before = ~keys.cummax(1).values                     # positions before the row's first real token
    group = torch.where(keys, 1, torch.where(before, 0, 2))
    position = torch.arange(seqlen, device=keys.device)
    order = (torch.arange(batch, device=keys.device)[:, None] * 3 + group) * seqlen + position
    ranked = order.reshape(-1)[kept.reshape(-1)].sort().values  # one sync: the kept count
    indices = ranked // (3 * seqlen) * seqlen + ranked % seqlen     # each one's flat index in [batch * seqlen]
    seqlens = kept.sum(1, dtype=torch.int32)
    start = (kept & before).sum(1, dtype=torch.int32)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=keys.device)
    torch.cumsum(seqlens, 0, out=cu_seqlens[1:])
    longest, empty = torch.stack([seqlens.max() if batch else seqlens.new_zeros(()), empty.int()]).tolist()
    if empty:
        return ReadLayout(None, "a row without a real token whose padded positions a head reads, where the original "
                                "attention attends uniformly over its masked keys")
    layout = packed_layout(cu_seqlens, indices.numel(), longest, origin=Origin(indices, batch, seqlen))
    return ReadLayout(layout._replace(keys=KeySpans(start, real)))


def static_layout(keep: torch.Tensor, segments: torch.Tensor | None = None) -> Packed:
    """A layout of a [batch, seqlen] key mask whose shapes do not depend on its values (torch.compile at a fixed
    batch shape, torch.export): every one of the batch * seqlen tokens, each row's kept tokens in order as its
    sequence, and all the padding after the last sequence as filler, which the attention gives zeros and the
    caller discards; max_seqlen is seqlen. Given `segments` (as unpad_mask), a row holds up to seqlen sequences:
    there are batch * seqlen sequence slots, the used ones first, the rest empty. Only cumulative sums, row sums
    and scatters to distinct places (no sort, no search, no sync, no scatter-add: Inductor's C++ code generator
    fails on a vectorised scatter-add whose index it computes), so it compiles into one graph and exports to
    ONNX. The attention skips the padding; the matmuls do not."""
    batch, seqlen = keep.shape
    keep = keep != 0
    n, device = batch * seqlen, keep.device
    if segments is None:  # a row, a sequence
        slots, sequence = batch, torch.arange(batch, device=device).repeat_interleave(seqlen)
        cu_seqlens = torch.cat([keep.new_zeros(1, dtype=torch.int32), keep.sum(1).cumsum(0, dtype=torch.int32)])
        keep = keep.reshape(-1)
    else:
        keep = keep.reshape(-1)
        slots, (sequence, cu_seqlens) = n, _segment_slots(keep, segments, seqlen)
    # A kept token's packed place is its rank among all kept tokens (the kept tokens of one slot are consecutive
    # in token order: segments never decrease along a row).
    filler = (~keep).long().cumsum(0) - 1                                       # a padded token's place after all
    slot = torch.where(keep, keep.long().cumsum(0) - 1, cu_seqlens.long()[-1] + filler)  # its packed place
    at = torch.empty(n, dtype=torch.long, device=device)
    indices = at.scatter(0, slot, torch.arange(n, device=device))               # packed place -> padded place
    seq = at.scatter(0, slot, torch.where(keep, sequence, slots))
    pos = at.scatter(0, slot, torch.where(keep, slot - cu_seqlens.long()[sequence], filler))
    return Packed(cu_seqlens, seqlen, seq, pos, 0, Origin(indices, batch, seqlen))


def _segment_slots(keep: torch.Tensor, segments: torch.Tensor, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's sequence slot, cu_seqlens over batch * seqlen slots) for flattened `keep` and [batch, seqlen]
    `segments`: the (row, segment) pairs numbered in token order, and each slot's end read from the kept tokens'
    running count at its last token, written to its own place (the other tokens write to places of their own past
    the slots, discarded); the unused slots at the end hold the total."""
    n, device = keep.numel(), keep.device
    token = torch.arange(n, device=device)
    if n == 0:
        return token, torch.zeros(1, dtype=torch.int32, device=device)
    pair = (token // seqlen) * seqlen + segments.reshape(-1).long()            # (row, segment), never decreasing
    new = pair[1:] != pair[:-1]
    sequence = torch.cat([token.new_zeros(1), new.long().cumsum(0)])           # a slot per pair, in token order
    last = torch.cat([new, new.new_ones(1)])                                   # a pair's last token
    kept = keep.long().cumsum(0)                                               # kept tokens up to and with each
    ends = kept.new_zeros(2 * n).scatter(0, torch.where(last, sequence, n + token), kept)[:n]
    ends = torch.where(token <= sequence[-1], ends, kept[-1])
    return sequence, torch.cat([ends.new_zeros(1), ends]).to(torch.int32)


def unpad(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """[batch, seqlen, ...] -> [T, ...]: the kept tokens of a padded input."""
    o = p.origin
    return x.reshape(o.batch * o.seqlen, *x.shape[2:])[o.indices]


def pad(x: torch.Tensor, p: Packed, fill: float = 0.0) -> torch.Tensor:
    """[T, ...] -> [batch, seqlen, ...], `fill` at padded positions: back to the caller's layout, so x itself
    when the input was packed (no origin)."""
    o = p.origin
    if o is None:
        return x
    out = x.new_full((o.batch * o.seqlen, *x.shape[1:]), fill).index_put((o.indices,), x)
    return out.view(o.batch, o.seqlen, *x.shape[1:])


def kept(p: Packed) -> torch.Tensor:
    """bool [batch, seqlen]: which positions of the padded input were kept."""
    o = p.origin
    keep = torch.zeros(o.batch * o.seqlen, dtype=torch.bool, device=o.indices.device)
    return keep.index_fill(0, o.indices, True).view(o.batch, o.seqlen)


# ---- the model's edge: either call convention -> Tokens, checked once -----------------------------
def to_tokens(config, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, cu_seqlens=None,
              max_seqlen=None, row_aligned: bool = False, validate: bool = False) -> Tokens:
    """A padded call (input_ids [batch, seq_len], optional attention_mask, token_type_ids, position_ids; values
    always checked, syncs) or a packed one (input_ids, token_type_ids, position_ids [T], cu_seqlens, max_seqlen;
    shapes always checked, values with `validate` (one sync) and whenever the batch is on the CPU (free))."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
    if cu_seqlens is None:
        if max_seqlen is not None or row_aligned:
            raise ValueError("max_seqlen and row_aligned describe a packed batch: pass cu_seqlens with them")
        return _from_padded(config, input_ids, attention_mask, token_type_ids, position_ids)
    if attention_mask is not None:
        raise ValueError("a packed batch (cu_seqlens given) takes no attention_mask: cu_seqlens says where each "
                         "sequence lies")
    return _from_packed(config, input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen, row_aligned,
                        validate)


def _check_ids(name, t, shape, device) -> None:
    """The one layout check of ids, types and positions, padded or packed: integers, input_ids' shape and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of integer ids, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer ids, got dtype {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (the shape of input_ids)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but input_ids is on {device}")


def _from_padded(config, input_ids, attention_mask, token_type_ids, position_ids) -> Tokens:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, seq_len] tensor (or [tokens] with cu_seqlens), got "
                         f"{tuple(input_ids.shape)}")
    shape, device = tuple(input_ids.shape), input_ids.device
    _check_ids("input_ids", input_ids, shape, device)
    if position_ids is None and shape[1] > config.max_position_embeddings:
        raise ValueError(f"sequence length {shape[1]} is longer than max_position_embeddings "
                         f"({config.max_position_embeddings})")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {shape} "
                         "(the shape of input_ids)")
    if attention_mask.device != device:
        raise ValueError(f"attention_mask is on {attention_mask.device} but input_ids is on {device}")
    token_type_ids = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    position_ids = torch.arange(shape[1], device=device).expand(shape) if position_ids is None else position_ids
    _check_ids("token_type_ids", token_type_ids, shape, device)
    _check_ids("position_ids", position_ids, shape, device)
    # The longest sequence is read with the value ranges (padding is never read): one sync besides nonzero's.
    p = unpad_mask(attention_mask, max_seqlen=0)
    lens = p.cu_seqlens[1:] - p.cu_seqlens[:-1]
    longest = lens.max().long() if lens.numel() else torch.zeros((), dtype=torch.long, device=device)
    tokens = Tokens(unpad(input_ids, p), unpad(token_type_ids, p), unpad(position_ids, p), p)
    values = torch.stack([*value_ranges(tokens), longest]).tolist()
    problems = range_problems(config, values[:6])
    if problems:
        raise ValueError("; ".join(problems))
    return tokens._replace(layout=p._replace(max_seqlen=values[6]))


def _from_packed(config, input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen, row_aligned,
                 validate) -> Tokens:
    if input_ids.dim() != 1:
        raise ValueError(f"packed input_ids must be a [tokens] tensor, got shape {tuple(input_ids.shape)}")
    n = input_ids.shape[0]
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 2 or cu_seqlens.device != input_ids.device:
        raise ValueError(f"packed cu_seqlens must be a 1-D int32 tensor [sequences + 1] on {input_ids.device}")
    if max_seqlen is None:
        raise ValueError("a packed batch needs max_seqlen, a bound on its longest sequence (an int: no sync)")
    max_seqlen = static_max_seqlen(max_seqlen)
    if max_seqlen < 1:
        raise ValueError(f"packed max_seqlen must be at least 1, got {max_seqlen}")
    if row_aligned and n % max_seqlen:
        raise ValueError(f"row_aligned: a packed batch of rows of max_seqlen tokens, but {n} tokens are not a "
                         f"multiple of max_seqlen={max_seqlen}")
    p = packed_layout(cu_seqlens, n, max_seqlen, row_aligned)
    # Defaults as for a padded call: one segment, positions counted from each sequence's start (filler: 0).
    token_type_ids = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    position_ids = torch.where(p.seq < p.sequences, p.pos, 0) if position_ids is None else position_ids
    for name, t in (("input_ids", input_ids), ("token_type_ids", token_type_ids), ("position_ids", position_ids)):
        _check_ids(name, t, (n,), input_ids.device)
    tokens = Tokens(input_ids, token_type_ids, position_ids, p)
    if validate or checks_are_free(cu_seqlens):
        check_packed_values(config, tokens, row_aligned)
    return tokens

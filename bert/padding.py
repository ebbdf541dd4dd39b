"""The model's one batch layout, and the one conversion from padded inputs to it and back.

Inside the model every batch is packed (FlashAttention's variable-length convention): tokens [T] one sequence
after another, int32 `cu_seqlens` [S + 1] saying where each sequence starts (empty sequences allowed), tokens at
or past cu_seqlens[-1] are filler that belongs to no sequence, and `max_seqlen` bounds every sequence's length.
`Packed` describes that layout once per forward; every layer, head and loss reads it. A padded Hugging Face-style
call ([batch, seq_len] and an attention_mask) is converted at the model's edge (`to_tokens`) and its outputs
padded back at the end (`pad`): tokens keep their order inside a sequence, so any 0/1 mask works (right padding,
left padding or holes). A packed call passes `cu_seqlens` and `max_seqlen` itself; any valid cu_seqlens gives
the padded call's results. `row_aligned` is the packer's promise (bert.packing) that the tokens are rows of
max_seqlen that no sequence crosses: the PyTorch attention then runs row by row; it is never assumed otherwise.
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch


class Origin(NamedTuple):
    """Where packed tokens sat in a padded input."""
    indices: torch.Tensor      # [T] int64, flat index into [batch * seqlen] of each kept token
    batch: int
    seqlen: int


class Packed(NamedTuple):
    """The layout of T packed tokens in S sequences; built without a host sync (`packed_layout`)."""
    cu_seqlens: torch.Tensor   # [S + 1] int32, sequence s is tokens [cu_seqlens[s], cu_seqlens[s + 1])
    max_seqlen: int            # no sequence is longer (a Python int: kernels size their grid with it)
    seq: torch.Tensor          # [T] int64, each token's sequence (S for filler)
    pos: torch.Tensor          # [T] int64, its position in that sequence
    rows: int = 0              # > 0: the tokens are `rows` rows of max_seqlen that no sequence crosses
    origin: Origin | None = None   # the padded input the tokens came from; None for a packed input

    @property
    def sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def tokens(self) -> int:
        return self.seq.numel()


class Tokens(NamedTuple):
    """A batch at the model's edge, in the one layout: the embeddings' inputs [T] and their `Packed` layout."""
    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: Packed


def packed_layout(cu_seqlens: torch.Tensor, tokens: int, max_seqlen: int, row_aligned: bool = False,
                  origin: Origin | None = None) -> Packed:
    """The layout of `tokens` packed tokens split by cu_seqlens, without a host sync. Whatever cu_seqlens holds,
    seq lies in [0, S] and pos is the token's offset from its sequence's start (consumers mask what is out of
    range; only validated cu_seqlens give meaningful results)."""
    t = torch.arange(tokens, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), t.to(cu_seqlens.dtype), right=True)
    pos = t - cu_seqlens.long()[seq]  # filler: its offset past cu_seqlens[-1]
    rows = tokens // max_seqlen if row_aligned and max_seqlen > 0 else 0
    return Packed(cu_seqlens, max_seqlen, seq, pos, rows, origin)


def unpad_mask(attention_mask: torch.Tensor, max_seqlen: int | None = None) -> Packed:
    """The layout of the kept tokens (nonzero) of a [batch, seqlen] mask, one sequence per row; two syncs (the
    token count, and the longest sequence unless the caller gives max_seqlen)."""
    batch, seqlen = attention_mask.shape
    keep = attention_mask != 0
    seqlens = keep.sum(1, dtype=torch.int32)
    indices = keep.reshape(-1).nonzero().squeeze(1)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=attention_mask.device)
    torch.cumsum(seqlens, 0, out=cu_seqlens[1:])
    if max_seqlen is None:
        max_seqlen = int(seqlens.max()) if batch else 0
    return packed_layout(cu_seqlens, indices.numel(), max_seqlen, origin=Origin(indices, batch, seqlen))


def static_layout(keep: torch.Tensor) -> Packed:
    """A layout of a [batch, seqlen] key mask whose shapes do not depend on its values (for torch.export): every
    one of the batch * seqlen tokens, each row's kept tokens first (a stable sort), as 2 * batch sequences, a
    row's kept tokens then its padding. The padding attends only to itself (its outputs, finite, are for the
    caller to discard); max_seqlen is seqlen. Costs the attention FLOPs of the padding, so only for export."""
    batch, seqlen = keep.shape
    keep = keep != 0
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # kept first, in order
    rows = torch.arange(batch, device=keep.device)[:, None] * seqlen
    kept = keep.sum(1)
    lengths = torch.stack([kept, seqlen - kept], 1).reshape(-1).to(torch.int32)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
    origin = Origin((rows + order).reshape(-1), batch, seqlen)
    return packed_layout(cu_seqlens, batch * seqlen, seqlen, origin=origin)


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


def static_max_seqlen(max_seqlen) -> int:
    """A packed batch's max_seqlen as a Python int: an int, a NumPy integer or a one-element integer tensor (read
    once: a sync when it lives on a GPU, so pass an int there)."""
    if isinstance(max_seqlen, torch.Tensor):
        if max_seqlen.numel() != 1 or max_seqlen.is_floating_point() or max_seqlen.dtype == torch.bool:
            raise ValueError(f"packed max_seqlen must be an integer, got a {max_seqlen.dtype} tensor of shape "
                             f"{tuple(max_seqlen.shape)}")
        return int(max_seqlen.reshape(()))
    try:
        return operator.index(max_seqlen)
    except TypeError:
        raise ValueError(f"packed max_seqlen must be an integer, got {type(max_seqlen).__name__} "
                         f"{max_seqlen!r}") from None


def checks_are_free(t: torch.Tensor) -> bool:
    """Whether reading t's values costs no device sync: it lives on the CPU and nothing is being traced."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def read_values(t: torch.Tensor) -> list:
    """A small tensor's values on the host: through NumPy for a CPU tensor (no device involved, so allowed inside
    bert.static.forbid_host_sync), a sync otherwise."""
    return t.numpy().tolist() if t.device.type == "cpu" else t.tolist()


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
    values = read_values(torch.stack([*_ranges(tokens), longest]))
    problems = _range_problems(config, values[:6])
    if problems:
        raise ValueError("; ".join(problems))
    return tokens._replace(layout=p._replace(max_seqlen=values[6]))


def _ranges(tokens: Tokens) -> list[torch.Tensor]:
    ids = tokens[:3]
    if not tokens.input_ids.numel():
        return [torch.zeros((), dtype=torch.long, device=tokens.input_ids.device)] * 6
    return [v.long() for t in ids for v in (t.min(), t.max())]


def _range_problems(config, values) -> list[str]:
    """The one check of token values: ids, token types and positions inside their embedding tables."""
    limits = (("input_ids", "vocab_size"), ("token_type_ids", "type_vocab_size"),
              ("position_ids", "max_position_embeddings"))
    return [f"{name} must lie in [0, {limit}={getattr(config, limit)}); got values in [{lo}, {hi}]"
            for (name, limit), lo, hi in zip(limits, values[0::2], values[1::2])
            if lo < 0 or hi >= getattr(config, limit)]


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
        _check_packed_values(config, tokens, row_aligned)
    return tokens


def _check_packed_values(config, tokens: Tokens, row_aligned: bool) -> None:
    n, p = tokens.input_ids.shape[0], tokens.layout
    cu, max_seqlen = p.cu_seqlens, p.max_seqlen
    lens = cu[1:] - cu[:-1]
    # A sequence crosses a row boundary when its first and last token lie in different rows.
    crossing = ((lens > 0) & (cu[:-1] // max_seqlen != (cu[1:] - 1) // max_seqlen)).sum()
    values = read_values(torch.stack([*_ranges(tokens), cu[0].long(), cu[-1].long(), (lens < 0).sum(),
                                      lens.max().long(), crossing]))
    first, last, decreasing, longest, crossing = values[6:]
    problems = _range_problems(config, values[:6]) + [message for bad, message in (
        (first != 0, "cu_seqlens does not start at 0"),
        (last > n, f"cu_seqlens ends at {last}, past the {n} tokens"),
        (decreasing, "cu_seqlens decreases"),
        (longest > max_seqlen, f"a sequence is longer than max_seqlen={max_seqlen}"),
        (row_aligned and crossing,
         f"row_aligned, but {crossing} sequence(s) cross a row boundary (a multiple of max_seqlen={max_seqlen})"))
        if bad]
    if problems:
        raise ValueError("packed batch: " + "; ".join(problems))


SCALAR_KEYS = ("labels", "start_positions", "end_positions", "next_sentence_label")


def pad_batch(rows: list[dict], pad_id: int = 0, multiple: int = 8) -> dict[str, torch.Tensor]:
    """Model inputs from rows of token lists: input_ids (pad_id on padding) and token_type_ids padded to the
    longest row rounded up to `multiple`, an attention_mask, labels given per token padded with -100, and
    per-row values (a class label, QA start/end positions, next_sentence_label) stacked. Other keys of a row
    (bookkeeping such as NER's first-token positions) are not model inputs and are left out."""
    width = -(-max(len(r["input_ids"]) for r in rows) // multiple) * multiple
    out = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
           "token_type_ids": torch.zeros((len(rows), width), dtype=torch.long),
           "attention_mask": torch.zeros((len(rows), width), dtype=torch.long)}
    per_token = [k for k in ("labels",) if k in rows[0] and isinstance(rows[0][k], (list, torch.Tensor))]
    for key in per_token:
        out[key] = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        out["input_ids"][i, :n] = torch.as_tensor(r["input_ids"])
        out["token_type_ids"][i, :n] = torch.as_tensor(r.get("token_type_ids", [0] * n))
        out["attention_mask"][i, :n] = 1
        for key in per_token:
            out[key][i, :len(r[key])] = torch.as_tensor(r[key])
    for key in SCALAR_KEYS:
        if key in rows[0] and key not in per_token:
            out[key] = torch.tensor([r[key] for r in rows], dtype=torch.long)
    return out

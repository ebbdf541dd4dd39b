"""The batch types the data builds and the model reads, and their checks, in one place.

Inside the model every batch is packed (FlashAttention's variable-length convention): tokens [T] one sequence
after another, int32 `cu_seqlens` [S + 1] saying where each sequence starts (empty sequences allowed), tokens at
or past cu_seqlens[-1] are filler that belongs to no sequence, and `max_seqlen` bounds every sequence's length.
`Packed` describes that layout once per forward; every layer, head and loss reads it. `row_aligned` is the
packer's promise that the tokens are rows of max_seqlen that no sequence crosses: the PyTorch attention then runs
row by row; it is never assumed otherwise.

A packed pre-training micro-batch (`PackedBatch`, bert.data.packing builds it) holds, every shape fixed by
(T, S, R):
    input_ids, token_type_ids, position_ids   [T]     row r at [r L, (r + 1) L): its instances, then filler
    cu_seqlens                                [S + 1] int32: each instance is a sequence, and so is each row's
                                                      filler tail (a sequence nobody reads); unused slots are
                                                      empty sequences at the end
    mlm_positions, mlm_labels                 [R]     the labelled tokens (indices into [T]); -100 in unused slots
    next_sentence_label                       [S]     -100 for filler sequences and unused slots; None in an
                                                      MLM-only batch (BertForMaskedLM's arguments)
    max_seqlen                                int     L (a Python int, the same for every batch of the run)
    row_aligned                               True    no sequence crosses a row (the PyTorch attention's shortcut)
    instance                                  [S]     bool, which sequences are instances (the data's bookkeeping:
                                                      not a model argument, never moved to the device)
Its values are checked where they cannot be trusted: the token side (`check_packed_values`) and the label side
(`check_packed_labels`), each in one read of the device. Fine-tuning batches are padded (`pad_batch`).
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch


class Origin(NamedTuple):
    """Where packed tokens sat in a padded input."""
    indices: torch.Tensor      # [T] int64, flat index into [batch * seqlen] of each kept token
    batch: int
    seqlen: int


class KeySpans(NamedTuple):
    """Which tokens of each sequence are keys, where not all are: the `count` positions from `start`. The others
    are queries only (a padded position a head reads: it attends to its sequence's real tokens, as the model's own
    code computes it)."""
    start: torch.Tensor        # [S] int32, the first key's position in its sequence
    count: torch.Tensor        # [S] int32, the number of keys (the attention's seqused_k)


class Packed(NamedTuple):
    """The layout of T packed tokens in S sequences; built without a host sync (`packed_layout`)."""
    cu_seqlens: torch.Tensor   # [S + 1] int32, sequence s is tokens [cu_seqlens[s], cu_seqlens[s + 1])
    max_seqlen: int            # no sequence is longer (a Python int: kernels size their grid with it)
    seq: torch.Tensor          # [T] int64, each token's sequence (S for filler)
    pos: torch.Tensor          # [T] int64, its position in that sequence
    rows: int = 0              # > 0: the tokens are `rows` rows of max_seqlen that no sequence crosses
    origin: Origin | None = None   # the padded input the tokens came from; None for a packed input
    keys: KeySpans | None = None   # None: every token is a key of its sequence

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


def value_ranges(tokens: Tokens) -> list[torch.Tensor]:
    ids = tokens[:3]
    if not tokens.input_ids.numel():
        return [torch.zeros((), dtype=torch.long, device=tokens.input_ids.device)] * 6
    return [v.long() for t in ids for v in (t.min(), t.max())]


def range_problems(config, values) -> list[str]:
    """The one check of token values: ids, token types and positions inside their embedding tables."""
    limits = (("input_ids", "vocab_size"), ("token_type_ids", "type_vocab_size"),
              ("position_ids", "max_position_embeddings"))
    return [f"{name} must lie in [0, {limit}={getattr(config, limit)}); got values in [{lo}, {hi}]"
            for (name, limit), lo, hi in zip(limits, values[0::2], values[1::2])
            if lo < 0 or hi >= getattr(config, limit)]


def check_packed_values(config, tokens: Tokens, row_aligned: bool) -> None:
    n, p = tokens.input_ids.shape[0], tokens.layout
    cu, max_seqlen = p.cu_seqlens, p.max_seqlen
    lens = cu[1:] - cu[:-1]
    # A sequence crosses a row boundary when its first and last token lie in different rows.
    crossing = ((lens > 0) & (cu[:-1] // max_seqlen != (cu[1:] - 1) // max_seqlen)).sum()
    values = torch.stack([*value_ranges(tokens), cu[0].long(), cu[-1].long(), (lens < 0).sum(),
                                      lens.max().long(), crossing]).tolist()
    first, last, decreasing, longest, crossing = values[6:]
    problems = range_problems(config, values[:6]) + [message for bad, message in (
        (first != 0, "cu_seqlens does not start at 0"),
        (last > n, f"cu_seqlens ends at {last}, past the {n} tokens"),
        (decreasing, "cu_seqlens decreases"),
        (longest > max_seqlen, f"a sequence is longer than max_seqlen={max_seqlen}"),
        (row_aligned and crossing,
         f"row_aligned, but {crossing} sequence(s) cross a row boundary (a multiple of max_seqlen={max_seqlen})"))
        if bad]
    if problems:
        raise ValueError("packed batch: " + "; ".join(problems))


def check_packed_labels(config, p: Packed, positions, labels, nsp, check_values: bool) -> None:
    """The label side of a packed batch: shapes and dtypes always; with check_values (one read) that every used
    MLM slot (label != -100) has a label in the vocabulary and a position inside a sequence (in [0, T), before
    cu_seqlens[-1], and, given NSP labels, in a sequence with one), no position twice, and NSP labels in
    {0, 1, -100}, none on an empty sequence. nsp None: an MLM-only batch."""
    sequences, total = p.sequences, p.tokens
    named = [("mlm_positions", positions, None if labels is None else labels.shape),
             ("mlm_labels", labels, None if positions is None else positions.shape)]
    for name, t, shape in named + ([("next_sentence_label", nsp, (sequences,))] if nsp is not None else []):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool or t.dim() != 1 \
                or tuple(t.shape) != tuple(shape) or t.device != p.cu_seqlens.device:
            what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"packed {name} must be a 1-D integer tensor of shape {tuple(shape or ('R',))} on "
                             f"{p.cu_seqlens.device}, got {what}")
    if not check_values:
        return
    lens = p.cu_seqlens[1:] - p.cu_seqlens[:-1]
    # MLM-only: every sequence holds labels, and the layout's empty ones (filler slots) are no mistake
    nsp_used = lens > 0 if nsp is None else nsp != -100
    nsp = torch.zeros(sequences, dtype=torch.long, device=positions.device) if nsp is None else nsp
    used = labels != -100
    inside = (positions >= 0) & (positions < total) & (positions < p.cu_seqlens[-1].long())
    # Each position's sequence (from the layout; positions outside are counted apart), and whether it is labelled.
    seq = p.seq[positions.clamp(0, max(total - 1, 0))] if total else torch.zeros_like(positions)
    in_instance = nsp_used[seq.clamp(max=max(sequences - 1, 0))] if sequences else torch.zeros_like(used)
    key = torch.where(used, positions, -1 - torch.arange(positions.numel(), device=positions.device)).sort().values
    counts = torch.stack([
        (used & ((labels < 0) | (labels >= config.vocab_size))).sum(), (used & ~inside).sum(),
        (used & inside & ~in_instance).sum(), (key[1:] == key[:-1]).sum(),
        (nsp_used & ((nsp < 0) | (nsp > 1))).sum(), (nsp_used & (lens <= 0)).sum()]).tolist()
    problems = [f"{n} {message}" for n, message in zip(counts, (
        f"mlm_labels outside [0, {config.vocab_size}) (and not -100)",
        f"mlm_positions outside the sequences of the {total} tokens (negative, past cu_seqlens[-1] or the tokens)",
        "mlm_positions in filler (a sequence whose next_sentence_label is -100)",
        "mlm_positions given twice", "next_sentence_label(s) outside {0, 1, -100}",
        "next_sentence_label(s) on an empty sequence")) if n]
    if problems:
        raise ValueError("packed batch: " + "; ".join(problems))


@dataclass
class PackedBatch(Mapping):
    """A packed pre-training micro-batch (the module docstring's layout), as the packer builds it and the job, the
    trainer and the benchmark read it. A Mapping of the model's keyword arguments, BertForPreTraining's (or
    BertForMaskedLM's when next_sentence_label is None): `model(**batch)`."""
    input_ids: torch.Tensor            # [T]
    token_type_ids: torch.Tensor       # [T]
    position_ids: torch.Tensor         # [T]
    cu_seqlens: torch.Tensor           # [S + 1] int32
    mlm_positions: torch.Tensor        # [R]
    mlm_labels: torch.Tensor           # [R], -100 in unused slots
    next_sentence_label: torch.Tensor | None  # [S], -100 for filler and unused slots; None: MLM-only
    max_seqlen: int
    row_aligned: bool = True           # no sequence crosses a row of max_seqlen tokens
    instance: torch.Tensor | None = None  # [S] bool: an instance, not filler (not a model argument)

    def __getitem__(self, key):
        if key not in tuple(self):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return (f.name for f in fields(self) if f.name != "instance" and getattr(self, f.name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def to(self, device, non_blocking: bool = False) -> "PackedBatch":
        return replace(self, **{k: v.to(device, non_blocking=non_blocking) for k, v in self.items()
                                if isinstance(v, torch.Tensor)})

    def pin_memory(self) -> "PackedBatch":
        """Pinned host copies (the DataLoader's pin_memory calls this, keeping the type)."""
        return replace(self, **{k: v.pin_memory() for k, v in self.items() if isinstance(v, torch.Tensor)})

    @property
    def lengths(self) -> list[int]:
        """Of the instances: not the rows' filler tails or the unused slots."""
        cu, instance = self.cu_seqlens.tolist(), self.instance.tolist()
        return [b - a for a, b, real in zip(cu, cu[1:], instance) if real]

    @property
    def labelled(self) -> int:
        return int((self.mlm_labels != -100).sum())

    @property
    def slots(self) -> int:
        """Tokens in the budget, filler included."""
        return self.input_ids.numel()


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

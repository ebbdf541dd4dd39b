"""Packing pre-training instances into micro-batches of a fixed token budget (the data side of static shapes).

Instead of padding every instance to the longest of its batch, instances are packed, as Krell et al. (2021) do
for BERT, into rows of max_seqlen tokens (L) holding up to a few instances each, and a micro-batch is a fixed
number of rows: T = rows x L tokens. Every packed batch then has the same shapes, whatever the lengths, and
almost no token is padding. Packing is best-fit decreasing over a window of instances (in a shuffled order, so
rows differ from epoch to epoch): the window is sorted longest first and each instance goes into the open row
with the least room left that still fits it.

Rows matter for one reason: no sequence crosses a row boundary, so attention without a variable-length kernel
(the PyTorch path) runs as [rows, L, L] with a block-diagonal mask, at the cost of a padded batch of `rows`
sequences, not of one padded slot per sequence. The Triton kernel reads cu_seqlens and never sees rows.

A packed micro-batch (`PackingCollator`) holds, every shape fixed by (T, S, R):
    input_ids, token_type_ids, position_ids   [T]     row r at [r L, (r + 1) L): its instances, then filler
    cu_seqlens                                [S + 1] int32: each instance is a sequence, and so is each row's
                                                      filler tail (a sequence nobody reads); unused slots are
                                                      empty sequences at the end
    mlm_positions, mlm_labels                 [R]     the labelled tokens (indices into [T]); -100 in unused slots
    next_sentence_label                       [S]     -100 for filler sequences and unused slots
    max_seqlen                                int     L (a Python int, the same for every batch of the run)
    row_aligned                               True    no sequence crosses a row (the PyTorch attention's shortcut)
S = rows x (instances per row + 1). Masking chooses exactly round(p * candidates) tokens of each instance (at
least one), as the original BERT code does, 80/10/10 as usual, keyed per instance like MLMCollator. That is
about p * (real tokens) per micro-batch; R = ceil(p * T) + rows leaves room for the rounding, and in the rare
pack that still chooses more, the last instances' extra choices are undone (their tokens restored, unlabelled),
as BERT's max_predictions_per_seq cap does.

Pre-training without packing (`--no-packing`) uses the same type: `one_per_row` lays a length-bucketed batch out
as one instance per row, rows as long as its longest instance (rounded up to 8), so the job, the trainer and
evaluation read one kind of batch; only its shapes then change from batch to batch.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np
import torch

from . import seeds
from .data import MLMCollator, check_instance


def pack(lengths, budget: int, max_seqs: int, window: int = 1024) -> list[list[int]]:
    """Indices of `lengths` grouped into packs of at most `budget` tokens and `max_seqs` sequences: best-fit
    decreasing within consecutive windows of `window` instances. Every index appears exactly once."""
    lengths = [int(n) for n in lengths]
    for name, value in (("budget", budget), ("max_seqs", max_seqs), ("window", window)):
        if int(value) < 1:
            raise ValueError(f"pack: {name} must be at least 1, got {value}")
    negative = [i for i, n in enumerate(lengths) if n < 0]
    if negative:
        raise ValueError(f"pack: instance {negative[0]} has a negative length {lengths[negative[0]]}")
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise ValueError(f"instance {too_long[0]} has {lengths[too_long[0]]} tokens, more than the budget {budget}")
    packs: list[list[int]] = []
    for start in range(0, len(lengths), window):
        ids = sorted(range(start, min(start + window, len(lengths))), key=lambda i: (-lengths[i], i))
        room, members = [], []
        for i in ids:
            fits = [p for p in range(len(room)) if room[p] >= lengths[i] and len(members[p]) < max_seqs]
            if fits:
                p = min(fits, key=lambda p: (room[p], p))
                room[p] -= lengths[i]
                members[p].append(i)
            else:
                room.append(budget - lengths[i])
                members.append([i])
        packs += members
    return packs


def epoch_packs(lengths, row_len: int, rows_per_batch: int, per_row: int, seed: int, epoch: int,
                window: int = 1024) -> list[list[list[int]]]:
    """An epoch's micro-batches, each `rows_per_batch` rows of instance indices: the instances in a shuffled
    order (deterministic in seed and epoch: the run's "order" stream, bert.seeds) packed into rows window by window
    (`pack`), the rows shuffled again so that long and short ones mix, and cut into micro-batches (a last
    incomplete one is dropped)."""
    rng = seeds.rng(seed, "order", epoch)
    order = rng.permutation(len(lengths))
    rows = pack(np.asarray(lengths)[order], row_len, per_row, window)
    rows = [[int(order[i]) for i in rows[j]] for j in rng.permutation(len(rows))]
    return [rows[i:i + rows_per_batch] for i in range(0, len(rows) - rows_per_batch + 1, rows_per_batch)]


def efficiency(lengths, packs: list[list[int]], budget: int) -> float:
    """Real tokens over the tokens the packs' budgets hold."""
    return sum(int(lengths[i]) for p in packs for i in p) / max(len(packs) * budget, 1)


class PackedShapes(NamedTuple):
    tokens: int          # T = rows x max_seqlen, the token budget of a micro-batch
    sequences: int       # S = rows x (per_row + 1): instances and each row's filler tail
    labels: int          # R, the most labelled tokens a micro-batch holds
    max_seqlen: int      # L, the length of a row and so of the longest instance
    per_row: int         # the most instances a row holds

    @classmethod
    def for_rows(cls, rows: int, max_seqlen: int, per_row: int, mlm_probability: float) -> "PackedShapes":
        tokens = rows * max_seqlen
        return cls(tokens, rows * (per_row + 1), math.ceil(mlm_probability * tokens) + rows, max_seqlen, per_row)

    @property
    def rows(self) -> int:
        return self.tokens // self.max_seqlen


@dataclass
class PackedBatch(Mapping):
    """A packed pre-training micro-batch (the module docstring's layout), as the packer builds it and the job, the
    trainer and the benchmark read it. A Mapping of BertForPreTraining's keyword arguments: `model(**batch)`."""
    input_ids: torch.Tensor            # [T]
    token_type_ids: torch.Tensor       # [T]
    position_ids: torch.Tensor         # [T]
    cu_seqlens: torch.Tensor           # [S + 1] int32
    mlm_positions: torch.Tensor        # [R]
    mlm_labels: torch.Tensor           # [R], -100 in unused slots
    next_sentence_label: torch.Tensor  # [S], -100 for filler and unused slots
    max_seqlen: int
    row_aligned: bool = True           # no sequence crosses a row of max_seqlen tokens

    def __getitem__(self, key):
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return (f.name for f in fields(self))

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)

    def to(self, device, non_blocking: bool = False) -> "PackedBatch":
        return replace(self, **{k: v.to(device, non_blocking=non_blocking) for k, v in self.items()
                                if isinstance(v, torch.Tensor)})

    def pin_memory(self) -> "PackedBatch":
        """Pinned host copies (the DataLoader's pin_memory calls this, keeping the type)."""
        return replace(self, **{k: v.pin_memory() for k, v in self.items() if isinstance(v, torch.Tensor)})

    @property
    def lengths(self) -> list[int]:
        """Of the instances: not the rows' filler tails or the unused slots (their NSP label is -100)."""
        cu, nsp = self.cu_seqlens.tolist(), self.next_sentence_label.tolist()
        return [b - a for a, b, label in zip(cu, cu[1:], nsp) if label != -100]

    @property
    def labelled(self) -> int:
        return int((self.mlm_labels != -100).sum())

    @property
    def slots(self) -> int:
        """Tokens in the budget, filler included."""
        return self.input_ids.numel()


class PackingCollator:
    """Rows of instances -> a packed micro-batch of fixed shapes (see the module docstring)."""

    def __init__(self, masker: MLMCollator, shapes: PackedShapes):
        if not getattr(masker, "exact", True):
            raise ValueError("packed batches need exact-count masking (MLMCollator(exact=True)): their labelled "
                             "tokens must stay within a fixed bound")
        self.masker, self.shapes = masker, shapes

    def _empty(self) -> PackedBatch:
        T, S, R, L, _ = self.shapes
        return PackedBatch(input_ids=torch.full((T,), self.masker.special.pad, dtype=torch.long),
                           token_type_ids=torch.zeros(T, dtype=torch.long), position_ids=torch.zeros(T, dtype=torch.long),
                           cu_seqlens=torch.zeros(S + 1, dtype=torch.int32), mlm_positions=torch.zeros(R, dtype=torch.long),
                           mlm_labels=torch.full((R,), -100), next_sentence_label=torch.full((S,), -100, dtype=torch.long),
                           max_seqlen=L, row_aligned=True)

    def _check(self, rows) -> None:
        L, per_row = self.shapes.max_seqlen, self.shapes.per_row
        if len(rows) > self.shapes.rows:
            raise ValueError(f"{len(rows)} rows do not fit a micro-batch of {self.shapes.rows}")
        for row in rows:
            if len(row) > per_row or sum(len(x["input_ids"]) for x in row) > L:
                raise ValueError(f"a row of {len(row)} instances, {sum(len(x['input_ids']) for x in row)} tokens, "
                                 f"does not fit {per_row} instances of {L} tokens")

    def __call__(self, rows: list[list[dict]], keys, stream: str = "masking") -> PackedBatch:
        """rows: lists of instances; keys: one masking key per instance, in order. Every instance is checked
        (bert.data.check_instance), so the batch passes the model's packed validation."""
        self._check(rows)
        keys = list(keys)
        if len(keys) != sum(len(row) for row in rows):
            raise ValueError(f"{sum(len(row) for row in rows)} instances but {len(keys)} masking keys")
        out, L = self._empty(), self.shapes.max_seqlen
        keys, s, labelled = iter(keys), 0, 0
        for r, row in enumerate(rows):
            start = r * L
            for j, x in enumerate(row):
                ids = check_instance(x, self.masker.special.vocab_size, f"instance {j} of row {r}")
                n = len(ids)
                masked, labels = self.masker.mask(ids, next(keys), stream)
                chosen = (labels != -100).nonzero().squeeze(1)
                over = chosen[self.shapes.labels - labelled:]  # past R: undone (rare; see the module docstring)
                masked, chosen = masked.index_copy(0, over, ids[over]), chosen[:self.shapes.labels - labelled]
                out["input_ids"][start:start + n] = masked
                out["token_type_ids"][start:start + n] = torch.as_tensor(x["token_type_ids"])
                out["position_ids"][start:start + n] = torch.arange(n)
                out["mlm_positions"][labelled:labelled + len(chosen)] = start + chosen
                out["mlm_labels"][labelled:labelled + len(chosen)] = labels[chosen]
                out["next_sentence_label"][s] = x["next_sentence_label"]
                start, labelled, s = start + n, labelled + len(chosen), s + 1
                out["cu_seqlens"][s:] = start
            if start < (r + 1) * L:  # the row's filler tail: a sequence of its own, so the next row starts aligned
                s += 1
                out["cu_seqlens"][s:] = (r + 1) * L
        return out


def one_per_row(masker: MLMCollator, instances: list[dict], keys, stream: str = "masking",
                multiple: int = 8) -> PackedBatch:
    """A padded batch in the packed layout: instance i alone in row i, the rows as long as the longest instance
    rounded up to `multiple`. Masked as packed batches are (same keys, same masks); no label is ever capped,
    since exact masking chooses at most p x length + 1/2 tokens of an instance."""
    if not instances:
        raise ValueError("one_per_row: no instances")
    longest = max(len(x["input_ids"]) for x in instances)
    shapes = PackedShapes.for_rows(len(instances), -(-longest // multiple) * multiple, 1, masker.p)
    return PackingCollator(masker, shapes)([[x] for x in instances], keys, stream)

"""Packing pre-training instances into micro-batches of a fixed token budget (the data side of static shapes).

Instead of padding every instance to the longest of its batch, instances are packed, as Krell et al. (2021) do
for BERT, into rows of max_seqlen tokens (L) holding up to a few instances each, and a micro-batch is a fixed
number of rows: T = rows x L tokens. Every packed batch then has the same shapes, whatever the lengths, and
almost no token is padding. Packing (`pack`) is shortest-pack-first histogram packing, as Krell et al. do: best
fit decreasing computed on the histogram of lengths rather than instance by instance, so an epoch packs in one
pass linear in its instances (millions a second) and ~99% full at 128 tokens on WikiText-2. A micro-batch is
collated in a few array operations over all its instances (`PackingCollator.collate`), straight from the
spans of the tokenised corpus (bert.data.pipeline).

Rows matter for one reason: no sequence crosses a row boundary, so attention without a variable-length kernel
(the PyTorch path) runs as [rows, L, L] with a block-diagonal mask, at the cost of a padded batch of `rows`
sequences, not of one padded slot per sequence. The Triton kernel reads cu_seqlens and never sees rows.

A packed micro-batch (bert.data.batch.PackedBatch, whose docstring gives its layout) has
S = rows x (instances per row + 1). Masking chooses exactly round(p * candidates) tokens of each instance (at
least one), as the original BERT code does, 80/10/10 as usual, keyed per instance (bert.data.masking). That is
about p * (real tokens) per micro-batch; R = ceil(p * T) + rows leaves room for the rounding, and in the rare
pack that still chooses more, the last instances' extra choices are undone (their tokens restored, unlabelled),
as BERT's max_predictions_per_seq cap does. From p = 0.25 on (MosaicBERT's 30%, 40%) that never happens with up to
four instances a row: an instance of n tokens has at least two specials, so it chooses max(1, round(p (n - 2)))
<= p n + max(1/2 - 2p, 1 - 3p) <= p n + 1/4 tokens, at most one more than p T in a row of four.

Pre-training without packing (`--no-packing`) uses the same type: `one_per_row` lays a length-bucketed batch out
as one instance per row, rows as long as its longest instance (rounded up to 8), so the job, the trainer and
evaluation read one kind of batch; only its shapes then change from batch to batch.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from typing import NamedTuple

import numpy as np
import torch

from bertfuse.bert.data.batch import PackedBatch
from bertfuse.bert.data.instances import NO_NSP, token_index
from bertfuse.bert.data.masking import Masker


def pack(lengths, budget: int, max_seqs: int) -> np.ndarray:
    """Instances (their `lengths`) packed into rows of at most `budget` tokens and `max_seqs` instances:
    int64 [rows, max_seqs], each row's instance indices then -1. Every index appears exactly once.

    Shortest-pack-first histogram packing (Krell et al. 2021): lengths are processed longest first as counts,
    not items. Each count goes, as many at once as fit, into the group of identical open rows with the least
    room that still takes it (best fit), or opens new rows. The work grows with budget x distinct row layouts,
    not with the instances, so a whole epoch packs in one pass; instances of one length fill their places in the
    order given (shuffle it first for rows that differ from epoch to epoch)."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    for name, value in (("budget", budget), ("max_seqs", max_seqs)):
        if int(value) < 1:
            raise ValueError(f"pack: {name} must be at least 1, got {value}")
    for bad, message in ((lengths < 0, "a negative length"), (lengths > budget, f"more than the budget {budget}")):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"pack: instance {i} has {message} ({lengths[i]} tokens)")
    groups = _pack_counts(np.bincount(lengths, minlength=budget + 1), budget, max_seqs)
    queue = np.argsort(lengths, kind="stable")  # per length, in the order given
    taken = np.searchsorted(lengths[queue], np.arange(budget + 1))  # the next unused instance of each length
    rows = np.full((sum(c for _, c in groups), max_seqs), -1, dtype=np.int64)
    r = 0
    for layout, count in groups:
        for j, n in enumerate(layout):
            rows[r:r + count, j] = queue[taken[n]:taken[n] + count]
            taken[n] += count
        r += count
    return rows


def _pack_counts(counts: np.ndarray, budget: int, max_seqs: int) -> list[tuple[tuple[int, ...], int]]:
    """(row layout: the lengths it holds, how many such rows) for `counts` instances of each length."""
    open_rows: list[list] = [[] for _ in range(budget + 1)]  # by room left: [layout, count] that can take more
    rooms: list[int] = []  # the rooms with open rows, sorted: the best fit is a bisection away
    done: list[tuple[tuple[int, ...], int]] = []

    def put(layout, count, room):
        if room == 0 or len(layout) == max_seqs:
            done.append((layout, count))
            return
        if not open_rows[room]:
            insort(rooms, room)
        open_rows[room].append((layout, count))

    for n in range(budget, -1, -1):
        left = int(counts[n])
        while left:
            at = bisect_left(rooms, n)
            if at == len(rooms):  # nothing takes it: new rows, each holding as many as fit (as one by one does)
                per = min(max_seqs, budget // n) if n else max_seqs
                if left >= per:
                    put((n,) * per, left // per, budget - per * n)
                if left % per:
                    put((n,) * (left % per), 1, budget - (left % per) * n)
                break
            room = rooms[at]
            layout, count = open_rows[room].pop()
            if not open_rows[room]:
                rooms.pop(at)
            k = min(count, left)
            if count > k:
                put(layout, count - k, room)
            put(layout + (n,), k, room - n)
            left -= k
    return done + [g for room in open_rows for g in room]


def epoch_rows(lengths, row_len: int, per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Rows (`pack`) of instances in a shuffled order, the rows shuffled again so that long and short ones mix:
    what a shard of an epoch trains on, deterministic in `rng`."""
    order = rng.permutation(len(lengths))
    rows = pack(np.asarray(lengths)[order], row_len, per_row)
    rows = np.where(rows >= 0, order[np.maximum(rows, 0)], -1)
    return rows[rng.permutation(len(rows))]


def efficiency(lengths, rows: np.ndarray, budget: int) -> float:
    """Real tokens over the tokens the rows' budgets hold."""
    lengths = np.asarray(lengths)
    return float(lengths[rows[rows >= 0]].sum()) / max(len(rows) * budget, 1)


class PackedShapes(NamedTuple):
    """The fixed shape of a packed micro-batch, built once from the command line (--max-seq-len is L). L is
    `max_seqlen` from here to the kernels: the batch, the model's packed forward and varlen attention take it by
    that name, as a bound on every sequence's length."""
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


class FlatInstances(NamedTuple):
    """Instances laid end to end, as a micro-batch is collated from: the spans of the tokenised corpus
    (bert.data.instances.gather)."""
    ids: np.ndarray          # int64 [tokens]
    types: np.ndarray        # int64 [tokens]
    lengths: np.ndarray      # int64 [instances]
    nsp: np.ndarray          # int64 [instances]: 0 / 1, or NO_NSP (MLM-only instances)



class PackingCollator:
    """Rows of instances -> a packed micro-batch of fixed shapes (see the module docstring), every step over the
    whole micro-batch at once."""

    def __init__(self, masker: Masker, shapes: PackedShapes, nsp: bool = True):
        """nsp False: MLM-only batches (instances labelled NO_NSP; next_sentence_label None)."""
        if not getattr(masker, "exact", True):
            raise ValueError("packed batches need exact-count masking (Masker(exact=True)): their labelled "
                             "tokens must stay within a fixed bound")
        self.masker, self.shapes, self.nsp = masker, shapes, nsp

    def _check(self, per_row: np.ndarray, row_tokens: np.ndarray) -> None:
        L, n = self.shapes.max_seqlen, self.shapes.per_row
        if len(per_row) > self.shapes.rows:
            raise ValueError(f"{len(per_row)} rows do not fit a micro-batch of {self.shapes.rows}")
        bad = np.flatnonzero((per_row > n) | (row_tokens > L))
        if len(bad):
            r = int(bad[0])
            raise ValueError(f"a row of {per_row[r]} instances, {row_tokens[r]} tokens, does not fit {n} instances "
                             f"of {L} tokens")

    def collate(self, flat: FlatInstances, per_row: np.ndarray, keys: np.ndarray,
                stream: str = "masking") -> PackedBatch:
        """The micro-batch of instances `flat`, per_row[r] of them in row r, masked by `keys` (key_array)."""
        T, S, R, L, _ = self.shapes
        row = np.repeat(np.arange(len(per_row)), per_row)
        row_tokens = np.bincount(row, weights=flat.lengths, minlength=len(per_row)).astype(np.int64)
        self._check(per_row, row_tokens)
        inst, position = token_index(flat.lengths)
        _check_values(flat, self.masker.special.vocab_size, inst, row, per_row, self.nsp)
        ends = np.cumsum(flat.lengths)
        start = row * L + (ends - flat.lengths) - (np.cumsum(row_tokens) - row_tokens)[row]  # in the batch
        at = start[inst] + position
        masked, labels = self.masker.mask_flat(flat.ids, flat.lengths, keys, stream)
        chosen = np.flatnonzero(labels != -100)
        masked[chosen[R:]] = flat.ids[chosen[R:]]  # past R: undone (rare; see the module docstring)
        chosen = chosen[:R]
        out = _empty(self.shapes, self.masker.special.pad, self.nsp)
        for name, values in (("input_ids", masked), ("token_type_ids", flat.types), ("position_ids", position)):
            out[name][at] = torch.from_numpy(values)
        out.mlm_positions[:len(chosen)] = torch.from_numpy(at[chosen])
        out.mlm_labels[:len(chosen)] = torch.from_numpy(labels[chosen])
        _sequences(out, start + flat.lengths, flat.nsp, row_tokens, L)
        return out


def _check_values(flat: FlatInstances, vocab: int, inst: np.ndarray, row: np.ndarray, per_row: np.ndarray,
                  nsp: bool) -> None:
    """The instances' values, over the whole batch at once: at least one token, ids in [0, vocab), types 0/1,
    next-sentence labels 0/1 (NO_NSP in an MLM-only batch). inst: each token's instance."""
    bad_ids = np.bincount(inst[(flat.ids < 0) | (flat.ids >= vocab)], minlength=len(flat.lengths)) > 0
    bad_types = np.bincount(inst[(flat.types < 0) | (flat.types > 1)], minlength=len(flat.lengths)) > 0
    bad_nsp = ((flat.nsp != 0) & (flat.nsp != 1), "has a next_sentence_label that is not 0 or 1") if nsp else \
        (flat.nsp != NO_NSP, "is a next-sentence pair in an MLM-only batch")
    for bad, message in ((flat.lengths == 0, "has no tokens"), (bad_ids, f"has ids outside [0, {vocab})"),
                         (bad_types, "has token_type_ids that are not 0/1 for each token"), bad_nsp):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            first = int(per_row[:row[i]].sum())
            raise ValueError(f"instance {i - first} of row {row[i]} {message}")


def _empty(shapes: PackedShapes, pad: int, nsp: bool) -> PackedBatch:
    T, S, R, L, _ = shapes
    return PackedBatch(input_ids=torch.full((T,), pad, dtype=torch.long),
                       token_type_ids=torch.zeros(T, dtype=torch.long), position_ids=torch.zeros(T, dtype=torch.long),
                       cu_seqlens=torch.zeros(S + 1, dtype=torch.int32),
                       mlm_positions=torch.zeros(R, dtype=torch.long), mlm_labels=torch.full((R,), -100),
                       next_sentence_label=torch.full((S,), -100, dtype=torch.long) if nsp else None, max_seqlen=L,
                       row_aligned=True, instance=torch.zeros(S, dtype=torch.bool))


def _sequences(out: PackedBatch, ends: np.ndarray, nsp: np.ndarray, row_tokens: np.ndarray, L: int) -> None:
    """cu_seqlens, which sequences are instances, and the NSP labels: each instance a sequence, then each used
    row's filler tail (a sequence of its own, so the next row starts aligned); the unused slots empty sequences at
    the end."""
    rows = np.arange(len(row_tokens))
    filler = rows[row_tokens < L]
    all_ends = np.concatenate([ends, (filler + 1) * L])
    labels = np.concatenate([nsp, np.full(len(filler), -100)])
    order = np.argsort(all_ends, kind="stable")
    n = len(all_ends)
    out.cu_seqlens[1:n + 1] = torch.from_numpy(all_ends[order].astype(np.int32))
    out.cu_seqlens[n + 1:] = int(all_ends.max()) if n else 0
    out.instance[:n] = torch.from_numpy(order < len(ends))
    if out.next_sentence_label is not None:
        out.next_sentence_label[:n] = torch.from_numpy(labels[order])


def one_per_row(masker: Masker, flat: FlatInstances, keys: np.ndarray, stream: str = "masking",
                multiple: int = 8, nsp: bool = True) -> PackedBatch:
    """Instances laid end to end as a padded batch: one a row, rows as long as the longest (rounded up to
    `multiple`)."""
    longest = int(flat.lengths.max())
    shapes = PackedShapes.for_rows(len(flat.lengths), -(-longest // multiple) * multiple, 1, masker.p)
    return PackingCollator(masker, shapes, nsp).collate(flat, np.ones(len(flat.lengths), dtype=np.int64), keys,
                                                        stream)


def bucket_rows(lengths: np.ndarray, batch: int, rng: np.random.Generator, pool: int = 50) -> np.ndarray:
    """Instances in batches of similar length, as int64 [batches x batch, 1] (one instance a row): shuffled, cut
    into pools of `pool` batches, each pool sorted by length and cut into batches (an incomplete one dropped),
    the batches shuffled."""
    order = rng.permutation(len(lengths))
    span = batch * pool
    batches = []
    for start in range(0, len(order), span):
        chunk = order[start:start + span]
        chunk = chunk[np.argsort(np.asarray(lengths)[chunk], kind="stable")]
        batches += [chunk[i:i + batch] for i in range(0, len(chunk) - batch + 1, batch)]
    if not batches:
        return np.zeros((0, 1), dtype=np.int64)
    return np.concatenate([batches[i] for i in rng.permutation(len(batches))]).reshape(-1, 1).astype(np.int64)

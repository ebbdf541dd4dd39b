"""Packing pre-training instances into micro-batches of a fixed token budget (the data side of static shapes).

Instead of padding every instance to the longest of its batch, instances are packed end to end into a budget of
T tokens with at most S sequences, as Krell et al. (2021) do for BERT: every packed batch then has the same
shapes, whatever the lengths, and almost no token is padding. Packing is best-fit decreasing over a window of
instances (in the sampler's shuffled order, so packs differ from epoch to epoch): the window is sorted longest
first and each instance goes into the open pack with the least room left that still fits it.

A packed micro-batch (`PackingCollator`) holds, every shape fixed by (T, S, R):
    input_ids, token_type_ids, position_ids   [T]     the instances one after another; filler after them
    cu_seqlens                                [S + 1] int32, sequence starts; unused slots are empty sequences
    mlm_positions, mlm_labels                 [R]     the labelled tokens (indices into [T]); -100 in unused slots
    next_sentence_label                       [S]     -100 in unused slots
    max_seqlen                                int     the longest instance the run allows (not a tensor)
Masking chooses exactly round(p * candidates) tokens of each instance (at least one), as the original BERT
code does (it caps at max_predictions_per_seq), so R = ceil(p * T) + S always holds them; 80/10/10 as usual,
keyed per instance like MLMCollator.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from .data import MLMCollator


def pack(lengths, budget: int, max_seqs: int, window: int = 1024) -> list[list[int]]:
    """Indices of `lengths` grouped into packs of at most `budget` tokens and `max_seqs` sequences: best-fit
    decreasing within consecutive windows of `window` instances. Every index appears exactly once."""
    lengths = [int(n) for n in lengths]
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


def epoch_packs(lengths, budget: int, max_seqs: int, seed: int, epoch: int, window: int = 1024) -> list[list[int]]:
    """An epoch's packs of instance indices: the instances in a shuffled order (deterministic in seed and
    epoch), packed window by window (`pack`), the packs shuffled again so that long and short ones mix."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    packs = pack(np.asarray(lengths)[order], budget, max_seqs, window)
    return [[int(order[i]) for i in packs[j]] for j in rng.permutation(len(packs))]


def efficiency(lengths, packs: list[list[int]], budget: int) -> float:
    """Real tokens over the tokens the packs' budgets hold."""
    return sum(int(lengths[i]) for p in packs for i in p) / max(len(packs) * budget, 1)


class PackedShapes(NamedTuple):
    tokens: int          # T, the token budget of a micro-batch
    sequences: int       # S, the most sequences a micro-batch holds
    labels: int          # R, the most labelled tokens it holds
    max_seqlen: int      # the longest instance (the run's --max-seq-len): sizes the attention kernels' grids

    @classmethod
    def for_budget(cls, tokens: int, sequences: int, mlm_probability: float,
                   max_seqlen: int | None = None) -> "PackedShapes":
        return cls(tokens, sequences, math.ceil(mlm_probability * tokens) + sequences,
                   min(tokens, max_seqlen or tokens))


class PackingCollator:
    """Instances of one pack -> a packed micro-batch of fixed shapes (see the module docstring)."""

    def __init__(self, masker: MLMCollator, shapes: PackedShapes):
        self.masker, self.shapes = masker, shapes

    def __call__(self, instances: list[dict], keys) -> dict:
        T, S, R, longest = self.shapes
        if len(instances) > S or sum(len(x["input_ids"]) for x in instances) > T:
            raise ValueError(f"a pack of {len(instances)} instances does not fit {S} sequences of {T} tokens")
        if any(len(x["input_ids"]) > longest for x in instances):
            raise ValueError(f"an instance is longer than max_seqlen={longest}")
        out = {"input_ids": torch.full((T,), self.masker.special.pad, dtype=torch.long),
               "token_type_ids": torch.zeros(T, dtype=torch.long), "position_ids": torch.zeros(T, dtype=torch.long),
               "cu_seqlens": torch.zeros(S + 1, dtype=torch.int32),
               "mlm_positions": torch.zeros(R, dtype=torch.long), "mlm_labels": torch.full((R,), -100),
               "next_sentence_label": torch.full((S,), -100, dtype=torch.long)}
        start, labelled = 0, 0
        for s, (x, key) in enumerate(zip(instances, keys)):
            n = len(x["input_ids"])
            masked, labels = self.masker.mask_exact(torch.as_tensor(x["input_ids"], dtype=torch.long), key)
            out["input_ids"][start:start + n] = masked
            out["token_type_ids"][start:start + n] = torch.as_tensor(x["token_type_ids"])
            out["position_ids"][start:start + n] = torch.arange(n)
            chosen = (labels != -100).nonzero().squeeze(1)
            out["mlm_positions"][labelled:labelled + len(chosen)] = start + chosen
            out["mlm_labels"][labelled:labelled + len(chosen)] = labels[chosen]
            out["next_sentence_label"][s] = x["next_sentence_label"]
            start, labelled = start + n, labelled + len(chosen)
            out["cu_seqlens"][s + 1:] = start  # later slots: empty sequences ending here
        out["max_seqlen"] = longest  # a Python int, the same for every batch of the run
        return out

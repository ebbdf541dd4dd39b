"""MLM masking: the special ids of a vocabulary, and the masking of a whole micro-batch in a few array operations.

Masking happens at collation, fresh each time an instance is drawn: 15% of real, non-special tokens are chosen
(exactly, or each independently); 80% of those become [MASK], 10% a random non-special token, 10% stay.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from bertfuse.bert.common import seeds
from bertfuse.bert.data.instances import token_index


@dataclass
class SpecialIds:
    cls: int
    sep: int
    mask: int
    pad: int
    vocab_size: int
    special: tuple[int, ...]   # ids never chosen for masking and never used as random replacements

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "SpecialIds":
        ids = {t: tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]")}
        missing = [t for t, i in ids.items() if i is None and t != "[UNK]"]
        if missing:
            raise ValueError(f"the tokenizer's vocabulary lacks {missing}, which BERT pre-training needs")
        special = tuple(sorted({i for i in ids.values() if i is not None}))
        return cls(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids["[PAD]"], tokenizer.get_vocab_size(), special)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64: a bijection whose outputs look independent and uniform."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _uniform(h: np.ndarray) -> np.ndarray:
    """uint64 hashes -> floats in [0, 1) (their top 53 bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def key_array(keys, n: int) -> np.ndarray:
    """Masking keys (ints, or tuples of ints of one length) as a uint64 array [n, key length]."""
    array = np.asarray(list(keys) if not isinstance(keys, np.ndarray) else keys, dtype=np.int64)
    array = array.reshape(len(array), -1) if array.size else np.zeros((0, 1), np.int64)
    if len(array) != n:
        raise ValueError(f"{n} instances but {len(array)} masking keys")
    if (array < 0).any():
        raise ValueError("masking keys must be non-negative integers")
    return array.astype(np.uint64)


class Masker:
    """Masks pre-training instances for MLM, a whole micro-batch at once (`mask_flat`).

    Each instance is masked by random numbers of its own: a hash of the run's seed, a named stream
    (bert.common.seeds), the instance's key and the token's position. Training keys an instance by (epoch, shard,
    its index in the shard) (bert.data.pipeline), evaluation by its index in the held-out set. So an instance is
    masked the same way however the batch is split over ranks, packed or padded, and whether or not training resumed
    in between, yet differently each epoch; and a whole micro-batch is masked in a few array operations
    (`mask_flat`), whatever its instances.
    """

    def __init__(self, special: SpecialIds, mlm_probability=0.15, mask_prob=0.8, random_prob=0.1,
                 whole_word: bool = False, continuation_ids: Iterable[int] = (),
                 seed: int = 0, exact: bool = True):
        if not 0 < mlm_probability < 1 or mask_prob < 0 or random_prob < 0 or mask_prob + random_prob > 1:
            raise ValueError("need 0 < mlm_probability < 1 and mask_prob + random_prob <= 1")
        self.special, self.p, self.mask_prob, self.random_prob = special, mlm_probability, mask_prob, random_prob
        self.whole_word, self.seed, self.exact = whole_word, seed, exact
        self.is_continuation = np.zeros(special.vocab_size, dtype=bool)
        self.is_continuation[list(continuation_ids)] = True
        self.is_special = np.zeros(special.vocab_size, dtype=bool)
        self.is_special[list(special.special)] = True
        self.replacement_ids = np.flatnonzero(~self.is_special)
        self.special_ids = torch.as_tensor(special.special)

    def _groups(self, ids: np.ndarray, candidates: np.ndarray, first: np.ndarray | None = None) -> np.ndarray:
        """Per token, the unit it is chosen with (1, 2, ... over the batch; 0 for specials): with whole words, a
        word (a piece and the ## pieces after it; a ## piece after a special token or at an instance's start
        (`first`) starts a unit of its own), else each token."""
        ids, candidates = np.asarray(ids), np.asarray(candidates)
        starts = candidates
        if self.whole_word:
            after_candidate = np.concatenate([[False], candidates[:-1]])
            if first is not None:
                after_candidate &= ~first
            starts = candidates & (~self.is_continuation[ids] | ~after_candidate)
        return np.where(candidates, np.cumsum(starts), 0)

    def mask_flat(self, ids: np.ndarray, lengths: np.ndarray, keys: np.ndarray, stream: str = "masking"):
        """(masked ids, labels; -100 where not chosen) of instances laid end to end in `ids` (int64), each
        `lengths` long and masked by its row of `keys` (key_array). exact (the default, as the original BERT
        code and packed batches need: their labelled tokens stay within a fixed bound): units in random order,
        each taken if it still fits max(1, round(p x candidate tokens)) tokens. Otherwise each unit independently
        with probability p. Then 80% of the chosen tokens become [MASK], 10% a random token, 10% stay."""
        inst, position = token_index(lengths)
        h = np.full(len(lengths), seeds.integer(self.seed, stream), dtype=np.uint64)
        for column in keys.T:
            h = _mix(h ^ _mix(column))
        token_hash = h[inst] ^ _mix(position.astype(np.uint64) * np.uint64(4))
        draws = [_mix(token_hash + np.uint64(c)) for c in range(3)]  # unit order, 80/10/10, replacement id
        candidates = ~self.is_special[ids]
        group = self._groups(ids, candidates, first=position == 0)
        chosen = self._choose(group, candidates, inst, len(lengths), _uniform(draws[0]))
        return self._replace(ids, chosen, _uniform(draws[1]), draws[2])

    def _choose(self, group, candidates, inst, n_instances, u) -> np.ndarray:
        """Which tokens are chosen: whole units (`group`), by the random number of each unit's first token."""
        units = int(group.max()) if len(group) else 0
        first_token = np.zeros(units + 1, dtype=np.int64)
        first_token[group[::-1]] = np.arange(len(group))[::-1]  # the lowest index of each unit wins
        unit_u, unit_inst = u[first_token[1:]], inst[first_token[1:]]
        if not self.exact:
            picked = unit_u < self.p
        else:
            sizes = np.bincount(group, minlength=units + 1)[1:]
            n_candidates = np.bincount(inst[candidates], minlength=n_instances)
            budget = np.where(n_candidates > 0, np.maximum(1, np.round(self.p * n_candidates)), 0).astype(np.int64)
            picked = _greedy_fill(unit_inst, unit_u, sizes, budget)
        return np.concatenate([[False], picked])[group] & candidates

    def _replace(self, ids, chosen, roll, replacement_hash):
        """80% of the chosen tokens become [MASK], 10% a random non-special token, 10% stay; labels -100 elsewhere."""
        replacement = self.replacement_ids[(replacement_hash % np.uint64(len(self.replacement_ids))).astype(np.int64)]
        out = np.where(chosen & (roll < self.mask_prob), self.special.mask, ids)
        to_random = chosen & (roll >= self.mask_prob) & (roll < self.mask_prob + self.random_prob)
        return np.where(to_random, replacement, out), np.where(chosen, ids, -100)


def _greedy_fill(unit_inst, unit_u, sizes, budget) -> np.ndarray:
    """Per instance, its units in increasing `unit_u`, each taken if it still fits the instance's budget: the
    sequential greedy in rounds over the whole batch. A round takes, per instance, the longest run of its open
    units that fits, and closes every unit larger than what is left (it never fits later), so each round
    decides at least one unit of every instance with open units, and in practice three rounds or four do."""
    order = np.lexsort((unit_u, unit_inst))
    inst, size = unit_inst[order], sizes[order]
    left = budget.copy()
    open_, taken = np.ones(len(order), dtype=bool), np.zeros(len(order), dtype=bool)
    first = np.searchsorted(inst, inst)  # each unit's instance's first sorted unit
    while True:
        open_ &= size <= left[inst]
        if not open_.any():
            break
        running = np.cumsum(np.where(open_, size, 0))
        before = running[first] - np.where(open_[first], size[first], 0)  # the sum before the instance's units
        fits = open_ & (running - before <= left[inst])
        taken |= fits
        open_ &= ~fits
        left -= np.bincount(inst[fits], weights=size[fits], minlength=len(left)).astype(np.int64)
    picked = np.zeros(len(order), dtype=bool)
    picked[order] = taken
    return picked

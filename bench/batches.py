"""Synthetic pre-training batches: random ids with realistic lengths, 15% of real tokens labelled for MLM."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .lengths import sample_lengths


@dataclass
class Batch:
    input_ids: torch.Tensor        # [B, S]
    attention_mask: torch.Tensor   # [B, S]
    token_type_ids: torch.Tensor   # [B, S]
    labels: torch.Tensor           # [B, S], -100 where not chosen
    next_sentence_label: torch.Tensor

    @property
    def labelled(self) -> int:
        return int((self.labels != -100).sum())

    @property
    def lengths(self) -> list[int]:
        return self.attention_mask.sum(1).tolist()

    @property
    def slots(self) -> int:
        return self.attention_mask.numel()

    def to(self, device) -> "Batch":
        return Batch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def kwargs(self, family: str = "bert") -> dict:
        """The model's keyword arguments. RoBERTa: MLM only, one segment, padding id 1 (its positions count
        only non-padding ids)."""
        if family == "roberta":
            return {"input_ids": self.input_ids.masked_fill(self.attention_mask == 0, 1),
                    "attention_mask": self.attention_mask, "labels": self.labels}
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def make_batch(batch: int, seq_len: int, vocab: int, padding, seed: int, mlm_p: float = 0.15) -> Batch:
    rng = np.random.default_rng(seed)
    lengths = torch.from_numpy(sample_lengths(batch, seq_len, padding, rng))
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq_len)[None]
    mask = (pos < lengths[:, None]).long()
    ids = torch.randint(min(1000, vocab // 2), vocab, (batch, seq_len), generator=g) * mask  # no special ids
    ids[:, 0] = 101
    ids[torch.arange(batch), lengths - 1] = 102
    token_type = ((pos >= (lengths[:, None] // 2)) & mask.bool()).long()
    chosen = (torch.rand(batch, seq_len, generator=g) < mlm_p) & mask.bool()
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return Batch(ids, mask, token_type, labels, nsp)


@dataclass
class PackedBatch:
    """A packed micro-batch of a fixed token budget (bert.packing's layout), filled from a pool of synthetic
    sequences; fields as BertForPreTraining's packed call takes them."""
    input_ids: torch.Tensor            # [T]
    token_type_ids: torch.Tensor       # [T]
    position_ids: torch.Tensor         # [T]
    cu_seqlens: torch.Tensor           # [S + 1] int32
    mlm_positions: torch.Tensor        # [R]
    mlm_labels: torch.Tensor           # [R], -100 in unused slots
    next_sentence_label: torch.Tensor  # [S], -100 in unused slots
    max_seqlen: int

    @property
    def labelled(self) -> int:
        return int((self.mlm_labels != -100).sum())

    @property
    def lengths(self) -> list[int]:
        cu = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(cu, cu[1:]) if b > a]

    @property
    def slots(self) -> int:
        return self.input_ids.numel()

    def to(self, device) -> "PackedBatch":
        return PackedBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__ if f != "max_seqlen"),
                           self.max_seqlen)

    def kwargs(self, family: str = "bert") -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def make_packed_batch(batch: int, seq_len: int, vocab: int, padding, seed: int, mlm_p: float = 0.15) -> PackedBatch:
    """The budget of a padded [batch, seq_len] batch (T = batch x seq_len tokens, at most S = 2 x batch
    sequences, R = ceil(0.15 T) + S labels), filled in order with sequences of make_batch's lengths and
    contents until the next one does not fit."""
    from bert.packing import PackedShapes

    T, S, R, _ = PackedShapes.for_budget(batch * seq_len, 2 * batch, mlm_p)
    pool = make_batch(2 * batch, seq_len, vocab, padding, seed, mlm_p)
    rows, used = [], 0
    for i, n in enumerate(pool.attention_mask.sum(1).tolist()):
        if used + n > T:
            break
        rows.append((i, n))
        used += n
    out = PackedBatch(torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long),
                      torch.zeros(T, dtype=torch.long), torch.full((S + 1,), used, dtype=torch.int32),
                      torch.zeros(R, dtype=torch.long), torch.full((R,), -100), torch.full((S,), -100), seq_len)
    start = labelled = 0
    for s, (i, n) in enumerate(rows):
        out.cu_seqlens[s] = start
        out.input_ids[start:start + n] = pool.input_ids[i, :n]
        out.token_type_ids[start:start + n] = pool.token_type_ids[i, :n]
        out.position_ids[start:start + n] = torch.arange(n)
        chosen = (pool.labels[i, :n] != -100).nonzero().squeeze(1)[:R - labelled]
        out.mlm_positions[labelled:labelled + len(chosen)] = start + chosen
        out.mlm_labels[labelled:labelled + len(chosen)] = pool.labels[i, chosen]
        out.next_sentence_label[s] = pool.next_sentence_label[i]
        start, labelled = start + n, labelled + len(chosen)
    return out

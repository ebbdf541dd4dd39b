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

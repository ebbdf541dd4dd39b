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
    next_sentence_label: torch.Tensor | None  # None in masked-LM-only batches (mlm_only)

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
        return Batch(*(None if getattr(self, f) is None else getattr(self, f).to(device)
                       for f in self.__dataclass_fields__))

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


def mlm_only(batch: Batch) -> Batch:
    """The batch as masked-LM-only pre-training sees it: one segment, no next-sentence label, no label on the
    first token ([CLS], which DataCollatorWithFlattening's separator takes), so that the padded, the flattened and
    our rows of the MLM-only comparison score the same tokens."""
    return Batch(batch.input_ids, batch.attention_mask, torch.zeros_like(batch.token_type_ids),
                 batch.labels.clone().index_fill_(1, torch.tensor([0]), -100), None)


@dataclass
class FlatBatch:
    """A padded batch's sequences as transformers trains padding-free: DataCollatorWithFlattening's one row of
    all of them, position ids restarting at each (and, for flash attention, its cu_seqlens keyword arguments)."""
    features: dict     # the collator's output: input_ids, labels, position_ids [1, T] (+ flash attention's)
    lengths: list[int]

    @property
    def labelled(self) -> int:
        return int((self.features["labels"] != -100).sum())

    @property
    def slots(self) -> int:
        return sum(self.lengths)

    def to(self, device) -> "FlatBatch":
        return FlatBatch({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.features.items()},
                         self.lengths)


def make_flat_batch(batch: Batch, flash_kwargs: bool = False) -> FlatBatch:
    """mlm_only(batch)'s sequences through transformers' DataCollatorWithFlattening (with return_flash_attn_kwargs
    where the model runs flash attention, as transformers' padding-free recipe does)."""
    from transformers import DataCollatorWithFlattening

    b = mlm_only(batch)
    features = [{"input_ids": ids[:n].tolist(), "labels": labels[:n].tolist()}
                for ids, labels, n in zip(b.input_ids, b.labels, b.lengths) if n]
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_tensors="pt")
    return FlatBatch(collate(features), [n for n in b.lengths if n])


def model_kwargs(batch, family: str = "bert", mlm: bool = False) -> dict:
    """The model's keyword arguments for a padded synthetic Batch, a packed bert.data.batch.PackedBatch or a
    FlatBatch; `mlm`: for a masked-LM-only model (no next-sentence labels)."""
    if isinstance(batch, FlatBatch):
        return dict(batch.features)
    kwargs = batch.kwargs(family) if isinstance(batch, Batch) else dict(batch)
    return {k: v for k, v in kwargs.items() if not (mlm and k == "next_sentence_label")}


class _PoolLabels:
    """Stands in for the MLM masker of bert.data.packing.PackingCollator: instance `key` of a synthetic pool keeps
    the labels make_batch drew for it."""

    def __init__(self, pool: Batch, vocab: int):
        self.pool = pool
        self.special = type("Special", (), {"pad": 0, "vocab_size": vocab})  # what PackingCollator reads

    def mask_flat(self, ids: np.ndarray, lengths: np.ndarray, keys: np.ndarray, stream: str = "masking"):
        labels = [self.pool.labels[int(k), :int(n)].numpy() for k, n in zip(keys[:, 0], lengths)]
        return ids.copy(), np.concatenate(labels) if labels else np.zeros(0, np.int64)


def make_packed_batch(batch: int, seq_len: int, vocab: int, padding, seed: int, mlm_p: float = 0.15):
    """The budget of a padded [batch, seq_len] batch as `batch` rows of seq_len tokens (bert.data.batch's layout,
    up to 3 instances a row), filled with sequences of make_batch's lengths and contents: a pool of 16 x batch
    sequences is packed into rows best-fit decreasing, and `batch` rows drawn at random from them are laid out
    by bert.data.packing.PackingCollator."""
    from bertfuse.bert.data.packing import FlatInstances, PackedShapes, PackingCollator, pack

    pool = make_batch(16 * batch, seq_len, vocab, padding, seed, mlm_p)
    lengths = pool.attention_mask.sum(1).tolist()
    rows = pack(lengths, seq_len, 3)
    rows = [rows[i][rows[i] >= 0] for i in np.random.default_rng(seed).permutation(len(rows))[:batch]]
    index = np.concatenate(rows)  # the pool's instances, row after row
    flat = FlatInstances(*(np.concatenate([t[i, :lengths[i]].numpy() for i in index]).astype(np.int64)
                           for t in (pool.input_ids, pool.token_type_ids)),
                         np.asarray(lengths, dtype=np.int64)[index], pool.next_sentence_label[index].numpy())
    collate = PackingCollator(_PoolLabels(pool, vocab), PackedShapes.for_rows(batch, seq_len, 3, mlm_p))
    return collate.collate(flat, np.array([len(r) for r in rows]), index[:, None].astype(np.uint64))

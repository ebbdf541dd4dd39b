"""Pre-training instances as Python dicts, for tests: building them from a corpus, checking them, and masking,
padding or packing lists of them. The library itself collates straight from the tokenised corpus's arrays
(bert.data.pipeline); these are the same operations on small hand-made inputs."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from bertfuse.bert.data.batch import PackedBatch, pad_batch
from bertfuse.bert.data.corpus import TokenisedCorpus
from bertfuse.bert.data.instances import SPAN, gather, iter_spans, span_lengths
from bertfuse.bert.data.masking import Masker, key_array
from bertfuse.bert.data.packing import FlatInstances, PackingCollator
from bertfuse.bert.data.packing import one_per_row as one_per_row_flat


def materialize(corpus: TokenisedCorpus, spans: np.ndarray, cls: int, sep: int) -> list[dict]:
    """Instances as dicts (input_ids, token_type_ids, next_sentence_label) from their spans."""
    ids, types = gather(corpus, spans, cls, sep)
    ends = np.cumsum(span_lengths(spans)).tolist()
    return [{"input_ids": ids[a:b].tolist(), "token_type_ids": types[a:b].tolist(), "next_sentence_label": int(x)}
            for a, b, x in zip([0] + ends[:-1], ends, spans["label"].tolist())]


def iter_instances(documents, max_seqlen: int, special, seed: int) -> Iterator[dict]:
    """NSP instances of `documents` (a TokenisedCorpus, or documents of sentences of ids) as dicts, in order."""
    corpus = documents if isinstance(documents, TokenisedCorpus) else TokenisedCorpus.from_documents(documents)
    for span in iter_spans(corpus, np.arange(len(corpus)), max_seqlen, seed):
        yield from materialize(corpus, np.array([span], dtype=SPAN), special.cls, special.sep)


def check_instance(x: dict, vocab_size: int, where: str) -> torch.Tensor:
    """An instance's input_ids as a tensor, after checking it as the packer checks a micro-batch's: at least one
    token, ids in [0, vocab_size), token_type_ids of the same length in {0, 1}, a next_sentence_label of 0 or 1."""
    ids = torch.as_tensor(x["input_ids"], dtype=torch.long)
    types = torch.as_tensor(x["token_type_ids"], dtype=torch.long)
    nsp = x["next_sentence_label"]
    problems = [message for bad, message in (
        (ids.dim() != 1 or ids.numel() == 0, "has no tokens"),
        (ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size), f"has ids outside [0, {vocab_size})"),
        (types.shape != ids.shape or (types.numel() and (int(types.min()) < 0 or int(types.max()) > 1)),
         "has token_type_ids that are not 0/1 for each token"),
        (nsp not in (0, 1), f"has next_sentence_label {nsp!r}, not 0 or 1")) if bad]
    if problems:
        raise ValueError(f"{where} " + ", ".join(problems))
    return ids


def flat(instances: list[dict], names, vocab_size: int = np.iinfo(np.int64).max) -> FlatInstances:
    """Instances laid end to end, each checked; `names(i)` says where instance i is, in an error."""
    ids = [check_instance(x, vocab_size, names(i)).numpy() for i, x in enumerate(instances)]
    empty = np.zeros(0, np.int64)
    return FlatInstances(np.concatenate(ids) if ids else empty,
                         np.concatenate([np.asarray(x["token_type_ids"], np.int64) for x in instances]) if ids
                         else empty,
                         np.array([len(i) for i in ids], dtype=np.int64),
                         np.array([x["next_sentence_label"] for x in instances], dtype=np.int64))


class DictMasker(Masker):
    """A Masker that also masks dicts: called on a list of instances, it masks them and pads them to the longest
    (rounded up to a multiple of 8), as a padded batch."""

    def __call__(self, instances: list[dict], keys: Iterable | None = None,
                 stream: str = "masking") -> dict[str, torch.Tensor]:
        keys = key_array(range(len(instances)) if keys is None else keys, len(instances))
        f = flat(instances, lambda i: f"instance {i} of the batch", self.special.vocab_size)
        masked, labels = self.mask_flat(f.ids, f.lengths, keys, stream)
        ends = np.cumsum(f.lengths)
        rows = [{"input_ids": torch.from_numpy(masked[e - n:e]), "token_type_ids": x["token_type_ids"],
                 "labels": torch.from_numpy(labels[e - n:e]), "next_sentence_label": x["next_sentence_label"]}
                for x, n, e in zip(instances, f.lengths, ends)]
        return pad_batch(rows, self.special.pad, 8)

    def mask(self, row: torch.Tensor, key, stream: str = "masking") -> tuple[torch.Tensor, torch.Tensor]:
        """(masked ids, labels) of one instance (`mask_flat` of a batch of one)."""
        check_instance({"input_ids": row, "token_type_ids": torch.zeros_like(row), "next_sentence_label": 0},
                       self.special.vocab_size, "the instance to mask")
        masked, labels = self.mask_flat(row.numpy().astype(np.int64), np.array([len(row)]), key_array([key], 1),
                                        stream)
        return torch.from_numpy(masked), torch.from_numpy(labels)


class DictPacker(PackingCollator):
    """A PackingCollator that also packs dicts: called on rows (lists of instances) and one masking key per
    instance, in order."""

    def __call__(self, rows: list[list[dict]], keys, stream: str = "masking") -> PackedBatch:
        per_row = np.array([len(row) for row in rows], dtype=np.int64)
        where = np.repeat(np.arange(len(rows)), per_row)
        f = flat([x for row in rows for x in row],
                 lambda i: f"instance {i - int(per_row[:where[i]].sum())} of row {where[i]}")
        return self.collate(f, per_row, key_array(keys, len(f.lengths)), stream)


def one_per_row(masker: Masker, instances: list[dict], keys, stream: str = "masking") -> PackedBatch:
    """bert.data.packing.one_per_row of dicts."""
    if not instances:
        raise ValueError("one_per_row: no instances")
    f = flat(instances, lambda i: f"instance {i} of row {i}")
    return one_per_row_flat(masker, f, key_array(keys, len(instances)), stream)

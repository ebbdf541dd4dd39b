"""Pre-training data: corpus files -> documents of paragraphs -> sentences; the special ids; MLM masking.

Documents come from text files, JSONL (Wikipedia's schema on the hub: id, url, title, text) or a Hugging Face
dataset streamed by name (`iter_document_texts`); sentences are split by rule (`split_sentences`). Tokenising
is bert.corpus's, NSP instances bert.instances', packing bert.packing's, the epoch's stream bert.pipeline's.
Masking happens at collation, fresh each time an instance is drawn: 15% of real, non-special tokens are chosen
(exactly, or each independently); 80% of those become [MASK], 10% a random non-special token, 10% stay.
"""
from __future__ import annotations

import glob
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from . import seeds
from .padding import pad_batch

_HEADING = re.compile(r"^\s*=(\s*=)*\s[^=].*[^=]\s=(\s*=)*\s*$")
_TOP_HEADING = re.compile(r"^\s*=\s[^=].*[^=]\s=\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """A light rule-based splitter: break after . ! ? when the next word starts upper-case or with a digit."""
    return [s.strip() for s in _SENTENCE_END.split(text.strip()) if s.strip()]


def text_sentences(paragraphs) -> list[str]:
    """The sentences of one document's paragraphs (a string is split at its line breaks)."""
    if isinstance(paragraphs, str):
        paragraphs = paragraphs.split("\n")
    return [s for para in paragraphs for s in split_sentences(para)]


def corpus_files(source: str) -> list[str]:
    """The files a local corpus source names: a file, a glob, or every file under a directory."""
    paths = sorted(glob.glob(os.path.join(source, "**", "*"), recursive=True)) if os.path.isdir(source) \
        else sorted(glob.glob(source))
    return [p for p in paths if os.path.isfile(p)]


def _text_lines(path: str) -> Iterator[str]:
    """A text file's lines, read line by line (memory bounded by the longest line, whatever the file's size):
    the same lines as str.splitlines of the whole text; an error naming the file and line when it is not UTF-8
    text."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            yield from _decode_line(raw, path, lineno).splitlines()


def _text_file_documents(path: str) -> Iterator[list[str]]:
    """Plain text: documents are separated by blank lines. WikiText: each `= Title =` line starts a document,
    `= = Section = =` lines are dropped, and blank lines only separate paragraphs. Yields each document's lines.
    Which of the two a file is, its first 2,000 lines say."""
    lines = _text_lines(path)
    head = list(itertools.islice(lines, 2000))
    wikitext = any(_TOP_HEADING.match(line) for line in head)
    doc: list[str] = []
    for line in itertools.chain(head, lines):
        if wikitext and _TOP_HEADING.match(line):
            if doc:
                yield doc
            doc = []
        elif wikitext and _HEADING.match(line):
            continue
        elif not line.strip():
            if not wikitext and doc:
                yield doc
                doc = []
        else:
            doc.append(line)
    if doc:
        yield doc


def _document_text(value, where: str, text_field: str) -> list[str] | None:
    """A record's text field as its paragraphs; None when blank; an error naming the record when the field is not
    a string (null, a number, a list...: never trained on as its Python repr)."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: the {text_field!r} field is {type(value).__name__ if value is not None else 'null'}"
                         ", not a string")
    return value.split("\n") if value.strip() else None


def _jsonl_documents(path: str, text_field: str) -> Iterator[list[str]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode_line(raw, path, lineno)
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_field]
            except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a {text_field!r} field") from e
            doc = _document_text(text, f"{path}:{lineno}", text_field)
            if doc:
                yield doc


def _decode_line(raw: bytes, path: str, lineno: int) -> str:
    if b"\0" in raw:
        raise ValueError(f"{path}: binary data (a NUL byte on line {lineno}), not a text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x})") from None


def iter_document_texts(source: str, text_field: str = "text", hf_split: str = "train") -> Iterator[list[str]]:
    """Documents as lists of paragraphs (not yet split into sentences) from local text files (a path, a
    directory or a glob), .jsonl files with a text field (one document per line, read line by line: a corpus
    of any size), or a Hugging Face dataset streamed by name: `hf:NAME` or `hf:NAME:CONFIG`, e.g.
    hf:wikimedia/wikipedia:20231101.en, whose rows (id, url, title, text) a local .jsonl may mirror."""
    if source.startswith("hf:"):
        import datasets

        name, _, config = source[3:].partition(":")
        for i, row in enumerate(datasets.load_dataset(name, config or None, split=hf_split, streaming=True)):
            if text_field not in row:
                raise ValueError(f"{source}, row {i}: no {text_field!r} field (fields: {', '.join(row)})")
            doc = _document_text(row[text_field], f"{source}, row {i}", text_field)
            if doc:
                yield doc
        return
    paths = corpus_files(source)
    if not paths:
        raise FileNotFoundError(f"no corpus files at {source}")
    for path in paths:
        yield from (_jsonl_documents(path, text_field) if path.endswith((".jsonl", ".json"))
                    else _text_file_documents(path))


def iter_documents(source: str, text_field: str = "text", hf_split: str = "train") -> Iterator[list[str]]:
    """Documents as lists of sentences (iter_document_texts, split by `split_sentences`); empty ones skipped."""
    for paragraphs in iter_document_texts(source, text_field, hf_split):
        sentences = text_sentences(paragraphs)
        if sentences:
            yield sentences


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


def check_instance(x: dict, vocab_size: int, where: str) -> torch.Tensor:
    """A pre-training instance's input_ids as a tensor, after checking what the model would otherwise meet as a
    wrong loss or an index error: at least one token, ids in [0, vocab_size), token_type_ids of the same length
    in {0, 1}, a next_sentence_label of 0 or 1. `where` names the instance in the error."""
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


def token_index(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For instances `lengths` long laid end to end: each token's instance and its position in that instance
    (int64 [sum of lengths] each)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    inst = np.repeat(np.arange(len(lengths)), lengths)
    return inst, np.arange(len(inst)) - (np.cumsum(lengths) - lengths)[inst]


def key_array(keys, n: int) -> np.ndarray:
    """Masking keys (ints, or tuples of ints of one length) as a uint64 array [n, key length]."""
    array = np.asarray(list(keys) if not isinstance(keys, np.ndarray) else keys, dtype=np.int64)
    array = array.reshape(len(array), -1) if array.size else np.zeros((0, 1), np.int64)
    if len(array) != n:
        raise ValueError(f"{n} instances but {len(array)} masking keys")
    if (array < 0).any():
        raise ValueError("masking keys must be non-negative integers")
    return array.astype(np.uint64)


class MLMCollator:
    """Masks instances for MLM and, called on a list of instances, pads them to the longest (rounded up to a
    multiple of 8); instances are checked first (`check_instance`).

    Each instance is masked by random numbers of its own: a hash of the run's seed, a named stream (bert.seeds),
    the instance's key and the token's position. Training keys an instance by (epoch, shard, its index in the
    shard) (bert.pipeline), evaluation by its index in the held-out set. So an instance is masked the same way however the batch is
    split over ranks, packed or padded, and whether or not training resumed in between, yet differently each
    epoch; and a whole micro-batch is masked in a few array operations (`mask_flat`), whatever its instances.
    """

    def __init__(self, special: SpecialIds, mlm_probability=0.15, mask_prob=0.8, random_prob=0.1,
                 whole_word: bool = False, continuation_ids: Iterable[int] = (), pad_to_multiple_of: int = 8,
                 seed: int = 0, exact: bool = True):
        if not 0 < mlm_probability < 1 or mask_prob < 0 or random_prob < 0 or mask_prob + random_prob > 1:
            raise ValueError("need 0 < mlm_probability < 1 and mask_prob + random_prob <= 1")
        self.special, self.p, self.mask_prob, self.random_prob = special, mlm_probability, mask_prob, random_prob
        self.whole_word, self.multiple, self.seed, self.exact = whole_word, pad_to_multiple_of, seed, exact
        self.is_continuation = np.zeros(special.vocab_size, dtype=bool)
        self.is_continuation[list(continuation_ids)] = True
        self.is_special = np.zeros(special.vocab_size, dtype=bool)
        self.is_special[list(special.special)] = True
        self.replacement_ids = np.flatnonzero(~self.is_special)
        self.special_ids = torch.as_tensor(special.special)

    def __call__(self, instances: list[dict], keys: Iterable | None = None,
                 stream: str = "masking") -> dict[str, torch.Tensor]:
        keys = key_array(range(len(instances)) if keys is None else keys, len(instances))
        ids = [check_instance(x, self.special.vocab_size, f"instance {i} of the batch").numpy()
               for i, x in enumerate(instances)]
        lengths = np.array([len(r) for r in ids], dtype=np.int64)
        masked, labels = self.mask_flat(np.concatenate(ids) if ids else np.zeros(0, np.int64), lengths, keys, stream)
        ends = np.cumsum(lengths)
        rows = [{"input_ids": torch.from_numpy(masked[e - n:e]), "token_type_ids": x["token_type_ids"],
                 "labels": torch.from_numpy(labels[e - n:e]), "next_sentence_label": x["next_sentence_label"]}
                for x, n, e in zip(instances, lengths, ends)]
        return pad_batch(rows, self.special.pad, self.multiple)

    def mask(self, row: torch.Tensor, key, stream: str = "masking") -> tuple[torch.Tensor, torch.Tensor]:
        """(masked ids, labels) of one instance (`mask_flat` of a batch of one)."""
        check_instance({"input_ids": row, "token_type_ids": torch.zeros_like(row), "next_sentence_label": 0},
                       self.special.vocab_size, "the instance to mask")
        masked, labels = self.mask_flat(row.numpy().astype(np.int64), np.array([len(row)]), key_array([key], 1),
                                        stream)
        return torch.from_numpy(masked), torch.from_numpy(labels)

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


class BucketBatchSampler:
    """Global batches of similar length: shuffle, cut into pools of 50 batches, sort each pool by length, cut into
    batches, shuffle the batches. Deterministic in (seed, epoch): the run's "order" stream (bert.seeds). A global
    batch is later split into per-rank, per-accumulation-step micro-batches (`bert.trainer.micro_batch`), so the
    data of a step does not depend on how many processes share it."""

    def __init__(self, lengths: list[int] | np.ndarray, global_batch: int, seed: int = 0, pool: int = 50):
        self.lengths = np.asarray(lengths)
        self.global_batch, self.seed, self.pool = global_batch, seed, pool
        if len(self.lengths) < global_batch:
            raise ValueError(f"{len(self.lengths)} instances cannot fill one global batch of {global_batch}")

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        rows = bucket_rows(self.lengths, self.global_batch, seeds.rng(self.seed, "order", epoch), self.pool)
        return rows.reshape(-1, self.global_batch).tolist()


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

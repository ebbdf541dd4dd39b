"""Pre-training data: corpus -> documents of sentences -> token ids -> NSP instances -> masked batches.

Instances follow BERT: a target length of max_seq_len (10% of the time a shorter random one), segment A from
consecutive sentences, segment B the true continuation (50%) or sentences of a random other document (50%), the
longer side trimmed at a random end, laid out as [CLS] A [SEP] B [SEP]. Masking happens in the collator, fresh
each time an instance is drawn: 15% of real, non-special tokens are chosen; 80% of those become [MASK], 10% a
random non-special token, 10% stay.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re
import shutil
import warnings
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


def _text_sentences(text) -> list[str]:
    """The sentences of one document's text, paragraph by paragraph."""
    return [s for para in str(text).split("\n") for s in split_sentences(para)]


def corpus_files(source: str) -> list[str]:
    """The files a local corpus source names: a file, a glob, or every file under a directory."""
    paths = sorted(glob.glob(os.path.join(source, "**", "*"), recursive=True)) if os.path.isdir(source) \
        else sorted(glob.glob(source))
    return [p for p in paths if os.path.isfile(p)]


def read_text(path: str) -> str:
    """A corpus file's text; an error naming the file when it is not UTF-8 text."""
    with open(path, "rb") as f:
        data = f.read()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{path}: binary data (a NUL byte at offset {nul}), not a text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None


def _text_file_documents(path: str) -> Iterator[list[str]]:
    """Plain text: documents are separated by blank lines. WikiText: each `= Title =` line starts a document,
    `= = Section = =` lines are dropped, and blank lines only separate paragraphs."""
    lines = read_text(path).splitlines()
    wikitext = sum(1 for line in lines[:2000] if _TOP_HEADING.match(line)) >= 1
    doc: list[str] = []
    for line in lines:
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
            doc.extend(split_sentences(line))
    if doc:
        yield doc


def iter_documents(source: str, text_field: str = "text", hf_split: str = "train") -> Iterator[list[str]]:
    """Documents (lists of sentences) from local text files (a path, a directory or a glob), a .jsonl file with a
    text field, or a Hugging Face dataset streamed by name: `hf:NAME` or `hf:NAME:CONFIG`."""
    if source.startswith("hf:"):
        import datasets

        name, _, config = source[3:].partition(":")
        stream = datasets.load_dataset(name, config or None, split=hf_split, streaming=True)
        for row in stream:
            sentences = _text_sentences(row[text_field])
            if sentences:
                yield sentences
        return
    paths = corpus_files(source)
    if not paths:
        raise FileNotFoundError(f"no corpus files at {source}")
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            for lineno, line in enumerate(read_text(path).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_field]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a {text_field!r} field") from e
                sentences = _text_sentences(text)
                if sentences:
                    yield sentences
        else:
            yield from _text_file_documents(path)


def _fingerprint(source: str, tokenizer, extra) -> str:
    h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    h.update(tokenizer.to_str().encode())
    if not source.startswith("hf:"):
        for p in corpus_files(source):
            st = os.stat(p)
            h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        h.update(source.encode())
    return h.hexdigest()[:16]


def tokenize_corpus(source: str, tokenizer, cache_dir: str | None = None, num_proc: int = 1,
                    max_documents: int | None = None):
    """A datasets.Dataset with one row per document: {"sentences": list of token-id lists} (no specials).

    Tokenised in batches (datasets.map, `num_proc` processes) and cached under `cache_dir`, keyed by the
    corpus files and the tokenizer, so a second run loads from disk.
    """
    import datasets

    key = _fingerprint(source, tokenizer, {"max_documents": max_documents, "v": 1})
    path = os.path.join(cache_dir, f"tokenized-{key}") if cache_dir else None
    if path and os.path.isdir(path):
        try:
            return datasets.load_from_disk(path)
        except Exception as e:  # a cache from an older datasets or a damaged disk: rebuild, never fail on it
            warnings.warn(f"the tokenised-corpus cache {path} cannot be read ({type(e).__name__}: {e}); "
                          "rebuilding it")
            shutil.rmtree(path, ignore_errors=True)
    if next(iter_documents(source), None) is None:  # datasets cannot even infer a schema from nothing
        raise ValueError(f"the corpus at {source} has no text")

    def gen():
        for i, doc in enumerate(iter_documents(source)):
            if max_documents is not None and i >= max_documents:
                break
            yield {"text": doc}

    docs = datasets.Dataset.from_generator(gen, cache_dir=cache_dir)
    if len(docs) == 0:
        raise ValueError(f"the corpus at {source} has no text")
    serialized = tokenizer.to_str()

    def encode(batch):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(serialized)
        tok.no_truncation()
        tok.no_padding()
        out = []
        for sentences in batch["text"]:
            encs = tok.encode_batch(sentences, add_special_tokens=False)
            out.append([e.ids for e in encs if e.ids])
        return {"sentences": out}

    tokenized = docs.map(encode, batched=True, batch_size=256, num_proc=num_proc if num_proc > 1 else None,
                         remove_columns=["text"], desc="tokenising")
    tokenized = tokenized.filter(lambda row: len(row["sentences"]) > 0)
    if path:  # written under a temporary name, then renamed: a killed run leaves no half-written cache
        tmp = f"{path}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tokenized.save_to_disk(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        tokenized = datasets.load_from_disk(path)
    return tokenized


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


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer side, from a random end, until both fit (BERT's truncate_seq_pair)."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


class DocumentView:
    """Tokenised documents (rows of {"sentences": [[ids]]}) read from a memory-mapped Arrow dataset one at a time,
    so a corpus the size of Wikipedia never has to fit in memory as Python lists."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> list[list[int]]:
        return self.dataset[int(i)]["sentences"]

    def __iter__(self):
        for row in self.dataset:
            yield row["sentences"]


def iter_instances(documents, max_seq_len: int, special: SpecialIds, seed: int, short_seq_prob: float = 0.1,
                   nsp_random_prob: float = 0.5) -> Iterator[dict]:
    """NSP instances from tokenised documents (documents -> sentences -> ids), deterministic in `seed`.

    `documents` is any sequence of documents (a list, or a DocumentView over Arrow). Each instance: input_ids
    ([CLS] A [SEP] B [SEP]), token_type_ids (0 for [CLS] A [SEP], 1 for B [SEP]) and next_sentence_label
    (0: B follows A in the document, 1: B comes from another document).
    """
    if max_seq_len < 8:
        raise ValueError(f"max_seq_len must be at least 8, got {max_seq_len}")
    rng = random.Random(seed)
    max_tokens = max_seq_len - 3

    def draw_target():
        return rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens

    def take(sentences, start, want):
        """Whole sentences from `start` until `want` tokens are reached (at least one); returns (ids, count)."""
        ids, n = [], 0
        while start + n < len(sentences) and (n == 0 or len(ids) < want):
            ids.extend(sentences[start + n])
            n += 1
        return ids, n

    n_docs = len(documents)
    for d, doc in enumerate(documents):
        i = 0
        while i < len(doc):
            target = draw_target()
            _, n_chunk = take(doc, i, target)
            a_end = rng.randint(1, n_chunk - 1) if n_chunk >= 2 else 1
            a = [t for s in doc[i:i + a_end] for t in s]
            want_random = n_docs > 1 and rng.random() < nsp_random_prob
            if not want_random and a_end < n_chunk:          # the rest of the chunk follows A
                b, label, i = [t for s in doc[i + a_end:i + n_chunk] for t in s], 0, i + n_chunk
            elif not want_random and i + a_end < len(doc):   # a one-sentence chunk: continue past it
                b, used = take(doc, i + a_end, max(1, target - len(a)))
                label, i = 0, i + a_end + used
            elif n_docs > 1:                                 # B from another document; A's leftovers are kept
                other = rng.randrange(n_docs - 1)
                other += other >= d
                other_doc = documents[other]
                b, _ = take(other_doc, rng.randrange(len(other_doc)), max(1, target - len(a)))
                label, i = 1, i + a_end
            else:
                break
            if a and b:
                _truncate_pair(a, b, max_tokens, rng)
                ids = [special.cls, *a, special.sep, *b, special.sep]
                types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
                yield {"input_ids": ids, "token_type_ids": types, "next_sentence_label": label}


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


class MLMCollator:
    """Pads a list of instances to the longest (rounded up to a multiple of 8) and masks them for MLM; instances
    are checked first (`check_instance`).

    Each instance is masked with a generator of its own from a named stream of the run's seed (bert.seeds) and
    the instance's key: training passes (epoch, index of the instance in the epoch), evaluation its index in the
    held-out set. So an instance is masked the same way however the batch is split over ranks, packed or padded,
    and whether or not training resumed in between, yet differently each epoch. `mask` is the one masking
    algorithm, for padded and packed batches alike.
    """

    def __init__(self, special: SpecialIds, mlm_probability=0.15, mask_prob=0.8, random_prob=0.1,
                 whole_word: bool = False, continuation_ids: Iterable[int] = (), pad_to_multiple_of: int = 8,
                 seed: int = 0, exact: bool = True):
        if not 0 < mlm_probability < 1 or mask_prob < 0 or random_prob < 0 or mask_prob + random_prob > 1:
            raise ValueError("need 0 < mlm_probability < 1 and mask_prob + random_prob <= 1")
        self.special, self.p, self.mask_prob, self.random_prob = special, mlm_probability, mask_prob, random_prob
        self.whole_word, self.multiple, self.seed, self.exact = whole_word, pad_to_multiple_of, seed, exact
        self.is_continuation = torch.zeros(special.vocab_size, dtype=torch.bool)
        for i in continuation_ids:
            self.is_continuation[i] = True
        allowed = torch.ones(special.vocab_size, dtype=torch.bool)
        allowed[list(special.special)] = False
        self.replacement_ids = allowed.nonzero().squeeze(1)
        self.special_ids = torch.as_tensor(special.special)

    def __call__(self, instances: list[dict], keys: Iterable | None = None,
                 stream: str = "masking") -> dict[str, torch.Tensor]:
        keys = list(range(len(instances))) if keys is None else list(keys)
        if len(keys) != len(instances):
            raise ValueError(f"{len(instances)} instances but {len(keys)} masking keys")
        rows = []
        for i, (x, key) in enumerate(zip(instances, keys)):
            ids = check_instance(x, self.special.vocab_size, f"instance {i} of the batch")
            masked, labels = self.mask(ids, key, stream)
            rows.append({"input_ids": masked, "token_type_ids": x["token_type_ids"], "labels": labels,
                         "next_sentence_label": x["next_sentence_label"]})
        return pad_batch(rows, self.special.pad, self.multiple)

    def _groups(self, row: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Per token, the unit it is chosen with (1, 2, ...; 0 for specials): with whole words, a word (a piece
        and the ## pieces after it; a ## piece after a special token starts a unit of its own), else each token."""
        starts = candidates
        if self.whole_word:
            after_candidate = torch.cat([torch.zeros(1, dtype=torch.bool), candidates[:-1]])
            starts = candidates & (~self.is_continuation[row] | ~after_candidate)
        return torch.where(candidates, torch.cumsum(starts.long(), 0), 0)

    def mask(self, row: torch.Tensor, key, stream: str = "masking"):
        """(masked ids, labels) of one instance. exact (the default, as the original BERT code and packed
        batches need: their labelled tokens stay within a fixed bound): units in random order, each taken if it
        still fits max(1, round(p x candidate tokens)) tokens. Otherwise each unit independently with
        probability p. Then 80% of the chosen tokens become [MASK], 10% a random token, 10% stay."""
        g = seeds.generator(self.seed, stream, *(key if isinstance(key, tuple) else (key,)))
        candidates = ~torch.isin(row, self.special_ids)
        group = self._groups(row, candidates)
        units = int(group.max()) if len(row) else 0
        if self.exact:
            budget = max(1, round(self.p * int(candidates.sum()))) if units else 0
            sizes, taken, total = torch.bincount(group, minlength=units + 1).tolist(), [], 0
            for u in (torch.randperm(units, generator=g) + 1).tolist():
                if total + sizes[u] <= budget:
                    taken.append(u)
                    total += sizes[u]
            picked = torch.zeros(units + 1, dtype=torch.bool)
            picked[taken] = True
        else:
            picked = torch.rand(units + 1, generator=g) < self.p
        return self._replace(row, picked[group] & candidates, g)

    def _replace(self, row: torch.Tensor, chosen: torch.Tensor, g: torch.Generator):
        """80% of the chosen tokens become [MASK], 10% a random non-special token, 10% stay; labels -100 elsewhere."""
        roll = torch.rand(row.shape, generator=g)
        random_ids = self.replacement_ids[torch.randint(len(self.replacement_ids), row.shape, generator=g)]
        out = torch.where(chosen & (roll < self.mask_prob), torch.full_like(row, self.special.mask), row)
        to_random = chosen & (roll >= self.mask_prob) & (roll < self.mask_prob + self.random_prob)
        out = torch.where(to_random, random_ids, out)
        return out, torch.where(chosen, row, torch.full_like(row, -100))


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
        rng = seeds.rng(self.seed, "order", epoch)
        order = rng.permutation(len(self.lengths))
        span = self.global_batch * self.pool
        batches = []
        for start in range(0, len(order), span):
            chunk = order[start:start + span]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches += [chunk[i:i + self.global_batch].tolist() for i in range(0, len(chunk), self.global_batch)
                        if len(chunk) - i >= self.global_batch]
        return [batches[i] for i in rng.permutation(len(batches))]


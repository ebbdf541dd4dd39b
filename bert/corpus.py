"""The tokenised corpus: every sentence's token ids end to end in one flat array on disk, memory-mapped.

Wikipedia is ~3.3 billion tokens; as Python lists of lists it would not fit in memory, and as Arrow rows of lists
every read builds Python objects. Here a corpus is three arrays (and a meta.json), written once and then
memory-mapped by every process that reads it, so opening it costs nothing whatever its size:

    tokens      [n_tokens]         uint16 (a vocabulary of at most 65,536) or int32: the token ids, no specials
    sentences   [n_sentences + 1]  int64: sentence i is tokens[sentences[i]:sentences[i + 1]]
    documents   [n_documents + 1]  int64: document d is sentences documents[d] ... documents[d + 1] - 1

`tokenize_corpus` builds it: documents are read as text in this process (bert.data.iter_document_texts), split
into sentences and encoded by `num_proc` worker processes (bert.workers.ordered_map), and appended to the arrays
in order, so memory stays bounded by the tasks in flight. For BERT's tokenizers each distinct whitespace-separated
word is encoded once and then looked up (`WordCache`: the tokenizer's own result, exactly, at twice its speed on
running text); other tokenizers get one call per batch of documents. The result is cached under `cache_dir`,
keyed by the corpus files and the tokenizer, written to a temporary name and renamed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from .data import corpus_files, iter_document_texts, text_sentences
from .workers import ordered_map

FORMAT = 2
_ARRAYS = ("tokens", "sentences", "documents")
TASK_BYTES = 1 << 21   # text per tokenising task: large enough to amortise a call, small enough to stay bounded


@dataclass
class TokenisedCorpus:
    """The three arrays (memory-mapped when loaded from disk) and where they live (None: in memory)."""
    tokens: np.ndarray
    sentences: np.ndarray
    documents: np.ndarray
    path: str | None = None

    @classmethod
    def load(cls, path: str) -> "TokenisedCorpus":
        """A corpus directory, memory-mapped; a ValueError naming the damage when it is incomplete."""
        meta = _read_meta(path)
        arrays = {}
        for name in _ARRAYS:
            dtype, count = np.dtype(meta[name]["dtype"]), int(meta[name]["count"])
            file = os.path.join(path, f"{name}.bin")
            if os.path.getsize(file) != count * dtype.itemsize:
                raise ValueError(f"{file}: {os.path.getsize(file)} bytes, expected {count * dtype.itemsize}")
            arrays[name] = np.memmap(file, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
        corpus = cls(**arrays, path=path)
        corpus.check()
        return corpus

    @classmethod
    def from_documents(cls, documents: Iterable[Iterable[Iterable[int]]]) -> "TokenisedCorpus":
        """An in-memory corpus from documents of sentences of token ids (tests, small examples)."""
        writer = _Arrays()
        for doc in documents:
            writer.add([np.asarray(list(s), dtype=np.int64) for s in doc])
        return writer.finish()

    def __reduce__(self):
        """Pickled by path when it has one (to another process: it maps the files itself, copying nothing)."""
        if self.path:
            return (TokenisedCorpus.load, (self.path,))
        return (TokenisedCorpus, (self.tokens, self.sentences, self.documents))

    def check(self) -> None:
        """The offsets are consistent: what every reader relies on instead of re-checking per read."""
        s, d = self.sentences, self.documents
        if len(s) < 1 or len(d) < 1 or s[0] != 0 or d[0] != 0 or s[-1] != len(self.tokens) or d[-1] != len(s) - 1:
            raise ValueError(f"{self.path or 'corpus'}: inconsistent offsets")

    def __len__(self) -> int:
        return len(self.documents) - 1

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def sentence_bounds(self, doc: int) -> np.ndarray:
        """Token offsets of document `doc`'s sentences: [start of sentence 0, ..., end of the last]."""
        return self.sentences[self.documents[doc]:self.documents[doc + 1] + 1]

    def document_tokens(self, docs=None) -> np.ndarray:
        """Tokens per document (of `docs`, default all), int64. Computed for all documents in order first: the
        gather from the mapped sentence offsets then reads the file front to back, never at random."""
        starts = np.asarray(self.sentences[self.documents])
        tokens = np.diff(starts)
        return tokens if docs is None else tokens[np.asarray(docs)]

    def document(self, doc: int) -> list[list[int]]:
        """Document `doc` as lists of token ids per sentence (for inspection and tests)."""
        bounds = self.sentence_bounds(doc).tolist()
        return [self.tokens[a:b].tolist() for a, b in zip(bounds, bounds[1:])]


class _Arrays:
    """Accumulates documents into the three arrays, in memory or appended to files in `path`."""

    def __init__(self, path: str | None = None, token_dtype=np.int32):
        self.path, self.token_dtype = path, np.dtype(token_dtype)
        self.counts = {"tokens": 0, "sentences": 1, "documents": 1}  # entries written to each array
        self.parts: dict[str, list] = {n: [] for n in _ARRAYS}
        self.files = {n: open(os.path.join(path, f"{n}.bin"), "wb") for n in _ARRAYS} if path else None
        self._write("sentences", np.zeros(1, np.int64))
        self._write("documents", np.zeros(1, np.int64))

    def _write(self, name: str, array: np.ndarray) -> None:
        if self.files:
            self.files[name].write(np.ascontiguousarray(array).tobytes())
        else:
            self.parts[name].append(array)

    def add_encoded(self, ids: np.ndarray, sentence_lengths: np.ndarray, sentences_per_doc: np.ndarray) -> None:
        """A batch of documents: their ids end to end, each sentence's length, each document's sentence count
        (every count positive)."""
        self._write("tokens", ids.astype(self.token_dtype, copy=False))
        self._write("sentences", self.counts["tokens"] + np.cumsum(sentence_lengths, dtype=np.int64))
        self._write("documents", self.counts["sentences"] - 1 + np.cumsum(sentences_per_doc, dtype=np.int64))
        self.counts["tokens"] += len(ids)
        self.counts["sentences"] += len(sentence_lengths)
        self.counts["documents"] += len(sentences_per_doc)

    def add(self, sentences: list[np.ndarray]) -> None:
        sentences = [s for s in sentences if len(s)]
        if sentences:
            self.add_encoded(np.concatenate(sentences), np.array([len(s) for s in sentences]),
                             np.array([len(sentences)]))

    def finish(self, meta: dict | None = None) -> TokenisedCorpus:
        if not self.files:
            return TokenisedCorpus(*(np.concatenate(self.parts[n]) if self.parts[n] else np.zeros(0, np.int64)
                                     for n in _ARRAYS))
        for f in self.files.values():
            f.close()
        dtypes = {"tokens": self.token_dtype.str, "sentences": "<i8", "documents": "<i8"}
        meta = {**(meta or {}), "format": FORMAT,
                **{n: {"dtype": dtypes[n], "count": self.counts[n]} for n in _ARRAYS}}
        with open(os.path.join(self.path, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        return TokenisedCorpus.load(self.path)


def _read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: no readable meta.json ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')}, this version reads {FORMAT}")
    return meta


# ---- tokenising ------------------------------------------------------------------------------------
_TOKENIZER = None
_WORDS: "WordCache | None" = None
# What BERT's normaliser and pre-tokeniser treat as whitespace: each splits words and yields no token (checked
# against the tokenizer over every code point; \x0b, \x0c, \x1c-\x1f and \x85 are control characters it deletes).
_BERT_SPACE = re.compile("[\t\n\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")
CACHE_WORDS = 1 << 19  # ~120 MB a process


class WordCache:
    """BERT's encoding of text is the concatenation of its whitespace-separated words' encodings (the normaliser
    works character by character, the pre-tokeniser splits at whitespace, WordPiece works word by word), and
    running text repeats its words: each distinct word is encoded once, by the tokenizer, and looked up after.
    Only for tokenizers where that holds (`applies`); at most CACHE_WORDS words are kept (then it starts over)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids = tokenizer, {"": ()}
        self.encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    @staticmethod
    def applies(tokenizer) -> bool:
        """A BERT normaliser and pre-tokeniser, and no added token containing whitespace."""
        spec = json.loads(tokenizer.to_str())
        kind = lambda part: (spec.get(part) or {}).get("type")  # noqa: E731
        added = [t.get("content", "") for t in spec.get("added_tokens", [])]
        return kind("normalizer") == "BertNormalizer" and kind("pre_tokenizer") == "BertPreTokenizer" and \
            not any(_BERT_SPACE.search(t) for t in added)

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Each sentence's token ids, without special tokens."""
        words = [_BERT_SPACE.split(s) for s in sentences]
        unseen = list({w for ws in words for w in ws if w not in self.ids})
        if unseen:
            if len(self.ids) + len(unseen) > CACHE_WORDS:
                self.ids = {"": ()}
            for w, enc in zip(unseen, self.encode_batch(unseen, add_special_tokens=False)):
                self.ids[w] = tuple(enc.ids)
        ids = self.ids
        return [[i for w in ws for i in ids[w]] for ws in words]


def _init_encoder(serialized: str, parallel: bool) -> None:
    """In each tokenising process: the tokenizer, single-threaded when several processes share the cores."""
    global _TOKENIZER, _WORDS
    if not parallel:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_str(serialized)
    _TOKENIZER.no_truncation()
    _TOKENIZER.no_padding()
    _WORDS = WordCache(_TOKENIZER) if WordCache.applies(_TOKENIZER) else None


def _sentence_ids(docs: list[list[str]]) -> list[list[list[int]]]:
    """Each document's sentences' ids: through the word cache, or one tokenizer call per batch (a document is
    one pre-tokenised input whose words are its sentences; the word ids give each token's sentence)."""
    if _WORDS is not None:
        flat = _WORDS.encode([s for d in docs for s in d])
        ends = np.cumsum([len(d) for d in docs]).tolist()
        return [flat[a:b] for a, b in zip([0] + ends[:-1], ends)]
    out = []
    for doc, enc in zip(docs, _TOKENIZER.encode_batch(docs, is_pretokenized=True, add_special_tokens=False)):
        words, ids = np.array(enc.word_ids, dtype=np.int64), enc.ids
        bounds = np.searchsorted(words, np.arange(len(doc) + 1)).tolist() if ids else [0] * (len(doc) + 1)
        out.append([ids[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def encode_documents(texts: list[list[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents (lists of paragraphs) -> (ids end to end, length of each non-empty sentence, non-empty sentences
    per non-empty document). Sentences and documents without a token are dropped."""
    docs = [d for d in (text_sentences(paragraphs) for paragraphs in texts) if d]
    ids, lengths, per_doc = [], [], []
    for sentences in _sentence_ids(docs):
        kept = [len(s) for s in sentences if s]
        if kept:
            ids.extend(i for s in sentences for i in s)
            lengths.extend(kept)
            per_doc.append(len(kept))
    return (np.array(ids, dtype=np.int64), np.array(lengths, dtype=np.int64), np.array(per_doc, dtype=np.int64))


def _text_batches(texts: Iterator[list[str]], max_documents: int | None) -> Iterator[list[list[str]]]:
    batch, size = [], 0
    for i, paragraphs in enumerate(texts):
        if max_documents is not None and i >= max_documents:
            break
        batch.append(paragraphs)
        size += sum(map(len, paragraphs))
        if size >= TASK_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def fingerprint(source: str, tokenizer, extra) -> str:
    """What a cached corpus is keyed by: the local files' names, sizes and times (or the hub name), the
    tokenizer, and `extra`."""
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
                    max_documents: int | None = None, text_field: str = "text") -> TokenisedCorpus:
    """The tokenised corpus of `source` (bert.data.iter_document_texts): from the cache under `cache_dir` when it
    is there and readable, else built by `num_proc` processes and cached (without `cache_dir`: built in memory,
    nothing written)."""
    if not cache_dir:
        return _build(source, tokenizer, None, num_proc, max_documents, text_field)
    key = fingerprint(source, tokenizer, {"max_documents": max_documents, "field": text_field, "v": FORMAT})
    path = os.path.join(cache_dir, f"tokenized-{key}")
    if os.path.isdir(path):
        try:
            return TokenisedCorpus.load(path)
        except (ValueError, OSError) as e:  # a cache from an older version or a damaged disk: rebuild it
            warnings.warn(f"the tokenised-corpus cache {path} cannot be read ({e}); rebuilding it")
            shutil.rmtree(path, ignore_errors=True)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _build(source, tokenizer, tmp, num_proc, max_documents, text_field)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # a killed run leaves at most the temporary directory, never a half-written cache
    return TokenisedCorpus.load(path)


def _build(source, tokenizer, path, num_proc, max_documents, text_field) -> TokenisedCorpus:
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.int32
    writer = _Arrays(path, dtype)
    batches = _text_batches(iter_document_texts(source, text_field), max_documents)
    # One process: this one, the tokenizer using every core itself; several: one thread each.
    processes = num_proc if num_proc > 1 else 0
    for ids, lengths, per_doc in ordered_map(encode_documents, batches, processes, _init_encoder,
                                             (tokenizer.to_str(), num_proc <= 1)):
        writer.add_encoded(ids, lengths, per_doc)
    corpus = writer.finish({"source": source})
    if len(corpus) == 0:
        raise ValueError(f"the corpus at {source} has no text")
    return corpus

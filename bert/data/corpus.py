"""The tokenised corpus: every sentence's token ids end to end in one flat array on disk, memory-mapped.

Wikipedia is ~3.3 billion tokens; as Python lists of lists it would not fit in memory, and as Arrow rows of lists
every read builds Python objects. Here a corpus is three arrays (and a meta.json), written once and then
memory-mapped by every process that reads it, so opening it costs nothing whatever its size:

    tokens      [n_tokens]         uint16 (a vocabulary of at most 65,536) or int32: the token ids, no specials
    sentences   [n_sentences + 1]  int64: sentence i is tokens[sentences[i]:sentences[i + 1]]
    documents   [n_documents + 1]  int64: document d is sentences documents[d] ... documents[d + 1] - 1

`tokenize_corpus` builds it: documents are read as text in this process (bert.data.text.iter_document_texts), split
into sentences and encoded by `num_proc` worker processes (bert.common.workers.ordered_map), and appended to the arrays
in order, so memory stays bounded by the tasks in flight. For BERT's tokenizers each distinct whitespace-separated
word is encoded once and then looked up (`WordCache`: the tokenizer's own result, exactly, at twice its speed on
running text); other tokenizers get one call per batch of documents. The result is cached under `cache_dir`,
keyed by the corpus files' content and the tokenizer, written to a temporary name and renamed (`tokenize_corpus`
says what a build cleans up).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from bertfuse.bert.common.files import atomic_write_text
from bertfuse.bert.common.workers import ordered_map
from bertfuse.bert.data.text import SPLITTER_VERSION, corpus_files, iter_document_texts, text_sentences

FORMAT = 2


_ARRAYS = ("tokens", "sentences", "documents")


CHECK_BLOCK = 1 << 23  # offsets per block of TokenisedCorpus.check


TASK_BYTES = 1 << 21   # text per tokenising task: large enough to amortise a call, small enough to stay bounded


@dataclass
class TokenisedCorpus:
    """The three arrays (memory-mapped when loaded from disk) and where they live (None: in memory)."""
    tokens: np.ndarray
    sentences: np.ndarray
    documents: np.ndarray
    path: str | None = None
    vocab_size: int | None = None   # of the tokenizer that built it (a bound on every id), when known

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
        corpus = cls(**arrays, path=path, vocab_size=meta.get("vocab_size"))
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
        return (TokenisedCorpus, (self.tokens, self.sentences, self.documents, None, self.vocab_size))

    def check(self) -> None:
        """The offsets are consistent, every one of them: each array starts at 0, ends at the length of the next,
        and rises strictly (no empty sentence or document is ever written). What every reader relies on instead
        of re-checking per read; read in blocks, a second or two for Wikipedia's ~150M sentences."""
        s, d, where = self.sentences, self.documents, self.path or "corpus"
        if len(s) < 1 or len(d) < 1 or s[0] != 0 or d[0] != 0 or s[-1] != len(self.tokens) or d[-1] != len(s) - 1:
            raise ValueError(f"{where}: inconsistent offsets")
        for name, offsets in (("sentences", s), ("documents", d)):
            for start in range(0, len(offsets) - 1, CHECK_BLOCK):
                steps = np.diff(np.asarray(offsets[start:start + CHECK_BLOCK + 1]))
                if (steps <= 0).any():
                    i = start + int(np.argmax(steps <= 0)) + 1
                    raise ValueError(f"{where}: inconsistent offsets ({name}[{i}] = {int(offsets[i])} does not "
                                     f"follow {int(offsets[i - 1])})")

    def check_ids(self, ids: np.ndarray) -> None:
        """Token ids read from this corpus lie in its vocabulary (a damaged file would otherwise surface as an
        index error deep in the model)."""
        if self.vocab_size and len(ids) and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            bad = int(ids[(ids >= self.vocab_size) | (ids < 0)][0])
            raise ValueError(f"{self.path or 'corpus'}: token id {bad} is outside the tokenizer's vocabulary of "
                             f"{self.vocab_size}: the tokenised corpus is damaged; delete that directory and run "
                             "again to rebuild it")

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
                                     for n in _ARRAYS), vocab_size=(meta or {}).get("vocab_size"))
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
        distinct = {w for ws in words for w in ws}
        unseen = [w for w in distinct if w not in self.ids]
        if unseen:
            if len(self.ids) + len(unseen) > CACHE_WORDS:  # start over: every word of these sentences is unseen
                self.ids = {"": ()}
                unseen = [w for w in distinct if w]
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


def fingerprint(source: str, settings: str, cache_dir: str | None = None) -> str:
    """What a cached corpus is keyed by: the corpus's content (source_digest; the hub name for hf:) and its
    `settings` (settings_key: the tokenizer and the reading options)."""
    h = hashlib.sha256(settings.encode())
    h.update(source_digest(source, cache_dir).encode())
    return h.hexdigest()[:16]


def settings_key(tokenizer, extra) -> str:
    """The tokenizer and the reading settings, hashed: the part of a cache's key that is not the corpus."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    h.update(tokenizer.to_str().encode())
    return h.hexdigest()[:16]


def source_digest(source: str, cache_dir: str | None = None) -> str:
    """A digest of a local corpus's bytes (every file's, with its name), or the hub name of an hf: source. A
    file's digest is remembered in CACHE_DIR/digests.json under its size, mtime, ctime and inode, and computed
    again when any of them changes: the ctime moves with every write and every restored mtime (cp -p, tar x), so
    an edited file is never taken for the old one, and an unchanged corpus is read once, not at every run."""
    if source.startswith("hf:"):
        return source
    memo_path = os.path.join(cache_dir, "digests.json") if cache_dir else None
    memo = _read_json(memo_path) if memo_path else {}
    h, changed = hashlib.sha256(), False
    for p in corpus_files(source):
        st = os.stat(p)
        stamp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
        key = os.path.abspath(p)
        if memo.get(key, {}).get("stamp") != stamp:
            memo[key], changed = {"stamp": stamp, "sha256": file_sha256(p)}, True
        h.update(f"{p}:{memo[key]['sha256']}".encode())
    if memo_path and changed:
        _write_json(memo_path, memo)
    return h.hexdigest()


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):  # absent or torn: computed again
        return {}


def _write_json(path: str, value: dict) -> None:
    """Written to a temporary name and renamed (several jobs may share the directory; the last one wins); a memo
    that cannot be written costs a recomputation, nothing else."""
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps(value))


def tokenize_corpus(source: str, tokenizer, cache_dir: str | None = None, num_proc: int = 1,
                    max_documents: int | None = None, text_field: str = "text") -> TokenisedCorpus:
    """The tokenised corpus of `source` (bert.data.text.iter_document_texts): from the cache under `cache_dir` when it
    is there and readable, else built by `num_proc` processes and cached (without `cache_dir`: built in memory,
    nothing written). Building removes what killed builds left in `cache_dir` (remove_stale) and, once done,
    the caches of this source and settings that an edit of the corpus made stale."""
    extra = {"max_documents": max_documents, "field": text_field, "v": FORMAT, "split": SPLITTER_VERSION}
    meta = {"source": source, "settings": settings_key(tokenizer, extra), "vocab_size": tokenizer.get_vocab_size()}
    if not cache_dir:
        return _build(source, tokenizer, None, num_proc, max_documents, text_field, meta)
    os.makedirs(cache_dir, exist_ok=True)
    key = fingerprint(source, meta["settings"], cache_dir)
    path = os.path.join(cache_dir, f"tokenized-{key}")
    if os.path.isdir(path):
        try:
            return TokenisedCorpus.load(path)
        except (ValueError, OSError) as e:  # a cache from an older version or a damaged disk: rebuild it
            warnings.warn(f"the tokenised-corpus cache {path} cannot be read ({e}); rebuilding it")
            shutil.rmtree(path, ignore_errors=True)
    remove_stale(cache_dir)
    with _writing(f"{path}.tmp-{socket.gethostname()}-{os.getpid()}") as tmp:
        try:
            _build(source, tokenizer, tmp, num_proc, max_documents, text_field, meta)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
                raise
            raise _unwritable(e, cache_dir) from e
        shutil.rmtree(path, ignore_errors=True)
        os.remove(os.path.join(tmp, WRITER_LOCK))
        os.replace(tmp, path)  # a killed run leaves at most the temporary directory, never a half-written cache
    _remove_superseded(cache_dir, path, meta)
    return TokenisedCorpus.load(path)


WRITER_LOCK = ".writing"  # inside a temporary cache directory: flocked by the process building it


@contextlib.contextmanager
def _writing(tmp: str):
    """A temporary cache directory, held (an flock on its WRITER_LOCK, which the kernel drops when the process
    dies) while it is built, and removed unless it was renamed into place."""
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    fd = os.open(os.path.join(tmp, WRITER_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)


STALE_UNLOCKED_SECONDS = 3600  # a temporary directory without its lock file yet is someone's for this long


def remove_stale(cache_dir: str) -> list[str]:
    """Remove the temporary directories of builds whose process is gone (killed mid-build: at Wikipedia's size
    ~8 GB each): those whose WRITER_LOCK nobody holds. Safe when several ranks, jobs or machines share the
    directory: a live builder holds its lock, and a directory too new to have one is left alone. Returns the
    removed paths."""
    removed = []
    for name in os.listdir(cache_dir):
        tmp = os.path.join(cache_dir, name)
        if not (name.startswith("tokenized-") and ".tmp-" in name and os.path.isdir(tmp)):
            continue
        try:
            fd = os.open(os.path.join(tmp, WRITER_LOCK), os.O_RDWR)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - os.stat(tmp).st_mtime > STALE_UNLOCKED_SECONDS:
                    shutil.rmtree(tmp, ignore_errors=True)
                    removed.append(tmp)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a build in progress
            continue
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        finally:
            os.close(fd)
    return removed


def _remove_superseded(cache_dir: str, keep: str, meta: dict) -> None:
    """Caches of the same source and settings under another key hold the corpus as it was before an edit: no
    run can ask for them again (the key follows the content), so they are removed. (Removing a directory a
    running job has mapped is safe: its mapping stays until it unmaps.)"""
    for name in os.listdir(cache_dir):
        other = os.path.join(cache_dir, name)
        if not name.startswith("tokenized-") or ".tmp-" in name or other == keep:
            continue
        old = _read_json(os.path.join(other, "meta.json"))
        if old.get("source") == meta["source"] and old.get("settings") == meta["settings"]:
            shutil.rmtree(other, ignore_errors=True)


def _unwritable(e: OSError, cache_dir: str) -> OSError:
    """One error naming the cache disk, its free space and the fix."""
    free = shutil.disk_usage(cache_dir).free if os.path.isdir(cache_dir) else 0
    return OSError(e.errno, f"the tokenised corpus could not be written under {cache_dir} ({e.strerror or e}); "
                            f"that disk has {free / 2**20:.0f} MiB free. Free some space or give --cache-dir on "
                            "another disk, and run again")


def _build(source, tokenizer, path, num_proc, max_documents, text_field, meta) -> TokenisedCorpus:
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.int32
    writer = _Arrays(path, dtype)
    batches = _text_batches(iter_document_texts(source, text_field), max_documents)
    # One process: this one, the tokenizer using every core itself; several: one thread each.
    processes = num_proc if num_proc > 1 else 0
    for ids, lengths, per_doc in ordered_map(encode_documents, batches, processes, _init_encoder,
                                             (tokenizer.to_str(), num_proc <= 1), name="tokenising"):
        writer.add_encoded(ids, lengths, per_doc)
    corpus = writer.finish(meta)
    if len(corpus) == 0:
        raise ValueError(f"the corpus at {source} has no text")
    return corpus

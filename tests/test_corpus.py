"""bert.data.corpus: the flat, memory-mapped tokenised corpus, built in parallel and cached."""
import json
import os
import pickle

import numpy as np
import pytest

from bertfuse.bert.data.corpus import TokenisedCorpus, tokenize_corpus
from bertfuse.bert.data.text import iter_documents
from bertfuse.bert.data.tokenizer import train_tokenizer
from corpus_utils import topic_documents, write_wikipedia_jsonl


def test_documents_round_trip_through_the_three_arrays():
    docs = [[[5, 6, 7], [8]], [[9, 10]], [], [[11], [], [12, 13]]]  # an empty document and sentence are dropped
    corpus = TokenisedCorpus.from_documents(docs)
    assert len(corpus) == 3 and corpus.n_tokens == 9
    assert [corpus.document(d) for d in range(3)] == [[[5, 6, 7], [8]], [[9, 10]], [[11], [12, 13]]]
    assert corpus.sentences.tolist() == [0, 3, 4, 6, 7, 9] and corpus.documents.tolist() == [0, 2, 3, 5]
    assert corpus.document_tokens().tolist() == [4, 2, 3] and corpus.document_tokens([2, 0]).tolist() == [3, 4]
    assert corpus.sentence_bounds(2).tolist() == [6, 7, 9]


def test_wikipedia_jsonl_is_tokenised_like_sentence_by_sentence_and_cached_memory_mapped(tmp_path):
    path = write_wikipedia_jsonl(tmp_path / "wiki.jsonl", n_docs=12)
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert set(rows[0]) == {"id", "url", "title", "text"}  # the schema of hf:wikimedia/wikipedia
    tok = train_tokenizer(topic_documents(12, 6), vocab_size=150)
    corpus = tokenize_corpus(path, tok, cache_dir=str(tmp_path / "cache"))
    expected = [[tok.encode(s, add_special_tokens=False).ids for s in doc] for doc in iter_documents(path)]
    assert len(corpus) == 12 and [corpus.document(d) for d in range(12)] == expected
    assert corpus.tokens.dtype == np.uint16  # a vocabulary this small fits 16 bits
    again = tokenize_corpus(path, tok, cache_dir=str(tmp_path / "cache"))
    assert isinstance(again.tokens, np.memmap) and again.path == corpus.path
    assert len(pickle.dumps(again)) < 500  # sent to another process by path, not by value
    assert np.array_equal(pickle.loads(pickle.dumps(again)).tokens, corpus.tokens)
    assert tokenize_corpus(path, tok, max_documents=5).document_tokens().tolist() == \
        corpus.document_tokens()[:5].tolist()


def test_a_cache_with_inconsistent_arrays_is_refused_by_name(tmp_path):
    corpus = TokenisedCorpus.from_documents([[[5, 6]], [[7]]])
    path = tmp_path / "c"
    path.mkdir()
    for name in ("tokens", "sentences", "documents"):
        (path / f"{name}.bin").write_bytes(getattr(corpus, name).astype("<i8").tobytes())
    meta = {"format": 2, **{n: {"dtype": "<i8", "count": len(getattr(corpus, n))} for n in
                            ("tokens", "sentences", "documents")}}
    (path / "meta.json").write_text(json.dumps(meta))
    assert TokenisedCorpus.load(str(path)).document(1) == [[7]]
    (path / "sentences.bin").write_bytes(np.array([0, 1, 9], "<i8").tobytes())  # ends past the tokens
    with pytest.raises(ValueError, match="inconsistent offsets"):
        TokenisedCorpus.load(str(path))
    (path / "meta.json").write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(ValueError, match="format 1, this version reads 2"):
        TokenisedCorpus.load(str(path))
    os.remove(path / "meta.json")
    with pytest.raises(ValueError, match="no readable meta.json"):
        TokenisedCorpus.load(str(path))


ODD = list("abcXYZ é,.!?'\"-_[]()#$") + ["\x0b", "\x0c", "\x1c", "\x85", "\u00a0", "\u200b", "\u2028", "\u3000", "中",
                                         "\u0301", "Σ", "ß", "[MASK]", "[CLS]", "\t", "\r", "\ufffd", "\x00", "İ", "ﬁ"]


def test_the_word_cache_encodes_exactly_as_the_tokenizer_on_hostile_text():
    """Whitespace of every kind (and control characters BERT deletes, which split nothing), accents, CJK, special
    tokens written in the text: cached word by word equals the tokenizer on the whole sentence."""
    import random

    from bertfuse.bert.data.corpus import WordCache

    tok = train_tokenizer(topic_documents(12, 6) + ["café naïve 中文 straße"], vocab_size=150)
    assert WordCache.applies(tok)
    cache, rng = WordCache(tok), random.Random(0)
    sentences = ["".join(rng.choice(ODD) for _ in range(rng.randint(0, 40))) for _ in range(600)]
    expected = [tok.encode(s, add_special_tokens=False).ids for s in sentences]
    first = cache.encode(sentences)  # every word met for the first time
    again = cache.encode(sentences)  # every word from the cache
    assert first == expected and again == expected


def test_a_full_word_cache_starts_over_without_losing_the_words_it_had(monkeypatch):
    """Filling up mid-corpus (a real corpus has millions of distinct words): a later batch that repeats words of
    earlier ones and brings new ones still encodes every word."""
    from bertfuse.bert.data import corpus as corpus_module
    from bertfuse.bert.data.corpus import WordCache

    monkeypatch.setattr(corpus_module, "CACHE_WORDS", 8)
    tok = train_tokenizer(topic_documents(12, 6), vocab_size=150)
    cache = WordCache(tok)
    first, second = ["apple river stone cloud"], ["apple river music garden silver window paper"]
    assert cache.encode(first) == [tok.encode(first[0], add_special_tokens=False).ids]
    assert cache.encode(second) == [tok.encode(second[0], add_special_tokens=False).ids]
    assert len(cache.ids) <= 8


def test_a_tokenizer_the_word_cache_does_not_fit_is_encoded_directly(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from bertfuse.bert.data.corpus import WordCache

    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert not WordCache.applies(byte_level)  # its tokens carry their spaces: words are not independent
    path = write_wikipedia_jsonl(tmp_path / "wiki.jsonl", n_docs=12)
    tok = train_tokenizer(topic_documents(12, 6), vocab_size=150)
    cached = tokenize_corpus(path, tok)
    monkeypatch.setattr(WordCache, "applies", staticmethod(lambda tokenizer: False))
    direct = tokenize_corpus(path, tok)
    assert np.array_equal(cached.tokens, direct.tokens) and np.array_equal(cached.sentences, direct.sentences)


# ---- faults: damaged, stale, edited, full ------------------------------------------------------------------
import errno  # noqa: E402
import fcntl  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from bertfuse.bert.data import corpus as corpus_module  # noqa: E402
from bertfuse.bert.data.corpus import WRITER_LOCK, remove_stale  # noqa: E402
from bertfuse.bert.data.instances import SPAN, gather  # noqa: E402
from corpus_utils import write_corpus  # noqa: E402


@pytest.fixture
def built(tmp_path):
    path = write_corpus(tmp_path / "c.txt", n_docs=6, sentences=4)
    tok = train_tokenizer(topic_documents(6, 4), vocab_size=120)
    return path, tok, str(tmp_path / "cache")


def _caches(cache):
    return sorted(n for n in os.listdir(cache) if n.startswith("tokenized-"))


def test_a_damaged_offset_anywhere_is_refused_and_the_cache_rebuilt(built):
    path, tok, cache = built
    first = tokenize_corpus(path, tok, cache_dir=cache)
    good = first.tokens.tolist()
    offsets = os.path.join(first.path, "sentences.bin")
    values = np.fromfile(offsets, "<i8")
    values[5] += 1 << 40  # one offset in the middle: the planner would trim one token at a time, for ever
    values.tofile(offsets)
    with pytest.raises(ValueError, match=r"inconsistent offsets \(sentences\[6\] = \d+ does not follow \d+\)"):
        TokenisedCorpus.load(first.path)
    with pytest.warns(UserWarning, match="cannot be read"):
        assert tokenize_corpus(path, tok, cache_dir=cache).tokens.tolist() == good


def test_a_damaged_token_id_is_an_error_naming_the_cache_and_the_fix(built):
    path, tok, cache = built
    corpus = tokenize_corpus(path, tok, cache_dir=cache)
    tokens = os.path.join(corpus.path, "tokens.bin")
    values = np.fromfile(tokens, corpus.tokens.dtype)
    values[3] = 60000
    values.tofile(tokens)
    damaged = TokenisedCorpus.load(corpus.path)
    spans = np.array([(0, 4, 10, 4, 0)], dtype=SPAN)
    with pytest.raises(ValueError, match=rf"{corpus.path}: token id 60000 is outside the tokenizer's vocabulary of "
                                         r"120: the tokenised corpus is damaged; delete that directory"):
        gather(damaged, spans, 2, 3)


def test_an_edit_that_keeps_size_and_mtime_is_not_served_the_old_tokens(built):
    path, tok, cache = built
    old = tokenize_corpus(path, tok, cache_dir=cache)
    old_ids = old.tokens.tolist()
    st = os.stat(path)
    text = open(path, encoding="utf-8").read()
    with open(path, "w", encoding="utf-8") as f:  # same size, other words
        f.write(text.replace("apple", "tiger", 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p or tar x restore it
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    new = tokenize_corpus(path, tok, cache_dir=cache)
    assert new.tokens.tolist() != old_ids and new.path != old.path
    assert _caches(cache) == [os.path.basename(new.path)]  # the superseded cache is removed
    calls = []
    monkey = corpus_module.file_sha256
    corpus_module.file_sha256 = lambda p: calls.append(p) or monkey(p)
    try:
        assert tokenize_corpus(path, tok, cache_dir=cache).path == new.path and calls == []  # stat only
    finally:
        corpus_module.file_sha256 = monkey


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_stale_temporary_caches_are_removed_and_live_ones_kept(built, tmp_path):
    path, tok, cache = built
    os.makedirs(cache)
    dead = os.path.join(cache, "tokenized-aaaa.tmp-host-1")  # its writer was killed: nobody holds the lock
    live = os.path.join(cache, "tokenized-bbbb.tmp-host-2")  # another rank, job or machine building now
    fresh = os.path.join(cache, "tokenized-cccc.tmp-host-3")  # just made, its lock file not yet created
    for d in (dead, live, fresh):
        os.makedirs(d)
        open(os.path.join(d, "tokens.bin"), "wb").write(b"\0" * 1000)
    for d in (dead, live):
        open(os.path.join(d, WRITER_LOCK), "w").close()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, os.path.join(live, WRITER_LOCK)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        corpus = tokenize_corpus(path, tok, cache_dir=cache)  # a build cleans up first
        assert not os.path.exists(dead) and os.path.isdir(live) and os.path.isdir(fresh)
        assert _caches(cache) == sorted([os.path.basename(corpus.path), os.path.basename(live),
                                         os.path.basename(fresh)])
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale(cache) == [live]  # its holder is gone now


def test_a_build_holds_its_temporary_directory_while_it_writes(built, monkeypatch):
    path, tok, cache = built
    seen = []
    real = corpus_module._Arrays.add_encoded

    def spy(self, *args):
        lock = os.open(os.path.join(self.path, WRITER_LOCK), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what remove_stale tries
            seen.append(remove_stale(cache))
        finally:
            os.close(lock)
        return real(self, *args)

    monkeypatch.setattr(corpus_module._Arrays, "add_encoded", spy)
    tokenize_corpus(path, tok, cache_dir=cache)
    assert seen and all(removed == [] for removed in seen)


def test_a_full_cache_disk_is_one_error_naming_the_disk_and_leaves_nothing(built, monkeypatch):
    path, tok, cache = built

    def full(self, name, array):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(corpus_module._Arrays, "_write", full)
    with pytest.raises(OSError, match=rf"could not be written under {cache} \(No space left on device\); that disk "
                                      r"has \d+ MiB free. Free some space or give --cache-dir on another disk"):
        tokenize_corpus(path, tok, cache_dir=cache)
    assert _caches(cache) == []

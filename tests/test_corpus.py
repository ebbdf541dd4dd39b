"""bert.corpus: the flat, memory-mapped tokenised corpus, built in parallel and cached."""
import json
import os
import pickle

import numpy as np
import pytest

from bert.corpus import TokenisedCorpus, tokenize_corpus
from bert.data import iter_documents
from bert.tokenizer import train_tokenizer
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

    from bert.corpus import WordCache

    tok = train_tokenizer(topic_documents(12, 6) + ["café naïve 中文 straße"], vocab_size=150)
    assert WordCache.applies(tok)
    cache, rng = WordCache(tok), random.Random(0)
    sentences = ["".join(rng.choice(ODD) for _ in range(rng.randint(0, 40))) for _ in range(600)]
    expected = [tok.encode(s, add_special_tokens=False).ids for s in sentences]
    first = cache.encode(sentences)  # every word met for the first time
    again = cache.encode(sentences)  # every word from the cache
    assert first == expected and again == expected


def test_a_tokenizer_the_word_cache_does_not_fit_is_encoded_directly(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from bert.corpus import WordCache

    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert not WordCache.applies(byte_level)  # its tokens carry their spaces: words are not independent
    path = write_wikipedia_jsonl(tmp_path / "wiki.jsonl", n_docs=12)
    tok = train_tokenizer(topic_documents(12, 6), vocab_size=150)
    cached = tokenize_corpus(path, tok)
    monkeypatch.setattr(WordCache, "applies", staticmethod(lambda tokenizer: False))
    direct = tokenize_corpus(path, tok)
    assert np.array_equal(cached.tokens, direct.tokens) and np.array_equal(cached.sentences, direct.sentences)

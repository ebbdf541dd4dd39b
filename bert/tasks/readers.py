"""Fine-tuning data: readers for GLUE-style TSV, CoNLL-2003 and SQuAD v1.1 (or HF datasets by name), and their
conversion to model features. Bad data raises an error naming the file and line (or question id).
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
from dataclasses import dataclass, field
from typing import NamedTuple

from bertfuse.bert.common.files import check_utf8

PAIR_COLUMNS = [("sentence1", "sentence2"), ("question", "sentence"), ("question1", "question2"),
                ("premise", "hypothesis")]


@contextlib.contextmanager
def truncation(tokenizer, max_seqlen: int, **kwargs):
    """Truncate to max_seqlen (tokenizers' enable_truncation options) inside the block, and off again after it."""
    tokenizer.enable_truncation(max_seqlen, **kwargs)
    try:
        yield tokenizer
    finally:
        tokenizer.no_truncation()


# ---- classification ------------------------------------------------------------------------------
@dataclass
class TextExample:
    text: str
    pair: str | None
    label: str
    where: str  # file:line, for error messages


def read_classification(source: str, split: str) -> list[TextExample]:
    """A TSV with a header naming 'label' and 'sentence' (or a sentence pair), or a Hub dataset by name. Fields
    are read as written (GLUE's files hold unescaped quotes); a row with more fields than the header is read
    again with CSV quoting (a quoted field holding a tab, as pandas writes it) and refused, naming its line, if
    that does not make it fit. A UTF-8 byte-order mark is skipped."""
    if not os.path.exists(source):
        return _hf_classification(source, split)
    check_utf8(source)
    with open(source, encoding="utf-8-sig", newline="") as f:
        header = f.readline().rstrip("\r\n").split("\t")
        if not any(h.strip() for h in header):
            raise ValueError(f"{source}:1: empty file (expected a header row)")
        cols = {name.strip(): i for i, name in enumerate(header)}
        if "label" not in cols:
            raise ValueError(f"{source}:1: missing column 'label' (header: {header})")
        if "sentence" in cols:
            a, b = cols["sentence"], None
        else:
            found = next(((cols[x], cols[y]) for x, y in PAIR_COLUMNS if x in cols and y in cols), None)
            if found is None:
                raise ValueError(f"{source}:1: missing column 'sentence' (or a sentence pair such as "
                                 f"sentence1/sentence2); header: {header}")
            a, b = found
        out = []
        for lineno, line in enumerate(f, 2):
            row = _tsv_fields(line, len(header), f"{source}:{lineno}")
            if row is None:
                continue
            label = _label(row[cols["label"]].strip())
            if not label:
                raise ValueError(f"{source}:{lineno}: empty label")
            out.append(TextExample(row[a].strip(), row[b].strip() if b is not None else None, label,
                                   f"{source}:{lineno}"))
    _check_label_kinds(out, source)
    return out


def _tsv_fields(line: str, columns: int, where: str) -> list[str] | None:
    """A data row's fields (None for a blank line): as written when they match the header's count, else through
    CSV quoting when that makes them match; else an error naming the line."""
    line = line.rstrip("\r\n")
    if not line.strip():
        return None
    fields = line.split("\t")
    if len(fields) > columns and '"' in line:
        try:
            quoted = next(csv.reader([line], delimiter="\t", quotechar='"', strict=True))
        except csv.Error:
            quoted = fields
        fields = quoted if len(quoted) == columns else fields
    if len(fields) != columns:
        hint = " (a quoted field holding a tab must open and close on this line)" if '"' in line else ""
        raise ValueError(f"{where}: {len(fields)} tab-separated fields, but the header has {columns}{hint}")
    return fields


def _label(text: str) -> str:
    """A class label as written, whole numbers in one spelling: "1.0", "+1" and "01" are the class "1" (a file
    written by pandas from floats, and one written by hand, mean the same classes)."""
    body = text[1:] if text[:1] in "+-" else text
    whole, dot, zeros = body.partition(".")
    if whole.isdigit() and (not dot or not zeros.strip("0")):
        return str(int(whole) * (-1 if text.startswith("-") else 1))
    return text


def _check_label_kinds(examples: list[TextExample], source: str) -> None:
    """Integer labels (0/1, 0-4...) or names, not a mix: a stray 'positive' in a 0/1 file is a typo, not a class."""
    numeric = [e.label.lstrip("-").isdigit() for e in examples]
    if any(numeric) and not all(numeric):
        odd = next(e for e, n in zip(examples, numeric) if n != (sum(numeric) * 2 >= len(numeric)))
        kind = "integer" if sum(numeric) * 2 >= len(numeric) else "name"
        raise ValueError(f"{odd.where}: label {odd.label!r}, but the other labels in {source} are {kind}s")


def _hf_classification(name: str, split: str) -> list[TextExample]:
    import datasets

    path, _, config = name.partition("/")
    ds = datasets.load_dataset(path, config or None, split="validation" if split == "eval" else "train")
    names = ds.features["label"].names if hasattr(ds.features["label"], "names") else None
    cols = ds.column_names
    a, b = ("sentence", None) if "sentence" in cols else next((x, y) for x, y in PAIR_COLUMNS if x in cols)
    return [TextExample(r[a], r[b] if b else None, names[r["label"]] if names else str(r["label"]), f"{name}[{i}]")
            for i, r in enumerate(ds)]


def classification_features(examples: list[TextExample], tokenizer, label2id: dict[str, int], max_seqlen: int):
    with truncation(tokenizer, max_seqlen):
        encs = tokenizer.encode_batch([(e.text, e.pair) if e.pair is not None else e.text for e in examples])
    feats = []
    for e, enc in zip(examples, encs):
        if e.label not in label2id:
            raise ValueError(f"{e.where}: label {e.label!r} is not in the label set {sorted(label2id)}")
        feats.append({"input_ids": enc.ids, "token_type_ids": enc.type_ids, "labels": label2id[e.label]})
    return feats


# ---- NER -----------------------------------------------------------------------------------------
@dataclass
class NerSentence:
    words: list[str]
    tags: list[str]
    where: str


def read_conll(source: str, split: str) -> list[NerSentence]:
    """CoNLL-2003: `word POS chunk NER` per line, blank lines between sentences, -DOCSTART- lines skipped."""
    if not os.path.exists(source):
        return _hf_conll(source, split)
    sentences, words, tags, start, columns = [], [], [], 1, None
    check_utf8(source)
    with open(source, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts or parts[0] == "-DOCSTART-":
                if words:
                    sentences.append(NerSentence(words, tags, f"{source}:{start}"))
                words, tags = [], []
                continue
            if len(parts) < 2:
                raise ValueError(f"{source}:{lineno}: expected 'word ... tag' columns, got {line.strip()!r}")
            columns = columns or len(parts)  # every token line has as many columns as the first one
            if len(parts) != columns:
                raise ValueError(f"{source}:{lineno}: {len(parts)} columns where the file's first token line has "
                                 f"{columns} (the tag is the last column): {line.strip()!r}")
            if not words:
                start = lineno
            words.append(parts[0])
            tags.append(parts[-1])
    if words:
        sentences.append(NerSentence(words, tags, f"{source}:{start}"))
    return sentences


def _hf_conll(name: str, split: str) -> list[NerSentence]:
    import datasets

    ds = datasets.load_dataset(name, split="validation" if split == "eval" else "train")
    names = ds.features["ner_tags"].feature.names
    return [NerSentence(r["tokens"], [names[t] for t in r["ner_tags"]], f"{name}[{i}]") for i, r in enumerate(ds)]


def ner_features(sentences: list[NerSentence], tokenizer, label2id: dict[str, int], max_seqlen: int):
    """Label the first sub-token of each word; the other pieces and the special tokens get -100.
    Words cut off by max_seqlen are recorded, so their predictions can be filled in as 'O'."""
    with truncation(tokenizer, max_seqlen):
        encs = tokenizer.encode_batch([s.words for s in sentences], is_pretokenized=True)
    feats = []
    for s, enc in zip(sentences, encs):
        for tag in s.tags:
            if tag not in label2id:
                raise ValueError(f"{s.where}: tag {tag!r} is not in the label set {sorted(label2id)}")
        labels, first_token, prev = [], [], None
        for pos, w in enumerate(enc.word_ids):
            if w is not None and w != prev:
                labels.append(label2id[s.tags[w]])
                first_token.append(pos)
            else:
                labels.append(-100)
            prev = w
        feats.append({"input_ids": enc.ids, "token_type_ids": enc.type_ids, "labels": labels,
                      "first_token": first_token})
    return feats


# ---- extractive QA -------------------------------------------------------------------------------
@dataclass
class QAExample:
    qid: str
    question: str
    context: str
    answers: list[str]
    answer_start: int | None   # of the first answer, for training
    where: str


def read_squad(source: str, split: str) -> list[QAExample]:
    if not os.path.exists(source):
        return _hf_squad(source, split)
    check_utf8(source)
    with open(source, encoding="utf-8") as f:
        try:
            data_root = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{source}: not a SQuAD v1.1 JSON file ({e})") from None
    out = []
    for a, article in enumerate(_field(data_root, "data", list, source)):
        for p, para in enumerate(_field(article, "paragraphs", list, f"{source}: article {a}")):
            where_para = f"{source}: article {a} paragraph {p}"
            context = _field(para, "context", str, where_para)
            for qa in _field(para, "qas", list, where_para):
                qid = qa.get("id") if isinstance(qa, dict) else None
                where = f"{source}: question {qid!r}" if qid is not None else f"{where_para}: a question"
                _field(qa, "id", str, where)
                answers = _field(qa, "answers", list, where) if isinstance(qa, dict) and "answers" in qa else []
                for ans in answers:
                    start, text = _field(ans, "answer_start", int, where), _field(ans, "text", str, where)
                    if context[start:start + len(text)] != text:
                        raise ValueError(f"{where}: answer_start {start} does not match the answer text {text!r} "
                                         f"(context has {context[start:start + len(text)]!r} there)")
                out.append(QAExample(qa["id"], _field(qa, "question", str, where), context,
                                     [a["text"] for a in answers], answers[0]["answer_start"] if answers else None,
                                     where))
    return out


def _field(obj, key: str, kind: type, where: str):
    """obj[key], which must exist and be of `kind` (a bool is not an int): else an error saying where."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: field {key!r} must be a {kind.__name__}, got {type(value).__name__} {value!r:.40}")
    return value


def _hf_squad(name: str, split: str) -> list[QAExample]:
    import datasets

    ds = datasets.load_dataset(name, split="validation" if split == "eval" else "train")
    return [QAExample(r["id"], r["question"], r["context"], r["answers"]["text"],
                      r["answers"]["answer_start"][0] if r["answers"]["answer_start"] else None, f"{name}[{i}]")
            for i, r in enumerate(ds)]


@dataclass
class QAWindow:
    example: int                     # index into the example list
    input_ids: list[int]
    token_type_ids: list[int]
    context_offsets: list            # per token: (start, end) in the context, or None outside the passage
    start_position: int = 0          # training targets; 0 ([CLS]) when the answer is not inside this window
    end_position: int = 0
    features: dict = field(default_factory=dict)


def qa_windows(examples: list[QAExample], tokenizer, max_seqlen: int, doc_stride: int) -> list[QAWindow]:
    """Question as segment A, passage as segment B; long passages become overlapping windows that share
    `doc_stride` tokens. Each window's targets are the answer's first and last tokens when it lies inside."""
    windows = []
    specials = tokenizer.num_special_tokens_to_add(True)
    with truncation(tokenizer, max_seqlen, stride=doc_stride, strategy="only_second"):
        for i, ex in enumerate(examples):
            room = max_seqlen - specials - len(tokenizer.encode(ex.question, add_special_tokens=False).ids)
            if room <= 0:
                raise ValueError(f"{ex.where}: the question does not fit in --max-seq-len {max_seqlen}")
            if doc_stride >= room:  # (the tokenizer would panic: windows could not advance)
                raise ValueError(f"{ex.where}: the question leaves {room} passage tokens a window, so --doc-stride "
                                 f"{doc_stride} leaves no room to advance; lower --doc-stride below {room} or raise "
                                 "--max-seq-len")
            first = tokenizer.encode(ex.question, ex.context)
            for enc in [first, *first.overflowing]:
                seq = enc.sequence_ids
                offsets = [tuple(o) if s == 1 else None for o, s in zip(enc.offsets, seq)]
                w = QAWindow(i, enc.ids, enc.type_ids, offsets)
                if ex.answer_start is not None and ex.answers:
                    a0, a1 = ex.answer_start, ex.answer_start + len(ex.answers[0])
                    inside = [t for t, o in enumerate(offsets) if o is not None]
                    if inside and offsets[inside[0]][0] <= a0 and offsets[inside[-1]][1] >= a1:
                        w.start_position = next(t for t in inside if offsets[t][1] > a0)
                        w.end_position = max(t for t in inside if offsets[t][0] < a1)
                windows.append(w)
    return windows


def decode_answers(examples: list[QAExample], windows: list[QAWindow], start_logits, end_logits,
                   n_best: int = 20, max_answer_len: int = 30) -> dict[str, str]:
    """The best passage span of each question over all its windows: the top n_best starts and ends of each
    window, pairs with start <= end and at most max_answer_len tokens, scored by start + end logit."""
    best: dict[int, tuple[float, str]] = {}
    for w, s_log, e_log in zip(windows, start_logits, end_logits):
        ctx = [t for t, o in enumerate(w.context_offsets) if o is not None]
        if not ctx:
            continue
        s_top = sorted(ctx, key=lambda t: -s_log[t])[:n_best]
        e_top = sorted(ctx, key=lambda t: -e_log[t])[:n_best]
        for s in s_top:
            for e in e_top:
                if e < s or e - s + 1 > max_answer_len:
                    continue
                score = float(s_log[s] + e_log[e])
                if w.example not in best or score > best[w.example][0]:
                    text = examples[w.example].context[w.context_offsets[s][0]:w.context_offsets[e][1]]
                    best[w.example] = (score, text)
    return {ex.qid: best.get(i, (0.0, ""))[1] for i, ex in enumerate(examples)}


# ---- the tasks, one class each: read, label set, features, batches, loss counts, metrics, predictions ---------
class Features(NamedTuple):
    rows: list[dict]                 # model inputs per example (or QA window), as lists
    windows: list | None = None      # QA: the windows, for decoding answers

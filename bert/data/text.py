"""Pre-training text: corpus files -> documents of paragraphs -> sentences.

Documents come from text files, JSONL (Wikipedia's schema on the hub: id, url, title, text) or a Hugging Face
dataset streamed by name (`iter_document_texts`); sentences are split by rule (`split_sentences`).
"""
from __future__ import annotations

import glob
import itertools
import json
import os
import re
from collections.abc import Iterator

from bertfuse.bert.common.files import check_utf8

_HEADING = re.compile(r"^\s*=(\s*=)*\s[^=].*[^=]\s=(\s*=)*\s*$")


_TOP_HEADING = re.compile(r"^\s*=\s[^=].*[^=]\s=\s*$")


# A sentence ends at . ! ? (and closing quotes or brackets, kept with it) before whitespace and the next
# sentence's first character: upper-case, a digit, or lower-case (lowercased corpora, as uncased corpora are
# often shipped).
_SENTENCE_END = re.compile(r"([.!?][\"')\]]*)\s+(?=[\"'(\[]?[A-Za-z0-9])")
# Words whose full stop does not end a sentence before a lower-case word: abbreviations, initials, "e.g.".
_ABBREVIATIONS = frozenset("al approx ca cf dept dr e.g eg est etc fig i.e ie inc jr ltd mr mrs ms no nos p pp prof "
                           "sr st viz vol vs".split())
_LAST_WORD = re.compile(r"([\w.]+)\.$")
SPLITTER_VERSION = 2  # part of the corpus cache's key: a cache split by other rules is not served


def split_sentences(text: str) -> list[str]:
    """A light rule-based splitter: break after . ! ? when the next word starts upper-case or with a digit, or
    lower-case unless the full stop ends an abbreviation or an initial ("e.g. this", "dr. smith", "j. smith") or
    a quotation goes on ('"stop." he said')."""
    parts = _SENTENCE_END.split(text.strip())
    out: list[str] = []
    for i in range(0, len(parts), 2):
        body, end = parts[i], parts[i + 1] if i + 1 < len(parts) else ""
        piece = (body + end).strip()
        if not piece:
            continue
        if out and body.lstrip("\"'([")[:1].islower() and _continues(out[-1]):
            out[-1] = f"{out[-1]} {piece}"
        else:
            out.append(piece)
    return out


def _continues(sentence: str) -> bool:
    """Whether a lower-case word after `sentence` goes on with it: `sentence` ends in a closing quote or bracket,
    or in a full stop after an abbreviation, a single letter or a dotted form (u.s.); not after ! or ?."""
    if sentence[-1:] in "\"')]":
        return True
    end = _LAST_WORD.search(sentence)
    if end is None:
        return False
    word = end.group(1).lower()
    return len(word) == 1 or "." in word or word in _ABBREVIATIONS


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
    check_utf8(path)
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
    check_utf8(path)
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
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x}); convert it first, e.g. "
                         f"iconv -f CP1252 -t UTF-8 '{path}' > '{path}.utf8' for Windows-1252 or Latin-1 "
                         "text") from None
    return text[1:] if lineno == 1 and text.startswith("\ufeff") else text  # a UTF-8 byte-order mark


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

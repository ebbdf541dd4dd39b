"""WordPiece tokenisation with the `tokenizers` library, encoding exactly as transformers' BertTokenizerFast.

`load_tokenizer` reads an HF directory (tokenizer.json, or vocab.txt plus tokenizer_config.json) and returns a
plain `tokenizers.Tokenizer` with padding and truncation off, as BertTokenizerFast behaves unless asked.
`train_tokenizer` learns a new vocabulary and saves files both `load_tokenizer` and BertTokenizerFast read.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import WordPiece

from bertfuse.bert.common.files import atomic_write_text

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _read_vocab(path: str) -> dict[str, int]:
    with open(path, encoding="utf-8") as f:
        return {line.rstrip("\n"): i for i, line in enumerate(f)}


def _finish(tok: Tokenizer, source: str) -> Tokenizer:
    """Check the special tokens BERT needs, set BERT's [CLS] A [SEP] B [SEP] template, turn padding off."""
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]") if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"the vocabulary of {source} lacks the special token(s) {missing}")
    # As in transformers, special tokens written in the text are matched whole, never split.
    tok.add_special_tokens([t for t in SPECIAL_TOKENS if tok.token_to_id(t) is not None])
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tok.no_padding()
    tok.no_truncation()
    return tok


def _lines(paths) -> Iterable[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            yield from f


def _continuation_pieces(tok: Tokenizer, texts: Iterable[str]) -> list[str]:
    """'##c' for every character that continues a word, in sorted order. The trainer numbers these pieces in the
    order it meets them while iterating a hash map, which differs from run to run; ties between merges are then
    broken differently, and even the set of learned pieces changes. Given up front (as reserved tokens) they get
    fixed ids, and training becomes deterministic: one command, one vocab.txt."""
    chars: set[str] = set()
    for text in texts:
        for word, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text)):
            chars.update(word[1:])
    return ["##" + c for c in sorted(chars)]


def bert_wordpiece(vocab: dict[str, int] | None = None, lowercase: bool = True, strip_accents: bool | None = None,
                   tokenize_chinese_chars: bool = True) -> Tokenizer:
    """A BERT WordPiece pipeline (normaliser, pre-tokeniser, model, decoder) around `vocab`."""
    model = WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100) if vocab else WordPiece(unk_token="[UNK]")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=tokenize_chinese_chars,
                                                strip_accents=strip_accents, lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from an HF directory, a tokenizer.json or a vocab.txt."""
    path = os.fspath(path)
    if os.path.isdir(path):
        json_path, vocab_path = os.path.join(path, "tokenizer.json"), os.path.join(path, "vocab.txt")
        config_path = os.path.join(path, "tokenizer_config.json")
    elif os.path.isfile(path):
        json_path = path if path.endswith(".json") else ""
        vocab_path = path if not json_path else ""
        config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    else:
        raise FileNotFoundError(f"no tokenizer at {path} (expected a directory with tokenizer.json or vocab.txt)")
    if json_path and os.path.isfile(json_path):
        try:
            tok = Tokenizer.from_file(json_path)
        except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception for a file it cannot parse
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"{json_path}: not a tokenizer file the tokenizers library can read ({reason}); "
                             "save it again or point at a directory with a good one") from None
        return _finish(tok, json_path)
    if not os.path.isfile(vocab_path):
        raise FileNotFoundError(f"{path} has neither tokenizer.json nor vocab.txt")
    settings = {}
    if os.path.isfile(config_path):
        from bertfuse.bert.common.files import read_json_object

        settings = read_json_object(config_path)
    tok = bert_wordpiece(_read_vocab(vocab_path), lowercase=settings.get("do_lower_case", True),
                         strip_accents=settings.get("strip_accents"),
                         tokenize_chinese_chars=settings.get("tokenize_chinese_chars", True))
    return _finish(tok, vocab_path)


def train_tokenizer(files_or_iterator: str | Iterable[str], vocab_size: int, output_dir: str | None = None,
                    lowercase: bool = True, min_frequency: int = 2, limit_alphabet: int = 1000,
                    show_progress: bool = False) -> Tokenizer:
    """Train a BERT WordPiece vocabulary on a text file, a list of text files, or an iterable of strings.

    With `output_dir`, writes vocab.txt, tokenizer.json and tokenizer_config.json there.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must leave room beyond the {len(SPECIAL_TOKENS)} special tokens")
    tok = bert_wordpiece(lowercase=lowercase)
    if isinstance(files_or_iterator, (str, os.PathLike)):
        files_or_iterator = [files_or_iterator]
        if not os.path.isfile(files_or_iterator[0]):
            raise FileNotFoundError(f"no such text file: {files_or_iterator[0]}")
    files = isinstance(files_or_iterator, (list, tuple)) and files_or_iterator and all(
        isinstance(p, (str, os.PathLike)) and os.path.isfile(p) for p in files_or_iterator)
    with tempfile.TemporaryDirectory(prefix="bert-tokenizer-") as spool:
        if not files:  # read twice (the pieces below, then the training): spooled to disk, not kept in memory
            path = os.path.join(spool, "texts.txt")
            with open(path, "w", encoding="utf-8") as f:
                for text in files_or_iterator:
                    f.write(text + "\n")
            files_or_iterator = [path]
        pieces = _continuation_pieces(tok, _lines(files_or_iterator))
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            limit_alphabet=limit_alphabet, special_tokens=SPECIAL_TOKENS + pieces,
                                            continuing_subword_prefix="##", show_progress=show_progress)
        tok.train([os.fspath(p) for p in files_or_iterator], trainer)
    if tok.get_vocab_size() <= len(SPECIAL_TOKENS) + len(pieces):
        raise ValueError("the training text produced no vocabulary (is it empty?)")
    # Rebuilt so that only BERT's own special tokens are matched whole in text.
    tok = _finish(bert_wordpiece(tok.get_vocab(), lowercase=lowercase), "the trained vocabulary")
    if output_dir is not None:
        save_tokenizer(tok, output_dir, lowercase=lowercase)
    return tok


def save_tokenizer(tok: Tokenizer, output_dir: str, lowercase: bool = True) -> None:
    """vocab.txt (one token per line in id order), tokenizer_config.json, then tokenizer.json, each written to a
    temporary name and renamed: a run killed while saving leaves each file whole or absent, and tokenizer.json,
    which says a directory holds a tokenizer, comes last."""
    os.makedirs(output_dir, exist_ok=True)
    vocab = sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": lowercase, "unk_token": "[UNK]",
              "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]",
              "tokenize_chinese_chars": True, "strip_accents": None}
    for name, text in (("vocab.txt", "".join(f"{t}\n" for t, _ in vocab)),
                       ("tokenizer_config.json", json.dumps(config, indent=2)),
                       ("tokenizer.json", tok.to_str(pretty=True))):
        atomic_write_text(os.path.join(output_dir, name), text)


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the tokenizer's full serialisation (vocabulary, normaliser, specials): what --resume compares."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()

"""A small synthetic corpus with structure a tiny BERT can learn in a few hundred CPU steps."""
from __future__ import annotations

import random

WORDS = ("apple river stone cloud music garden silver window paper engine forest candle mirror bridge winter "
         "orange planet thunder violin harbor desert castle rocket pepper marble island feather lantern tiger "
         "velvet canyon meadow copper jungle glacier falcon walnut cactus dolphin saddle").split()


def topic_documents(n_docs=40, sentences=12, seed=0) -> list[str]:
    """Each document cycles through its own five topic words, so masked words are predictable from context and
    a sentence from another document is easy to tell apart (NSP)."""
    rng = random.Random(seed)
    docs = []
    for d in range(n_docs):
        topic = [WORDS[(d * 5 + j) % len(WORDS)] for j in range(5)]
        lines = []
        for s in range(sentences):
            words = [topic[(s + j) % 5] for j in range(rng.randint(5, 9))]
            lines.append("The " + " ".join(words) + ".")
        docs.append(" ".join(lines))
    return docs


def write_corpus(path, **kw) -> str:
    path.write_text("\n\n".join(topic_documents(**kw)) + "\n", encoding="utf-8")
    return str(path)


def write_wikipedia_jsonl(path, n_docs=12, sentences=6, seed=0) -> str:
    """The topic documents as Wikipedia's rows on the Hugging Face hub (id, url, title, text; paragraphs separated
    by newlines), one JSON object a line: what hf:wikimedia/wikipedia streams, made locally (no network here)."""
    import json

    lines = []
    for i, text in enumerate(topic_documents(n_docs, sentences, seed)):
        sentences_ = text.split(". ")
        half = len(sentences_) // 2
        body = ". ".join(sentences_[:half]) + ".\n" + ". ".join(sentences_[half:])
        lines.append(json.dumps({"id": str(100 + i), "url": f"https://en.wikipedia.org/wiki?curid={100 + i}",
                                 "title": f"Topic {i}", "text": body}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)

"""Pre-training instances as spans of the flat tokenised corpus (bert.data.corpus), drawn document by document:
NSP pairs (`iter_spans`) for the paper's MLM + NSP objective, or single segments of contiguous text
(`iter_chunks`) for the MLM-only one.

An instance, as in BERT, is [CLS] A [SEP] B [SEP]: a target length of max_seqlen - 3 tokens (10% of the time a
shorter random one), A the first sentences of a chunk of consecutive sentences reaching the target, B the rest
of the chunk (the true continuation: label 0) or, half of the time, sentences of a random other document (label
1; A's unused sentences are then drawn again), the longer side trimmed at a random end until both fit.

A and B are each consecutive sentences of one document, and trimming a run of tokens at its ends leaves a run,
so an instance is five numbers (`SPAN`): where A starts and how long it is, the same for B, and the label. Drawing
them touches only sentence offsets, never a token; the tokens are gathered when a micro-batch is collated
(bert.data.packing), so an epoch's instances cost 25 bytes each, not a Python list per token.

MLM-only instances (RoBERTa's and MosaicBERT's objective) are [CLS] A [SEP]: each document's tokens cut in order
into runs of max_seqlen - 2, the last one shorter, sentence boundaries ignored, so the text stays contiguous and
no token is dropped. The same SPAN with no B (b_len 0) and no next-sentence label (NO_NSP); packing then puts the
short runs of several documents into one row, each its own sequence.
"""
from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Iterator

import numpy as np

from bertfuse.bert.data.corpus import TokenisedCorpus


def token_index(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For instances `lengths` long laid end to end: each token's instance and its position in that instance
    (int64 [sum of lengths] each)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    inst = np.repeat(np.arange(len(lengths)), lengths)
    return inst, np.arange(len(inst)) - (np.cumsum(lengths) - lengths)[inst]


SPAN = np.dtype([("a_start", "<i8"), ("a_len", "<i4"), ("b_start", "<i8"), ("b_len", "<i4"), ("label", "i1")])
NO_NSP = -1  # the label of an instance without B: no next-sentence prediction on it


def span_lengths(spans: np.ndarray) -> np.ndarray:
    """Tokens of each instance, specials included: A + B + [CLS] and two [SEP]; A + [CLS] + [SEP] without B."""
    b_len = spans["b_len"].astype(np.int64)
    return spans["a_len"].astype(np.int64) + b_len + 2 + (b_len > 0)


def iter_chunks(corpus: TokenisedCorpus, doc_ids: np.ndarray, max_seqlen: int, first: int = 0,
                last: int | None = None) -> Iterator[tuple]:
    """The MLM-only instances of documents doc_ids[first:last], in order: each document's tokens in runs of
    max_seqlen - 2 (the last run shorter), as SPAN tuples without B."""
    if max_seqlen < 3:
        raise ValueError(f"max_seqlen must be at least 3 ([CLS] A [SEP]), got {max_seqlen}")
    step = max_seqlen - 2
    for d in range(first, len(doc_ids) if last is None else last):
        bounds = corpus.sentence_bounds(int(doc_ids[d]))
        start, end = int(bounds[0]), int(bounds[-1])
        for a0 in range(start, end, step):
            yield a0, min(step, end - a0), a0, 0, NO_NSP


def iter_spans(corpus: TokenisedCorpus, doc_ids: np.ndarray, max_seqlen: int, seed: int, first: int = 0,
               last: int | None = None, short_seq_prob: float = 0.1, nsp_random_prob: float = 0.5) -> Iterator[tuple]:
    """(a_start, a_len, b_start, b_len, label) of the instances of documents doc_ids[first:last], in order,
    deterministic in `seed`; a random B comes from any other document of `doc_ids`."""
    if max_seqlen < 8:
        raise ValueError(f"max_seqlen must be at least 8, got {max_seqlen}")
    rng, max_tokens, n_docs = random.Random(seed), max_seqlen - 3, len(doc_ids)
    for d in range(first, n_docs if last is None else last):
        bounds = corpus.sentence_bounds(int(doc_ids[d])).tolist()
        i, n = 0, len(bounds) - 1
        while i < n:
            target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
            n_chunk = _take(bounds, i, target)
            a_end = rng.randint(1, n_chunk - 1) if n_chunk >= 2 else 1
            a0, la = bounds[i], bounds[i + a_end] - bounds[i]
            want_random = n_docs > 1 and rng.random() < nsp_random_prob
            if not want_random and a_end < n_chunk:          # the rest of the chunk follows A
                b0, lb, label, i = bounds[i + a_end], bounds[i + n_chunk] - bounds[i + a_end], 0, i + n_chunk
            elif not want_random and i + a_end < n:          # a one-sentence chunk: continue past it
                used = _take(bounds, i + a_end, max(1, target - la))
                b0, lb, label = bounds[i + a_end], bounds[i + a_end + used] - bounds[i + a_end], 0
                i += a_end + used
            elif n_docs > 1:                                 # B from another document; A's leftovers are kept
                other = rng.randrange(n_docs - 1)
                other_bounds = corpus.sentence_bounds(int(doc_ids[other + (other >= d)])).tolist()
                start = rng.randrange(len(other_bounds) - 1)
                used = _take(other_bounds, start, max(1, target - la))
                b0, lb, label, i = other_bounds[start], other_bounds[start + used] - other_bounds[start], 1, i + a_end
            else:
                break
            if la and lb:
                yield _truncate(a0, la, b0, lb, max_tokens, rng) + (label,)


def nsp_skew(corpus: TokenisedCorpus, doc_ids: np.ndarray) -> str | None:
    """Why next-sentence prediction would see far more "random next" pairs than half, or None: most documents
    hold one sentence (sentence-per-row files, one sentence per JSON record), and such a document's instances
    can only take their B from another document."""
    if not len(doc_ids):
        return None
    counts = np.diff(np.asarray(corpus.documents))[np.asarray(doc_ids)]
    single = float((counts == 1).mean())
    if single < 0.5:
        return None
    return (f"{single:.0%} of the training documents hold one sentence, so about {single + (1 - single) / 2:.0%} "
            "of the next-sentence pairs will be \"random next\" instead of half: a document is the text up to a "
            "blank line (one JSON record), so put each document's sentences together, not one sentence per "
            "document")


def _take(bounds: list[int], start: int, want: int) -> int:
    """How many whole sentences from `start` reach `want` tokens (at least one, at most the document's rest)."""
    n = len(bounds) - 1
    return bisect_left(bounds, bounds[start] + want, start + 1, n) - start


def _truncate(a0: int, la: int, b0: int, lb: int, max_tokens: int, rng: random.Random) -> tuple:
    """Trim the longer side, one token at a time from a random end, until both fit (BERT's truncate_seq_pair)."""
    while la + lb > max_tokens:
        if la > lb:
            la -= 1
            a0 += rng.random() < 0.5
        else:
            lb -= 1
            b0 += rng.random() < 0.5
    return a0, la, b0, lb


def iter_instances(corpus: TokenisedCorpus, doc_ids: np.ndarray, max_seqlen: int, seed: int, first: int = 0,
                   last: int | None = None, nsp: bool = True) -> Iterator[tuple]:
    """The instances of documents doc_ids[first:last], in order: NSP pairs (iter_spans), or with nsp False single
    segments of contiguous text (iter_chunks, which draws nothing at random)."""
    if nsp:
        return iter_spans(corpus, doc_ids, max_seqlen, seed, first, last)
    return iter_chunks(corpus, doc_ids, max_seqlen, first, last)


def draw_spans(corpus: TokenisedCorpus, doc_ids: np.ndarray, max_seqlen: int, seed: int, first: int = 0,
               last: int | None = None, nsp: bool = True) -> np.ndarray:
    """The instances of documents doc_ids[first:last] (iter_instances) as a SPAN array."""
    return np.array(list(iter_instances(corpus, doc_ids, max_seqlen, seed, first, last, nsp)), dtype=SPAN)


def gather(corpus: TokenisedCorpus, spans: np.ndarray, cls: int, sep: int) -> tuple[np.ndarray, np.ndarray]:
    """The instances' input ids and token type ids, end to end (int64 [sum of span_lengths]): [CLS] A [SEP] B [SEP],
    types 0 up to the first [SEP] and 1 after it ([CLS] A [SEP] without B, all type 0). One gather from the
    (memory-mapped) token array."""
    la, lb = spans["a_len"].astype(np.int64), spans["b_len"].astype(np.int64)
    inst, p = token_index(span_lengths(spans))  # each token's instance, its position there
    la_t, lb_t = la[inst], lb[inst]
    in_a, in_b = (p >= 1) & (p <= la_t), (p >= la_t + 2) & (p < la_t + lb_t + 2)
    src = np.where(in_a, spans["a_start"][inst] + p - 1, np.where(in_b, spans["b_start"][inst] + p - la_t - 2, 0))
    tokens = corpus.tokens[src].astype(np.int64)
    corpus.check_ids(tokens)
    ids = np.where(in_a | in_b, tokens, sep)
    ids[p == 0] = cls
    return ids, (p > la_t + 1).astype(np.int64)

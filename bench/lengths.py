"""Realistic sequence lengths for synthetic benchmark batches, without downloading anything.

WIKI_PERCENTILES are the 0th, 5th, ..., 100th percentiles of the token counts ([CLS] and [SEP] included) of the
17,556 non-heading paragraphs of WikiText-2's train split (Wikipedia articles), tokenised with the
bert-base-uncased WordPiece vocabulary; measured once, on 2026-11-29, and embedded here.

SQUAD_PERCENTILES are the same percentiles of the token counts of the 10,833 features of SQuAD v1.1 dev as
fine-tuning prepares them (question cut to 64 tokens, [CLS] question [SEP] context [SEP], contexts longer than a
384-token feature split into windows with a stride of 128), with the same vocabulary (the uncased WordPiece
tokenizer of all-MiniLM-L6-v2); measured once, on 2026-12-07 (mean 178.5 tokens: 54% of a 384-token row is
padding), and embedded here.
"""
from __future__ import annotations

import numpy as np

WIKI_PERCENTILES = [3, 9, 16, 30, 48, 64, 76, 87, 97, 106, 116, 126, 136, 147, 159, 172, 187, 207, 232, 272, 790]
SQUAD_PERCENTILES = [41, 88, 110, 120, 127, 133, 139, 145, 150, 157, 164, 172, 179, 188, 198, 210, 223, 247, 272, 320,
                     384]


def sample_lengths(batch: int, max_len: int, padding: str | float, rng: np.random.Generator) -> np.ndarray:
    """`batch` lengths in [1, max_len].

    padding="wiki": drawn from WIKI_PERCENTILES (interpolated), longer paragraphs cut to max_len.
    padding=f in [0, 0.5]: uniform on [(1 - 2f) max_len, max_len], so on average a fraction f is padding.
    """
    if padding == "wiki":
        u = rng.uniform(0, 100, batch)
        lengths = np.interp(u, np.arange(0, 101, 5), WIKI_PERCENTILES)
    else:
        f = float(padding)
        if not 0.0 <= f <= 0.5:
            raise ValueError(f"padding must be 'wiki' or a fraction in [0, 0.5], got {padding}")
        lengths = rng.uniform(max(1.0, (1 - 2 * f) * max_len), max_len, batch)
    return np.clip(np.round(lengths), 1, max_len).astype(np.int64)

"""Every random choice of a run, drawn from one root seed (`--seed`) through a stream of its own.

A stream is a `numpy.random.SeedSequence` of the root seed with its own spawn key, so streams are independent of
each other and of their keys: changing how many evaluation batches run, say, moves nothing in training. Keys
are non-negative integers (an epoch, a shard of the training documents, an instance's index in it), which is
what makes a run the same under any number of ranks or accumulation steps and after a resume: an instance is
masked by (epoch, shard, index), wherever and whenever it is collated. Masking hashes its keys with the token's
position (bert.data.masking.Masker.mask_flat), so a whole micro-batch is masked at once.

| stream        | what it decides                                                   | keys            |
|---------------|-------------------------------------------------------------------|-----------------|
| split         | which documents are held out for evaluation                       | -               |
| nsp           | a shard's sentence pairs in an epoch (lengths, 50% random B)      | epoch, shard    |
| order         | the order of an epoch's shards; a shard's packed rows or batches   | epoch [, shard] |
| masking       | which tokens an instance masks, and how (80% [MASK], 10% random)   | epoch, shard, instance |
| eval_nsp      | the held-out instances                                            | -               |
| eval_masking  | their masking (the same at every evaluation)                      | instance        |
| shuffle       | fine-tuning's example order                                       | epoch           |

Weight initialisation and dropout use torch's global generator, seeded with the root seed at the start
(`torch.manual_seed(seed)`); the trainer's checkpoints carry its state.
"""
from __future__ import annotations

import numpy as np
import torch

STREAMS = ("split", "nsp", "order", "masking", "eval_nsp", "eval_masking", "shuffle")


def sequence(seed: int, stream: str, *keys: int) -> np.random.SeedSequence:
    """The SeedSequence of one stream (and keys) of a root seed; any int seed, negative ones too."""
    if stream not in STREAMS:
        raise ValueError(f"unknown random stream {stream!r} (have: {', '.join(STREAMS)})")
    bad = [k for k in keys if not isinstance(k, (int, np.integer)) or k < 0]
    if bad:
        raise ValueError(f"random stream keys must be non-negative integers, got {bad}")
    return np.random.SeedSequence(int(seed) % 2**64, spawn_key=(STREAMS.index(stream), *map(int, keys)))


def rng(seed: int, stream: str, *keys: int) -> np.random.Generator:
    return np.random.default_rng(sequence(seed, stream, *keys))


def integer(seed: int, stream: str, *keys: int) -> int:
    """A 63-bit seed for a library that takes one (torch.Generator, random.Random)."""
    return int(sequence(seed, stream, *keys).generate_state(1, np.uint64)[0] >> np.uint64(1))


def generator(seed: int, stream: str, *keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(integer(seed, stream, *keys))

"""bert.common.seeds: one root seed, independent named streams, keys that are what they say."""
import numpy as np
import pytest
import torch

from bertfuse.bert.common import seeds


def test_streams_are_deterministic_and_independent():
    a = seeds.rng(7, "masking", 3, 11).integers(0, 2**62, 4)
    assert np.array_equal(a, seeds.rng(7, "masking", 3, 11).integers(0, 2**62, 4))
    others = [seeds.rng(7, "masking", 3, 12), seeds.rng(7, "masking", 4, 11), seeds.rng(7, "order", 3, 11),
              seeds.rng(8, "masking", 3, 11), seeds.rng(7, "masking", 3)]
    assert all(not np.array_equal(a, r.integers(0, 2**62, 4)) for r in others)
    g = seeds.generator(7, "shuffle", 2)
    assert torch.equal(torch.randperm(50, generator=g), torch.randperm(50, generator=seeds.generator(7, "shuffle", 2)))
    assert 0 <= seeds.integer(-3, "nsp", 0) < 2**63  # any int seed, a 63-bit result
    assert seeds.integer(-3, "nsp", 0) != seeds.integer(3, "nsp", 0)


def test_bad_streams_and_keys_are_named():
    with pytest.raises(ValueError, match="unknown random stream 'mask'"):
        seeds.rng(0, "mask")
    with pytest.raises(ValueError, match=r"non-negative integers, got \[-1\]"):
        seeds.generator(0, "masking", 0, -1)
    with pytest.raises(ValueError, match="non-negative integers"):
        seeds.integer(0, "masking", 1.5)

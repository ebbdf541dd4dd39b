"""Shared pytest set-up for tests/ and bench/.

Without a CUDA device the Triton kernels run in Triton's interpreter, which must be switched on before triton
is first imported; this file is loaded before any test module, so it does that here.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when there is one, else the CPU under the Triton interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")

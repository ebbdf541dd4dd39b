"""Shared pytest set-up for tests/ and bench/.

Without a CUDA device the Triton kernels run in Triton's interpreter, which must be switched on before triton
is first imported; this file is loaded before any test module, so it does that here.
"""
import os
import random
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
RUN_SLOW = os.environ.get("RUN_SLOW") == "1"
SLOW_TIERS = ("slow", "compile")


def _in_slow_tier(item) -> bool:
    return any(item.get_closest_marker(m) for m in SLOW_TIERS)


def pytest_report_header(config):
    if not (RUN_SLOW or config.getoption("markexpr")):
        return "tier: fast (RUN_SLOW=1 adds the slow and compile tiers)"
    return None


def pytest_collection_modifyitems(config, items):
    if not (RUN_SLOW or config.getoption("markexpr")):
        slow = [item for item in items if _in_slow_tier(item)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not _in_slow_tier(item)]
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test starts from a seed of its own name: what it draws does not depend on which tests ran before
    it, or on the process (CI runs the suite once; a draw that fails there must fail here too)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when there is one, else the CPU under the Triton interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")

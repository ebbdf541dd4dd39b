"""Shared pytest set-up for tests/ and bench/.

Without a CUDA device the Triton kernels run in Triton's interpreter, which must be switched on before triton
is first imported; this file is loaded before any test module, so it does that here.
"""
import os
import random
import sys
import zlib

import pytest
import torch

# pytest-xdist runs one process a core (pytest.ini): each keeps torch to one thread, so the processes do not
# oversubscribe the cores between them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
RUN_SLOW = os.environ.get("RUN_SLOW") == "1"


def _interpreter_site():
    """tests/interpreter_site/sitecustomize.py, loaded under a name of its own: the interpreter's speed-ups."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "interpreter_site", "sitecustomize.py")
    spec = importlib.util.spec_from_file_location("interpreter_speed_ups", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_interpreter_site().speed_up()  # under TRITON_INTERPRET=1: what the interpreter computes, at a third of its time

SLOW_TIERS = ("slow", "compile")


def _in_slow_tier(item) -> bool:
    return any(item.get_closest_marker(m) for m in SLOW_TIERS)


def _timed_benchmarks(config) -> bool:
    """Whether pytest-benchmark is asked to time its tests (`pytest bench --benchmark-only`)."""
    return bool(config.getoption("benchmark_only", False) or config.getoption("benchmark_enable", False))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini): one process a core, except for pytest-benchmark's timed runs, which run in this
    process alone: timings taken beside other processes mean little."""
    return 0 if _timed_benchmarks(config) else None


def pytest_configure(config):
    """Under pytest-xdist, pytest-benchmark's timed runs are off (pytest_xdist_auto_num_workers runs them in one
    process): said here, so that pytest-benchmark does not warn of it at every run."""
    distributed = config.getoption("dist", "no") != "no" or os.environ.get("PYTEST_XDIST_WORKER")
    if distributed and not _timed_benchmarks(config) and hasattr(config.option, "benchmark_disable"):
        config.option.benchmark_disable = True


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
def _no_warning_given_yet():
    """Each test starts as if no once-per-process warning had been given (kernels._common.warn_once), so what it
    expects to be warned of does not depend on which tests its process ran before it (pytest-xdist spreads them
    over processes in no fixed order)."""
    common = sys.modules.get("bertfuse.kernels._common")
    if common is not None:
        common._warned.clear()


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test starts from a seed of its own name: what it draws does not depend on which tests ran before
    it, or on the process (CI runs the suite once; a draw that fails there must fail here too)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture(autouse=True)
def _refused_model_type(request):
    """On a transformers where fuse refuses a model type's code as not checked (the compatibility tier on an older
    release: bench/results/hf_versions/), a drop-in test of that model type (its `family` parameter, or its name)
    is skipped with the reason; tests/test_hf_code.py checks what fuse does there instead: it refuses, and the
    answer is the unfused model's."""
    name = request.node.path.name
    if not name.startswith(("test_hf", "test_masks")) or name == "test_hf_code.py" \
            or "transformers" not in sys.modules:
        return
    from hf_utils import names_model_type, refused_here

    refused = refused_here()
    callspec = getattr(request.node, "callspec", None)
    family = callspec.params.get("family") if callspec else None
    hit = family if family in refused else next((f for f in refused if names_model_type(request.node.name, f)), None)
    if hit:
        pytest.skip(f"fuse refuses {hit} on this transformers: {refused[hit]}")


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when there is one, else the CPU under the Triton interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")

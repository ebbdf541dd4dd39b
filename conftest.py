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


def _patch_the_language_once_a_launch():
    """Triton's interpreter patches the triton.language modules a kernel's module holds for each launch (its
    GridExecutor), and again at every call of a @triton.jit helper inside the kernel: modules mostly patched
    already, rescanned member by member each time. Here a helper's call patches only where its module holds a
    language module this launch has not patched yet; the launch restores the language as before. Where the
    interpreter is not built so, it is left as it is."""
    import inspect

    from triton import language as tl
    from triton.runtime import interpreter

    names = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")
    if not all(hasattr(interpreter, n) for n in names):
        return
    patch_lang, run, launches = interpreter._patch_lang, interpreter.GridExecutor.__call__, []

    def launch(self, *args, **kwargs):
        launches.append(set())  # the language modules this launch has patched
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    langs_of = {}  # a jit function -> the ids of the language modules its module holds (imported once, at the top)

    def patch_once(fn):
        langs = langs_of.get(fn)
        if langs is None:
            modules = (v for v in fn.__globals__.values() if inspect.ismodule(v))
            langs = langs_of[fn] = {id(v) for v in modules if v in (tl, tl.core)}
        if launches and langs and langs <= launches[-1]:
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        if launches:
            launches[-1] |= langs
        return scope

    interpreter.GridExecutor.__call__ = launch
    interpreter._patch_lang = patch_once


def _skip_overflow_checks_nothing_asserts():
    """The interpreter's integer add, sub and mul compute an overflow check (both operands cast to int64, the
    operation again, two comparisons) and hand it to device_assert, which does nothing unless the interpreter's
    options ask for debugging (they do not: its options are fixed, debug off). That unused check was a third of
    an attention step's time; it is skipped while debug is off, and runs as before when it is on."""
    from triton.runtime import interpreter

    semantic = getattr(interpreter, "interpreter_semantic", None)
    check = getattr(type(semantic), "binary_op_sanitize_overflow_impl", None)
    if check is None or not hasattr(getattr(semantic.builder, "options", None), "debug"):
        return

    def only_when_asserted(lhs, rhs, binary_op):
        if semantic.builder.options.debug:
            return check(semantic, lhs, rhs, binary_op)
        return None

    semantic.binary_op_sanitize_overflow_impl = only_when_asserted


def _derive_each_type_once():
    """Every operation the interpreter runs builds its result's block type again (the shape unwrapped and
    checked, the name formatted) and looks up its numpy dtype in a table it builds at each call. Both depend
    only on the element type and the shape: here each is derived once, by Triton's own code, and remembered. A
    shape Triton refuses is refused every time (it raises before anything is remembered); what cannot be hashed
    (a pointer type) is derived every time. Where the block type holds other fields than these, or the lookup
    is not there, nothing is changed."""
    from triton.language import core
    from triton.runtime import interpreter

    np_dtype, init = getattr(interpreter, "_get_np_dtype", None), core.block_type.__init__
    if np_dtype is None or set(vars(core.block_type(core.float32, [2]))) != {"element_ty", "shape", "numel", "name"}:
        return
    dtypes, blocks = {}, {}

    def key_of(*parts):
        try:
            hash(parts)
            return parts
        except TypeError:
            return None

    def remembered_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, core.block_type) else tt_dtype  # a block's: its element's
        key = key_of(scalar)
        if key not in dtypes:
            if key is None:
                return np_dtype(tt_dtype)
            dtypes[key] = np_dtype(tt_dtype)
        return dtypes[key]

    def remembered_block_type(self, element_ty, shape):
        key = key_of(element_ty, *((type(s), s) for s in shape)) if isinstance(shape, (list, tuple)) else None
        if key is None or key not in blocks:
            init(self, element_ty, shape)
            if key is not None:
                blocks[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = blocks[key]

    interpreter._get_np_dtype = remembered_np_dtype
    core.block_type.__init__ = remembered_block_type


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_a_launch()
    _skip_overflow_checks_nothing_asserts()
    _derive_each_type_once()

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


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when there is one, else the CPU under the Triton interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")

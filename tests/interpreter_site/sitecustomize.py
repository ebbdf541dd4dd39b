"""Triton's interpreter made cheaper, without changing what it computes, for the tests' CPU runs.

Two ways in: conftest.py loads this file and calls `speed_up()` in every test process; and a Python process whose
PYTHONPATH holds this folder (`subprocess_env`) imports it at start-up as `sitecustomize`, which speeds up its
interpreter when TRITON_INTERPRET=1 is set by then: what the tests start that runs kernels in the interpreter in
processes of its own (bench.smoke's workers, under `gpu_check.sh --stages smoke`). tests/test_conftest.py checks
that the kernels give the same bits as in a plain interpreter.
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))


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
    options ask for debugging (they do not: its options are fixed, debug off). That unused check is a third of an
    attention step's time in the plain interpreter; it is skipped while debug is off, and runs when it is on."""
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
    only on the element type and the shape: here each is derived once, by Triton's own code, and remembered,
    keyed by the element type's name and the shape's values (a constexpr's value, not the object; Triton's own
    tuple, which the interpreter mostly passes, as well as a list). A shape Triton refuses is refused every time
    (it raises before anything is remembered). Where the block type holds other fields than these, or the lookup
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

    def dim(s):  # a constexpr hashes by identity: its value is the key (Triton unwraps it to that value)
        v = s.value if isinstance(s, core.constexpr) else s
        return type(v), v

    def remembered_block_type(self, element_ty, shape):
        # What is remembered depends on the element type through its name alone (a pointer type has no hash);
        # the shape's own type is in the key, so one Triton refuses (it asserts on it) is refused every time.
        try:
            key = key_of(type(shape), type(element_ty), str(element_ty), *map(dim, shape))
        except TypeError:  # not iterable: Triton's own check says what is wrong
            key = None
        if key is None or key not in blocks:
            init(self, element_ty, shape)
            if key is not None:
                blocks[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = blocks[key]

    # For the tests: Triton's own derivation (to tell it apart) and what is remembered.
    remembered_block_type.derive, remembered_block_type.blocks = init, blocks
    interpreter._get_np_dtype = remembered_np_dtype
    core.block_type.__init__ = remembered_block_type


def speed_up():
    """Every change above, once a process (conftest.py and a sitecustomize may both ask), under TRITON_INTERPRET=1
    (else triton compiles, and nothing is changed)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    if getattr(interpreter, "_sped_up_for_tests", False):
        return
    interpreter._sped_up_for_tests = True
    _patch_the_language_once_a_launch()
    _skip_overflow_checks_nothing_asserts()
    _derive_each_type_once()


def subprocess_env(env: dict) -> dict:
    """`env` with this folder first on PYTHONPATH: a process started with it imports this file as sitecustomize."""
    return dict(env, PYTHONPATH=os.pathsep.join([HERE, *filter(None, [env.get("PYTHONPATH")])]))


def without_interpreter(**extra) -> dict:
    """This process's environment without TRITON_INTERPRET, plus `extra`: a process started with it decides on
    the interpreter itself (triton compiles; where it cannot, our code takes its PyTorch path or, as bench.smoke
    and gpu_check.sh do, switches the interpreter on)."""
    return dict({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **extra)


if __name__ == "sitecustomize":
    speed_up()

"""Whose transformers code the fused forwards were checked against: a digest of the code each known class (or
function) has in the installed transformers, and the digests recorded as checked (`checked.json`).

A fused forward stands in for a transformers class's code: its forward, the methods and `__init__` that set
what the forward reads, the functions of transformers those call (attention functions such as the modeling
module's eager_attention_forward, rotary application, mask preparation), transitively, and the classes of the
same modeling module they name. `digest(cls)` hashes all of that as it is installed and live now: each
function's normalised source (its syntax tree without docstrings, annotations, comments or layout), read from the
function object actually there, so a release that changes any of it, or a patch of a class's method or of a
module's function at run time, gives another digest. A digest that `checked.json` does not list for that class is
code no one has checked: fuse keeps the original module (`code_problem` says why). The digests are recorded by
`python -m bertfuse.bench.hf_versions --record`, per release, only for the model types whose configuration fuzz
(bench.hf_fuzz) found the fused model giving the unfused answer there; two releases with the same code share one
digest.

`checking(False)` (fuse(..., unchecked_code=True)) fuses unrecorded code too: for testing a new release with the
fuzz, never the default.
"""
from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import hashlib
import inspect
import json
import textwrap
import types
from pathlib import Path

CHECKED_FILE = Path(__file__).with_name("checked.json")

# The oldest transformers release checked (bench/results/hf_versions/); setup.py's extras name the same floor.
OLDEST = "4.57.6"

# The base classes whose code a class's digest includes: the modeling modules' own, and transformers 5's
# self-checkpointing layer (its __call__ runs every layer). PreTrainedModel and the mixins are loading and
# generation machinery, not the math of a forward.
_OWN_BASES = ("transformers.models.", "transformers.modeling_layers")
_DUNDERS = ("__init__", "__call__", "__init_subclass__")
_PRIMITIVES = (int, float, str, bool, type(None))

_CHECKING = contextvars.ContextVar("bertfuse_checking_code", default=True)


@contextlib.contextmanager
def checking(enabled: bool):
    """Within: whether unrecorded code is refused (True, the default) or fused unchecked (False)."""
    token = _CHECKING.set(enabled)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def version_problem() -> str | None:
    """Why the installed transformers is too old to fuse, or None."""
    from packaging.version import Version

    if Version(transformers_version()) < Version(OLDEST):
        return (f"transformers {transformers_version()} is installed; bertfuse supports transformers {OLDEST} and "
                "newer (pip install -U transformers)")
    return None


def qualified(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


@functools.cache
def recorded() -> dict[str, dict[str, list[str]]]:
    """checked.json: qualified name -> {digest: [the releases it was checked on]}."""
    return json.loads(CHECKED_FILE.read_text(encoding="utf-8")) if CHECKED_FILE.exists() else {}


def code_problem(obj) -> str | None:
    """Why `obj`'s installed code (a transformers class or function) is not known to compute what the fused forward
    does, or None: its digest is recorded as checked (or checking is off). The reason says what a user can do:
    the releases on which its code was checked (upgrade to them), or none yet."""
    if not _CHECKING.get():
        return None
    if digest(obj) in recorded().get(qualified(obj), {}):
        return None
    return (f"the code of {obj.__qualname__} in the installed transformers {transformers_version()} has not been "
            f"checked against the fused forward ({_checked_releases(obj)}, or the code was changed at run time; "
            "fuse(..., unchecked_code=True) fuses it anyway)")


def _checked_releases(obj) -> str:
    """Where `obj`'s code was checked, as advice: the oldest checked release after the installed one (upgrade to
    it), else that this release or its code is one bertfuse has not checked."""
    from packaging.version import Version

    releases = sorted({Version(r) for rs in recorded().get(qualified(obj), {}).values() for r in rs})
    newer = [r for r in releases if r > Version(transformers_version())]
    if newer:
        return (f"fused on transformers {newer[0]} and the releases checked after it: "
                f"pip install 'transformers>={newer[0]}'")
    return "a release bertfuse has not checked"


def digest(obj) -> str:
    """The digest of a class's or function's code as installed and live now (see the module docstring)."""
    pieces: dict[str, str] = {}
    _walk(obj, pieces)
    text = "\n".join(f"{k}:{v}" for k, v in sorted(pieces.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _walk(obj, pieces: dict) -> None:
    if isinstance(obj, type):
        _walk_class(obj, pieces)
    elif isinstance(obj, types.FunctionType):
        _walk_function(obj, pieces)


def _walk_class(cls: type, pieces: dict) -> None:
    key = f"class {qualified(cls)}"
    if key in pieces:
        return
    pieces[key] = ",".join(qualified(b) for b in cls.__mro__)
    for base in cls.__mro__:
        if not base.__module__.startswith(_OWN_BASES):
            continue
        assigned = _assigned_in_body(base)
        for name, value in sorted(vars(base).items()):
            if name.startswith("__") and name not in _DUNDERS:
                continue
            where = f"{qualified(base)}.{name}"
            for fn in _functions_of(value):
                own = _unwrapped_from_kernels(fn)
                pieces[where + f"#{own.__name__}"] = _source_digest(own.__code__)
                _walk_function(fn, pieces)
            if name in assigned and _primitive(value):  # not a cache transformers sets on the class later
                pieces[where] = repr(value)


@functools.cache
def _assigned_in_body(cls: type) -> frozenset[str]:
    """The names the class's own body assigns (its data attributes, as written: `is_causal = False`)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    names = set()
    for node in body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return frozenset(names)


def _functions_of(value) -> list[types.FunctionType]:
    """The functions a class attribute holds: a method, static or class method, or a property's accessors."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset) if isinstance(f, types.FunctionType)]
    return [value] if isinstance(value, types.FunctionType) else []


def _primitive(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_primitive(v) for v in value)
    if isinstance(value, dict):
        return all(_primitive(k) and _primitive(v) for k, v in value.items())
    return isinstance(value, _PRIMITIVES)


def _walk_function(fn: types.FunctionType, pieces: dict) -> None:
    """fn's source, what it wraps (a decorator's inner function: its __wrapped__ and closure cells), and the
    functions of transformers and classes of fn's own module that its code names, transitively."""
    key = f"def {fn.__module__}.{fn.__qualname__}"
    value = _source_digest(fn.__code__)
    if value in pieces.get(key, "").split("+"):  # walked already (or the same code under the same name)
        return
    pieces[key] = "+".join(sorted(filter(None, [*pieces.get(key, "").split("+"), value])))
    followed = [getattr(fn, "__wrapped__", None)]
    followed += [c.cell_contents for c in fn.__closure__ or () if _cell_set(c)]
    if _from_kernels(fn):  # a hub-kernel wrapper: what it wraps only (its own code is the kernels library's)
        del pieces[key]
    else:
        followed += [_kernel_function(fn.__globals__.get(name)) for name in _names(fn.__code__)]
    for g in followed:
        if isinstance(g, types.FunctionType) and (g.__module__ or "").startswith("transformers"):
            _walk_function(g, pieces)
        elif isinstance(g, type) and g.__module__ == fn.__module__ and fn.__module__.startswith("transformers."):
            _walk_class(g, pieces)


def _from_kernels(fn) -> bool:
    """A function of Hugging Face's kernels library: the wrappers its decorators (which transformers applies to
    hub-kernel layers and functions) put around transformers' code differ from one kernels release to the next."""
    return (getattr(fn, "__module__", None) or "").split(".")[0] == "kernels"


def _unwrapped_from_kernels(fn):
    """fn, or, for a kernels library's wrapper, the function of transformers it wraps."""
    while _from_kernels(fn):
        inner = [getattr(fn, "__wrapped__", None), *(c.cell_contents for c in fn.__closure__ or () if _cell_set(c))]
        found = next((f for f in inner if isinstance(f, types.FunctionType)), None)
        if found is None:
            return fn
        fn = found
    return fn


def _kernel_function(g):
    """`g`, or the function a hub-kernel function module stands for (the kernels library makes a module of a
    decorated function, e.g. a modeling module's apply_rotary_pos_emb, whose forward calls it)."""
    forward = getattr(type(g), "forward", None) if type(g).__name__ == "Func" else None
    cells = [c.cell_contents for c in getattr(forward, "__closure__", None) or () if _cell_set(c)]
    return next((c for c in cells if isinstance(c, types.FunctionType)), g)


def _cell_set(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _names(code: types.CodeType) -> set[str]:
    """The global names code (and the functions nested in it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


@functools.lru_cache(maxsize=None)
def _source_digest(code: types.CodeType) -> str:
    """The digest of the normalised source of one code object (keyed by the code object: a patch is a new one)."""
    try:
        source = textwrap.dedent(inspect.getsource(code))
    except (OSError, TypeError):  # no source (a function made at run time): unknown unless recorded so
        return f"nosource:{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}"
    try:
        text = ast.dump(_Normalise().visit(ast.parse(source)), annotate_fields=False, include_attributes=False)
    except SyntaxError:  # a lambda inside a longer line: its line, without layout
        text = " ".join(source.split())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Normalise(ast.NodeTransformer):
    """Drops what does not change what code computes: docstrings and annotations."""

    def _body(self, node):
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        return node

    def visit_FunctionDef(self, node):
        node.returns = None
        self.generic_visit(node)
        return self._body(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self.generic_visit(node)
        return self._body(node)

    def visit_Module(self, node):
        self.generic_visit(node)
        return self._body(node)

    def visit_arg(self, node):
        node.annotation = None
        return node

    def visit_AnnAssign(self, node):
        if node.value is None:
            return None
        return ast.Assign(targets=[node.target], value=self.visit(node.value))

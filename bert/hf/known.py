"""Whose code is known, and the fused classes given to it.

A module is fused only where its class is known to compute the fused op's math: a class a family module names
for its model types (`known_classes`), or a subclass adding nothing but __init__ (`unknown_code`), and only where
that class's code, as installed and live now, is a variant recorded as checked (bertfuse.bert.hf.code: a release
not checked, or a class patched at run time, keeps its code). Look-alikes
with BERT's submodule names around other attention (MRA, Nystromformer, YOSO) keep their code, with the reason in
fuse_report. A fused module keeps its object and gets `fused_class(its class, a fused forward)`, a subclass that
pickles as "this class, fused", and that transformers' kernelize leaves alone.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable

from torch import nn

from bertfuse.bert.hf.code import code_problem
from bertfuse.bert.hf.records import Padded, _padded_call
from bertfuse.bert.model import ops


class _NotAHubLayer:
    """A fused class's `kernel_layer_name`, read as absent (AttributeError, so hasattr is False): transformers'
    kernelize (kernels.kernelize, also run by `model.train()`/`eval()` on a model with kernels in use) looks for
    that name on each module's class, and so never binds a hub kernel's forward over the fused one."""
    def __get__(self, obj, cls=None):
        raise AttributeError("kernel_layer_name: a fused module is not for kernelize")


_NOT_A_HUB_LAYER = _NotAHubLayer()


@functools.cache
def fused_class(base: type, forward: Callable) -> type:
    """`base` (a transformers module class) with `forward` (one of the package's fused forwards) as its forward:
    fuse sets it as one module object's __class__, and unfuse puts base back. It pickles (and deep-copies) as
    "this base class, fused with this forward", not by a dynamic name."""
    def fused_or_original(self, *args, **kwargs):  # an ONNX export exports the original code
        if not isinstance(self, fused):
            # unfused since this bound forward was taken: a wrapper transformers 4.57's output capturing left on
            # the instance when a call raised holds it. The module's own class's code runs, as unfused.
            return type(self).forward(self, *args, **kwargs)
        if ops.exporting_onnx():
            return base.forward(self, *args, **kwargs)
        if isinstance(kwargs.get("packed"), Padded):  # a call recording hidden states: padded in and out
            return _padded_call(forward, self, args, kwargs)
        return forward(self, *args, **kwargs)

    def reduce(self, protocol):
        return _new_fused, (base, forward), self.__dict__

    fused_or_original.__signature__ = inspect.signature(base.forward)  # what callers introspect (inputs_embeds...)
    namespace = {"forward": fused_or_original, "__reduce_ex__": reduce, "__module__": __name__,
                 "_bertfuse_base": base, "_bertfuse_forward": forward}
    if hasattr(base, "kernel_layer_name"):
        namespace["kernel_layer_name"] = _NOT_A_HUB_LAYER
    if hasattr(base, "is_custom_code"):
        # A model fused whole is still transformers' code to transformers (which initialises the weights of code
        # from elsewhere differently, judging by the class's module).
        namespace["is_custom_code"] = classmethod(lambda cls: base.is_custom_code())
    fused = type(f"Fused{base.__name__}", (base,), namespace)
    return fused


def _new_fused(base: type, forward: Callable):
    return object.__new__(fused_class(base, forward))


# transformers' own attention functions by implementation name: any of them computes softmax(q k^T s + mask) v.
_ATTENTION_FUNCTIONS = {"sdpa": "sdpa_attention.sdpa_attention_forward",
                        "flex_attention": "flex_attention.flex_attention_forward",
                        **{f"flash_attention_{n}": "flash_attention.flash_attention_forward" for n in (2, 3, 4)}}


@functools.cache
def known_classes(names: tuple[str, ...], models: tuple[tuple[str, str], ...]) -> tuple[type, ...]:
    """The classes `names` ("{P}" the model's class-name prefix) in each transformers modeling module of
    `models` this transformers has; a name it lacks (older or newer releases name a few differently) is skipped."""
    found = []
    for module, prefix in models:
        try:
            mod = importlib.import_module(f"transformers.models.{module}")
        except ImportError:
            continue
        for name in names:
            cls = getattr(mod, name.replace("{P}", prefix), None)
            if isinstance(cls, type) and cls not in found:
                found.append(cls)
    return tuple(found)


def unknown_code(module: nn.Module, known: tuple[type, ...]) -> str | None:
    """Why `module` may compute something other than `known`'s code, or None where it cannot: its class is one
    of `known`, or a subclass of one adding nothing but __init__ and data (any method of its own, even a helper
    the forward calls, could change the math), no method is replaced on the instance (a hub kernel's forward,
    `ops.hub_kernel`, is another implementation of the class's function: fuse sets it aside), and the known
    class's installed code is a checked variant (`code.code_problem`)."""
    cls = getattr(type(module), "_bertfuse_base", type(module))  # a module fuse gave a fused class: its own
    base = next((c for c in cls.__mro__ if c in known), None)
    if base is None:
        return f"{cls.__name__} is not a class whose math the fused op is known to match"
    for sub in cls.__mro__[:cls.__mro__.index(base)]:
        own = sorted(n for n, v in vars(sub).items() if n != "__init__" and not _checkpointing_wrapper(sub, n, v)
                     and (callable(v) or isinstance(v, (property, staticmethod, classmethod))))
        if own:
            return f"{sub.__name__} overrides {', '.join(own)} of {base.__name__}"
    hub = ops.hub_kernel(module) is not None
    patched = sorted(n for n, v in vars(module).items()
                     if callable(v) and inspect.isfunction(getattr(cls, n, None)) and not (hub and n == "forward")
                     and not (n == "forward" and self_bound_forward(module)))
    if patched:
        return f"{cls.__name__}.{patched[0]} is replaced on this instance"
    return code_problem(base)


def self_bound_forward(module: nn.Module) -> bool:
    """The instance holds its own class's forward, bound to itself: the same code as holding none (transformers
    5.0's output capturing puts the forward it wrapped back so, as an instance attribute)."""
    f = vars(module).get("forward")
    return inspect.ismethod(f) and f.__self__ is module and f.__func__ is getattr(type(module), "forward", None)


def _checkpointing_wrapper(sub: type, name: str, value) -> bool:
    """transformers 5's GradientCheckpointingLayer wraps `forward` anew in every subclass, one that defines none
    too: such a wrapper around the inherited forward adds no code of the subclass's own."""
    return getattr(value, "__wrapped__", None) is getattr(super(sub, sub), name, None) and \
        getattr(getattr(value, "__code__", None), "co_name", "") == "forward_with_checkpointing"


def _attention_function_problem(cfg) -> str | None:
    """Why the configured attention implementation may compute something else, or None (eager, or transformers'
    own function under its own name; a function registered in its place is not known)."""
    impl = getattr(cfg, "_attn_implementation", None)
    if impl in (None, "eager"):
        return None
    if impl not in _ATTENTION_FUNCTIONS:
        return f"attention implementation {impl!r}, which the fused attention does not know"
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # transformers before the registry: the implementation picks one of the known classes
        return None
    fn = ALL_ATTENTION_FUNCTIONS.get(impl)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    if name != f"transformers.integrations.{_ATTENTION_FUNCTIONS[impl]}":
        return f"attention implementation {impl!r} is registered to {name}, not transformers' own function"
    return code_problem(fn)


def _is_fused(module: nn.Module) -> bool:
    return "_bertfuse_base" in vars(type(module))

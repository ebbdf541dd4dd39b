"""pytest plugin: with BERTFUSE_MODE=fused, every transformers model of the family under test is passed through
`bert.hf.fuse` as soon as its outermost constructor returns (a task model's inner encoder model is fused with it,
once). Loaded by bench/hf_suite.py with `-p bertfuse.bench.hf_testers.plugin`; does nothing in the unfused run."""
from __future__ import annotations

import functools
import importlib
import os
import threading

_depth = threading.local()


def _fusing_init(init):
    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        from bertfuse.bert.hf import fuse

        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _depth.n -= 1
        if _depth.n == 0:
            fuse(self)
    return wrapped


def model_classes(module) -> list[type]:
    """Every PreTrainedModel subclass a transformers modeling module defines."""
    from transformers import PreTrainedModel

    return [c for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == module.__name__]


def modeling_module(family: str):
    """The transformers modeling module of a bert.hf family: the one defining its base model class (NomicBERT's
    is nomic_bert.modeling_nomic_bert)."""
    import transformers

    from bertfuse.bert.hf import family as record

    return importlib.import_module(getattr(transformers, record(family).prefix + "Model").__module__)


def pytest_configure(config):
    if os.environ.get("BERTFUSE_MODE") != "fused":
        return
    for cls in model_classes(modeling_module(os.environ["BERTFUSE_FAMILY"])):
        if "__init__" in vars(cls):
            cls.__init__ = _fusing_init(vars(cls)["__init__"])

"""Fused Triton kernels for BERT, forward and backward, each usable on its own.

One module per op (`attention`, `bias_gelu`, `layer_norm`, `mlm_loss`, and any added next to them): its kernels,
launcher, custom op, function and module drop-in, then its `RECORD` (kernels/_record.py), what the benchmark,
tuning and check tools need to know about it. This package imports every such module, exports the names in its
`__all__`, and lists the records in `RECORDS`: a new op file is picked up without editing this one.

Importing this package imports triton. On a machine without CUDA the kernels run on CPU tensors in Triton's
interpreter, which must be enabled with TRITON_INTERPRET=1 before triton is first imported.
"""

import importlib as _importlib
import pkgutil as _pkgutil

import bert as _bert

if not getattr(_bert, "__bertfuse__", False):  # another distribution's `bert` shadows ours (see bert.collision)
    raise ImportError(f"`import bert` found {_bert!r}, not bertfuse's `bert`: a package of the same name from another "
                      "distribution shadows it (README: Installing next to other packages)")
__bertfuse__ = True

RECORDS = []
__all__ = []
for _info in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("_") or _info.name == "tuned":  # helpers and the launch-config tables: not ops
        continue
    _module = _importlib.import_module(f"{__name__}.{_info.name}")
    RECORDS.append(_module.RECORD)
    for _name in _module.__all__:  # a function may shadow its module's name (kernels.layer_norm is the function)
        globals()[_name] = getattr(_module, _name)
    __all__ += _module.__all__
RECORDS = tuple(RECORDS)

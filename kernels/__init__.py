"""Fused Triton kernels for BERT, forward and backward: a library of its own (torch and triton only).

One module per op (`attention`, `bias_gelu`, `layer_norm`, `mlm_loss`, and any added next to them): its kernels,
launcher, custom op, function, module drop-in and plain-PyTorch reference (`<op>_ref`), which the drop-in runs
where the kernels cannot (`backend_for`). This package imports every such module and exports the names in its
`__all__`: a new op file is picked up without editing this one. `targets` names the GPU families the launchers
know and `tuned` reads their launch-config tables (`configs/<family>.json`).

Importing this package imports triton. On a machine without CUDA the kernels run on CPU tensors in Triton's
interpreter, which must be enabled with TRITON_INTERPRET=1 before triton is first imported.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from ._common import backend_for, exporting_onnx

__bertfuse__ = True  # this distribution's `kernels`, not another package of the same name (what imports it may check)

__all__ = ["backend_for", "exporting_onnx"]
for _info in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("_") or _info.name in ("targets", "tuned"):  # the GPU families, their tables: not ops
        continue
    _module = _importlib.import_module(f"{__name__}.{_info.name}")
    for _name in _module.__all__:  # a function may shadow its module's name (kernels.layer_norm is the function)
        globals()[_name] = getattr(_module, _name)
    __all__ += _module.__all__

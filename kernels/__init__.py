"""Fused Triton kernels for BERT, forward and backward: a library of its own (torch and triton only).

One module per op (`attention`, `bias_gelu`, `layer_norm`, `mlm_loss`, and any added next to them): its kernels,
launcher, custom op, function, module drop-in and plain-PyTorch reference (`<op>_ref`), which the drop-in runs
where the kernels cannot (`backend_for`). This package imports every such module and exports the names in its
`__all__`: a new op file is picked up without editing this one. `launches` holds every op's launch sites (its
kernels, default and candidate configs) and records launches without a GPU, `targets` names the GPU families the
launchers know and `tuned` reads their launch-config tables (`configs/<family>.json`). `refusal` answers whether an op's
kernels run on a device, in a dtype, at a shape, and if not why; `backend_for` is the drop-in modules'
choice and `backend_of` says it in words.

Importing this package imports triton. On a machine without CUDA the kernels run on CPU tensors in Triton's
interpreter, which must be enabled with TRITON_INTERPRET=1 before triton is first imported.
"""

if __name__ == "kernels":  # the bare folder name, from the repository root: not this package's name (bertfuse._bare)
    from bertfuse._bare import elsewhere

    elsewhere(__name__, __file__)
else:
    import importlib as _importlib
    import pkgutil as _pkgutil

    import torch as _torch

    from . import targets as _targets
    from ._common import backend_for, backend_of, device_refusal, exporting_onnx, warn_once

    __all__ = ["backend_for", "backend_of", "exporting_onnx", "refusal", "warn_once"]
    _OPS = {}
    for _info in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if _info.name.startswith("_") or _info.name in ("launches", "targets", "tuned"):  # sites, families, tables
            continue
        _module = _OPS[_info.name] = _importlib.import_module(f"{__name__}.{_info.name}")
        for _name in _module.__all__:  # a function may shadow its module's name (kernels.layer_norm is the function)
            globals()[_name] = getattr(_module, _name)
        __all__ += _module.__all__


    def refusal(op: str, device=None, dtype: _torch.dtype | None = None, **shape) -> str | None:
        """Why op `op` (a module name here: "attention", "layer_norm", ...) cannot run its Triton kernels, or None
        where it can: on `device` (`device_refusal`: a GPU older than the kernels support, a CPU without the
        interpreter), in `dtype` on that device's GPU family (`targets.refusal`: bfloat16 before sm_80; for an op
        built on half-precision dots, a family where Triton has no tensor-core dots), at `shape` (the op's own
        limits, such as attention's head_dim=). What is not given is not judged."""
        if op not in _OPS:
            raise KeyError(f"kernels has no op {op!r} (have: {', '.join(_OPS)})")
        module = _OPS[op]
        device = None if device is None else _torch.device(device)
        why = device_refusal(device) if device is not None else None
        if why is None and dtype is not None:
            target = _targets.of(device) if device is not None else None
            why = _targets.refusal(op, dtype, target, getattr(module, "DOTS", False))
        if why is None and shape:
            if not hasattr(module, "shape_refusal"):
                raise TypeError(f"kernels.refusal: op {op!r} has no shape limits to judge ({', '.join(shape)})")
            why = module.shape_refusal(**shape)
            why = why and f"{op}: {why}"
        return why

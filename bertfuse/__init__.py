"""bertfuse: BERT with fused Triton kernels.

    from bertfuse import fuse, unfuse, fuse_report   # the drop-in for Hugging Face encoders (bertfuse.bert.hf)
    from bertfuse import kernels                     # the fused ops themselves (imports triton)

The repository's folders are this package's parts: `kernels/` is `bertfuse.kernels`, `bert/` is `bertfuse.bert`
(the model, its training and the drop-in) and `bench/` is `bertfuse.bench` (the benchmarks). The three drop-in
functions are imported at first use, so `import bertfuse` alone imports neither transformers nor triton.

Installed (a wheel or `pip install -e .`), the parts are where setup.py puts them. In a source checkout that is
not installed (`PYTHONPATH=.`, as bench/gpu_check.sh runs on a bare machine), this folder's parent, the
repository root, is on this package's path, so the parts import from the folders beside this one.
"""
import os as _os

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "kernels")) and _os.path.isfile(_os.path.join(_ROOT, "setup.py")):
    __path__.append(_ROOT)

_DROP_IN = ("fuse", "unfuse", "fuse_report")
__all__ = list(_DROP_IN)


def __getattr__(name: str):
    if name in _DROP_IN:
        from bertfuse.bert import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'bertfuse' has no attribute {name!r}")

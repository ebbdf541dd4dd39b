"""`import kernels`, `import bert` and `import bench` never answer with this repository's folders.

The folders install as `bertfuse.kernels`, `bertfuse.bert` and `bertfuse.bench`. Run from the repository root
(`python -c`, `python -m`, `pytest`), the current directory is on sys.path, so a bare `import kernels` (which
transformers makes for Hugging Face's hub-kernel package), `import bert` or `import bench` would find the folder
itself. Each folder's __init__ hands such an import to `elsewhere`, which gives what the import gives without the
repository on sys.path: another distribution's package of that name, or, where none is installed, an empty
module without a file or a version, as Python makes of an empty namespace package (transformers counts that as
not installed).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types


def _foreign_spec(name: str, root: str):
    """How `import name` resolves with the repository root taken off sys.path, or None."""
    folder = os.path.join(root, name)
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(name, path)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, None)
        else:
            continue
        origin = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), None))
        if spec is not None and not (origin and os.path.realpath(origin).startswith(folder + os.sep)):
            return spec
    return None


def _empty(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"No package named {name!r} is installed (bertfuse's folder of that name is "
                                    f"`bertfuse.{name}`).")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    return module


def elsewhere(name: str, init_file: str) -> types.ModuleType:
    """Called by a folder's __init__ when it runs as top-level `name`: puts in sys.modules, in its place, what
    `import name` finds outside the repository (see the module docstring), and returns that."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
    sys.modules.pop(name, None)
    spec = _foreign_spec(name, root)
    if spec is None:
        sys.modules[name] = module = _empty(name)
        return module
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return sys.modules[name]

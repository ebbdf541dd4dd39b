"""Import names bertfuse shares with other distributions: it installs `bert`, `kernels` and `bench` as top-level
packages, names other distributions use too (Hugging Face's hub-kernel package installs `kernels`). Installing
both makes one shadow or overwrite the other; each of ours carries the marker `__bertfuse__`, and the imports
across them check it (`ours`)."""
from __future__ import annotations


def collision(name: str, module) -> str:
    """What happened and what to do when `import name` finds another distribution's package."""
    from importlib.metadata import packages_distributions

    owners = sorted(set(packages_distributions().get(name, [])) - {"bertfuse"})
    by = f"the distribution(s) {', '.join(owners)}" if owners else "another distribution or a directory on sys.path"
    return (f"`import {name}` found {getattr(module, '__file__', None) or module!r}, which is not bertfuse's "
            f"`{name}` package: {by} provide(s) a package of the same name and shadow or overwrite ours. "
            f"Use separate virtual environments, or `pip uninstall {owners[0] if owners else name}` and reinstall "
            "bertfuse (`pip install --force-reinstall --no-deps -e .` from its source tree).")


def ours(name: str, module):
    """`module`, the result of `import name`, if it is bertfuse's package (kernels, bench); else ImportError
    saying which package took its place. A plain attribute check: torch.compile traces it."""
    if not getattr(module, "__bertfuse__", False):
        raise ImportError(collision(name, module))
    return module

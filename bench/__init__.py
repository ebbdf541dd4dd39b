"""Benchmarks of this project against baseline PyTorch (`bert-bench`, `python -m bench`)."""

import bert as _bert

if not getattr(_bert, "__bertfuse__", False):  # another distribution's `bert` shadows ours (see bert.common.packages)
    raise ImportError(f"`import bert` found {_bert!r}, not bertfuse's `bert`: a package of the same name from another "
                      "distribution shadows it (README: Installing next to other packages)")
__bertfuse__ = True

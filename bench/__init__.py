"""Benchmarks of this project against baseline PyTorch (`bert-bench`, `python -m bertfuse.bench`)."""

if __name__ == "bench":  # the bare folder name, from the repository root: not this package's name (bertfuse._bare)
    from bertfuse._bare import elsewhere

    elsewhere(__name__, __file__)

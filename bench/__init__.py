"""Benchmarks of this project against baseline PyTorch (`bert-bench`, `python -m bench`)."""

"""The model: its configuration (config.py), the conversion of padded calls to the packed layout (padding.py), the
one switch between PyTorch and the Triton kernels (ops.py), BERT and its heads (modeling.py), and Hugging Face
checkpoint interop (checkpoint.py).
"""

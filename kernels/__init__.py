"""Fused Triton kernels for BERT, forward and backward, each usable on its own.

Importing this package imports triton. On a machine without CUDA the kernels run on CPU tensors in Triton's
interpreter, which must be enabled with TRITON_INTERPRET=1 before triton is first imported.
"""

import bert as _bert

if not getattr(_bert, "__bertfuse__", False):  # another distribution's `bert` shadows ours (see bert.collision)
    raise ImportError(f"`import bert` found {_bert!r}, not bertfuse's `bert`: a package of the same name from another "
                      "distribution shadows it (README: Installing next to other packages)")
__bertfuse__ = True
from .attention import padded_attention, varlen_attention
from .bias_gelu import LinearGeLU, bias_gelu
from .layer_norm import LayerNorm, fuse_layer_norms, layer_norm
from .mlm_loss import masked_lm_loss

__all__ = ["LayerNorm", "layer_norm", "fuse_layer_norms", "LinearGeLU", "bias_gelu", "varlen_attention", "padded_attention",
           "masked_lm_loss"]

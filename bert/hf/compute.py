"""The fused computations the family modules' forwards are made of, and the forwards every family shares.

Each computation calls the modules the user put there, and reads around a module (its weight, its epsilon)
only where it is plain (`ops.plain`: exactly the expected class, no hooks, its own forward): a LoRA layer, a
quantised Linear or a hooked dropout is called as the unfused code calls it, and the fused kernel computes the
rest. The fused forwards here and in the family modules are given to module objects by `fused_class` (their
class becomes a subclass of their own); called without `packed`, or in an ONNX export, a module computes what
its own class computes (`_original`).

Names with a leading underscore are this package's own: its modules import them from one another; what users
import is in bertfuse.bert.hf.
"""
from __future__ import annotations

import functools
import inspect

import torch.nn.functional as F
from torch import nn

from bertfuse.bert.model import ops


def _warn(reason: str) -> None:
    ops.warn_once(f"fuse: {reason}")


def _get(module, path: str):
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _has(module, *paths: str) -> bool:
    return all(_get(module, p) is not None for p in paths)


@functools.cache
def _forward_parameters(cls: type) -> frozenset[str]:
    """The parameter names of a module class's own forward (a fused class's: its base's): how a release's code
    is called, where releases differ (transformers before 5 hands encoders head masks and output flags)."""
    cls = getattr(cls, "_bertfuse_base", cls)
    return frozenset(inspect.signature(cls.forward).parameters)


def _unique(items) -> tuple:
    return tuple(dict.fromkeys(items))


def gelu_kind(act) -> str | None:
    """'none' (erf) or 'tanh' for a GeLU activation module of transformers or torch; None for anything else."""
    name = type(act).__name__
    if isinstance(act, nn.GELU):
        return act.approximate
    if name == "GELUActivation" and not getattr(act, "use_gelu_python", False):
        return "none"
    if name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh"):  # not FastGELU: other constants
        return "tanh"
    return None


def glu_kind(act) -> str | None:
    """The kernels' name of a gated unit's activation module ("gelu", "gelu_tanh", "silu"), None for another."""
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(gelu_kind(act))


# ---- the fused computations: each calls the modules the user put there, and reads around a module only where
# it is plain (ops.plain: exactly the expected class, no hooks, its own forward) ----------------------------------
def _linear_gelu(linear, act, x):
    """act(linear(x)), act None meaning the erf GeLU function (RoBERTa's lm_head): the matmul without its bias,
    then bias + GeLU in one kernel, where the Linear is a plain biased nn.Linear and the activation a hookless
    GeLU; otherwise both modules are called, so the activation applies to whatever the Linear module returns (a
    LoRA layer's sum, a quantised Linear's output)."""
    kind = "none" if act is None else gelu_kind(act) if ops.hookless(act) else None
    if kind and ops.plain(linear, nn.Linear) and linear.bias is not None:
        return ops.linear_gelu(x, linear.weight, linear.bias, kind, backend=ops.backend_for(x))
    h = linear(x)
    return F.gelu(h) if act is None else act(h)


def _add_norm(norm, dropout, h, residual):
    """norm(dropout(h) + residual) (dropout None: none) in one LayerNorm kernel where both modules are plain; a
    dropout or LayerNorm that is not (hooks, another class) is called as the unfused code calls it."""
    p = 0.0
    if dropout is not None:
        if ops.plain(dropout, nn.Dropout):
            p = dropout.p if dropout.training else 0.0
        else:
            h = dropout(h)
    if (eps := _layer_norm_eps(norm)) is not None:
        return ops.layer_norm(h, norm.weight, norm.bias, eps, residual, p, backend=ops.backend_for(h))
    return norm((F.dropout(h, p) if p else h) + residual)


def _add_then_norm(norm, h, residual):
    """(norm(h + residual), h + residual), a pre-norm layer's next input and its residual stream, from one
    LayerNorm or RMSNorm kernel where the norm is plain; else the add, then the norm called."""
    if (eps := _layer_norm_eps(norm)) is not None:
        return ops.layer_norm(h, norm.weight, norm.bias, eps, residual, backend=ops.backend_for(h),
                              return_sum=True)
    if _plain_rms_norm(norm):
        return _rms_norm(norm, h, residual)
    total = h + residual
    return norm(total), total


def _layer_norm_eps(norm) -> float | None:
    """The epsilon of a LayerNorm whose parameters a fused op may read instead of calling it: a plain nn.LayerNorm
    (or the kernels') over one dimension, or a family's own LayerNorm class made the kernel's (DebertaLayerNorm:
    the same function, its epsilon `variance_epsilon`); None for any other norm, which is called."""
    if ops.plain(norm, nn.LayerNorm, ops.kernels_package().LayerNorm) and len(norm.normalized_shape) == 1:
        return norm.eps
    if getattr(type(norm), "_bertfuse_forward", None) is _family_layer_norm_forward and ops.hookless(norm):
        return norm.variance_epsilon
    return None


def _plain_rms_norm(norm) -> bool:
    """An RMSNorm module fuse made a kernel's (a known family's class: EuroBertRMSNorm), without hooks."""
    return getattr(type(norm), "_bertfuse_forward", None) is _rms_norm_forward and ops.hookless(norm)


def _rms_norm(norm, x, residual=None):
    """norm(x) (residual given: (norm(x + residual), x + residual)) for a family's RMSNorm module, in one
    kernel."""
    return ops.layer_norm(x, norm.weight, None, norm.variance_epsilon, residual, backend=ops.backend_for(x),
                          rms=True, return_sum=residual is not None)


def _gate(act, a, b):
    """act(a) * b in one kernel where the activation is a hookless GeLU or SiLU; else the module called."""
    kind = glu_kind(act) if ops.hookless(act) else None
    if kind:
        return ops.glu(a, b, kind, backend=ops.backend_for(a))
    return act(a) * b


def _dropout_rate(dropout) -> float:
    """The rate of an attention's probabilities dropout: an nn.Dropout's p, or the float its code passes on."""
    return dropout if isinstance(dropout, float) else dropout.p


def _attend(attention, query, key, value, dropout, x, p, bias=None):
    """The attention context [tokens, hidden] of packed tokens x, before any output projection; q, k and v by
    their modules (ops.project_qkv), the dropout on the probabilities (`dropout`, a plain nn.Dropout: the encoder
    checks; or the rate its code passes on) and the relative-position bias (a kernels.RelativePositionBias, or
    None) inside the kernel."""
    heads = getattr(attention, "num_attention_heads", None) or attention.n_heads
    dropout_p = _dropout_rate(dropout) if attention.training else 0.0
    return ops.self_attention(x, p, query, key, value, heads, attention.attention_head_size, dropout_p,
                              ops.backend_for(x), position_bias=bias)


# ---- the fused forwards every family shares ----------------------------------------------------------------
def _original(module):
    """The module's own class's methods (its fused class's base), bound to it."""
    return super(type(module), module)


def _output_block_forward(self, hidden_states, input_tensor):
    """BertSelfOutput / BertOutput and their copies: LayerNorm(dropout(dense(x)) + residual)."""
    return _add_norm(self.LayerNorm, self.dropout, self.dense(hidden_states), input_tensor)


def _rms_norm_forward(self, hidden_states):
    """EuroBertRMSNorm: weight * x / sqrt(mean(x^2) + variance_epsilon), in one kernel."""
    return _rms_norm(self, hidden_states)


def _family_layer_norm_forward(self, hidden_states):
    """DebertaLayerNorm: weight * (x - mean) / sqrt(var + variance_epsilon) + bias, statistics in float32, in one
    kernel."""
    return ops.layer_norm(hidden_states, self.weight, self.bias, self.variance_epsilon,
                          backend=ops.backend_for(hidden_states))

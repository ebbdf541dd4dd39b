"""Every op in torch.ops.bertfuse passes torch.library.opcheck (its schema, fake implementation, autograd
registration, and a dynamic-shape trace), forward and backward ops alike.

The ops are listed from the dispatcher's registry, not named here. Their samples are recorded: each call in
`CALLS` runs a public kernels entry (awkward shapes, gradients on) forward and backward under a dispatch mode that
keeps the arguments of every bertfuse op it reaches, so a backward op, or an op a new entry calls, is checked
without a test of its own. An op no call reaches fails the test, naming itself: add a call that reaches it."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.kernels.attention import RelativePositionBias  # noqa: E402
from bertfuse.kernels.disentangled import DisentangledPositions  # noqa: E402
from bertfuse.kernels.rotary import Rotary  # noqa: E402

NAMESPACE = "bertfuse"


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


CU = torch.tensor([0, 3, 4, 9], dtype=torch.int32)   # lengths 3, 1, 5, and a filler token after them (10 tokens)


def _attention():
    q, k, v = _leaves((10, 2, 8), (10, 2, 8), (10, 2, 8))
    return kernels.varlen_attention(q, k, v, CU, 5, dropout_p=0.25, seed=3)


def _attention_bias_window_gqa():
    q, k, v, table = _leaves((10, 4, 8), (10, 2, 8), (10, 2, 8), (6, 4), seed=1)
    return kernels.varlen_attention(q, k, v, CU, 5, position_bias=RelativePositionBias(table, 6, 8),
                                    window_size=(2, 1))


def _disentangled():
    q, k, v, pk, pq = _leaves((10, 2, 8), (10, 2, 8), (10, 2, 8), (8, 2, 8), (8, 2, 8), seed=2)
    return kernels.disentangled_attention(q, k, v, CU, 5, DisentangledPositions(pk, pq, 4, 12), dropout_p=0.2,
                                          seed=5)


def _bias_gelu():
    x, b = _leaves((5, 3, 12), (12,), seed=3)
    return kernels.bias_gelu(x, b) + kernels.bias_gelu(x, b, approximate="tanh")


def _glu():
    a, b = _leaves((7, 10), (7, 10), seed=4)
    return kernels.glu(a, b, "gelu")


def _layer_norm():
    x, r, w, b = _leaves((6, 12), (6, 12), (12,), (12,), seed=5)
    out, total = kernels.layer_norm(x, w, b, residual=r, dropout_p=0.1, training=True, seed=7, return_sum=True)
    return out + total + kernels.rms_norm(x, w)


def _rotary():
    x, = _leaves((10, 2, 8), seed=6)
    cos, sin = torch.randn(9, 4), torch.randn(9, 4)
    positions = kernels.rotary_positions(CU, 10)
    return kernels.rotary(x, positions, Rotary(torch.rand(3))) + kernels.rotary(x, positions,
                                                                                 Rotary(None, 1.0, True, cos, sin))


LABELS = torch.tensor([3, -100, 0, 12, -100, 5, 5, -100, 1, 9, -100])


def _mlm_loss(strategy):
    hidden, weight, bias = _leaves((11, 8), (13, 8), (13,), seed=7)
    return kernels.masked_lm_loss(hidden, weight, bias, LABELS, strategy=strategy, chunk_rows=3) + \
        kernels.masked_lm_loss(hidden, weight, None, LABELS, reduction="sum", strategy=strategy, chunk_rows=3) + \
        kernels.masked_lm_loss(hidden, weight, bias, LABELS, reduction="none", strategy=strategy, chunk_rows=3).sum()


def _labelled_rows():
    """The op labelled_rows calls where the row count is unknown to the caller (under torch.compile)."""
    from bertfuse.kernels.mlm_loss import _labelled_rows as op

    return op(LABELS, -100)


def _lamb():
    """One optimizer step (no autograd: the weights it returns have no gradient to follow)."""
    weights = [torch.nn.Parameter(w.detach()) for w in _leaves((5, 3), (7,), seed=8)]
    for w in weights:
        w.grad = torch.ones_like(w)
    kernels.Lamb([{"params": weights[:1]}, {"params": weights[1:], "weight_decay": 0.0}], lr=0.1).step()
    return weights[0].detach()


CALLS = {"attention": _attention, "attention, bias, window, grouped heads": _attention_bias_window_gqa,
         "disentangled attention": _disentangled, "bias + GeLU": _bias_gelu, "GLU": _glu,
         "LayerNorm and RMSNorm": _layer_norm, "rotary": _rotary,
         "MLM loss, fused": functools.partial(_mlm_loss, "fused"),
         "MLM loss, chunked": functools.partial(_mlm_loss, "chunked"), "labelled rows": _labelled_rows,
         "LAMB step": _lamb}


class _Recorder(TorchDispatchMode):
    """Keeps (op, args, kwargs) of every bertfuse op called, its tensors copied; in backward (`grads` False)
    copied without gradients, as the backward pass hands them."""

    def __init__(self):
        super().__init__()
        self.calls, self.grads = [], True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == NAMESPACE:
            def copy(t):
                if not isinstance(t, torch.Tensor):
                    return t
                return t.detach().clone().requires_grad_(self.grads and t.requires_grad)
            self.calls.append((func, *torch.utils._pytree.tree_map(copy, (args, kwargs))))
        return func(*args, **kwargs)


@functools.cache
def samples() -> dict[str, list]:
    """op name -> the (op, args, kwargs) recorded for it from every call in CALLS."""
    found = {}
    for call in CALLS.values():
        recorder = _Recorder()
        with recorder:
            out = call()
            recorder.grads = False
            if out.requires_grad:
                out.float().sum().backward()
        for func, args, kwargs in recorder.calls:
            found.setdefault(func._schema.name, []).append((func, args, kwargs))
    return found


def registered_ops() -> list[str]:
    """Every op of the namespace in the dispatcher's registry (the kernels package imported registers them)."""
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(f"{NAMESPACE}::"))


def test_every_registered_op_is_reached_by_a_sample_call():
    ops = registered_ops()
    assert len(ops) >= 17, ops
    missing = [op for op in ops if op not in samples()]
    assert not missing, f"no call in CALLS reaches {missing}: add one that does"


@pytest.mark.compile
@pytest.mark.parametrize("op", registered_ops())
def test_op_passes_opcheck(op):
    for func, args, kwargs in samples().get(op, [])[:2]:  # the first two samples of each op: shapes differ
        result = torch.library.opcheck(func, args, kwargs)
        assert set(result.values()) == {"SUCCESS"}, (op, result)

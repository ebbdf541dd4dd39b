"""bert.model.ops, the one backend switch: its PyTorch paths against plain float64 references."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from bertfuse.bert.data.batch import packed_layout
from bertfuse.bert.model import ops


def test_resolve_backend():
    assert ops.resolve_backend("torch") == "torch"
    assert ops.resolve_backend("auto") == ("triton" if torch.cuda.is_available() else "torch")
    with pytest.raises(ValueError, match="backend must be 'auto', 'torch' or 'triton'"):
        ops.resolve_backend("cuda")


def test_auto_backend_skips_gpus_older_than_the_kernels_support(monkeypatch):
    monkeypatch.setattr(ops, "_HAS_TRITON", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, backend in (((7, 0), "torch"), ((7, 5), "triton"), ((9, 0), "triton")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert ops.resolve_backend("auto") == backend, capability


def test_half_precision_attention_runs_in_pytorch_where_triton_has_no_tensor_core_dots(monkeypatch):
    """On an sm_75 GPU (faked here) the Triton attention would run its dots on the CUDA cores: the model's
    attention takes the PyTorch path there, with one warning; float32 keeps the kernel."""
    kernels = pytest.importorskip("bertfuse.kernels")
    from bertfuse.kernels.targets import TARGETS

    monkeypatch.setattr(kernels.targets, "of", lambda device: TARGETS["sm_75"])
    monkeypatch.setattr(ops, "warn_once", lambda message: warnings.warn(message))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    p = packed_layout(cu, 12, 7, False)
    q, k, v = (torch.randn(12, 2, 16, generator=torch.Generator().manual_seed(i)).half() for i in range(3))
    with pytest.warns(UserWarning, match="no tensor-core dots on sm_75.*PyTorch"):
        out = ops.varlen_attention(q, k, v, p, backend="triton")
    torch.testing.assert_close(out, ops.varlen_attention(q, k, v, p, backend="torch"), rtol=0, atol=0)
    assert kernels.targets.dots_refusal("attention", torch.float32, TARGETS["sm_75"]) is None


def test_the_triton_table_names_a_public_entry_point_of_every_op_of_the_kernels():
    kernels = pytest.importorskip("bertfuse.kernels")

    assert set(ops.TRITON) == {s.op for s in kernels.launches.sites()}  # a new op is one row here
    for op, name in ops.TRITON.items():
        assert name in kernels.__all__ and getattr(kernels, name).__module__ == f"bertfuse.kernels.{op}", (op, name)


def test_attention_refusal_names_what_the_kernel_cannot_take():
    pytest.importorskip("bertfuse.kernels")
    assert "head_dim 200 is not supported" in ops.attention_refusal(200)
    assert ops.attention_refusal(64) is None and ops.attention_refusal(8, torch.device("cpu"), torch.float32) is None


def test_backend_for_follows_where_the_kernels_run():
    """CPU tensors take the kernels only under Triton's interpreter (conftest sets it on a machine without CUDA);
    CUDA tensors always do."""
    from bertfuse.kernels._common import INTERPRET

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning (tests/test_hf.py checks it)
        assert ops.backend_for(torch.zeros(1)) == ("triton" if INTERPRET else "torch")
    if torch.cuda.is_available():
        assert ops.backend_for(torch.zeros(1, device="cuda")) == "triton"


def _reference_attention(q, k, v, cu):
    out = torch.zeros_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) / q.shape[-1] ** 0.5
            out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:b])
    return out


@pytest.mark.parametrize("cu, max_seqlen, row_aligned", [
    ([0, 7, 19, 24], 12, False),          # sequences crossing rows of 12, then 12 filler tokens
    ([0, 0, 5, 8, 12, 16, 16, 20], 8, True),  # rows of 8 none crosses, empty sequences, a tail, 4 filler tokens
    ([0, 1], 1, False),                   # one token
])
def test_torch_attention_any_layout_against_float64(cu, max_seqlen, row_aligned):
    total = 24 if len(cu) > 2 else 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, 2, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor(cu, dtype=torch.int32)
    p = packed_layout(cu, total, max_seqlen, row_aligned)
    out = ops.varlen_attention(q, k, v, p, backend="torch")
    want = _reference_attention(q, k, v, cu)
    torch.testing.assert_close(out, want)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    for a, b in zip(got, torch.autograd.grad((want * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b)
    filler = torch.arange(total) >= cu[-1]
    assert (out[filler] == 0).all() and all((grad[filler] == 0).all() for grad in got)


@pytest.mark.parametrize("cu, max_seqlen, row_aligned", [([0, 7, 19, 24], 12, False),
                                                      ([0, 0, 5, 8, 12, 16, 16, 20], 8, True)])
def test_torch_attention_with_a_relative_position_bias(cu, max_seqlen, row_aligned):
    """The PyTorch path adds the same bias as the kernels (counted from each sequence's first token), and the
    table gets its gradient, in both layouts."""
    kernels = pytest.importorskip("bertfuse.kernels")
    total = 24
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(total, 2, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.randn(16, 2, generator=g, dtype=torch.float64, requires_grad=True)
    bias = kernels.RelativePositionBias(table, 16, 9)
    cu = torch.tensor(cu, dtype=torch.int32)
    out = ops.varlen_attention(q, k, v, packed_layout(cu, total, max_seqlen, row_aligned), backend="torch",
                               position_bias=bias)
    want = kernels.varlen_attention_ref(q, k, v, cu, position_bias=bias)
    torch.testing.assert_close(out, want)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got, expected = (torch.autograd.grad((t * w).sum(), (q, table)) for t in (out, want))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cu, max_seqlen, row_aligned", [([0, 7, 19, 24], 12, False),
                                                      ([0, 0, 5, 8, 12, 16, 16, 20], 8, True)])
def test_torch_disentangled_attention_means_what_the_kernels_do(cu, max_seqlen, row_aligned):
    """The PyTorch path of DeBERTa's attention (the [sequences, heads, L, L] scores formed) adds the same c2p and
    p2c terms as the kernels' reference, counted from each sequence's first token, both tables getting their
    gradients, in both layouts; filler tokens get zeros."""
    kernels = pytest.importorskip("bertfuse.kernels")
    total = 24
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(total, 2, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pk, pq = (torch.randn(8, 2, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    positions = kernels.DisentangledPositions(pk, pq, 4, 6)
    cu = torch.tensor(cu, dtype=torch.int32)
    out = ops.disentangled_attention(q, k, v, packed_layout(cu, total, max_seqlen, row_aligned), positions, 0.2)
    want = kernels.disentangled_attention_ref(q, k, v, cu, positions, softmax_scale=0.2)
    torch.testing.assert_close(out, want)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got, expected = (torch.autograd.grad((t * w).sum(), (q, k, pk, pq)) for t in (out, want))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert (out[int(cu[-1]):] == 0).all()


@pytest.mark.parametrize("cu, max_seqlen, row_aligned", [([0, 7, 19, 24], 12, False),
                                                      ([0, 0, 5, 8, 12, 16, 16, 20], 8, True),
                                                      ([0, 0, 9], 9, False)])  # an empty sequence first
@pytest.mark.parametrize("window", [(2, 1), (0, -1), (-1, -1)])
def test_torch_attention_with_grouped_heads_and_a_window(cu, max_seqlen, row_aligned, window):
    """The PyTorch path's grouped-query heads and sliding window mean what the kernels' do
    (kernels.varlen_attention_ref), output and gradients, in both layouts; and the Triton path agrees."""
    kernels = pytest.importorskip("bertfuse.kernels")
    total = 24
    g = torch.Generator().manual_seed(3)
    q = torch.randn(total, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(total, 2, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = torch.tensor(cu, dtype=torch.int32)
    p = packed_layout(cu, total, max_seqlen, row_aligned)
    out = ops.varlen_attention(q, k, v, p, backend="torch", window_size=window)
    want = kernels.varlen_attention_ref(q, k, v, cu, window_size=window)
    torch.testing.assert_close(out, want)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got, expected = (torch.autograd.grad((t * w).sum(), (q, k, v)) for t in (out, want))
    for a, b in zip(got, expected):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)
    fused = ops.varlen_attention(*(t.detach().float() for t in (q, k, v)), p, backend="triton", window_size=window)
    torch.testing.assert_close(fused.double(), want.detach(), rtol=1e-5, atol=1e-5)


def test_rotary_glu_and_rms_norm_paths_agree():
    """Each new op's PyTorch path here against its kernel (float32) and the kernels' float64 reference."""
    kernels = pytest.importorskip("bertfuse.kernels")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, 3, 20, generator=g)
    positions = torch.arange(11) * 5
    for interleaved, rotary_dim in ((False, 20), (True, 12)):
        rotation = ops.Rotation(1.0 / 500 ** (torch.arange(0, rotary_dim, 2) / rotary_dim), 0.8, interleaved)
        want = kernels.rotary_ref(x.double(), positions, kernels.Rotary(*rotation))
        for backend in ("torch", "triton"):
            torch.testing.assert_close(ops.rotary(x, positions, rotation, backend).double(), want, rtol=1e-5,
                                       atol=1e-5)
    a, b = torch.randn(2, 2, 9, 16, generator=g).unbind(0)
    for act in ("gelu", "gelu_tanh", "silu"):
        want = kernels.glu_ref(a.double(), b.double(), act)
        for backend in ("torch", "triton"):
            torch.testing.assert_close(ops.glu(a, b, act, backend).double(), want, rtol=1e-5, atol=1e-5)
    h, r, wt = torch.randn(6, 24, generator=g), torch.randn(6, 24, generator=g), torch.randn(24, generator=g)
    for rms in (False, True):
        want = kernels.layer_norm_ref(h.double(), wt.double(), None, 1e-6, r.double(), rms=rms, return_sum=True)
        for backend in ("torch", "triton"):
            got = ops.layer_norm(h, wt, None, 1e-6, r, backend=backend, rms=rms, return_sum=True)
            for a_, w_ in zip(got, want):
                torch.testing.assert_close(a_.double(), w_, rtol=1e-5, atol=1e-5)


def test_torch_layer_norm_and_linear_gelu():
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    w, b = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5, residual=r), F.layer_norm(x + r, (7,), w, b, 1e-5))
    lin = torch.randn(3, 7, generator=g, dtype=torch.float64)
    bias = torch.randn(3, generator=g, dtype=torch.float64)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(ops.linear_gelu(x, lin, bias, approximate),
                                   F.gelu(x @ lin.T + bias, approximate=approximate))


def test_torch_masked_lm_loss_ignores_unused_and_out_of_vocab_rows():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(10, 6, generator=g, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)
    labels = torch.tensor([3, -100, 12, 9])  # one unused slot, one label outside the vocabulary
    out = ops.masked_lm_loss(h, w, b, labels)
    logits = h @ w.T + b
    torch.testing.assert_close(out.loss.double(), F.cross_entropy(logits[[0, 3]], labels[[0, 3]]), rtol=1e-6, atol=1e-6)
    assert out.correct.item() == int((logits[[0, 3]].argmax(-1) == labels[[0, 3]]).sum())
    none = ops.masked_lm_loss(h, w, b, torch.full((4,), -100))
    none.loss.backward()
    assert none.loss.item() == 0 and (h.grad == 0).all()


@pytest.mark.parametrize("window, bias", [((-1, -1), False), ((2, 1), False), ((-1, -1), True)])
def test_torch_attention_with_key_spans(window, bias):
    """Key spans (padded positions kept as queries only, Packed.keys): the PyTorch path means what the kernels'
    reference does, with a window or MPNet's bias, a span in the middle, a prefix, a suffix and an empty one
    (whose queries get 0); the Triton path agrees; DeBERTa's PyTorch path too."""
    from bertfuse.bert.data.batch import KeySpans

    kernels = pytest.importorskip("bertfuse.kernels")
    total = 24
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(total, 2, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 7, 12, 19, 22], dtype=torch.int32)
    spans = dict(key_start=torch.tensor([2, 0, 3, 0], dtype=torch.int32),
                 seqused_k=torch.tensor([3, 4, 4, 0], dtype=torch.int32))
    p = packed_layout(cu, total, 7)._replace(keys=KeySpans(spans["key_start"], spans["seqused_k"]))
    rel = kernels.RelativePositionBias(torch.randn(16, 2, generator=g, dtype=torch.float64), 16, 9) if bias else None
    out = ops.varlen_attention(q, k, v, p, backend="torch", window_size=window, position_bias=rel)
    want = kernels.varlen_attention_ref(q, k, v, cu, window_size=window, position_bias=rel, **spans)
    torch.testing.assert_close(out, want)
    assert not out[19:].any()  # the sequence without keys, and the filler
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got, expected = (torch.autograd.grad((t * w).sum(), (q, k, v)) for t in (out, want))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    rel32 = None if rel is None else rel._replace(table=rel.table.float())
    fused = ops.varlen_attention(*(t.detach().float() for t in (q, k, v)), p, backend="triton", window_size=window,
                                 position_bias=rel32)
    torch.testing.assert_close(fused.double(), want.detach(), rtol=1e-5, atol=1e-5)
    pk, pq = (torch.randn(8, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    positions = kernels.DisentangledPositions(pk, pq, 4, 6)
    deberta = ops.disentangled_attention(q, k, v, p, positions, 0.25)
    plain = ops.disentangled_attention(q, k, v, packed_layout(cu, total, 7), positions, 0.25)
    assert not deberta[19:22].any() and not torch.allclose(deberta[:7], plain[:7])

"""pytest-benchmark micro-benchmarks of each kernel against PyTorch (`pytest bench --benchmark-only`).

Sized for the CPU (Triton interpreter) when there is no GPU, where the numbers say nothing about kernel speed,
only that the benchmarks run; on a GPU they use BERT-base shapes in bfloat16.
"""
import pytest
import torch
import torch.nn.functional as F

kernels = pytest.importorskip("kernels")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOKENS = 16384 if CUDA else 64


def fwd_bwd(fn, *inputs):
    def run():
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        if CUDA:
            torch.cuda.synchronize()
    return run


def leaf(*shape):
    return torch.randn(*shape, device=DEV, dtype=DTYPE, requires_grad=True)


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_layer_norm(benchmark, impl):
    x, r, w, b = leaf(TOKENS, 768), leaf(TOKENS, 768), leaf(768), leaf(768)
    if impl == "ours":
        fn = lambda: kernels.layer_norm(x, w, b, 1e-12, residual=r, dropout_p=0.1)  # noqa: E731
    else:
        fn = lambda: F.layer_norm(F.dropout(x, 0.1) + r, (768,), w, b, 1e-12)  # noqa: E731
    benchmark(fwd_bwd(fn))


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_bias_gelu(benchmark, impl):
    x, b = leaf(TOKENS, 3072), leaf(3072)
    fn = (lambda: kernels.bias_gelu(x, b)) if impl == "ours" else (lambda: F.gelu(x + b))
    benchmark(fwd_bwd(fn))


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_attention(benchmark, impl):
    batch, seq, heads = (64, 512, 12) if CUDA else (2, 32, 2)
    lengths = torch.randint(seq // 2, seq + 1, (batch,))
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    cu = cu.to(DEV)
    q, k, v = (leaf(int(lengths.sum()), heads, 64) for _ in range(3))
    mask = (torch.arange(seq)[None] < lengths[:, None]).to(DEV)
    if impl == "ours":
        fn = lambda: kernels.varlen_attention(q, k, v, cu, seq, validate=False)  # noqa: E731
    else:
        qp, kp, vp = (leaf(batch, heads, seq, 64) for _ in range(3))
        bias = torch.zeros(batch, 1, 1, seq, device=DEV, dtype=DTYPE).masked_fill(~mask[:, None, None], -1e4)
        fn = lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=bias)  # noqa: E731
    benchmark(fwd_bwd(fn))


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_mlm_loss(benchmark, impl):
    n, vocab, h = (4915, 30522, 768) if CUDA else (16, 512, 32)
    hidden, weight, bias = leaf(n, h), leaf(vocab, h), leaf(vocab)
    labels = torch.randint(0, vocab, (n,), device=DEV)
    if impl == "ours":
        fn = lambda: kernels.masked_lm_loss(hidden, weight, bias, labels)  # noqa: E731
    else:
        fn = lambda: F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)  # noqa: E731
    benchmark(fwd_bwd(fn))

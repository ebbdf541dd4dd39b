"""kernels._common.dropout_keep: eight keep decisions per Philox call, laid out as its docstring says."""
import pytest
import torch

from kernel_utils import binomial_ok

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
common = pytest.importorskip("bertfuse.kernels._common")


@triton.jit
def _philox_words_kernel(Out, seed, BLOCK: tl.constexpr):
    """Out [4, BLOCK]: the four Philox words of groups 0..BLOCK-1, as int64 (non-negative)."""
    g = tl.arange(0, BLOCK).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, g)
    tl.store(Out + g, r0.to(tl.int64) & 0xFFFFFFFF)
    tl.store(Out + BLOCK + g, r1.to(tl.int64) & 0xFFFFFFFF)
    tl.store(Out + 2 * BLOCK + g, r2.to(tl.int64) & 0xFFFFFFFF)
    tl.store(Out + 3 * BLOCK + g, r3.to(tl.int64) & 0xFFFFFFFF)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_element_8g_plus_s_uses_sixteen_bit_half_s_of_group_g(device, p):
    check_layout(device, p)


@pytest.mark.gpu
def test_gpu_compiled_layout():
    check_layout(torch.device("cuda"), 0.1)


def check_layout(device, p):
    seed, groups = 1234, 64
    words = torch.empty((4, groups), dtype=torch.int64, device=device)
    _philox_words_kernel[(1,)](words, seed, BLOCK=groups)
    halves = torch.stack([words & 0xFFFF, words >> 16], dim=1).reshape(8, groups)   # r0 lo, r0 hi, r1 lo, ...
    expected = (halves >= round(p * 65536)).t().reshape(-1).cpu()                   # element 8g + s
    # Rows of 24 columns (three groups each) and of 20 (padded to 24): both read the same groups in order.
    assert torch.equal(common.keep_mask(seed, 21, 24, p, device).reshape(-1).cpu(), expected[:21 * 24])
    ragged = common.keep_mask(seed, 21, 20, p, device).cpu()
    assert torch.equal(ragged, expected[:21 * 24].view(21, 24)[:, :20])


@pytest.mark.parametrize("p", [0.0, 0.1, 0.9])
def test_keep_rate_and_seeds(device, p):
    keep = common.keep_mask(7, 300, 1000, p, device)
    assert binomial_ok(int(keep.sum()), keep.numel(), 1 - p)
    assert torch.equal(keep, common.keep_mask(7, 300, 1000, p, device))
    if p:
        other = common.keep_mask(8, 300, 1000, p, device)
        assert not torch.equal(keep, other)
        # Different seeds give independent masks: the two agree about as often as chance says.
        agree = int((keep == other).sum())
        assert binomial_ok(agree, keep.numel(), p * p + (1 - p) * (1 - p))

"""kernels.varlen_attention / padded_attention against per-sequence softmax(QK^T * scale) V in float64."""
import math

import pytest
import torch

from kernel_utils import binomial_ok, case_seed, check_against_reference

kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.kernels.attention import attention_dropout_mask  # noqa: E402


def cu_of(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def reference(q, k, v, lengths, scale, keep=None, p=0.0):
    """Plain per-sequence attention; `keep` [heads, total, max_len] applies dropout to the probabilities."""
    outs, start = [], 0
    for n in lengths:
        qq, kk, vv = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        probs = torch.softmax(qq @ kk.transpose(-1, -2) * scale, dim=-1)
        if keep is not None:
            probs = probs * keep[:, start:start + n, :n] / (1 - p)
        outs.append((probs @ vv).transpose(0, 1))
        start += n
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def run_case(lengths, heads, dim, dtype, device, p=0.0, seed=0, scale=None):
    g = torch.Generator().manual_seed(case_seed(tuple(lengths), heads, dim, str(dtype)))
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, heads, dim, generator=g).to(device) for _ in range(4))
    cu = cu_of(lengths, device)
    max_len = max(lengths) if lengths else 0
    sm = 1 / math.sqrt(dim) if scale is None else scale
    keep = attention_dropout_mask(cu, heads, max_len, p, seed).to(torch.float64) if p > 0 else None

    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = kernels.varlen_attention(*leaves, cu, max_len, dropout_p=p, softmax_scale=scale, seed=seed)
    assert out.shape == q.shape and out.dtype == dtype
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    # The reference sees the same (rounded) inputs, so only the arithmetic differs.
    leaves64 = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    out64 = reference(*leaves64, lengths, sm, keep, p)
    grads64 = torch.autograd.grad(out64, leaves64, do.double())
    same = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out_same = reference(*same, lengths, sm, keep.to(dtype) if keep is not None else None, p)
    grads_same = torch.autograd.grad(out_same, same, do.to(dtype))
    # Inputs are standard normal, so outputs and gradients are O(1): that is the floor of the error scale.
    check_against_reference("out", out, out64, out_same, dtype, floor=1.0)
    for name, a, r, s in zip(("dq", "dk", "dv"), grads, grads64, grads_same):
        check_against_reference(name, a, r, s, dtype, floor=1.0)
    return out, grads


# Lengths include 0, 1 and non-multiples of the block sizes (16 and 32 in the interpreter, 32 to 128 compiled).
LENGTHS = [37, 0, 1, 16, 50]


# The fast tier runs a subset of each sweep; RUN_SLOW=1 runs the rest (the float16 sweep covers 16 and 64 too).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("dim", [pytest.param(16, marks=SLOW), 32, pytest.param(64, marks=SLOW), 128])
def test_float32_head_dims(device, dim):
    run_case(LENGTHS, 2, dim, torch.float32, device)


@pytest.mark.parametrize("dim", [1, pytest.param(8, marks=SLOW), 24, pytest.param(80, marks=SLOW)])
def test_head_dims_padded_inside_the_kernel(device, dim):
    """Heads narrower than 16 (transformers' tiny test models use 8) or not a power of two run on tiles zero-padded
    to the next power of two >= 16: the padded lanes must add nothing to q.k and never be stored (a strided
    view whose head is followed by other data shows it: those columns must not change, nor leak into dq)."""
    run_case(LENGTHS, 2, dim, torch.float32, device)
    run_case([9, 3], 1, dim, torch.float16, device)
    g = torch.Generator().manual_seed(dim)
    wide = torch.randn(sum(LENGTHS), 2, 3 * dim, generator=g).to(device)  # q, k, v as column slices of one buffer
    q, k, v = (wide[..., i * dim:(i + 1) * dim] for i in range(3))
    before = wide.clone()
    out = kernels.varlen_attention(q, k, v, cu_of(LENGTHS, device), max(LENGTHS))
    assert torch.equal(wide, before)
    assert torch.allclose(out, reference(q.double(), k.double(), v.double(), LENGTHS, dim ** -0.5).float(),
                          atol=1e-5)


@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("heads", [1, 3])
def test_float16(device, dim, heads):
    run_case(LENGTHS, heads, dim, torch.float16, device)


def test_bfloat16(device):
    """bfloat16 on every device: in the interpreter (whose bf16 tl.dot is wrong) the dots run on float32 copies."""
    run_case(LENGTHS, 2, 32, torch.bfloat16, device)


def test_single_token_sequences_and_custom_scale(device):
    run_case([1, 1, 1], 2, 32, torch.float32, device, scale=0.37)


def test_padded_attention_equals_varlen(device):
    torch.manual_seed(0)
    batch, heads, seqlen, dim = 3, 2, 21, 32
    lengths = [21, 5, 0]
    mask = (torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]).to(device)
    q, k, v = (torch.randn(batch, heads, seqlen, dim, device=device, requires_grad=True) for _ in range(3))
    out = kernels.padded_attention(q, k, v, mask)
    packed = [t.detach().transpose(1, 2)[mask.bool()].requires_grad_() for t in (q, k, v)]
    ref = kernels.varlen_attention(*packed, cu_of(lengths, device), max(lengths))
    assert torch.allclose(out.transpose(1, 2)[mask.bool()], ref, atol=1e-6)
    # Padded query rows (and the whole all-padding row) are exactly 0, with zero gradient into them.
    assert torch.equal(out.transpose(1, 2)[~mask.bool()], torch.zeros_like(out.transpose(1, 2)[~mask.bool()]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
        assert torch.equal(t.grad.transpose(1, 2)[~mask.bool()], torch.zeros_like(t.grad.transpose(1, 2)[~mask.bool()]))


def test_padded_attention_with_holes_in_the_mask(device):
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 1, 9, 16, device=device) for _ in range(3))
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0, 0], [1] * 9], device=device)
    out = kernels.padded_attention(q, k, v, mask)
    keep = mask[0].bool()
    probs = torch.softmax(q[0, 0, keep] @ k[0, 0, keep].T / 4, -1)
    assert torch.allclose(out[0, 0, keep], probs @ v[0, 0, keep], atol=1e-6)


def test_empty_batch_and_zero_length_sequences(device):
    q = torch.zeros(0, 2, 16, device=device, requires_grad=True)
    out = kernels.varlen_attention(q, q, q, cu_of([0, 0], device), 0)
    out.sum().backward()
    assert out.shape == (0, 2, 16) and q.grad.shape == (0, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_against_reference_with_kernel_mask(device, dtype):
    run_case([23, 0, 9], 2, 16, dtype, device, p=0.2, seed=99)


def test_dropout_rate_determinism_and_p_zero(device):
    lengths, heads, dim, p = [40, 24], 2, 16, 0.1
    cu = cu_of(lengths, device)
    keep = attention_dropout_mask(cu, heads, 40, p, 5)
    used = sum(heads * n * n for n in lengths)
    kept = sum(int(keep[:, s:s + n, :n].sum()) for s, n in zip([0, 40], lengths))
    assert binomial_ok(kept, used, 1 - p)
    torch.manual_seed(0)
    q, k, v = (torch.randn(64, heads, dim, device=device) for _ in range(3))
    a = kernels.varlen_attention(q, k, v, cu, 40, dropout_p=p, seed=5)
    assert torch.equal(a, kernels.varlen_attention(q, k, v, cu, 40, dropout_p=p, seed=5))
    assert not torch.equal(a, kernels.varlen_attention(q, k, v, cu, 40, dropout_p=p, seed=6))
    plain = kernels.varlen_attention(q, k, v, cu, 40)
    assert torch.equal(plain, kernels.varlen_attention(q, k, v, cu, 40, dropout_p=0.0, seed=5))
    assert torch.allclose(plain, reference(q, k, v, lengths, 0.25), atol=1e-6)


@pytest.mark.parametrize("change, err, match", [
    (lambda q, cu: dict(q=torch.randn(10, 2, 136), k=torch.randn(10, 2, 136), v=torch.randn(10, 2, 136)),
     ValueError, "head_dim 136 is not supported"),
    (lambda q, cu: dict(k=q[:, :1]), ValueError, "shapes differ"),
    (lambda q, cu: dict(k=q[:5], v=q[:5]), ValueError, "shapes differ"),
    (lambda q, cu: dict(v=q.half()), TypeError, "dtypes differ"),
    (lambda q, cu: dict(q=q.long(), k=q.long(), v=q.long()), TypeError, "must be float16"),
    (lambda q, cu: dict(cu_seqlens=cu.long()), TypeError, "cu_seqlens must be a 1-D int32"),
    (lambda q, cu: dict(cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), ValueError, "non-decreasing"),
    (lambda q, cu: dict(cu_seqlens=torch.tensor([0, 4, 11], dtype=torch.int32)), ValueError,
     "ends at 11 but there are only 10 tokens"),
    (lambda q, cu: dict(cu_seqlens=torch.tensor([1, 4, 10], dtype=torch.int32)), ValueError, "start at 0"),
    (lambda q, cu: dict(max_seqlen=3), ValueError, "max_seqlen=3 but a sequence has 6"),
    (lambda q, cu: dict(k=q.to("meta")), ValueError, "k is on meta"),
    (lambda q, cu: dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (lambda q, cu: dict(k=q, v=q, q=torch.randn(10, 3, 16)), ValueError,
     "q has 3 heads, which is not a multiple of k and v's 2"),
    (lambda q, cu: dict(window_size=(4,)), ValueError, r"window_size must be \(left, right\)"),
    (lambda q, cu: dict(window_size=(-2, 3)), ValueError, "window_size must be"),
    (lambda q, cu: dict(window_size=(1.5, 3)), ValueError, "window_size must be"),
])
def test_bad_inputs(change, err, match):
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    kw = dict(q=q, k=q, v=q, cu_seqlens=cu, max_seqlen=6)
    kw.update(change(q, cu))
    with pytest.raises(err, match=match):
        kernels.varlen_attention(**kw)


def run_window_case(lengths, heads, kv_heads, dim, dtype, device, window=(-1, -1), p=0.0, filler=2, bias=False,
                    spans=None):
    """varlen_attention with grouped-query heads and/or a sliding window (and MPNet's bias), and/or key spans
    (`spans`: (key_start, seqused_k) per sequence), against varlen_attention_ref: the output and the gradients of
    q, k, v (k and v with kv_heads heads)."""
    from bertfuse.kernels.attention import RelativePositionBias, varlen_attention_ref

    g = torch.Generator().manual_seed(case_seed(tuple(lengths), heads, kv_heads, dim, str(dtype), window, p))
    total = sum(lengths) + filler
    q, do = (torch.randn(total, heads, dim, generator=g).to(device) for _ in range(2))
    k, v = (torch.randn(total, kv_heads, dim, generator=g).to(device) for _ in range(2))
    table = torch.randn(32, heads, generator=g).to(device) if bias else None
    cu, max_len = cu_of(lengths, device), max(lengths)
    keep = attention_dropout_mask(cu, heads, max_len, p, 7, total) if p > 0 else None

    if spans is not None:
        start, used = (torch.tensor(t, dtype=torch.int32, device=device) for t in zip(*spans))
        kw_spans = dict(key_start=start, seqused_k=used)
    else:
        kw_spans = {}

    def run(cast, fn, **kw):
        leaves = [t.to(dtype).to(cast).requires_grad_() for t in (q, k, v)]
        rel = RelativePositionBias(table.to(dtype).to(cast)) if bias else None
        out = fn(*leaves, cu, dropout_p=p, window_size=window, position_bias=rel, **kw_spans, **kw)
        return [out, *torch.autograd.grad(out, leaves, do.to(dtype).to(cast))]

    ours = run(dtype, kernels.varlen_attention, max_seqlen=max_len, seed=7)
    exact = run(torch.float64, varlen_attention_ref, keep=keep)
    same = run(dtype, varlen_attention_ref, keep=keep)
    for name, a, r, s in zip(("out", "dq", "dk", "dv"), ours, exact, same):
        assert a.dtype == dtype and a.shape == r.shape, name
        check_against_reference(name, a, r, s, dtype, floor=1.0)
    assert not ours[0][sum(lengths):].any()  # filler: zero output
    return ours


@pytest.mark.parametrize("heads, kv_heads, window", [
    pytest.param(4, 2, (-1, -1), marks=SLOW),     # grouped-query heads alone (EuroBERT's num_key_value_heads)
    pytest.param(3, 1, (-1, -1), marks=SLOW),     # one k/v head for all (multi-query)
    (2, 2, (5, 5)),       # a symmetric window narrower than a tile (ModernBERT's local attention)
    pytest.param(2, 2, (0, -1), marks=SLOW),      # keys from the query on only
    (4, 2, (17, 3)),      # both, the window lopsided and wider than a tile
])
def test_grouped_heads_and_sliding_window(device, heads, kv_heads, window):
    run_window_case(LENGTHS, heads, kv_heads, 16, torch.float32, device, window)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, marks=SLOW), torch.bfloat16])
def test_grouped_heads_and_window_half_precision(device, dtype):
    run_window_case(LENGTHS, 4, 2, 32, dtype, device, (9, 9))


@SLOW
def test_window_with_dropout_and_relative_bias(device):
    run_window_case([23, 0, 9, 40], 4, 2, 16, torch.float32, device, (6, 11), p=0.2, bias=True)


# Per sequence of LENGTHS (37, 0, 1, 16, 50): the keys a prefix (right padding), none of an empty sequence, none
# at all (a query with no key: output 0), a suffix (left padding), a run in the middle across tile edges.
SPANS = [(0, 20), (0, 0), (0, 0), (5, 11), (9, 30)]


@pytest.mark.parametrize("heads, kv_heads, window, bias, p", [
    (2, 2, (-1, -1), False, 0.0),
    (4, 2, (6, 11), False, 0.0),                 # grouped heads and a window cut by the span
    pytest.param(2, 2, (-1, -1), True, 0.2, marks=SLOW),   # MPNet's bias and dropout
])
def test_key_spans(device, heads, kv_heads, window, bias, p):
    """seqused_k and key_start: every token a query, only each sequence's span of keys attended to; keys outside
    the spans get no gradient, and a sequence with no key gives 0 (its queries' gradients 0 too)."""
    out, dq, dk, dv = run_window_case(LENGTHS, heads, kv_heads, 16, torch.float32, device, window, p=p, bias=bias,
                                      spans=SPANS)
    cu = [0, 37, 37, 38, 54, 104]
    assert not out[37].any() and not dq[37].any()  # the length-1 sequence with no key
    outside = torch.ones(out.shape[0], dtype=torch.bool)
    for first, (start, used) in zip(cu, SPANS):
        outside[first + start:first + start + used] = False
    assert not dk[outside.to(dk.device)].any() and not dv[outside.to(dv.device)].any()


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=SLOW)])
def test_key_spans_half_precision(device, dtype):
    run_window_case(LENGTHS, 2, 2, 32, dtype, device, spans=SPANS)


def test_key_spans_checked(device):
    q = torch.randn(10, 2, 16, device=device)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    used = torch.tensor([4, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="key span"):
        kernels.varlen_attention(q, q, q, cu, 6, seqused_k=used, key_start=used)  # 4 + 3 > 6 in the second
    with pytest.raises(ValueError, match="seqused_k must be an int32"):
        kernels.varlen_attention(q, q, q, cu, 6, seqused_k=used.long())
    with pytest.raises(ValueError, match="pass seqused_k"):
        kernels.varlen_attention(q, q, q, cu, 6, key_start=used)


def test_tiles_outside_the_window_are_never_read(device):
    """The kernels walk only the tiles a block's window reaches: keys and values far outside every window of the
    first queries hold NaN, and those queries' outputs and gradients stay finite and exact (a masked tile would
    still have read the NaN into its sums)."""
    seqlen, dim, window = 64, 16, (2, 2)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(seqlen, 1, dim, generator=g).to(device) for _ in range(3))
    cu = cu_of([seqlen], device)
    ref = kernels.varlen_attention_ref(q, k, v, cu, window_size=window)
    k[48:], v[48:] = float("nan"), float("nan")
    out = kernels.varlen_attention(q, k, v, cu, seqlen, window_size=window)
    torch.testing.assert_close(out[:16], ref[:16], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out[:16]).all()


def test_padded_attention_with_grouped_heads_and_window(device):
    torch.manual_seed(3)
    mask = torch.tensor([[1] * 12 + [0] * 3, [1] * 15], device=device)
    q = torch.randn(2, 4, 15, 16, device=device)
    k, v = (torch.randn(2, 2, 15, 16, device=device) for _ in range(2))
    out = kernels.padded_attention(q, k, v, mask, window_size=(3, 3))
    for row, n in enumerate((12, 15)):
        allowed = kernels.window_mask(n, (3, 3), device)[None]
        scores = q[row, :, :n] @ k[row, :, :n].repeat_interleave(2, 0).transpose(-1, -2) / 4
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        torch.testing.assert_close(out[row, :, :n], probs @ v[row, :, :n].repeat_interleave(2, 0), rtol=1e-5,
                                   atol=1e-5)


def run_bias_case(lengths, heads, dim, dtype, device, max_distance=128, num_buckets=32, p=0.0, filler=3):
    """varlen_attention with a relative-position bias against varlen_attention_ref: the output and the gradients
    of q, k, v and the bias table."""
    from bertfuse.kernels.attention import RelativePositionBias, varlen_attention_ref

    g = torch.Generator().manual_seed(case_seed(tuple(lengths), heads, dim, str(dtype), max_distance, p))
    total = sum(lengths) + filler
    q, k, v, do = (torch.randn(total, heads, dim, generator=g).to(device) for _ in range(4))
    table = torch.randn(num_buckets, heads, generator=g).to(device)
    cu, max_len = cu_of(lengths, device), max(lengths)
    keep = attention_dropout_mask(cu, heads, max_len, p, 7, total) if p > 0 else None

    def run(cast, fn, **kw):
        leaves = [t.to(dtype).to(cast).requires_grad_() for t in (q, k, v, table)]
        out = fn(*leaves[:3], cu, position_bias=RelativePositionBias(leaves[3], num_buckets, max_distance),
                 dropout_p=p, **kw)
        return [out, *torch.autograd.grad(out, leaves, do.to(dtype).to(cast))]

    ours = run(dtype, kernels.varlen_attention, max_seqlen=max_len, seed=7)
    exact = run(torch.float64, varlen_attention_ref, keep=keep)
    same = run(dtype, varlen_attention_ref, keep=keep)
    for name, a, r, s in zip(("out", "dq", "dk", "dv", "dtable"), ours, exact, same):
        assert a.dtype == dtype and a.shape == r.shape, name
        check_against_reference(name, a, r, s, dtype, floor=1.0)
    assert not ours[0][sum(lengths):].any()  # filler: zero output
    return ours


@pytest.mark.parametrize("dtype, max_distance", [(torch.float32, 9), (torch.float16, 128),
                                                 pytest.param(torch.float32, 128, marks=SLOW),
                                                 pytest.param(torch.float16, 9, marks=SLOW)])
def test_relative_position_bias(device, dtype, max_distance):
    """MPNet's rule (32 buckets, 128) and a short max_distance, so that sequences of 50 reach the clamped end."""
    run_bias_case(LENGTHS, 3, 16, dtype, device, max_distance)


@SLOW
def test_relative_position_bias_with_dropout_and_other_buckets(device):
    run_bias_case([23, 0, 9, 40], 2, 16, torch.float32, device, max_distance=20, num_buckets=12, p=0.2)


def test_relative_position_bias_gradient_is_deterministic_and_optional(device):
    from bertfuse.kernels.attention import RelativePositionBias

    lengths, heads = [40, 7, 33], 2
    cu = cu_of(lengths, device)
    torch.manual_seed(1)
    q, k, v = (torch.randn(80, heads, 16, device=device, requires_grad=True) for _ in range(3))
    table = torch.randn(32, heads, device=device, requires_grad=True)
    grads = []
    for _ in range(2):
        out = kernels.varlen_attention(q, k, v, cu, 40, position_bias=RelativePositionBias(table))
        grads.append(torch.autograd.grad(out.square().sum(), [q, table]))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    frozen = RelativePositionBias(table.detach())  # no gradient asked of the table: the same q gradient
    out = kernels.varlen_attention(q, k, v, cu, 40, position_bias=frozen)
    assert torch.equal(torch.autograd.grad(out.square().sum(), q)[0], grads[0][0])


def test_bucket_rule_is_transformers_mpnet_rule():
    transformers = pytest.importorskip("transformers")
    from bertfuse.kernels.attention import relative_position_bucket
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    distance = torch.arange(600)[None, :] - torch.arange(600)[:, None]
    for buckets, max_distance in ((32, 128), (16, 64), (64, 300)):
        theirs = MPNetEncoder.relative_position_bucket(distance, buckets, max_distance)
        assert torch.equal(relative_position_bucket(distance, buckets, max_distance), theirs)
    del transformers


@pytest.mark.parametrize("bias, err, match", [
    (lambda t, B: B(t[:, :1]), ValueError, r"table must be \[num_buckets, heads\] = \[32, 2\], got \(32, 1\)"),
    (lambda t, B: B(t.long()), TypeError, "table must be float16"),
    (lambda t, B: B(t[:31], 31), ValueError, "num_buckets must be an even int"),
    (lambda t, B: B(t[:2], 2), ValueError, "num_buckets must be an even int of at least 4"),
    (lambda t, B: B(t, 32, 8), ValueError, "max_distance must be an int above num_buckets // 4 = 8"),
    (lambda t, B: B(t.to("meta")), ValueError, "table is on meta"),
    (lambda t, B: t, TypeError, "position_bias must be a kernels.RelativePositionBias"),
])
def test_bad_position_bias(bias, err, match):
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(err, match=match):
        kernels.varlen_attention(q, q, q, cu, 6, position_bias=bias(torch.randn(32, 2), kernels.RelativePositionBias))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [16, 32, 64, 128])
def test_gpu_compiled(dtype, dim):
    run_case([128, 0, 1, 77, 512, 300], 4, dim, dtype, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_dropout_and_long_sequences(dtype):
    run_case([200, 63], 2, 64, dtype, torch.device("cuda"), p=0.1, seed=3)
    run_case([8192, 1000], 1, 64, dtype, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [32, 64])
def test_gpu_relative_position_bias(dtype, dim):
    run_bias_case([128, 0, 1, 77, 512, 300], 4, dim, dtype, torch.device("cuda"))
    run_bias_case([200, 63], 2, dim, dtype, torch.device("cuda"), p=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_grouped_heads_and_window(dtype, dim):
    cuda = torch.device("cuda")
    run_window_case([128, 0, 1, 77, 512, 300], 4, 2, dim, dtype, cuda, (64, 64))  # ModernBERT's local window
    run_window_case([200, 63], 4, 1, dim, dtype, cuda, (-1, -1), p=0.1)
    run_window_case([513, 9], 2, 2, dim, dtype, cuda, (0, 200))


def test_strided_cu_seqlens_and_expanded_heads(device):
    """A strided int32 view of cu_seqlens is read as its values, never as raw memory; expanded q/k/v work too."""
    lengths = [5, 0, 9, 1]
    total, heads, dim = sum(lengths), 2, 16
    cu = cu_of(lengths, device)
    wide = torch.stack([cu, torch.full_like(cu, 10**6)], 1).reshape(-1)  # every other entry is garbage
    strided = wide[::2]
    assert not strided.is_contiguous() and torch.equal(strided, cu)
    g = torch.Generator().manual_seed(7)
    base = [torch.randn(total, 1, dim, generator=g).to(device).requires_grad_() for _ in range(3)]
    views = [b.expand(total, heads, dim) for b in base]
    out = kernels.varlen_attention(*views, strided, max(lengths))
    grads = torch.autograd.grad(out.pow(2).sum(), base)
    ref = reference(*[v.double() for v in views], lengths, 1 / math.sqrt(dim))
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), base)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), r.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_filler_after_the_last_sequence_is_zero_and_gets_zero_gradient(device, p):
    """Tokens past cu_seqlens[-1] (a packed batch's filler) affect nothing and receive zero gradient, never NaN,
    even when they hold NaN (PyTorch's own varlen_attn returns NaN gradients here, pytorch#176793)."""
    lengths, filler = [7, 0, 12], 5
    total, heads, dim = sum(lengths) + filler, 2, 16
    g = torch.Generator().manual_seed(11)
    base = [torch.randn(total, heads, dim, generator=g) for _ in range(3)]
    for t in base:
        t[sum(lengths):] = float("nan")
    leaves = [t.to(device).requires_grad_() for t in base]
    cu = cu_of(lengths, device)
    out = kernels.varlen_attention(*leaves, cu, 12, dropout_p=p, seed=3)
    dout = torch.randn(out.shape, generator=g).to(device)
    grads = torch.autograd.grad(out, leaves, dout)
    real = sum(lengths)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    assert all(torch.isfinite(gr).all() and torch.equal(gr[real:], torch.zeros_like(gr[real:])) for gr in grads)
    # The same tokens with zeros for filler (the dropout mask depends on the token count, kept the same).
    clean = [t.detach().nan_to_num(0.0).requires_grad_() for t in leaves]
    ref = kernels.varlen_attention(*clean, cu, 12, dropout_p=p, seed=3)
    torch.testing.assert_close(out[:real], ref[:real])
    for a, b in zip(grads, torch.autograd.grad(ref, clean, dout)):
        torch.testing.assert_close(a[:real], b[:real])


def test_cu_seqlens_past_the_tokens_never_leave_the_buffers(device):
    """Unvalidated cu_seqlens beyond the token count (and negative) are cut to the tokens inside the kernels: no
    access outside the buffers (the compiled kernels crashed here), finite outputs and gradients, and sequences
    inside the tokens computed as usual. Guard bands around the inputs catch a read or write outside them."""
    total, heads, dim = 96, 2, 16
    g = torch.Generator().manual_seed(5)
    band = torch.full((8, heads, dim), float("nan"))
    big = [torch.cat([band, torch.randn(total, heads, dim, generator=g), band]).to(device).requires_grad_()
           for _ in range(3)]
    leaves = [t[8:8 + total] for t in big]  # views into the banded buffers: a stray access reads NaN
    cu = torch.tensor([0, 30, 32, 39, 58, 64, 64, 64, 4000, 4020], dtype=torch.int32, device=device)
    out = kernels.varlen_attention(*leaves, cu, 64, validate=False)
    grads = [gr[8:8 + total] for gr in torch.autograd.grad(out.sum(), big)]
    assert torch.isfinite(out).all() and all(torch.isfinite(gr).all() for gr in grads)
    good = cu[:6]
    ref = kernels.varlen_attention(*[t.detach() for t in leaves], good, 64, validate=False)
    torch.testing.assert_close(out[:64], ref[:64])
    negative = torch.tensor([-50, 10, 96], dtype=torch.int32, device=device)
    assert torch.isfinite(kernels.varlen_attention(*leaves, negative, 96, validate=False)).all()
    with pytest.raises(ValueError, match="cu_seqlens ends at 4020 but there are only 96 tokens"):
        kernels.varlen_attention(*leaves, cu, 64)


def test_lse_is_defined_at_filler_tokens(device):
    """The forward op's log-sum-exp rows of tokens in no sequence hold 0, the same on every call (they were left
    uninitialised, which made opcheck's comparisons fail now and then)."""
    from bertfuse.kernels.attention import _attention_fwd

    q = torch.randn(40, 2, 16, device=device)
    cu = torch.tensor([0, 9, 25], dtype=torch.int32, device=device)
    for _ in range(2):
        _, lse = _attention_fwd(q, q, q, cu, 16, 0.0, 0.25, None)
        assert torch.equal(lse[:, 25:], torch.zeros_like(lse[:, 25:]))
        assert torch.isfinite(lse).all()


def test_opcheck_with_filler_tokens(device):
    """torch.library.opcheck on the forward op with tokens past cu_seqlens[-1]: its dynamic-shape comparison of
    two calls failed now and then while their lse rows held garbage."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(40, 2, 16, generator=g).to(device).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 9, 25], dtype=torch.int32, device=device)
    for _ in range(2):
        result = torch.library.opcheck(torch.ops.bertfuse.varlen_attention_fwd.default,
                                       (q, k, v, cu, 16, 0.0, 0.25, None))
        assert set(result.values()) == {"SUCCESS"}, result

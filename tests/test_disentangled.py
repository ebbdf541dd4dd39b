"""kernels.disentangled_attention against DeBERTa's attention per sequence in float64: outputs and the gradients
of q, k, v and both relative tables."""
import math

import pytest
import torch

from kernel_utils import binomial_ok, case_seed, check_against_reference

kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.kernels.disentangled import (  # noqa: E402
    DisentangledPositions, disentangled_attention, disentangled_attention_ref, disentangled_dropout_mask,
    relative_position_rows)

SLOW = pytest.mark.slow


def cu_of(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def run_case(lengths, heads, dim, dtype, device, buckets=8, max_rel=20, terms=("c2p", "p2c"), p=0.0, seed=0,
             filler=0, scale=None, spans=None):
    """Ours in `dtype` against the float64 reference on the same rounded inputs, and against PyTorch's own error
    in `dtype` (half precision); `spans`: (key_start, seqused_k) per sequence; returns (out, grads)."""
    g = torch.Generator().manual_seed(case_seed(tuple(lengths), heads, dim, str(dtype), buckets, max_rel, terms))
    total = sum(lengths) + filler
    span = buckets if buckets > 0 else max_rel
    q, k, v, do = (torch.randn(total, heads, dim, generator=g) for _ in range(4))
    pk, pq = (torch.randn(2 * span, heads, dim, generator=g) for _ in range(2))
    do[sum(lengths):] = 0
    cu = cu_of(lengths, device)
    max_len = max(lengths) if lengths else 0
    keep = disentangled_dropout_mask(cu, heads, max_len, p, seed, total) if p else None
    kw = {} if spans is None else dict(zip(("key_start", "seqused_k"), (
        torch.tensor(t, dtype=torch.int32, device=device) for t in zip(*spans))))

    def leaves(dt):
        out = [t.to(device=device, dtype=dt).requires_grad_() for t in (q, k, v, pk, pq)]
        return out, DisentangledPositions(out[3] if "c2p" in terms else None, out[4] if "p2c" in terms else None,
                                          buckets, max_rel)

    ours, pos = leaves(dtype)
    out = disentangled_attention(*ours[:3], cu, max_len, pos, dropout_p=p, seed=seed, softmax_scale=scale, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    used = [t for t in ours[:3]] + [t for t in (pos.pos_key, pos.pos_query) if t is not None]
    grads = torch.autograd.grad(out, used, do.to(device=device, dtype=dtype))
    results = []
    for dt in (torch.float64, dtype):
        leaves_dt, pos_dt = leaves(dt)
        ref = disentangled_attention_ref(*[t.to(dtype).to(dt) if dt == torch.float64 else t for t in leaves_dt[:3]],
                                         cu, pos_dt, p, scale, keep, **kw)
        used_dt = leaves_dt[:3] + [t for t in (pos_dt.pos_key, pos_dt.pos_query) if t is not None]
        results.append((ref, torch.autograd.grad(ref, used_dt, do.to(device=device, dtype=dt))))
    (out64, grads64), (out_same, grads_same) = results
    check_against_reference("out", out, out64, out_same, dtype, floor=1.0)
    names = ["dq", "dk", "dv"] + [n for n, t in (("dpos_key", "c2p"), ("dpos_query", "p2c")) if t in terms]
    for name, a, r, s in zip(names, grads, grads64, grads_same):
        check_against_reference(name, a, r, s, dtype, floor=1.0)
    return out, grads


# Lengths: 0, 1, non-multiples of the tiles (16 in the interpreter), and 4 and 5 around the 8-bucket rule's exact
# range (distances up to 4 keep their value), 19 and 21 around max_relative_positions = 20.
LENGTHS = [37, 0, 1, 5, 21, 4, 19]


# Per sequence of LENGTHS: a prefix of keys (right padding), none in an empty one, none at all (output 0), a
# suffix (left padding), a run inside, every token, a prefix again.
SPANS = [(0, 20), (0, 0), (0, 0), (2, 3), (3, 12), (0, 4), (0, 11)]


@pytest.mark.parametrize("p", [0.0, pytest.param(0.2, marks=SLOW)])
def test_key_spans(device, p):
    """seqused_k and key_start (padded positions kept as queries only): the keys outside each span unread (and
    their gradients 0), a sequence with no key 0, the tables' gradients over the spans' pairs only."""
    out, grads = run_case(LENGTHS, 2, 16, torch.float32, device, p=p, filler=2, spans=SPANS)
    assert not out[37].any() and not grads[0][37].any()
    starts = cu_of(LENGTHS, "cpu").tolist()
    outside = torch.ones(out.shape[0], dtype=torch.bool)
    for first, (start, used) in zip(starts, SPANS):
        outside[first + start:first + start + used] = False
    assert not grads[1][outside.to(out.device)].any() and not grads[2][outside.to(out.device)].any()


@pytest.mark.parametrize("buckets, max_rel", [(8, 20), (-1, 12), pytest.param(32, 64, marks=SLOW),
                                              pytest.param(-1, 64, marks=SLOW)])
def test_float32_against_deberta_in_float64(device, buckets, max_rel):
    run_case(LENGTHS, 2, 32, torch.float32, device, buckets, max_rel)


@pytest.mark.parametrize("terms", [("c2p",), ("p2c",), pytest.param((), marks=SLOW)])
def test_one_position_term_or_none(device, terms):
    """pos_att_type "c2p" or "p2c" alone (the other table None, and no gradient for it), or neither (plain
    attention scaled by 1 / sqrt(head_dim))."""
    run_case([23, 1, 9], 2, 16, torch.float32, device, terms=terms)


@pytest.mark.parametrize("dim", [1, 8, pytest.param(24, marks=SLOW), pytest.param(128, marks=SLOW)])
def test_head_dims_padded_inside_the_kernel(device, dim):
    run_case([23, 1, 9], 2, dim, torch.float32, device)


def test_float32_heads_over_32_take_the_dots_in_slices_of_32(device):
    """float32 at head_dim 72 with dropout: a 128-lane tile read in four 32-lane slices, the third partly and the
    fourth wholly past the head; the sliced dots (_chunked_dot) of the scores and of dP."""
    assert kernels.disentangled._chunk_d(torch.float32, 128) == 32
    assert kernels.disentangled._chunk_d(torch.float16, 128) == 128
    run_case([19, 1, 5], 1, 72, torch.float32, device, p=0.2, seed=3)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=SLOW)])
def test_half_precision_error_at_most_twice_pytorchs(device, dtype):
    run_case(LENGTHS, 2, 32, dtype, device)


def test_dropout_against_reference_with_the_kernel_mask(device):
    run_case([23, 0, 9], 2, 16, torch.float32, device, p=0.2, seed=99)


def test_dropout_mask_is_attentions_and_its_rate(device):
    """The mask is kernels.varlen_attention's for the same seed (one Philox stream for both ops), and keeps
    about 1 - p of the probabilities."""
    cu = cu_of([40, 24], device)
    ours = disentangled_dropout_mask(cu, 2, 40, 0.3, 5)
    assert torch.equal(ours, kernels.attention.attention_dropout_mask(cu, 2, 40, 0.3, 5))
    assert binomial_ok(int(ours.sum()), ours.numel(), 0.7)


def test_filler_tokens_are_zero_and_get_zero_gradient(device):
    out, grads = run_case([7, 12], 2, 16, torch.float32, device, filler=5)
    assert torch.equal(out[19:], torch.zeros_like(out[19:]))
    assert all(torch.equal(g[19:], torch.zeros_like(g[19:])) for g in grads[:3])


@SLOW
def test_many_sequences_split_the_table_gradient(device):
    """Enough tokens for the table gradient's programs to split the sequences between them (their partial sums
    added in order): still the reference's gradient, and bit for bit the same on a second call."""
    lengths = [9, 17, 3, 12, 16, 1, 14, 8] * 4
    out, grads = run_case(lengths, 1, 16, torch.float32, device)
    again = run_case(lengths, 1, 16, torch.float32, device)[1]
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_strided_views_and_expanded_tables(device):
    """q, k, v as column slices of one projection's output and a table expanded over heads read as their values."""
    lengths, heads, dim = [13, 6], 2, 16
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(19, heads, 3 * dim, generator=g).to(device).requires_grad_()
    q, k, v = (wide[..., i * dim:(i + 1) * dim] for i in range(3))
    base = torch.randn(16, 1, dim, generator=g).to(device).requires_grad_()
    pos = DisentangledPositions(base.expand(16, heads, dim), base.expand(16, heads, dim), 8, 20)
    out = disentangled_attention(q, k, v, cu_of(lengths, device), 13, pos)
    grads = torch.autograd.grad(out.pow(2).sum(), (wide, base))
    pos64 = DisentangledPositions(*(base.double().expand(16, heads, dim),) * 2, 8, 20)
    ref = disentangled_attention_ref(q.double(), k.double(), v.double(), cu_of(lengths, device), pos64)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (wide, base))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), r.double(), rtol=1e-5, atol=1e-5)


def test_empty_batch(device):
    q = torch.zeros(0, 2, 16, device=device, requires_grad=True)
    t = torch.zeros(16, 2, 16, device=device, requires_grad=True)
    out = disentangled_attention(q, q, q, cu_of([0, 0], device), 0, DisentangledPositions(t, t, 8, 20))
    out.sum().backward()
    assert out.shape == (0, 2, 16) and torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("buckets, max_rel", [(256, 512), (32, 64), (8, 20), (6, 9), (-1, 40), (-1, 3)])
def test_row_rule_is_transformers_deberta_v2_rule(buckets, max_rel):
    """Every distance up to well past the rule's end gets the row transformers' DeBERTa-v2 gathers for it."""
    modeling = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")
    length = 3 * max(buckets, max_rel)
    x = torch.zeros(1, length, 1)
    theirs = modeling.build_relative_position(x, x, bucket_size=buckets, max_position=max_rel)[0]
    span = buckets if buckets > 0 else max_rel
    pos = torch.arange(length)
    ours = relative_position_rows(pos[:, None] - pos[None, :], buckets, max_rel)
    assert torch.equal(ours, torch.clamp(theirs + span, 0, 2 * span - 1))


def test_reference_is_transformers_disentangled_attention():
    """disentangled_attention_ref on one padding-free sequence equals transformers' DisentangledSelfAttention's
    own scores, softmax and context (share_att_key on and off), so the kernel is checked against DeBERTa itself.
    (DeBERTa's scale is a float32 square root; given here as such.)"""
    modeling = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")
    from transformers import DebertaV2Config
    for share in (False, True):
        config = DebertaV2Config(hidden_size=32, num_attention_heads=2, relative_attention=True, position_buckets=8,
                                 max_relative_positions=20, pos_att_type=["p2c", "c2p"], share_att_key=share,
                                 attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
        torch.manual_seed(0)
        attn = modeling.DisentangledSelfAttention(config).double().eval()
        hidden, rel = torch.randn(1, 13, 32, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
        theirs = attn(hidden, torch.ones(1, 1, 13, 13), relative_pos=None, rel_embeddings=rel)[0]

        def heads(x):
            return x.view(x.shape[0], 2, 16)
        keyer, querier = (attn.key_proj, attn.query_proj) if share else (attn.pos_key_proj, attn.pos_query_proj)
        pos = DisentangledPositions(heads(keyer(rel)), heads(querier(rel)), 8, 20)
        ours = disentangled_attention_ref(heads(attn.query_proj(hidden[0])), heads(attn.key_proj(hidden[0])),
                                          heads(attn.value_proj(hidden[0])), torch.tensor([0, 13], dtype=torch.int32),
                                          pos, softmax_scale=1 / torch.sqrt(torch.tensor(16 * 3.0)).item())
        torch.testing.assert_close(ours.reshape(13, 32), theirs[0], rtol=1e-12, atol=1e-12)


def test_default_scale_is_debertas():
    """1 / sqrt(head_dim * (1 + number of position terms)), as DeBERTa scales (custom scales are taken as given)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 1, 4, generator=g, dtype=torch.float64) for _ in range(3))
    t = torch.randn(16, 1, 4, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    for pos, terms in ((DisentangledPositions(t, t, 8, 20), 2), (DisentangledPositions(t, None, 8, 20), 1)):
        given = disentangled_attention_ref(q, k, v, cu, pos, softmax_scale=1 / math.sqrt(4 * (1 + terms)))
        torch.testing.assert_close(disentangled_attention_ref(q, k, v, cu, pos), given)


@pytest.mark.parametrize("change, err, match", [
    (lambda a: dict(a, k=a["k"][:, :1]), ValueError, "shapes differ"),
    (lambda a: dict(a, v=a["v"].half()), TypeError, "dtypes differ"),
    (lambda a: dict(a, positions=(a["positions"].pos_key,)), TypeError, "DisentangledPositions"),
    (lambda a: dict(a, positions=a["positions"]._replace(pos_key=a["positions"].pos_key[:8])), ValueError,
     r"pos_key must be \[2 \* span"),
    (lambda a: dict(a, positions=a["positions"]._replace(pos_query=a["positions"].pos_query.half())), TypeError,
     "pos_query is torch.float16"),
    (lambda a: dict(a, positions=a["positions"]._replace(max_relative_positions=4)), ValueError,
     "position_buckets=8 needs"),
    (lambda a: dict(a, positions=a["positions"]._replace(position_buckets=1)), ValueError, "at least 2 buckets"),
    (lambda a: dict(a, positions=a["positions"]._replace(position_buckets=-1, max_relative_positions=0)),
     ValueError, "at least 1"),
    (lambda a: dict(a, cu_seqlens=a["cu_seqlens"].long()), TypeError, "int32"),
    (lambda a: dict(a, max_seqlen=3), ValueError, "max_seqlen=3 but a sequence has 6"),
    (lambda a: dict(a, dropout_p=1.0), ValueError, "dropout_p"),
    (lambda a: dict(a, q=torch.zeros(6, 2, 130), k=torch.zeros(6, 2, 130), v=torch.zeros(6, 2, 130)), ValueError,
     "head_dim 130"),
])
def test_bad_inputs(change, err, match):
    t = torch.zeros(16, 2, 8)
    args = dict(q=torch.zeros(6, 2, 8), k=torch.zeros(6, 2, 8), v=torch.zeros(6, 2, 8),
                cu_seqlens=torch.tensor([0, 6], dtype=torch.int32), max_seqlen=6,
                positions=DisentangledPositions(t, t.clone(), 8, 20))
    with pytest.raises(err, match=match):
        disentangled_attention(**change(args))


def test_opcheck(device):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(30, 2, 16, generator=g).to(device).requires_grad_() for _ in range(3))
    t = torch.randn(16, 2, 16, generator=g).to(device).requires_grad_()
    cu = torch.tensor([0, 9, 25], dtype=torch.int32, device=device)
    result = torch.library.opcheck(torch.ops.bertfuse.disentangled_attention_fwd.default,
                                   (q, k, v, cu, 16, t, t, 8, 20, 0.0, 0.2, None))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_gpu_compiled(dtype, dim):
    """DeBERTa-v3's rule (256 buckets, 512 positions) at lengths across the log range, with dropout."""
    cuda = torch.device("cuda")
    run_case([128, 0, 1, 77, 512, 300], 4, dim, dtype, cuda, 256, 512)
    run_case([200, 63], 2, dim, dtype, cuda, 256, 512, p=0.1, seed=3)
    run_case([700, 5], 2, dim, dtype, cuda, -1, 512)

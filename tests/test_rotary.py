"""kernels.rotary against rotary_ref and transformers' own rotary code in float64: output and gradient, both pair
layouts, partial rotary dimensions, scaling, strided views, every dtype."""
import pytest
import torch

from kernel_utils import DTYPES, case_seed, check_against_reference

kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.kernels.rotary import Rotary, rotary_positions, rotary_ref  # noqa: E402


def inv_freq(rotary_dim, base=10000.0):
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


def tables(rows, rotary_dim, device):
    """A model's own cos and sin [rows, rotary_dim // 2], made in float64 as RoFormer makes its sinusoids, held
    as RoFormer holds them (sin then cos in one [rows, rotary_dim] weight): two strided views."""
    angle = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq(rotary_dim).double()[None, :]
    weight = torch.cat([angle.sin(), angle.cos()], dim=1).float().to(device)
    half = rotary_dim // 2
    return weight[:, half:], weight[:, :half]


def run_case(heads, dim, rotary_dim, dtype, device, interleaved=False, scaling=1.0, lengths=(7, 0, 1, 19),
             table=False):
    g = torch.Generator().manual_seed(case_seed(heads, dim, rotary_dim, str(dtype), interleaved, scaling, table))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = sum(lengths) + 2  # and two filler tokens
    positions = rotary_positions(cu, total)
    rot = Rotary(inv_freq(rotary_dim).to(device), scaling, interleaved)
    if table:  # rows in any order, not the packed positions
        positions = torch.randint(0, 40, (total,), generator=g).to(device)
        rot = Rotary(None, scaling, interleaved, *tables(40, rotary_dim, device))
    x, dy = (torch.randn(total, heads, dim, generator=g).to(device) for _ in range(2))

    def run(fn, cast):
        leaf = x.to(dtype).to(cast).requires_grad_()
        out = fn(leaf, positions, rot)
        return out, torch.autograd.grad(out, leaf, dy.to(dtype).to(cast))[0]

    ours, exact, same = run(kernels.rotary, dtype), run(rotary_ref, torch.float64), run(rotary_ref, dtype)
    assert ours[0].dtype == dtype and ours[0].shape == x.shape and ours[0].is_contiguous()
    for name, a, r, s in zip(("y", "dx"), ours, exact, same):
        check_against_reference(name, a, r, s, dtype, floor=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_rotation_every_dtype(device, dtype):
    run_case(3, 32, 32, dtype, device)


@pytest.mark.parametrize("dim, rotary_dim, interleaved, scaling", [
    (64, 64, True, 1.0),     # RoFormer's layout
    (24, 16, False, 1.0),    # a partial rotary dimension: the rest passes through
    (20, 12, True, 0.5),     # interleaved and partial, with an attention scaling
    (6, 2, False, 1.0),      # one pair
])
def test_layouts_partial_dimensions_and_scaling(device, dim, rotary_dim, interleaved, scaling):
    run_case(2, dim, rotary_dim, torch.float32, device, interleaved, scaling)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_models_own_tables_every_dtype(device, dtype):
    run_case(3, 32, 32, dtype, device, table=True)


@pytest.mark.parametrize("dim, rotary_dim, interleaved, scaling", [(64, 64, True, 1.0), (20, 12, False, 0.5)])
def test_tables_in_both_layouts_partial_and_scaled(device, dim, rotary_dim, interleaved, scaling):
    run_case(2, dim, rotary_dim, torch.float32, device, interleaved, scaling, table=True)


def test_positions_inside_each_packed_sequence():
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    assert rotary_positions(cu, 10).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]  # filler counts on
    assert rotary_positions(torch.tensor([0], dtype=torch.int32), 2).tolist() == [0, 1]


def test_strided_view_and_int64_positions_and_empty(device):
    """A head slice of a fused [T, 3, H, D] projection is read through its strides, never copied wrongly."""
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(11, 3, 2, 16, generator=g).to(device)
    k = fused[:, 1]
    positions = torch.arange(11, device=device) * 3  # int64, any values
    rot = Rotary(inv_freq(16).to(device))
    torch.testing.assert_close(kernels.rotary(k, positions, rot), rotary_ref(k, positions, rot), rtol=1e-5,
                               atol=1e-5)
    empty = torch.zeros(0, 2, 16, device=device)
    assert kernels.rotary(empty, torch.zeros(0, dtype=torch.int32, device=device), rot).shape == (0, 2, 16)


def test_equals_transformers_rotary_code(device):
    """transformers' apply_rotary_pos_emb (half rotation, cos/sin from its rotary embedding module) and
    RoFormer's interleaved sinusoidal rotation give what the kernel gives, float32 to 1e-5."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.roformer.modeling_roformer import (RoFormerSelfAttention,
                                                                RoFormerSinusoidalPositionalEmbedding)

    g = torch.Generator().manual_seed(5)
    seqlen, heads, dim = 13, 2, 16
    q, k = (torch.randn(1, heads, seqlen, dim, generator=g) for _ in range(2))
    positions = torch.arange(seqlen)
    angle = positions.float()[:, None] * inv_freq(dim)[None, :]
    emb = torch.cat([angle, angle], -1)
    theirs, _ = apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
    packed = q[0].transpose(0, 1).to(device)  # [T, H, D]
    ours = kernels.rotary(packed, positions.to(device), Rotary(inv_freq(dim).to(device)))
    torch.testing.assert_close(ours.transpose(0, 1).cpu(), theirs[0], rtol=1e-5, atol=1e-5)

    sinusoidal = RoFormerSinusoidalPositionalEmbedding(32, dim)
    sinusoidal.weight.data = sinusoidal.create_weight()  # what its model's weight initialisation sets
    table = sinusoidal(torch.Size([1, seqlen]))[None, None]
    theirs, _ = RoFormerSelfAttention.apply_rotary_position_embeddings(table, q, k)
    ours = kernels.rotary(packed, positions.to(device), Rotary(inv_freq(dim).to(device), interleaved=True))
    torch.testing.assert_close(ours.transpose(0, 1).cpu(), theirs[0], rtol=1e-5, atol=1e-5)


def test_roformer_table_read_as_it_is_far_along_the_sequence(device):
    """At positions past 1,000 the float32 angle (position * a rounded inv_freq) drifts from RoFormer's table,
    made in float64, by more than 1e-5; read from the table itself, the rotation is RoFormer's to rounding."""
    pytest.importorskip("transformers")
    from transformers.models.roformer.modeling_roformer import (RoFormerSelfAttention,
                                                                RoFormerSinusoidalPositionalEmbedding)

    g = torch.Generator().manual_seed(6)
    start, seqlen, heads, dim = 1500, 12, 2, 64
    q, k = (torch.randn(1, heads, seqlen, dim, generator=g) for _ in range(2))
    sinusoidal = RoFormerSinusoidalPositionalEmbedding(1536, dim)
    sinusoidal.weight.data = sinusoidal.create_weight()
    table = sinusoidal(torch.Size([1, seqlen]), start)[None, None]
    theirs, _ = RoFormerSelfAttention.apply_rotary_position_embeddings(table, q, k)
    packed = q[0].transpose(0, 1).to(device)
    positions = torch.arange(start, start + seqlen, device=device)
    weight = sinusoidal.weight.to(device)
    ours = kernels.rotary(packed, positions, Rotary(None, interleaved=True, cos=weight[:, dim // 2:],
                                                    sin=weight[:, :dim // 2]))
    torch.testing.assert_close(ours.transpose(0, 1).cpu(), theirs[0], rtol=1e-6, atol=1e-6)
    computed = kernels.rotary(packed, positions, Rotary(inv_freq(dim).to(device), interleaved=True))
    assert (computed.transpose(0, 1).cpu() - theirs[0]).abs().max() > 1e-5  # why the table is read


@pytest.mark.parametrize("change, err, match", [
    (lambda x, p, r: dict(x=x[0]), ValueError, r"x must be \[total_tokens, heads, head_dim\]"),
    (lambda x, p, r: dict(positions=p[:-1]), ValueError, r"positions must be an int32 or int64 tensor \[total_tokens\]"),
    (lambda x, p, r: dict(positions=p.float()), ValueError, "positions must be an int32 or int64"),
    (lambda x, p, r: dict(rot=r._replace(inv_freq=torch.ones(9))), ValueError, "rotary_dim 18, which must be 2 .. "
                                                                               "head_dim = 16"),
    (lambda x, p, r: dict(rot=r._replace(inv_freq=r.inv_freq.double())), TypeError, "inv_freq must be a 1-D float32"),
    (lambda x, p, r: dict(rot=r.inv_freq), TypeError, "rotary must be a kernels.Rotary"),
    (lambda x, p, r: dict(x=x.long()), TypeError, "x must be float32, float16 or bfloat16"),
    (lambda x, p, r: dict(positions=p.to("meta")), ValueError, "positions is on meta"),
    (lambda x, p, r: dict(rot=Rotary(None, cos=torch.ones(9, 8))), TypeError, "sin must be a 2-D floating tensor"),
    (lambda x, p, r: dict(rot=Rotary(None, cos=torch.ones(9, 8), sin=torch.ones(9, 4))), ValueError, "differ in shape"),
    (lambda x, p, r: dict(rot=r._replace(cos=torch.ones(9, 8), sin=torch.ones(9, 8))), ValueError, "not both"),
    (lambda x, p, r: dict(rot=Rotary(None, cos=torch.ones(4, 8), sin=torch.ones(4, 8))), ValueError,
     r"positions must index the cos and sin tables' 4 rows; got values in \[0, 4\]"),
])
def test_bad_inputs(change, err, match):
    kw = dict(x=torch.randn(5, 2, 16), positions=torch.arange(5), rot=Rotary(inv_freq(16)))
    kw.update(change(kw["x"], kw["positions"], kw["rot"]))
    with pytest.raises(err, match=match):
        kernels.rotary(kw["x"], kw["positions"], kw["rot"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_compiled(dtype):
    for dim, rotary_dim, interleaved in ((64, 64, False), (128, 128, False), (64, 32, True), (16, 16, False)):
        run_case(12, dim, rotary_dim, dtype, torch.device("cuda"), interleaved, lengths=(512, 0, 1, 300, 77))
    run_case(12, 64, 64, dtype, torch.device("cuda"), True, lengths=(512, 0, 1, 300, 77), table=True)

"""bert.model.padding: packing kept tokens and scattering them back, for any mask pattern."""
import torch

from bertfuse.bert.data.batch import packed_layout
from bertfuse.bert.model.padding import pad, unpad, unpad_mask


def test_unpad_and_pad_round_trip_with_left_padding_and_holes():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 1, 1]])
    x = torch.arange(16.0).view(4, 4, 1)
    u = unpad_mask(mask)
    assert u.cu_seqlens.tolist() == [0, 3, 5, 5, 8] and u.max_seqlen == 3
    assert u.cu_seqlens.dtype == torch.int32
    packed = unpad(x, u)
    assert packed.squeeze(1).tolist() == [0, 1, 2, 6, 7, 12, 14, 15]
    assert u.seq.tolist() == [0, 0, 0, 1, 1, 3, 3, 3] and u.pos.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    back = pad(packed, u, fill=-1.0)
    assert torch.equal(back, torch.where(mask.bool()[..., None], x, torch.tensor(-1.0)))


def test_empty_batch():
    u = unpad_mask(torch.zeros(2, 5, dtype=torch.long))
    assert u.origin.indices.numel() == 0 and u.tokens == 0 and u.cu_seqlens.tolist() == [0, 0, 0] and u.max_seqlen == 0
    assert pad(torch.zeros(0, 3), u).shape == (2, 5, 3)


def test_static_layout_has_value_independent_shapes_and_the_kept_tokens_in_order():
    """torch.compile's and torch.export's layout: every token of the [batch, seq] input, each row's kept tokens
    in order as its sequence, all the padding after the last one as filler; holes, empty and full rows."""
    from bertfuse.bert.model.padding import static_layout

    keep = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 1]]).bool()
    p = static_layout(keep)
    assert p.tokens == keep.numel() and p.max_seqlen == 5 and p.sequences == 4
    assert p.cu_seqlens.tolist() == [0, 3, 3, 8, 10]
    x = torch.arange(20.0).view(4, 5, 1)
    packed = unpad(x, p)[:, 0]
    for row in range(4):
        part = packed[p.cu_seqlens[row]:p.cu_seqlens[row + 1]]
        assert part.tolist() == x[row, keep[row], 0].tolist()  # in order, nothing else
        assert p.seq[p.cu_seqlens[row]:p.cu_seqlens[row + 1]].tolist() == [row] * int(keep[row].sum())
        assert p.pos[p.cu_seqlens[row]:p.cu_seqlens[row + 1]].tolist() == list(range(int(keep[row].sum())))
    assert packed[10:].tolist() == x[~keep, 0].tolist()  # the padding, as filler: sequence S, counted on past it
    assert p.seq[10:].tolist() == [4] * 10 and p.pos[10:].tolist() == list(range(10))
    assert torch.equal(pad(unpad(x, p), p), x)
    # It is the layout packed_layout gives those cu_seqlens (the one every consumer reads).
    ref = packed_layout(p.cu_seqlens, p.tokens, 5)
    assert torch.equal(ref.seq, p.seq) and torch.equal(ref.pos, p.pos)


def test_read_layout_keeps_read_padded_positions_as_queries():
    """read_layout: each row one sequence of its real tokens as one run of keys and the padded positions a head
    reads as queries; right padding, left padding (the first position alone, or with every position up to the
    real tokens where the layers read distances), and holes (the padded query after the keys)."""
    from bertfuse.bert.model.padding import read_layout

    keys = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0]]).bool()
    first = torch.zeros_like(keys)
    first[:, 0] = True
    p = read_layout(keys, first).layout
    assert p.cu_seqlens.tolist() == [0, 3, 7, 10] and p.max_seqlen == 4
    assert p.origin.indices.tolist() == [0, 1, 2, 5, 7, 8, 9, 10, 12, 13]
    assert p.keys.start.tolist() == [0, 1, 0] and p.keys.count.tolist() == [3, 3, 3]
    near = read_layout(keys, first, distances=True).layout  # row 2: positions 0 .. 4, the keys from 2
    assert near.origin.indices.tolist()[3:8] == [5, 6, 7, 8, 9] and near.keys.start.tolist()[1] == 2
    every = read_layout(keys, torch.ones_like(keys)).layout
    assert every.cu_seqlens.tolist() == [0, 5, 10, 15]
    assert every.origin.indices.tolist()[10:] == [10, 12, 13, 11, 14]  # the hole at 11 after the keys
    assert every.keys.start.tolist() == [0, 2, 0] and every.keys.count.tolist() == [3, 3, 3]
    x = torch.arange(15.0).view(3, 5, 1)
    assert torch.equal(pad(unpad(x, every), every), x)  # every position back in its place
    keys[1] = False
    empty = read_layout(keys, first)
    assert empty.layout is None and "without a real token" in empty.why

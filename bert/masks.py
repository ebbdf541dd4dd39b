"""What the attention mask and the packing arguments of a Hugging Face call mean, read as the model's own code
reads them, for the fused drop-in (bert.hf): which keys each row attends to, and which sequences a row holds.

A row may hold several sequences packed end to end (padding-free batches: transformers' DataCollatorWithFlattening,
sentence-transformers' flattened batches), with `position_ids` restarting at each one and, for the flash
implementations, `cu_seq_lens_q/k` and `max_length_q/k`. Whether the original code keeps those sequences apart
depends on the installed transformers and the attention implementation, so the fused encoder reads it from
what the original would read:
  * eager, sdpa, flex: the mask the model built. Where transformers built it from the position ids (5.25 on,
    for the models that pass them: BERT's copies, ESM), it is block-diagonal over the sequences the ids mark;
    `packed_rows` reads those sequences from the mask itself (`mask_segments`: where a query's keys change) and
    checks the mask is exactly that, so a model whose encoder is not handed the position ids (ESM's) is read
    the same way. A mask over whole rows keeps a row one sequence.
  * flash: `cu_seq_lens_q/k` where given, else position ids that restart in a one-row batch without a mask, as
    transformers' flash path takes them.
The sequences are then the fused layout's sequences (bert.model.padding, `segments`): the varlen kernel's
cu_seqlens, no unpadding of anything else.

A 3-D or 4-D mask means what the attention that reads it makes of it (`mask_reading`): transformers hands such a
mask to the attention as it is, and the eager functions (and MPNet's and RoFormer's own code, and flex given a
tensor) *add* it to the scores, so a boolean one adds 1 to kept keys and masks nothing; sdpa reads a boolean mask
as True = attend and adds a float one; DeBERTa's code reads any mask as `mask.bool()`; the flash functions read a
2-D padding mask only, and flex's BlockMask is read as flex computes it (`block_mask_allowed`: its blocks, and
its mask_mod evaluated at every position). Where the fused attention cannot compute that meaning, `Rows.keys` is
None and the original code runs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# The flash implementations' packing arguments: read where the implementation is flash, ignored otherwise (the
# eager and sdpa attention functions ignore them too).
FLASH_PACKING = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class Rows(NamedTuple):
    """What one call's rows hold: `keys` [batch, seq] (True = attend; None: a mask the fused attention cannot
    express), `segments` [batch, seq] each token's sequence inside its row (None: one sequence per row), and why
    the original code must run (None where it need not)."""
    keys: torch.Tensor | None
    segments: torch.Tensor | None = None
    why: str | None = None


def sequence_indices(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] each token's sequence within its row, by transformers' rule: a new sequence begins wherever a
    position id is not the previous one + 1."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


ADDED, KEPT, NONZERO, UNREAD = "added", "kept", "nonzero", "unread"


def mask_reading(config, own: str | None = None) -> str:
    """How the attention of a model reads a 3-D/4-D mask (module docstring): `own`, where the family's code reads
    it one way whatever the configured implementation (MPNet, RoFormer: ADDED; DeBERTa: NONZERO), else by the
    implementation: sdpa KEPT (boolean True = attend, a float mask added), eager and flex ADDED, flash UNREAD."""
    if own:
        return own
    impl = getattr(config, "_attn_implementation", None) or "eager"
    return KEPT if impl == "sdpa" else UNREAD if impl.startswith("flash") else ADDED


def _shared(attention_mask) -> bool:
    """A 3-D/4-D mask that is one key mask expanded along heads and queries (a view: no value to compare)."""
    m = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
    return m.dim() == 4 and all(m.shape[d] == 1 or m.stride(d) == 0 for d in (1, 2))


def _allowed(attention_mask, batch: int, seqlen: int, reading: str = KEPT):
    """A 3-D/4-D mask as [batch, heads, seq, seq] bool (True = attend) and the check its values need, as `reading`
    reads it, or (None, None) for a shape transformers never gives or a mask the fused attention cannot read.
    Added to the scores, a float mask must hold only 0 and <= the dtype's minimum / 2, and a boolean or integer
    one the same value along each query's row (a constant added to every score of a row changes nothing)."""
    m = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
    if reading == UNREAD or m.dim() != 4 or m.shape[-1] != seqlen or m.shape[0] not in (1, batch) or \
            m.shape[2] not in (1, seqlen):
        return None, None
    m = m.expand(batch, -1, -1, seqlen)
    # A view expanded along heads and queries holds one key mask: its values are read on that mask alone (batch x
    # seq), and the result is expanded back, which key_mask recognises as shared.
    core = m[:, :1, :1] if _shared(m) else m
    if reading == NONZERO:
        return (core != 0).expand(m.shape), None
    if not core.dtype.is_floating_point:
        if reading == KEPT and core.dtype == torch.bool:
            return core.expand(m.shape), None
        if reading == KEPT:  # sdpa takes a boolean or a float mask only: the original code raises
            return None, None
        return torch.ones_like(core, dtype=torch.bool).expand(m.shape), (core == core[..., :1]).all()
    blocked = core <= torch.finfo(core.dtype).min / 2
    return (~blocked).expand(m.shape), ((core == 0) | blocked).all()


def _verdict(checks: list, message: str) -> bool:
    """Whether every check holds: one sync; compiled or exported, where no value can be read, the program checks it
    when it runs and stops with `message` rather than compute something else."""
    if not checks:
        return True
    ok = torch.stack(checks).all()
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
        return True
    return bool(ok)


def key_mask(attention_mask, batch: int, seqlen: int, device, reading: str = KEPT) -> torch.Tensor | None:
    """[batch, seq] key mask (True = attend) from whatever the model handed its encoder, read as its attention
    reads it (`reading`, `_allowed`): None; a 2-D mask (0 = padding); a 3-D/4-D mask. None when the fused attention
    cannot express it: a mask that differs between queries or heads (causal), an additive mask with other values
    (a bias), a mask the implementation does not read as a tensor (flash's 4-D; a BlockMask, which packed_rows
    reads first). Under torch.compile and torch.export the compiled program checks this when it runs (`_verdict`)."""
    if attention_mask is None:
        return torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    if not isinstance(attention_mask, torch.Tensor):
        return None
    if attention_mask.dim() == 2:
        return attention_mask != 0
    m, values = _allowed(attention_mask, batch, seqlen, reading)
    if m is None:
        return None
    keys = m[:, 0, 0, :]
    # A view expanded along heads and queries is one key mask by construction (`_allowed` keeps it a view);
    # anything else is checked.
    checks = ([] if _shared(m) else [(m == keys[:, None, None, :]).all()]) + ([] if values is None else [values])
    ok = _verdict(checks, "bert.hf.fuse: this attention mask differs between queries or holds additive values other "
                          "than 0 and the minimum, which the compiled fused attention cannot express; compile or "
                          "export the unfused model for such masks")
    return keys if ok else None


def mask_segments(allowed: torch.Tensor) -> torch.Tensor:
    """[batch, seq] each query's sequence in its row, read from [batch, seq, seq] `allowed` (True = attend): a new
    sequence begins at a query whose keys are not the previous query's. In a block-diagonal mask every query of a
    sequence has its sequence's keys (padding masks keys, not queries), so that is where the blocks begin; queries
    with no key at all in a row form one (padding, discarded)."""
    change = (allowed[:, 1:] != allowed[:, :-1]).any(-1)
    return torch.cat([change.new_zeros(change.shape[0], 1, dtype=torch.long), change.long().cumsum(1)], 1)


def _block_rows(attention_mask, batch: int, seqlen: int, reading: str) -> Rows:
    """The rows of a 3-D/4-D mask that differs between queries: block-diagonal over the sequences its own rows
    mark (`mask_segments`: each query attends to the allowed keys of its own sequence, the same whichever query of
    it asks: a padding-free batch's mask, however transformers built it) gives the key mask and those sequences
    (None where a row holds one); anything else (causal, a bias) keys None."""
    m, values = _allowed(attention_mask, batch, seqlen, reading)
    if m is None:
        return Rows(None)
    m = m.expand(batch, -1, seqlen, seqlen)
    segments = mask_segments(m[:, 0])
    keys = m[:, 0].diagonal(dim1=-2, dim2=-1)    # a token's own key: allowed unless it is padding
    same = segments[:, :, None] == segments[:, None, :]
    checks = [(m == (same & keys[:, None, :])[:, None]).all()] + ([] if values is None else [values])
    if torch.compiler.is_compiling():
        _verdict(checks, "bert.hf.fuse: this attention mask differs between queries but is not block-diagonal "
                         "over the sequences of a row (padding-free), or holds additive values other than 0 and the "
                         "minimum, which the compiled fused attention cannot express; compile or export the "
                         "unfused model for such masks")
        return Rows(keys, segments)
    ok, split = torch.stack([torch.stack(checks).all(), (segments[:, -1] > 0).any()]).tolist()
    return Rows(keys, segments if split else None) if ok else Rows(None)


def _expand_blocks(dense: torch.Tensor, block: tuple[int, int], seqlen: int) -> torch.Tensor:
    """[B, H, q blocks, kv blocks] bool -> [B, H, seq, seq]: each block's value at each of its elements."""
    return dense.repeat_interleave(block[0], 2)[:, :, :seqlen].repeat_interleave(block[1], 3)[..., :seqlen]


def block_mask_allowed(block_mask, batch: int, seqlen: int, device):
    """(allowed [B, H, seq, seq] bool, None) of what flex attention lets each query attend under `block_mask` (a
    BlockMask), or (None, why) where the fused attention cannot read it. flex computes every element of a full
    block, the elements of a partial block where its mask_mod is True, nothing of the other blocks; mask_mod is
    evaluated on every position of the row (torch's create_mask), which transformers' mask functions (padding,
    packed sequences as the position ids mark them) allow."""
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    name = f"a {type(block_mask).__name__} attention mask (flex attention's)"
    if not isinstance(block_mask, BlockMask):
        return None, f"{name}, which the fused attention does not read"
    if torch.compiler.is_compiling():
        return None, f"{name} in a compiled call, whose mask_mod the fused attention does not evaluate there"
    nums = block_mask.kv_num_blocks
    if tuple(block_mask.seq_lengths) != (seqlen, seqlen) or nums.dim() != 3 or nums.shape[0] not in (1, batch):
        return None, f"{name} of lengths {tuple(block_mask.seq_lengths)} for {batch} rows of {seqlen} tokens"
    size = tuple(block_mask.BLOCK_SIZE)

    def blocks(num, indices):
        if num is None:
            return None
        part = BlockMask.from_kv_blocks(num, indices, BLOCK_SIZE=size, seq_lengths=(seqlen, seqlen),
                                        compute_q_blocks=False)
        return _expand_blocks(part.to_dense().bool(), size, seqlen)

    try:
        elements = create_mask(block_mask.mask_mod, nums.shape[0], nums.shape[1], seqlen, seqlen, device)
    except Exception as error:  # a mask_mod that cannot be evaluated on its own (one reading other state)
        return None, f"{name} whose mask_mod cannot be evaluated alone ({type(error).__name__})"
    allowed = blocks(nums, block_mask.kv_indices) & elements.bool()
    full = blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return (allowed if full is None else allowed | full), None


def _flash_segments(kwargs: dict, batch: int, seqlen: int, device):
    """(segments, why) from a flash call's cu_seq_lens_q/k, as transformers' flash path reads them: (None, None)
    where there are none, (None, the reason) where they are not one split of the row's tokens."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None, None
    if cu_q is None or cu_k is None or cu_q.shape != cu_k.shape or not torch.equal(cu_q, cu_k):
        return None, "cu_seq_lens_q differing from cu_seq_lens_k"
    if batch != 1:
        return None, f"cu_seq_lens with a batch of {batch} rows (flash reads them for one row)"
    if cu_q.dim() != 1 or cu_q.numel() < 2 or int(cu_q[0]) != 0 or int(cu_q[-1]) != seqlen or \
            bool((cu_q.diff() < 0).any()):
        return None, f"cu_seq_lens that do not split the row's {seqlen} tokens"
    tokens = torch.arange(seqlen, device=device)
    return torch.searchsorted(cu_q[1:].to(device).contiguous(), tokens.to(cu_q.dtype), right=True)[None], None


def packed_rows(config, attention_mask, kwargs: dict, position_ids, batch: int, seqlen: int, device,
                reading: str | None = None) -> Rows:
    """What the rows of this call hold (`Rows`), as the model's own attention would read them (module docstring).
    position_ids: the ids a flash call reads (None where the attention is handed none); reading: how it reads a
    3-D/4-D mask where the family's code has one way (`mask_reading`), None: by the configured implementation."""
    reading = mask_reading(config, reading)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        attention_mask, why = block_mask_allowed(attention_mask, batch, seqlen, device)
        if why:
            return Rows(None, why=why)
        reading = KEPT
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl.startswith("flash"):
        segments, why = _flash_segments(kwargs, batch, seqlen, device)
        if why:
            return Rows(None, why=why)
        if segments is None and attention_mask is None and position_ids is not None and batch == 1:
            segments = sequence_indices(position_ids.expand(batch, seqlen))
        return Rows(key_mask(attention_mask, batch, seqlen, device, reading), segments)
    if attention_mask is not None and attention_mask.dim() in (3, 4) and seqlen > 1 and not _shared(attention_mask):
        return _block_rows(attention_mask, batch, seqlen, reading)
    return Rows(key_mask(attention_mask, batch, seqlen, device, reading))

"""Removing padding once per batch and putting it back at the end.

The encoder works on packed tokens: [total_tokens, hidden] with int32 `cu_seqlens` marking where each
sequence starts, as in FlashAttention's variable-length API. Tokens keep their order inside a sequence,
so any 0/1 mask works (right padding, left padding or holes).
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch


class Unpadded(NamedTuple):
    indices: torch.Tensor      # [total_tokens] int64, flat index into [batch * seqlen] of each kept token
    cu_seqlens: torch.Tensor   # [batch + 1] int32, start of each sequence in the packed tensor
    max_seqlen: int            # longest kept sequence (a Python int: kernels size their grid with it)
    batch: int
    seqlen: int                # padded length of the input
    seq: torch.Tensor          # [total_tokens] int64, the sequence each packed token belongs to
    pos: torch.Tensor | None   # [total_tokens] int64, its position among that sequence's kept tokens (None when
                               # packed: attention over rows needs no positions)
    rows: int = 0              # a packed batch's rows of max_seqlen tokens that no sequence crosses (0: none)


def unpad_mask(attention_mask: torch.Tensor, seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> Unpadded:
    """Index the kept tokens of a [batch, seqlen] mask (nonzero = keep)."""
    batch, seqlen = attention_mask.shape
    keep = attention_mask.reshape(-1) != 0
    if seqlens is None:
        seqlens = keep.view(batch, seqlen).sum(1, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int(seqlens.max()) if batch else 0
    indices = keep.nonzero().squeeze(1)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=attention_mask.device)
    torch.cumsum(seqlens, 0, out=cu_seqlens[1:])
    seq = torch.repeat_interleave(torch.arange(batch, device=seqlens.device), seqlens.long(),
                                  output_size=indices.numel())
    pos = torch.arange(indices.numel(), device=seqlens.device) - cu_seqlens[:-1].long()[seq]
    return Unpadded(indices, cu_seqlens, max_seqlen, batch, seqlen, seq, pos)


def packed_layout(cu_seqlens: torch.Tensor, total_tokens: int, max_seqlen: int) -> Unpadded:
    """The Unpadded description of an already packed batch (bert.packing): tokens [0, total_tokens) in rows of
    max_seqlen that no sequence crosses, sequences by cu_seqlens [S + 1] (empty ones allowed), tokens at or past
    cu_seqlens[-1] are filler. Built without a host sync: max_seqlen (>= 1, dividing total_tokens: pack_check)
    is the caller's static bound. Filler tokens get sequence S (one past the last), so that the PyTorch
    attention's block-diagonal mask keeps them apart."""
    batch = cu_seqlens.numel() - 1
    t = torch.arange(total_tokens, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), t, right=True)  # S for filler
    return Unpadded(t, cu_seqlens, max_seqlen, batch, max_seqlen, seq, None, total_tokens // max_seqlen)


def static_max_seqlen(max_seqlen) -> int:
    """A packed batch's max_seqlen as a Python int: an int, a NumPy integer or a one-element integer tensor (read
    once: a sync when it lives on a GPU, so pass an int there)."""
    if isinstance(max_seqlen, torch.Tensor):
        if max_seqlen.numel() != 1 or max_seqlen.is_floating_point() or max_seqlen.dtype == torch.bool:
            raise ValueError(f"packed max_seqlen must be an integer, got a {max_seqlen.dtype} tensor of shape "
                             f"{tuple(max_seqlen.shape)}")
        return int(max_seqlen.reshape(()))
    try:
        return operator.index(max_seqlen)
    except TypeError:
        raise ValueError(f"packed max_seqlen must be an integer, got {type(max_seqlen).__name__} "
                         f"{max_seqlen!r}") from None


def checks_are_free(t: torch.Tensor) -> bool:
    """Whether reading t's values costs no device sync: it lives on the CPU and nothing is being traced."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def read_values(t: torch.Tensor) -> list:
    """A small tensor's values on the host: through NumPy for a CPU tensor (no device involved, so allowed inside
    bert.static.forbid_host_sync), a sync otherwise."""
    return t.numpy().tolist() if t.device.type == "cpu" else t.tolist()


def pack_check(config, input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen, validate: bool) -> int:
    """Shapes and dtypes of a packed batch always (no sync); the values too with `validate` (one sync), and
    whenever the batch is on the CPU (free). Returns max_seqlen as an int."""
    n = input_ids.shape[0] if input_ids.dim() == 1 else -1
    for name, t in (("input_ids", input_ids), ("token_type_ids", token_type_ids), ("position_ids", position_ids)):
        if t.dim() != 1 or t.shape[0] != n or t.is_floating_point():
            raise ValueError(f"packed {name} must be integer [tokens] like input_ids ({n}), got {t.dtype} "
                             f"{tuple(t.shape)}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("packed cu_seqlens must be a 1-D int32 tensor [sequences + 1]")
    max_seqlen = static_max_seqlen(max_seqlen)
    if max_seqlen < 1:
        raise ValueError(f"packed max_seqlen must be at least 1, got {max_seqlen}")
    if n % max_seqlen:
        raise ValueError(f"a packed batch is rows of max_seqlen tokens: {n} tokens are not a multiple of "
                         f"max_seqlen={max_seqlen}")
    if validate or checks_are_free(cu_seqlens):
        _check_pack_values(config, input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen)
    return max_seqlen


def _check_pack_values(config, input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen: int) -> None:
    n = input_ids.shape[0]
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    # A sequence crosses a row boundary when its first and last token lie in different rows.
    crossing = ((lens > 0) & (cu_seqlens[:-1] // max_seqlen != (cu_seqlens[1:] - 1) // max_seqlen)).sum()
    ids = [input_ids.min(), input_ids.max(), token_type_ids.min(), token_type_ids.max(), position_ids.min(),
           position_ids.max()] if n else [torch.zeros((), dtype=torch.long, device=input_ids.device)] * 6
    checks = read_values(torch.stack([*(t.long() for t in ids), cu_seqlens[0].long(), cu_seqlens[-1].long(),
                                      (lens < 0).sum(), lens.max().long(), crossing]))
    id_lo, id_hi, tt_lo, tt_hi, pos_lo, pos_hi, first, last, decreasing, longest, crossing = checks
    problems = [message for bad, message in (
        (id_lo < 0 or id_hi >= config.vocab_size, f"input_ids outside [0, {config.vocab_size})"),
        (tt_lo < 0 or tt_hi >= config.type_vocab_size, f"token_type_ids outside [0, {config.type_vocab_size})"),
        (pos_lo < 0 or pos_hi >= config.max_position_embeddings,
         f"position_ids outside [0, {config.max_position_embeddings})"),
        (first != 0, "cu_seqlens does not start at 0"),
        (last > n, f"cu_seqlens ends at {last}, past the {n} tokens"),
        (decreasing, "cu_seqlens decreases"),
        (longest > max_seqlen, f"a sequence is longer than max_seqlen={max_seqlen}"),
        (crossing, f"{crossing} sequence(s) cross a row boundary (a multiple of max_seqlen={max_seqlen})")) if bad]
    if problems:
        raise ValueError("packed batch: " + "; ".join(problems))


def unpad(x: torch.Tensor, u: Unpadded) -> torch.Tensor:
    """[batch, seqlen, ...] -> [total_tokens, ...]."""
    return x.reshape(u.batch * u.seqlen, *x.shape[2:])[u.indices]


def pad(x: torch.Tensor, u: Unpadded, fill: float = 0.0) -> torch.Tensor:
    """[total_tokens, ...] -> [batch, seqlen, ...], `fill` at padded positions."""
    out = x.new_full((u.batch * u.seqlen, *x.shape[1:]), fill)
    out = out.index_put((u.indices,), x)
    return out.view(u.batch, u.seqlen, *x.shape[1:])


SCALAR_KEYS = ("labels", "start_positions", "end_positions", "next_sentence_label")


def pad_batch(rows: list[dict], pad_id: int = 0, multiple: int = 8) -> dict[str, torch.Tensor]:
    """Model inputs from rows of token lists: input_ids (pad_id on padding) and token_type_ids padded to the
    longest row rounded up to `multiple`, an attention_mask, labels given per token padded with -100, and
    per-row values (a class label, QA start/end positions, next_sentence_label) stacked. Other keys of a row
    (bookkeeping such as NER's first-token positions) are not model inputs and are left out."""
    width = -(-max(len(r["input_ids"]) for r in rows) // multiple) * multiple
    out = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
           "token_type_ids": torch.zeros((len(rows), width), dtype=torch.long),
           "attention_mask": torch.zeros((len(rows), width), dtype=torch.long)}
    per_token = [k for k in ("labels",) if k in rows[0] and isinstance(rows[0][k], (list, torch.Tensor))]
    for key in per_token:
        out[key] = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        out["input_ids"][i, :n] = torch.as_tensor(r["input_ids"])
        out["token_type_ids"][i, :n] = torch.as_tensor(r.get("token_type_ids", [0] * n))
        out["attention_mask"][i, :n] = 1
        for key in per_token:
            out[key][i, :len(r[key])] = torch.as_tensor(r[key])
    for key in SCALAR_KEYS:
        if key in rows[0] and key not in per_token:
            out[key] = torch.tensor([r[key] for r in rows], dtype=torch.long)
    return out

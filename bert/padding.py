"""Removing padding once per batch and putting it back at the end.

The encoder works on packed tokens: [total_tokens, hidden] with int32 `cu_seqlens` marking where each
sequence starts, as in FlashAttention's variable-length API. Tokens keep their order inside a sequence,
so any 0/1 mask works (right padding, left padding or holes).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Unpadded(NamedTuple):
    indices: torch.Tensor      # [total_tokens] int64, flat index into [batch * seqlen] of each kept token
    cu_seqlens: torch.Tensor   # [batch + 1] int32, start of each sequence in the packed tensor
    max_seqlen: int            # longest kept sequence (a Python int: kernels size their grid with it)
    batch: int
    seqlen: int                # padded length of the input
    seq: torch.Tensor          # [total_tokens] int64, the sequence each packed token belongs to
    pos: torch.Tensor          # [total_tokens] int64, its position among that sequence's kept tokens


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

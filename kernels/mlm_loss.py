"""Masked-LM loss fused with the decoder: cross_entropy(hidden @ weight^T + bias, labels) over labelled rows
only, in bounded memory, by one of two strategies.

Only labelled rows are computed: the launcher gathers the rows whose label is not ignore_index (in BERT
pre-training about 15% of tokens), so ignored rows cost nothing. A packed batch of fixed shapes passes its
labelled rows already gathered, with a few unused slots: `validate=False` then computes every row and zeroes the
unused ones, so that no host sync (the gather's count) stops the device.

With M rows, V = vocabulary, H = hidden, a "logit-sized matmul" is 2 M V H FLOPs.

Strategy "chunked" (kernels/_mlm_chunked.py, the default): logits of a chunk of rows at a time by cuBLAS, then
one Triton program per row for the loss and the gradient of the logits, the gradients of the sum computed in the
forward; one chunk of logits of extra memory.

Strategy "fused" (kernels/_mlm_fused.py): no logits in memory at all; Triton kernels build the logit tiles they
need, forward (an online log-sum-exp over vocabulary tiles) and backward (d hidden and d weight each by one
owner of every output block, recomputing the logit tiles).

Strategy "auto" runs what the launch-config table measured faster for this GPU, dtype, hidden size and row-count
bucket (pick_strategy), else "chunked".
"""
from __future__ import annotations

import json
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import launches, targets, tuned
from ._common import check_device, check_float, dense, unit_stride
from ._mlm_chunked import _mlm_loss_chunked, _mlm_loss_chunked_rows
from ._mlm_fused import _mlm_loss_fwd

__all__ = ["labelled_rows", "masked_lm_loss", "masked_lm_loss_ref"]
REDUCTIONS = ("mean", "sum", "none")
STRATEGIES = ("auto", "chunked", "fused")


class MLMLossOutput(NamedTuple):
    loss: torch.Tensor      # scalar for "mean"/"sum", [N] for "none"
    correct: torch.Tensor   # int64 scalar: labelled rows whose top-1 logit is the label


def _check(hidden, weight, bias, labels, reduction):
    op = "masked_lm_loss"
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{op}: {name} must be a 2-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        check_float(op, name, t)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{op}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: hidden has {hidden.shape[1]} features but weight is {tuple(weight.shape)} [V, H]")
    if bias is not None:
        check_float(op, "bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"{op}: labels must be an integer tensor")
    if tuple(labels.shape) != (hidden.shape[0],):
        raise ValueError(f"{op}: labels has shape {tuple(labels.shape)}, expected ({hidden.shape[0]},)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_device(op, hidden=hidden, weight=weight, bias=bias, labels=labels)


class _Strategy(NamedTuple):
    strategy: str


def _strategy_config(dtype: torch.dtype, h: int, target: targets.Target | None, rows: int | None) -> _Strategy:
    """The strategy entry of `target`'s table (keyed by hidden size and row bucket), else "chunked"."""
    return tuned.pick("mlm_loss.strategy", _Strategy("chunked"), target, dtype, h, seqlen=rows)


launches.declare(launches.LaunchSite("mlm_loss.strategy", None, lambda dtype, h, target: _Strategy("chunked"),
                                     lambda dtype, h, target, rows=None: _strategy_config(dtype, h, target, rows),
                                     launches.grid(strategy=["chunked", "fused"])))


def pick_strategy(hidden: torch.Tensor, rows: int) -> str:
    """What strategy="auto" runs for `rows` labelled rows of hidden's width and dtype on hidden's device: the
    committed launch-config table's choice for this GPU ("mlm_loss.strategy", measured by the tuner, keyed by
    the row count's bucket), else "chunked" (the CPU, or a GPU or shape the table lacks)."""
    choice = _strategy_config(hidden.dtype, hidden.shape[1], targets.of(hidden.device), rows).strategy
    if choice not in STRATEGIES[1:]:
        tuned.warn_ignored("mlm_loss.strategy", "table", json.dumps({"strategy": choice}),
                           f"not one of {', '.join(STRATEGIES[1:])}")
        return "chunked"
    return choice


class _Rows(NamedTuple):
    """The rows the kernels compute, one concern: gathering (validate=True) or masking (validate=False), in the
    layouts the ops take."""
    hidden: torch.Tensor             # [N', H], unit stride along H
    labels: torch.Tensor             # [N'] int64, contiguous; -1 where a row counts for nothing (validate=False)
    used: torch.Tensor | None        # [N'] bool (validate=False), else None: every row counts
    count: int | torch.Tensor        # labelled rows, at least 1 (the mean's divisor)
    index: torch.Tensor | None       # [N'] positions in the caller's rows (validate=True)


@torch.library.custom_op("bertfuse::labelled_rows", mutates_args=())
def _labelled_rows(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (labels != ignore_index).nonzero().squeeze(1)


@_labelled_rows.register_fake
def _(labels, ignore_index):
    return labels.new_empty(_data_dependent_size(torch.library.get_ctx()), dtype=torch.int64)


def _data_dependent_size(ctx) -> torch.SymInt:
    """A size only the data knows (the labelled count), as an unbacked symbol in the traced graph. The public
    ctx.new_dynamic_size refuses unless the trace allows every dynamic-shape op (fullgraph=True, or the global
    capture_dynamic_output_shape_ops): otherwise a plain torch.compile would break the graph here, around the
    whole MLM head. This op's consumers (the gather, the head, the loss ops) are written for such a size, so it
    is allocated the way new_dynamic_size allocates it, for this op alone; where that internal function is
    missing (another torch), the public call decides."""
    env = getattr(ctx, "_shape_env", None)
    try:
        from torch._library.fake_impl import allocate_size
    except ImportError:
        allocate_size = None
    if env is None or allocate_size is None or env.allow_dynamic_output_shape_ops:
        return ctx.new_dynamic_size()
    return allocate_size(env)


def labelled_rows(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The positions [R] int64 of labels [N] (integer) that are not ignore_index, in order: (labels !=
    ignore_index).nonzero() in eager mode, and an op of data-dependent size under torch.compile, so that a
    compiled model gathers its labelled rows without a graph break (and fullgraph=True works)."""
    if labels.dim() != 1 or labels.is_floating_point():
        raise ValueError(f"labelled_rows: labels must be a 1-D integer tensor, got {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if torch.compiler.is_compiling():
        return _labelled_rows(labels, ignore_index)
    return (labels != ignore_index).nonzero().squeeze(1)


def _check_picked(picked: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The gathered labels lie in [0, vocab): one sync in eager mode (the error names the range found); under
    torch.compile an asynchronous device assertion, which needs no sync and stops the step just the same."""
    message = f"masked_lm_loss: labels must be in [0, {vocab}) or ignore_index={ignore_index}"
    if torch.compiler.is_compiling():
        torch._assert_async(((picked >= 0) & (picked < vocab)).all(), message)
    elif picked.numel():
        lo, hi = torch.stack([picked.min(), picked.max()]).tolist()
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{message}; got values in [{lo}, {hi}]")


def _rows(hidden, labels, vocab: int, ignore_index: int, validate: bool) -> _Rows:
    used = labels != ignore_index
    if not validate:  # a label outside [0, V) is treated as ignored, as documented
        used = used & (labels >= 0) & (labels < vocab)
        return _Rows(unit_stride(hidden), labels.masked_fill(~used, -1).to(torch.int64).contiguous(), used,
                     used.sum().clamp_min(1), None)
    index = labelled_rows(labels, ignore_index)
    picked = labels[index]
    _check_picked(picked, vocab, ignore_index)
    count = used.sum().clamp_min(1) if torch.compiler.is_compiling() else max(index.numel(), 1)
    return _Rows(hidden[index], picked.to(torch.int64).contiguous(), None, count, index)


def _check_strategy(strategy, chunk_rows) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"masked_lm_loss: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"masked_lm_loss: chunk_rows must be a positive int or None, got {chunk_rows!r}")


def _row_loss(r: _Rows, weight, bias, strategy: str, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [N'] float32 with 0 where a row counts for nothing, hit [N'] bool), differentiable per row."""
    if strategy == "fused":
        per_row, hit, _ = _mlm_loss_fwd(r.hidden, weight, bias, r.labels)
    else:
        per_row, hit = _mlm_loss_chunked_rows(r.hidden, weight, bias, r.labels, chunk_rows)
    return (per_row if r.used is None else per_row * r.used), hit


def _reduced_loss(r: _Rows, weight, bias, reduction: str, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean or sum, hit [N']) by the chunked strategy, its gradients computed in the forward: the weight of each
    row in the differentiated sum (1/count or 1, 0 where a row counts for nothing) is known there."""
    scale = (torch.ones(r.hidden.shape[0], dtype=torch.float32, device=r.hidden.device) if r.used is None
             else r.used.float())
    norm = torch.ones((), dtype=torch.float32, device=r.hidden.device)
    if reduction == "mean":
        norm = norm / r.count
    grad = torch.is_grad_enabled()
    need_hidden = grad and r.hidden.requires_grad
    need_weight = grad and (weight.requires_grad or (bias is not None and bias.requires_grad))
    total, _, hit, *_ = _mlm_loss_chunked(r.hidden, weight, bias, r.labels, scale, norm, chunk_rows, need_hidden,
                                          need_weight)
    return total, hit


def masked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   ignore_index: int = -100, reduction: str = "mean", return_correct: bool = False,
                   validate: bool = True, strategy: str = "auto", chunk_rows: int | None = None):
    """cross_entropy(hidden @ weight^T + bias, labels) over the labelled rows only, in bounded memory.

    hidden [N, H], weight [V, H], bias [V] or None, labels [N] (ignore_index rows contribute nothing).
    Returns the loss ("mean" over labelled rows, 0 when there are none; "sum"; or "none": [N] with 0 at
    ignored rows), or with return_correct=True an MLMLossOutput(loss, correct), `correct` counting labelled
    rows whose top-1 logit is the label.

    strategy: "chunked" (logits of at most `chunk_rows` rows at a time by cuBLAS, default CHUNK_BYTES of them
    in kernels/_mlm_chunked.py; gradients computed in the forward), "fused" (no logits in memory at all; Triton
    matmuls, recomputed in the backward) or "auto" (the GPU's measured choice, pick_strategy; "chunked" on the
    CPU). The docstrings of kernels/_mlm_chunked.py and kernels/_mlm_fused.py give each one's FLOPs and memory.

    validate=True (the default) checks that labels lie in [0, V) and skips ignored rows, which takes one host
    sync. validate=False takes none, for fixed-shape batches whose labels are checked where they are made
    (a packer's): every row is computed and the ignored ones are zeroed, loss and gradients; a label
    outside [0, V) then acts like an ignored row's (no error, no NaN). Runs as custom ops
    (bertfuse::masked_lm_loss_*), which torch.compile traces through in one graph with either validate: compiled,
    validate=True gathers the labelled rows by an op of data-dependent size (labelled_rows) and checks their
    labels by a device assertion instead of a sync, and strategy="auto" picks for N rows (the count is not known
    while tracing).
    """
    _check(hidden, weight, bias, labels, reduction)
    _check_strategy(strategy, chunk_rows)
    r = _rows(hidden, labels, weight.shape[0], ignore_index, validate)
    weight, bias = unit_stride(weight), dense(bias)  # the layouts the kernels index
    if strategy == "auto":  # compiled, the labelled count is data: the pick is for its bound, all N rows
        strategy = pick_strategy(r.hidden, labels.shape[0] if torch.compiler.is_compiling() else r.hidden.shape[0])
    if strategy == "fused":
        targets.check("masked_lm_loss(strategy='fused')", hidden.dtype, hidden.device, dots=True)
    if strategy == "chunked" and reduction != "none":
        loss, hit = _reduced_loss(r, weight, bias, reduction, chunk_rows or 0)
    else:
        per_row, hit = _row_loss(r, weight, bias, strategy, chunk_rows or 0)
        if reduction == "mean":
            loss = per_row.sum() / r.count
        elif reduction == "sum":
            loss = per_row.sum()
        else:
            loss = per_row if r.index is None else per_row.new_zeros(labels.shape[0]).index_put((r.index,), per_row)
    if return_correct:
        return MLMLossOutput(loss, hit.sum(dtype=torch.int64))
    return loss


def masked_lm_loss_ref(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                       ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """`masked_lm_loss` in plain PyTorch, for checks: every row's logits in the inputs' dtype, the softmax in
    float32 at least (as under autocast); "mean" over the labelled rows, 0 when there are none."""
    logits = F.linear(hidden, weight, bias)
    per_row = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels,
                              ignore_index=ignore_index, reduction="none")
    if reduction == "none":
        return per_row
    return per_row.sum() if reduction == "sum" else per_row.sum() / (labels != ignore_index).sum().clamp_min(1)


"""Device tables through which one launch reaches many tensors (the multi-tensor kernels: kernels/lamb.py).

A multi-tensor step passes each kernel, per launch group (tensors of one parameter group and one pair of weight
and gradient dtypes), the group's first tensor of each kind as a base pointer and a table of every tensor's offset
from it, in units of VEC elements: VEC is the elements in 16 bytes where every tensor of that kind is 16-byte
aligned (torch allocates so), so the compiler knows the alignment of `base + offset * VEC` and moves whole
16-byte vectors; else 1. Each program takes one chunk of CHUNK elements of one tensor (`chunk_tensor`,
`first_chunk`, `numel`), and a last row holds the step counts' addresses.

Tables depend only on the tensors' addresses, sizes and dtypes: `plan` builds them once per set of tensors and
caches the last few. A plan made or used while a CUDA graph is being captured is kept for good (the graph reads
its tables at every replay), and its tables are copied from host memory pinned before the capture.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
import triton

ROWS = 5  # the table's rows: parameter, gradient, m, v offsets; step counts' addresses


class LaunchGroup(NamedTuple):
    """One launch group's tensors, its tables on the device (views into one buffer), and how they are addressed."""
    group: int                 # its parameter group
    index: list                # its tensors' positions in the step's lists
    n: int
    chunks: int
    chunk_offset: int          # where its chunks' partial sums start
    table: torch.Tensor        # [5, n] int64: offsets from each row's first tensor (in units of the row's VEC), and
                               # the step counts' addresses
    chunk_tensor: torch.Tensor  # [chunks] int32
    first_chunk: torch.Tensor  # [n + 1] int64
    numel: torch.Tensor        # [n] int64
    vec: tuple                 # (parameter, gradient, state) elements per offset unit


class Plan(NamedTuple):
    """Every launch group's tables for one set of tensors."""
    launches: list             # [LaunchGroup]
    chunks: int                # over every launch group
    step_table: torch.Tensor   # [tensors] int64: every step count's address
    buffers: tuple             # the host (pinned) and device buffers the views come from, kept alive


_PLANS: OrderedDict = OrderedDict()  # (device, chunk, tensors' addresses, sizes, dtypes) -> Plan, most recent last
_KEPT = 8                            # plans kept, besides those a CUDA graph captured
_CAPTURED: dict = {}                 # plans made or used in a CUDA-graph capture: the graph reads their tables
_RESERVE: dict = {}                  # device -> a pinned host buffer kept for the plan of a CUDA-graph capture


def _to_device(values: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(host buffer, device copy) of int64 values. On a GPU the host buffer is pinned and the copy does not block;
    inside a CUDA-graph capture the copy is a node of the graph, which reads the same host buffer (kept alive, never
    written again) at every replay. Memory is not pinned inside a capture (not every torch allows it): a capture
    takes the buffer reserved by the last plan made before it (a warm-up step's), as large as that plan's tables."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host, host
    if torch.cuda.is_current_stream_capturing():
        spare = _RESERVE.pop(device, None)
        if spare is None or spare.numel() < len(values):
            raise RuntimeError("multi-tensor step: a step captured in a CUDA graph must follow an eager step over "
                               "as many tensors (the capture's warm-up), which reserves the memory its tables are "
                               "copied from")
        staged = spare[:len(values)]
        staged.copy_(host)
        return spare, staged.to(device, non_blocking=True)
    if device not in _RESERVE or _RESERVE[device].numel() < len(values):
        _RESERVE[device] = torch.empty(len(values), dtype=torch.int64).pin_memory()
    host = host.pin_memory()
    return host, host.to(device, non_blocking=True)


def _vec(tensors: list[torch.Tensor]) -> int:
    """Elements per offset unit: those in 16 bytes where every tensor is 16-byte aligned (torch allocates so),
    else 1."""
    return 16 // tensors[0].element_size() if all(t.data_ptr() % 16 == 0 for t in tensors) else 1


def _offsets(tensors: list[torch.Tensor], name: str, index: list, vec: int) -> list[int]:
    """Each tensor's offset from the first, in units of `vec` elements."""
    size = tensors[0].element_size()
    addresses = [t.data_ptr() for t in tensors]
    for t, a in zip(index, addresses):
        if a % size:
            raise ValueError(f"multi-tensor step: {name} {t} is not aligned to its {size}-byte elements "
                             f"(address {a:#x})")
    return [(a - addresses[0]) // (size * vec) for a in addresses]


def _build(lists: tuple, launch_groups: list, chunk: int, device: torch.device) -> Plan:
    """The tables of every launch group, in one host buffer copied to the device at once."""
    values, layout, chunks_total = [], [], 0
    for group, index in launch_groups:
        counts = [triton.cdiv(lists[0][i].numel(), chunk) for i in index]
        first = [0]
        for count in counts:
            first.append(first[-1] + count)
        rows = [[lists[r][i] for i in index] for r in range(4)]
        vec = (_vec(rows[0]), _vec(rows[1]), _vec(rows[2] + rows[3]))  # m and v: one unit for both
        start = len(values)
        for row, name, row_vec in zip(rows, ("param", "grad", "state", "state"), vec + vec[2:]):
            values += _offsets(row, name, index, row_vec)
        values += [lists[4][i].data_ptr() for i in index]
        values += [t for t, count in enumerate(counts) for _ in range(count)] + first
        values += [lists[0][i].numel() for i in index]
        layout.append((group, index, first[-1], chunks_total, start, vec))
        chunks_total += first[-1]
    step_start = len(values)
    values += [s.data_ptr() for s in lists[4]]
    host, dev = _to_device(values, device)
    out = []
    for group, index, chunks, offset, start, vec in layout:
        n = len(index)
        at = start + ROWS * n
        out.append(LaunchGroup(group, index, n, chunks, offset, dev[start:at].view(ROWS, n),
                             dev[at:at + chunks].to(torch.int32), dev[at + chunks:at + chunks + n + 1],
                             dev[at + chunks + n + 1:at + chunks + 2 * n + 1], vec))
    return Plan(out, chunks_total, dev[step_start:step_start + len(lists[4])], (host, dev))


def _launch_groups(params: list, grads: list, group_sizes: list[int]) -> list:
    """(parameter group, positions of its tensors) per launch group: one per parameter group and pair of
    parameter and gradient dtypes (a kernel is compiled for its dtypes)."""
    out, i = [], 0
    for group, size in enumerate(group_sizes):
        by_dtype: dict = {}
        for j in range(i, i + size):
            by_dtype.setdefault((params[j].dtype, grads[j].dtype), []).append(j)
        out += [(group, index) for index in by_dtype.values()]
        i += size
    return out


def plan(lists: tuple, group_sizes: list[int], chunk: int) -> Plan:
    """The plan of `lists` (parameters, gradients, m, v, step counts; tensor i in the group holding position i of
    `group_sizes`), in chunks of `chunk` elements: the cached one where their addresses, sizes and dtypes are those it was made for
    (a plan depends on nothing else), else a new one. A plan made or used while a CUDA graph is being captured is
    kept for good: the graph reads its tables at every replay."""
    device = lists[0][0].device
    launch_groups = _launch_groups(lists[0], lists[1], group_sizes)
    key = (str(device), chunk, tuple((g, tuple(index)) for g, index in launch_groups),
           tuple((t.data_ptr(), t.numel(), t.dtype) for row in lists for t in row))
    found = _PLANS.get(key) or _build(lists, launch_groups, chunk, device)
    _PLANS[key] = found
    _PLANS.move_to_end(key)
    while len(_PLANS) > _KEPT:
        _PLANS.popitem(last=False)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _CAPTURED[key] = found
    return found

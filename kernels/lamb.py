"""LAMB, the optimizer of BERT's large-batch records, as multi-tensor Triton kernels: `Lamb`, a torch optimizer.

For each parameter w with gradient g (all of the optimizer's parameters at once), at step t (counted per
parameter, from 1; beta1, beta2, eps, the weight decay wd and the learning rate lr per parameter group):

    n      = || all gradients ||                      (one norm over every group)
    g'     = g / max(1, n / max_grad_norm)            (max_grad_norm 0: g' = g)
    m      = beta1 m + (1 - beta1) g'                 v = beta2 v + (1 - beta2) g'^2
    u      = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + wd w
    ratio  = ||w|| / ||u|| where wd != 0 and both norms are > 0, else 1
    w     <- w - lr ratio u

which is what NVIDIA's FusedLAMB (apex) computes with its defaults (`adam_w_mode`, `grad_averaging`,
`bias_correction`, `use_nvlamb=False`: no trust ratio on parameters without weight decay). The bias corrections
are formed as -expm1(t ln beta) (Kahan's expm1 from exp and log), so 1 - 0.999^1 keeps its digits in float32.

A step is five kinds of launch over the parameters, each program handling a chunk of CHUNK elements of one tensor,
found through device tables of the tensors' offsets (kernels/_multi_tensor.py: built once per set of tensors):

    sumsq    per chunk, sum of g^2                                    reads g
    global   one program: n, the pre-normalisation, whether to skip; adds 1 to every step count
    moments  per chunk, m and v updated; sums of w^2 and u^2          reads g, m, v, w; writes m, v
    ratio    per tensor, ||w|| / ||u|| from its chunks' sums
    update   per chunk, u again from the new m and v, w updated       reads m, v, w; writes w

so 44 bytes move per float32 parameter (a one-pass AdamW moves 28: LAMB's two norms need the extra passes).
Tensors are launched together per (parameter group, parameter dtype, gradient dtype). The state, m, v and the
step count, is float32 whatever the parameters' dtype; the sums are float32 and taken in a fixed order, so a step
is deterministic.

A step whose gradient norm is not finite, or whose `found_inf` flag (set by the caller: a loss that was not finite)
is nonzero, changes nothing: weights, moments and step counts stay as they were. Nothing reads the device, so the
step can be captured in a CUDA graph, with each group's learning rate a device tensor the graph reads.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _multi_tensor as multi_tensor, launches, targets, tuned
from ._common import FLOAT_DTYPES, _refusal, check_device, warn_once

__all__ = ["Lamb", "LambGroup", "lamb_step", "lamb_ref"]


@triton.jit
def _one_minus_pow(ln_beta, step):
    """1 - beta^step = -expm1(step ln beta), expm1(x) = (e^x - 1) x / ln(e^x) (Kahan): accurate where e^x is
    near 1, where 1 - exp(x) would keep few digits; -1 where e^x underflows (beta 0, long runs)."""
    x = step * ln_beta
    u = tl.exp(x)
    em1 = tl.where(u == 1.0, x, (u - 1.0) * x / tl.log(u))
    return -tl.where(u == 0.0, -1.0, em1)


@triton.jit
def _tensor(BASE, TABLE, row, n, t, VEC: tl.constexpr):
    """Tensor t of a table row: its launch group's first tensor of that row (BASE) plus its offset there, stored
    in units of VEC elements. With VEC the elements in 16 bytes (every tensor 16-byte aligned) the compiler knows
    the alignment and moves whole 16-byte vectors; with VEC 1, single elements."""
    return BASE + tl.load(TABLE + row * n + t) * VEC


@triton.jit
def _chunk(CHUNK_TENSOR, FIRST_CHUNK, NUMEL, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """(tensor, its element count, first element, end of the whole blocks, end) of this program's chunk: whole
    blocks from the first element, then where the end is short of a whole block (the tensor's end), its tail."""
    c = tl.program_id(0)
    t = tl.load(CHUNK_TENSOR + c)
    numel = tl.load(NUMEL + t)
    start = (c - tl.load(FIRST_CHUNK + t)).to(tl.int64) * CHUNK
    size = tl.minimum(numel - start, CHUNK)
    return t, numel, start, start + (size // BLOCK) * BLOCK, start + size


@triton.jit
def _load(ptr, offs, numel, FULL: tl.constexpr):
    """Float32 values at offs: unmasked in a block wholly inside the tensor (FULL), so that it is vectorised."""
    if FULL:
        return tl.load(ptr + offs).to(tl.float32)
    else:
        return tl.load(ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, offs, value, numel, FULL: tl.constexpr):
    if FULL:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty))
    else:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=offs < numel)


@triton.jit
def _sumsq_kernel(
    G0,            # a gradient of the launch group: the base of the gradient offsets
    TABLE,         # [5, n] int64: each tensor's offset from its row's base (parameter, gradient, m, v; in VEC
                   # units) and its step count's address
    CHUNK_TENSOR,  # [chunks] int32: the tensor of each chunk
    FIRST_CHUNK,   # [n + 1] int64: each tensor's first chunk
    NUMEL,         # [n] int64
    PARTIAL_G,     # [chunks] float32: sum of g^2 per chunk
    n,
    G_VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    t, numel, start, whole, end = _chunk(CHUNK_TENSOR, FIRST_CHUNK, NUMEL, CHUNK, BLOCK)
    g_ptr = _tensor(G0, TABLE, 1, n, t, G_VEC)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in range(start, whole, BLOCK):
        g = _load(g_ptr, b + tl.arange(0, BLOCK), numel, True)
        acc += g * g
    if whole < end:
        g = _load(g_ptr, whole + tl.arange(0, BLOCK), numel, False)
        acc += g * g
    tl.store(PARTIAL_G + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _global_kernel(
    PARTIAL_G,     # [chunks] float32: every launch's sums of g^2
    STEP_TABLE,    # [n] int64: every tensor's step-count address (float32 scalars)
    FOUND_INF,     # [1] float: nonzero skips the step (HAS_FOUND_INF)
    STATS,         # [3] float32 out: the gradient norm, the factor 1 / max(1, norm / max_grad_norm), skipped (0/1)
    chunks, n, max_grad_norm,
    HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr,
):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, chunks, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(PARTIAL_G + offs, mask=offs < chunks, other=0.0)
    norm = tl.sqrt(tl.sum(acc, 0))
    skip = (norm - norm) != 0.0  # inf or NaN
    if HAS_FOUND_INF:
        skip = skip | (tl.load(FOUND_INF).to(tl.float32) != 0.0)
    clip = tl.where(max_grad_norm > 0, tl.maximum(norm / tl.where(max_grad_norm > 0, max_grad_norm, 1.0), 1.0), 1.0)
    skipped = skip.to(tl.float32)
    tl.store(STATS, norm)
    tl.store(STATS + 1, 1.0 / clip)
    tl.store(STATS + 2, skipped)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        step_ptrs = tl.load(STEP_TABLE + offs, mask=offs < n, other=0).to(tl.pointer_type(tl.float32))
        steps = tl.load(step_ptrs, mask=offs < n, other=0.0)
        tl.store(step_ptrs, steps + (1.0 - skipped), mask=offs < n)


@triton.jit
def _direction(m, v, w, bc1, bc2, eps, weight_decay):
    """The update u, from the new moments."""
    return (m / bc1) / (tl.sqrt(v / bc2) + eps) + weight_decay * w


@triton.jit
def _moments_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, numel, scale, bc1, bc2, beta1, beta2, eps, weight_decay,
                   FULL: tl.constexpr):
    """One block's moments, stored; returns (w^2, u^2) of its elements (0 outside the tensor)."""
    g = _load(g_ptr, offs, numel, FULL) * scale
    w = _load(p_ptr, offs, numel, FULL)
    m = beta1 * _load(m_ptr, offs, numel, FULL) + (1.0 - beta1) * g
    v = beta2 * _load(v_ptr, offs, numel, FULL) + (1.0 - beta2) * g * g
    _store(m_ptr, offs, m, numel, FULL)
    _store(v_ptr, offs, v, numel, FULL)
    u = _direction(m, v, w, bc1, bc2, eps, weight_decay)
    if not FULL:
        u = tl.where(offs < numel, u, 0.0)
    return w * w, u * u


@triton.jit
def _moments_kernel(
    P0, G0, M0, V0,                            # the launch group's first parameter, gradient, m, v: the bases
    TABLE, CHUNK_TENSOR, FIRST_CHUNK, NUMEL,   # as in _sumsq_kernel
    STATS,                                     # [3] float32, from _global_kernel
    PARTIAL_W, PARTIAL_U,                      # [chunks] float32 out: sums of w^2 and u^2 per chunk
    n, beta1, beta2, ln_beta1, ln_beta2, eps, weight_decay,
    P_VEC: tl.constexpr, G_VEC: tl.constexpr, S_VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    if tl.load(STATS + 2) == 0.0:  # a skipped step stores nothing (and its sums are never read)
        t, numel, start, whole, end = _chunk(CHUNK_TENSOR, FIRST_CHUNK, NUMEL, CHUNK, BLOCK)
        p_ptr, g_ptr = _tensor(P0, TABLE, 0, n, t, P_VEC), _tensor(G0, TABLE, 1, n, t, G_VEC)
        m_ptr, v_ptr = _tensor(M0, TABLE, 2, n, t, S_VEC), _tensor(V0, TABLE, 3, n, t, S_VEC)
        step = tl.load(tl.load(TABLE + 4 * n + t).to(tl.pointer_type(tl.float32)))
        bc1, bc2 = _one_minus_pow(ln_beta1, step), _one_minus_pow(ln_beta2, step)
        scale = tl.load(STATS + 1)
        acc_w = tl.zeros((BLOCK,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK,), dtype=tl.float32)
        for b in range(start, whole, BLOCK):
            w2, u2 = _moments_block(p_ptr, g_ptr, m_ptr, v_ptr, b + tl.arange(0, BLOCK), numel, scale, bc1, bc2,
                                    beta1, beta2, eps, weight_decay, True)
            acc_w += w2
            acc_u += u2
        if whole < end:
            w2, u2 = _moments_block(p_ptr, g_ptr, m_ptr, v_ptr, whole + tl.arange(0, BLOCK), numel, scale, bc1, bc2,
                                    beta1, beta2, eps, weight_decay, False)
            acc_w += w2
            acc_u += u2
        c = tl.program_id(0)
        tl.store(PARTIAL_W + c, tl.sum(acc_w, 0))
        tl.store(PARTIAL_U + c, tl.sum(acc_u, 0))


@triton.jit
def _ratio_kernel(
    FIRST_CHUNK,             # [n + 1] int64
    PARTIAL_W, PARTIAL_U,    # [chunks] float32, from _moments_kernel
    RATIO,                   # [n] float32 out: each tensor's trust ratio
    weight_decay,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    first, last = tl.load(FIRST_CHUNK + t), tl.load(FIRST_CHUNK + t + 1)
    acc_w = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(first, last, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc_w += tl.load(PARTIAL_W + offs, mask=offs < last, other=0.0)
        acc_u += tl.load(PARTIAL_U + offs, mask=offs < last, other=0.0)
    w_norm, u_norm = tl.sqrt(tl.sum(acc_w, 0)), tl.sqrt(tl.sum(acc_u, 0))
    trusted = (weight_decay != 0.0) & (w_norm > 0.0) & (u_norm > 0.0)
    tl.store(RATIO + t, tl.where(trusted, w_norm / tl.where(trusted, u_norm, 1.0), 1.0))


@triton.jit
def _update_block(p_ptr, m_ptr, v_ptr, offs, numel, rate, bc1, bc2, eps, weight_decay, FULL: tl.constexpr):
    w = _load(p_ptr, offs, numel, FULL)
    u = _direction(_load(m_ptr, offs, numel, FULL), _load(v_ptr, offs, numel, FULL), w, bc1, bc2, eps, weight_decay)
    _store(p_ptr, offs, w - rate * u, numel, FULL)


@triton.jit
def _update_kernel(
    P0, M0, V0,                                # bases, as in _moments_kernel
    TABLE, CHUNK_TENSOR, FIRST_CHUNK, NUMEL,   # as in _sumsq_kernel
    STATS,                                     # [3] float32, from _global_kernel
    RATIO,                                     # [n] float32, from _ratio_kernel
    LR,                                        # [1] float32: the group's learning rate
    n, ln_beta1, ln_beta2, eps, weight_decay,
    P_VEC: tl.constexpr, S_VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    if tl.load(STATS + 2) == 0.0:
        t, numel, start, whole, end = _chunk(CHUNK_TENSOR, FIRST_CHUNK, NUMEL, CHUNK, BLOCK)
        p_ptr = _tensor(P0, TABLE, 0, n, t, P_VEC)
        m_ptr, v_ptr = _tensor(M0, TABLE, 2, n, t, S_VEC), _tensor(V0, TABLE, 3, n, t, S_VEC)
        step = tl.load(tl.load(TABLE + 4 * n + t).to(tl.pointer_type(tl.float32)))
        bc1, bc2 = _one_minus_pow(ln_beta1, step), _one_minus_pow(ln_beta2, step)
        rate = tl.load(LR).to(tl.float32) * tl.load(RATIO + t)
        for b in range(start, whole, BLOCK):
            _update_block(p_ptr, m_ptr, v_ptr, b + tl.arange(0, BLOCK), numel, rate, bc1, bc2, eps, weight_decay,
                          True)
        if whole < end:
            _update_block(p_ptr, m_ptr, v_ptr, whole + tl.arange(0, BLOCK), numel, rate, bc1, bc2, eps, weight_decay,
                          False)


# ---- launch configs -------------------------------------------------------------------------------------------

class _Launch(NamedTuple):
    CHUNK: int       # elements per program (a multiple of BLOCK)
    BLOCK: int       # elements per loop step
    num_warps: int


def _default_config(dtype: torch.dtype, size: int, target: targets.Target | None) -> _Launch:
    """Chunks of 16,384 elements: on a GPU in blocks of 1,024 (eight float32 per thread at 4 warps: 16-byte
    accesses; BERT-base is ~6,700 programs), in the interpreter in one block (few, wide numpy steps)."""
    if target is None and targets.INTERPRET:
        return _Launch(16384, 16384, 4)
    return _Launch(16384, 1024, 4)


def _config(part: str, dtype: torch.dtype, target: targets.Target | None) -> _Launch:
    """The config of a chunk kernel ("sumsq", "moments", "update"): BLOCK and num_warps from the family's table;
    CHUNK, which the address tables are built for, is the default's (a multiple of any BLOCK a table may give)."""
    return tuned.pick(f"lamb.{part}", _default_config(dtype, 1, target), target, dtype, 1,
                      tunable=("BLOCK", "num_warps"), need=lambda c, t: tuned.tile_need(c.BLOCK, c, t))


class _Reduce(NamedTuple):
    BLOCK: int       # partial sums per loop step
    num_warps: int


def _reduce_config(dtype, size, target, seqlen=None) -> _Reduce:
    return _Reduce(1024, 4)


def _site(part: str, kernel, tail: int) -> launches.LaunchSite:
    """A chunk kernel's site: 16-byte accesses in whole blocks; its tail block's `tail` half-precision accesses
    (the gradient's load; the parameter's and gradient's loads; the parameter's load and store) one by one."""
    return launches.LaunchSite(f"lamb.{part}", kernel, lambda dtype, n, target: _default_config(dtype, n, target),
                               lambda dtype, n, target, seqlen=None: _config(part, dtype, target), needs="vectors",
                               tail=tail)


_SUMSQ, _GLOBAL, _MOMENTS, _RATIO, _UPDATE = launches.declare(
    _site("sumsq", _sumsq_kernel, 1),
    launches.LaunchSite("lamb.global", _global_kernel, _reduce_config, _reduce_config),
    _site("moments", _moments_kernel, 2),
    launches.LaunchSite("lamb.ratio", _ratio_kernel, _reduce_config, _reduce_config),
    _site("update", _update_kernel, 2))


# ---- the launcher and its custom op ----------------------------------------------------------------------------

class LambGroup(NamedTuple):
    """One parameter group of a LAMB step: its next `count` tensors, and its hyperparameters. `lr` is a float or
    a one-element tensor on the parameters' device (what a CUDA graph reads)."""
    count: int
    lr: float | torch.Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def _ln(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


@torch.library.custom_op("bertfuse::lamb_step", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "steps", "stats"))
def _lamb_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], group_sizes: list[int],
               lrs: list[torch.Tensor], beta1s: list[float], beta2s: list[float], epss: list[float],
               weight_decays: list[float], max_grad_norm: float, found_inf: torch.Tensor | None,
               stats: torch.Tensor) -> None:
    """One LAMB step of checked tensors (see lamb_step) by the kernels: every parameter, its moments and its step
    count updated in place, `stats` = (gradient norm, pre-normalisation factor, skipped)."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
    device, target = params[0].device, targets.of(params[0].device)
    plan = multi_tensor.plan(lists, group_sizes, _default_config(torch.float32, 1, target).CHUNK)
    partials = torch.empty((3, max(plan.chunks, 1)), dtype=torch.float32, device=device)
    r = _reduce_config(torch.float32, 1, target)
    for lg in plan.launches:
        c = _config("sumsq", grads[lg.index[0]].dtype, target)
        if lg.chunks:
            _SUMSQ.launch((lg.chunks,), grads[lg.index[0]], lg.table, lg.chunk_tensor, lg.first_chunk, lg.numel,
                          partials[0, lg.chunk_offset:], lg.n, G_VEC=lg.vec[1], CHUNK=c.CHUNK, BLOCK=c.BLOCK,
                          num_warps=c.num_warps)
    _GLOBAL.launch((1,), partials[0], plan.step_table, found_inf, stats, plan.chunks, len(params),
                   float(max_grad_norm), HAS_FOUND_INF=found_inf is not None, BLOCK=r.BLOCK, num_warps=r.num_warps)
    for lg in plan.launches:
        g, first = lg.group, lg.index[0]
        bases = (params[first], exp_avgs[first], exp_avg_sqs[first])
        hyper = (_ln(beta1s[g]), _ln(beta2s[g]), epss[g], weight_decays[g])
        partial_w, partial_u = partials[1, lg.chunk_offset:], partials[2, lg.chunk_offset:]
        ratio = torch.empty(lg.n, dtype=torch.float32, device=device)
        c = _config("moments", params[first].dtype, target)
        if lg.chunks:
            _MOMENTS.launch((lg.chunks,), bases[0], grads[first], *bases[1:], lg.table, lg.chunk_tensor,
                            lg.first_chunk, lg.numel, stats, partial_w, partial_u, lg.n, beta1s[g], beta2s[g], *hyper,
                            P_VEC=lg.vec[0], G_VEC=lg.vec[1], S_VEC=lg.vec[2], CHUNK=c.CHUNK, BLOCK=c.BLOCK,
                            num_warps=c.num_warps)
        _RATIO.launch((lg.n,), lg.first_chunk, partial_w, partial_u, ratio, weight_decays[g], BLOCK=r.BLOCK,
                      num_warps=r.num_warps)
        c = _config("update", params[first].dtype, target)
        if lg.chunks:
            _UPDATE.launch((lg.chunks,), *bases, lg.table, lg.chunk_tensor, lg.first_chunk, lg.numel, stats, ratio,
                           lrs[g], lg.n, *hyper, P_VEC=lg.vec[0], S_VEC=lg.vec[2], CHUNK=c.CHUNK, BLOCK=c.BLOCK,
                           num_warps=c.num_warps)


@_lamb_step.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, steps, group_sizes, lrs, beta1s, beta2s, epss, weight_decays,
      max_grad_norm, found_inf, stats):
    return None


# ---- the functional entry, its reference, the optimizer --------------------------------------------------------

def _check(params, grads, exp_avgs, exp_avg_sqs, steps, groups, max_grad_norm, found_inf, stats) -> None:
    """One clear error for anything the kernels cannot take as it is."""
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    for name, values in lists.items():
        if len(values) != n:
            raise ValueError(f"lamb_step: {n} params but {len(values)} {name}")
    if sum(g.count for g in groups) != n or any(g.count < 0 for g in groups):
        raise ValueError(f"lamb_step: the groups count {sum(g.count for g in groups)} tensors, there are {n}")
    if not max_grad_norm >= 0:
        raise ValueError(f"lamb_step: max_grad_norm must be >= 0 (0: no pre-normalisation), got {max_grad_norm}")
    device = params[0].device
    for i, (p, g, m, v, s) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        for name, t in (("param", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v), ("step", s)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"lamb_step: {name} {i} is a {type(t).__name__}, not a tensor")
            if t.device != device:
                raise ValueError(f"lamb_step: {name} {i} is on {t.device}, param 0 on {device}")
            if t.layout != torch.strided:
                raise TypeError(f"lamb_step: {name} {i} is {t.layout}: LAMB takes dense gradients")
        if p.dtype not in FLOAT_DTYPES or g.dtype not in FLOAT_DTYPES:
            raise TypeError(f"lamb_step: param {i} is {p.dtype} with a {g.dtype} gradient; the kernels take float32, "
                            "float16 and bfloat16 (Lamb steps float64 in PyTorch: lamb_ref)")
        if g.shape != p.shape or m.shape != p.shape or v.shape != p.shape:
            raise ValueError(f"lamb_step: param {i} has shape {tuple(p.shape)}, its grad {tuple(g.shape)}, "
                             f"exp_avg {tuple(m.shape)}, exp_avg_sq {tuple(v.shape)}")
        if m.dtype != torch.float32 or v.dtype != torch.float32 or s.dtype != torch.float32 or s.numel() != 1:
            raise TypeError(f"lamb_step: param {i}'s state must be torch.float32 moments and a one-element float32 "
                            f"step count, got {m.dtype}, {v.dtype} and {s.dtype} {tuple(s.shape)}")
        if not (p.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
            raise ValueError(f"lamb_step: param {i} and its moments must be contiguous (strides {p.stride()}, "
                             f"{m.stride()}, {v.stride()})")
    for g in groups:
        if isinstance(g.lr, torch.Tensor) and (g.lr.numel() != 1 or g.lr.device != device):
            raise ValueError(f"lamb_step: a tensor learning rate must have one element on {device}, got "
                             f"{tuple(g.lr.shape)} on {g.lr.device}")
        if not (0 <= g.beta1 < 1 and 0 <= g.beta2 < 1 and g.eps >= 0 and g.weight_decay >= 0):
            raise ValueError(f"lamb_step: betas must be in [0, 1), eps and weight_decay >= 0; got {g}")
    if found_inf is not None and (found_inf.numel() != 1 or found_inf.device != device):
        raise ValueError(f"lamb_step: found_inf must be one element on {device}")
    if stats is not None and (stats.shape != (3,) or stats.dtype != torch.float32 or stats.device != device):
        raise ValueError(f"lamb_step: stats must be a float32 [3] tensor on {device}")


def lamb_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
              exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], groups: list[LambGroup],
              max_grad_norm: float = 1.0, found_inf: torch.Tensor | None = None,
              stats: torch.Tensor | None = None) -> torch.Tensor:
    """One LAMB step (the module docstring's formulas) of `params` in place, by the kernels (the custom op
    bertfuse::lamb_step, which torch.compile traces through): their moments (float32, contiguous, shaped as the
    parameters) and step counts (one-element float32 tensors) are updated too, tensor i belonging to the group
    that holds position i (`groups`, in order). Gradients may be strided views; parameters must be contiguous.
    Skipped where the gradient norm is not finite or found_inf is nonzero. Returns `stats` (a new float32 [3]
    tensor if None): the global gradient norm, the factor the gradients were scaled by, and 1.0 where the step
    was skipped. `Lamb` calls this, or `lamb_ref` where the kernels cannot run."""
    if not params:
        raise ValueError("lamb_step: no parameters")
    _check(params, grads, exp_avgs, exp_avg_sqs, steps, groups, max_grad_norm, found_inf, stats)
    device = check_device("lamb_step", param=params[0])
    if any(t.dtype == torch.bfloat16 for t in params + grads):
        targets.check("lamb_step", torch.bfloat16, device)
    if stats is None:
        stats = torch.zeros(3, dtype=torch.float32, device=device)
    lrs = [g.lr.to(torch.float32).reshape(1) if isinstance(g.lr, torch.Tensor)
           else torch.full((1,), float(g.lr), dtype=torch.float32, device=device) for g in groups]
    # A gradient's elements are read in the parameter's (contiguous) order: a strided one is copied first.
    grads = [g.contiguous() for g in grads]
    _lamb_step(params, grads, exp_avgs, exp_avg_sqs, steps, [g.count for g in groups], lrs,
               [float(g.beta1) for g in groups], [float(g.beta2) for g in groups], [float(g.eps) for g in groups],
               [float(g.weight_decay) for g in groups], float(max_grad_norm), found_inf, stats)
    return stats


def _kernels_refusal(params: list[torch.Tensor], grads: list[torch.Tensor]) -> str | None:
    """Why the kernels cannot step these tensors (None where they can): the device, a dtype (float64; bfloat16
    on a GPU without it), or a parameter that is not contiguous (a transposed view)."""
    for t in {t.dtype: t for t in params + grads}.values():
        why, _ = _refusal(t.device, t.dtype)
        if why is not None:
            return why
    strided = next((i for i, p in enumerate(params) if not p.is_contiguous()), None)
    return None if strided is None else f"parameter {strided} is not contiguous (strides {params[strided].stride()})"


@torch.no_grad()
def lamb_ref(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
             exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], groups: list[LambGroup],
             max_grad_norm: float = 1.0, found_inf: torch.Tensor | None = None,
             stats: torch.Tensor | None = None) -> torch.Tensor:
    """`lamb_step` in plain PyTorch, one tensor at a time, in float32 (float64 for float64 parameters, the
    checks' exact reference); like the kernels it never reads the device (a skipped step keeps the old values by
    torch.where)."""
    acc = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=acc) for g in grads]))
    skip = ~torch.isfinite(norm)
    if found_inf is not None:
        skip = skip | (found_inf.reshape(()) != 0)
    clip = torch.clamp(norm / max_grad_norm, min=1.0) if max_grad_norm > 0 else torch.ones_like(norm)
    i = 0
    for group in groups:
        for j in range(i, i + group.count):
            w, m, v, step = params[j], exp_avgs[j], exp_avg_sqs[j], steps[j]
            g = grads[j].to(acc) / clip
            t = (step + 1).to(acc)
            m_new = group.beta1 * m + (1 - group.beta1) * g
            v_new = group.beta2 * v + (1 - group.beta2) * g * g
            bc1 = -torch.expm1(t * _ln(group.beta1))
            bc2 = -torch.expm1(t * _ln(group.beta2))
            w32 = w.to(acc)
            u = (m_new / bc1) / ((v_new / bc2).sqrt() + group.eps) + group.weight_decay * w32
            w_norm, u_norm = torch.linalg.vector_norm(w32), torch.linalg.vector_norm(u)
            trusted = (w_norm > 0) & (u_norm > 0) & (group.weight_decay != 0)
            ratio = torch.where(trusted, w_norm / torch.where(trusted, u_norm, 1.0), 1.0)
            lr = group.lr.reshape(()) if isinstance(group.lr, torch.Tensor) else group.lr
            w_new = w32 - lr * ratio * u
            w.copy_(torch.where(skip, w, w_new.to(w.dtype)))
            m.copy_(torch.where(skip, m, m_new))
            v.copy_(torch.where(skip, v, v_new))
            step.copy_(torch.where(skip, step, step + 1))
        i += group.count
    if stats is None:
        stats = torch.zeros(3, dtype=torch.float32, device=params[0].device)
    stats.copy_(torch.stack([norm.float(), (1 / clip).float(), skip.float()]))
    return stats


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"), as NVIDIA's
    FusedLAMB computes it (the module docstring's formulas): Adam moments with bias correction and decoupled weight
    decay, each parameter's update scaled by the trust ratio ||w|| / ||u|| (where its group has weight decay), the
    gradients first pre-normalised by their global norm over all groups (`max_grad_norm`; 0: not).

    Takes the usual parameter groups, each with its own lr, betas, eps and weight_decay (max_grad_norm is one
    for all). All parameters step together in a few kernel launches (`lamb_step`), with float32 state (`exp_avg`,
    `exp_avg_sq` and `step` per parameter, on its device), on a GPU or under Triton's interpreter; elsewhere, or
    for float64 or non-contiguous parameters, in plain PyTorch (`lamb_ref`), the same numbers and state.

    The step never reads the device: it can be captured in a CUDA graph (a group's lr then a one-element device
    tensor, which a scheduler fills) or traced by torch.compile. A step whose gradient norm is not finite changes
    nothing, nor does one while `found_inf` (a device scalar the caller may set, as a gradient scaler sets a fused
    optimizer's) is nonzero; `grad_norm` is the last step's global gradient norm, a device scalar."""

    def __init__(self, params, lr: float | torch.Tensor, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, max_grad_norm: float = 1.0):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"Lamb: a tensor lr must have one element, got shape {tuple(lr.shape)}")
        if not float(lr) >= 0:
            raise ValueError(f"Lamb: lr must be >= 0, got {float(lr)}")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lamb: betas must be two values in [0, 1), got {betas}")
        if not eps >= 0 or not weight_decay >= 0 or not max_grad_norm >= 0:
            raise ValueError(f"Lamb: eps, weight_decay and max_grad_norm must be >= 0, got {eps}, {weight_decay}, "
                             f"{max_grad_norm}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      max_grad_norm=max_grad_norm))
        self.found_inf: torch.Tensor | None = None
        self._stats: torch.Tensor | None = None

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the last step (before pre-normalisation), a device scalar; None before one."""
        return None if self._stats is None else self._stats[0]

    @staticmethod
    def _new_state(p: torch.Tensor) -> dict:
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        return {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format),
                "exp_avg_sq": torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)}

    def _max_grad_norm(self) -> float:
        values = {float(g["max_grad_norm"]) for g in self.param_groups}
        if len(values) > 1:
            raise ValueError(f"Lamb: max_grad_norm is one norm over all groups; the groups set {sorted(values)}")
        return values.pop()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, grads, exp_avgs, exp_avg_sqs, steps, groups = [], [], [], [], [], []
        for group in self.param_groups:
            count = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._new_state(p))
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
                count += 1
            beta1, beta2 = group["betas"]
            groups.append(LambGroup(count, group["lr"], beta1, beta2, group["eps"], group["weight_decay"]))
        if not params:
            return loss
        device = params[0].device
        if self._stats is None or self._stats.device != device:
            self._stats = torch.zeros(3, dtype=torch.float32, device=device)
        self._stepper(params, grads)(params, grads, exp_avgs, exp_avg_sqs, steps, groups, self._max_grad_norm(),
                                     self.found_inf, self._stats)
        return loss

    def _stepper(self, params: list[torch.Tensor], grads: list[torch.Tensor]):
        """The step function for these tensors: `lamb_step`, or `lamb_ref` (after one warning) where the kernels
        cannot run."""
        why = _kernels_refusal(params, grads)
        if why is None:
            return lamb_step
        warn_once(f"Lamb steps in PyTorch (lamb_ref), not in the kernels: {why}")
        return lamb_ref

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, then the state as this optimizer keeps it (torch casts it to each parameter's dtype:
        bfloat16 moments would lose their digits): moments in float32 (float64 for float64 parameters) and step
        counts as float32 tensors, on the parameter's device."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            saved = state_dict["state"].get(i)
            if saved:
                fresh = self._new_state(p)
                self.state[p] = {k: saved[k].to(device=p.device, dtype=fresh[k].dtype).reshape(fresh[k].shape)
                                 .clone(memory_format=torch.contiguous_format) for k in fresh}

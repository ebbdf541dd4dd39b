"""What the benchmark, tuner and compile checks know about kernels.attention (bench/record.py)."""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from bertfuse.kernels.attention import (HEAD_DIMS, RelativePositionBias, attention_dropout_mask, relative_bias,
                               varlen_attention, varlen_attention_ref, window_mask)

from ..record import Bench, BenchShapes, Case, CompileCall, Goal, Record, TuneShape, Tuning, randn


def _cu_seqlens(lengths, device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.as_tensor(lengths).cumsum(0)
    return cu.to(device)


def _smoke(s, device, p: float) -> Case:
    seed, cu = 4321, _cu_seqlens(s.lengths, device)
    max_len = max(s.lengths)
    keep = attention_dropout_mask(cu, s.heads, max_len, p, seed) if p else None

    def ours(q, k, v):
        return varlen_attention(q, k, v, cu, max_len, dropout_p=p, seed=seed)

    def reference(q, k, v):  # with the kernel's own dropout mask
        return varlen_attention_ref(q, k, v, cu, dropout_p=p, keep=keep)

    inputs = [randn(s.tokens, s.heads, s.head_dim, device=device, seed=i) for i in range(3)]
    name = "attention" + (f" dropout{p}" if p else "") + (f" head_dim {s.head_dim}" if s.head_dim < 16 else "")
    return Case(name, inputs, ours, reference, ["o", "dq", "dk", "dv"])


def _peers(cu, max_seqlen) -> dict:
    """The variable-length attentions a user could pick instead, on the same packed inputs: PyTorch's own
    (torch >= 2.10, FlashAttention kernels inside) and the flash-attn package's; an absent one is the reason it
    is skipped."""
    peers = {}
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        peers["torch-varlen_attn"] = f"torch.nn.attention.varlen is not in torch {torch.__version__} (needs 2.10+)"
    else:
        peers["torch-varlen_attn"] = lambda q, k, v: varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen)
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        peers["flash_attn-varlen"] = "flash-attn is not installed"
    else:
        peers["flash_attn-varlen"] = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen)
    return peers


def _bench(shape, device, dtype, full):
    """At 0%, 25% and 50% padding: SDPA on the padded batch with a mask, then ours and the peers packed; with
    MPNet's relative-position bias at 0% and 50%."""
    for padding in (0.0, 0.25, 0.5):
        yield from _bench_at(*shape, padding, device, dtype, full)
    for padding in (0.0, 0.5):
        yield from _bench_bias_at(*shape, padding, device, dtype)
    if shape[1] >= 256:  # a window narrower than the sequence
        yield from _bench_window_at(*shape, 0.25, device, dtype)


class _Problem(NamedTuple):
    """One benchmarked batch: lengths drawn by the benchmark's length model, packed and padded."""
    batch: int
    seqlen: int
    heads: int
    padding: float
    lengths: torch.Tensor     # [batch] int64, on the CPU
    cu: torch.Tensor          # [batch + 1] int32 cu_seqlens, on the device
    pad: torch.Tensor         # [batch, 1, 1, seqlen] float32 additive key mask: 0, or -inf past each length


def _problem(batch, seqlen, heads, padding, device) -> _Problem:
    import numpy as np

    from bertfuse.bench.lengths import sample_lengths  # the benchmark's length model (only the benchmark calls this)

    lengths = torch.from_numpy(sample_lengths(batch, seqlen, padding, np.random.default_rng(0)))
    pad = torch.zeros(batch, 1, 1, seqlen, device=device)
    pad.masked_fill_(~(torch.arange(seqlen)[None] < lengths[:, None]).to(device)[:, None, None, :], float("-inf"))
    return _Problem(batch, seqlen, heads, padding, lengths, _cu_seqlens(lengths, device), pad)


def _rows(kernel, p: _Problem, label, padded, packed, exact, device, dtype):
    """The two Bench rows of a problem: the padded implementations on [batch, heads, seq, 64], the packed ones on
    [tokens, heads, 64]; exact: the float64 reference of each layout."""
    name = f"b{p.batch} s{p.seqlen} h{p.heads} d64 pad{int(p.padding * 100)}%{label}"
    flops = 4 * p.heads * 64 * float((p.lengths.double() ** 2).sum())
    extra = dict(seq_len=p.seqlen, padding=p.padding, head_dim=64)
    layouts = ((padded, (p.batch, p.heads, p.seqlen, 64), "padded"),
               (packed, (int(p.lengths.sum()), p.heads, 64), "packed"))
    for impls, dims, layout in layouts:
        yield Bench(kernel, name, impls, lambda dims=dims: tuple(
            torch.randn(*dims, device=device, dtype=dtype, requires_grad=True) for _ in range(3)),
            flops_fwd=flops, extra=extra, reference=exact[layout])


def _bench_at(batch, seqlen, heads, padding, device, dtype, full):
    p = _problem(batch, seqlen, heads, padding, device)
    cu, bias = p.cu, p.pad.to(dtype)
    padded = {"sdpa-masked": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)}
    packed = {"ours": lambda q, k, v: varlen_attention(q, k, v, cu, seqlen, validate=False)}
    if full:  # BERT trains with attention dropout 0.1: what it costs each side
        padded["sdpa-masked dropout0.1"] = lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=0.1)
        packed["ours dropout0.1"] = lambda q, k, v: varlen_attention(q, k, v, cu, seqlen, 0.1, validate=False)
    if device.type == "cuda":
        packed["sdpa-unpadded"] = lambda q, k, v: F.scaled_dot_product_attention(
            *(torch.nested.nested_tensor_from_jagged(t, cu.long()).transpose(1, 2) for t in (q, k, v))
        ).transpose(1, 2).values()
        packed.update(_peers(cu, seqlen))
    exact = {"padded": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias.double()),
             "packed": lambda q, k, v: varlen_attention_ref(q, k, v, cu)}
    yield from _rows("attention", p, "", padded, packed, exact, device, dtype)


def _bench_bias_at(batch, seqlen, heads, padding, device, dtype):
    """MPNet's attention (32 buckets, max_distance 128, the table trained): what Hugging Face runs (eager: the
    [B, H, L, L] scores and bias formed), SDPA given the bias and the padding as one additive float mask
    [B, H, L, L], and ours packed, the bias looked up inside the kernels."""
    p = _problem(batch, seqlen, heads, padding, device)
    table = (0.5 * torch.randn(32, heads, device=device)).requires_grad_()
    positions = torch.arange(seqlen, device=device)

    def full_mask(q, t=table):  # the padding mask plus the bias, in q's dtype, as MPNet's encoder makes it
        return (p.pad + relative_bias(RelativePositionBias(t), positions)).to(q.dtype)

    def eager(q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2)) / 8.0 + full_mask(q), dim=-1) @ v

    padded = {"torch-eager": eager,
              "sdpa-bias-mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=full_mask(q))}
    ours = RelativePositionBias(table)
    packed = {"ours": lambda q, k, v: varlen_attention(q, k, v, p.cu, seqlen, validate=False, position_bias=ours)}
    exact = {"padded": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=full_mask(q, table.double())),
             "packed": lambda q, k, v: varlen_attention_ref(q, k, v, p.cu,
                                                            position_bias=RelativePositionBias(table.double()))}
    yield from _rows("attention+bias", p, " bias", padded, packed, exact, device, dtype)


def _bench_window_at(batch, seqlen, heads, padding, device, dtype, window=(64, 64)):
    """ModernBERT's local attention (a window of 128: 64 each side): SDPA on the padded batch with the window and
    the padding as one boolean mask [B, 1, L, L] (what transformers' SDPA path builds), ours packed with the
    window (the tiles outside it skipped), flash-attn's varlen with window_size where installed."""
    p = _problem(batch, seqlen, heads, padding, device)
    near = window_mask(seqlen, window, device)
    allowed = (p.pad == 0) & near  # [B, 1, L, L]: key not padding and inside the window

    padded = {"sdpa-masked": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)}
    packed = {"ours": lambda q, k, v: varlen_attention(q, k, v, p.cu, seqlen, validate=False, window_size=window)}
    if device.type == "cuda":
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError:
            packed["flash_attn-varlen"] = "flash-attn is not installed"
        else:
            packed["flash_attn-varlen"] = lambda q, k, v: flash_attn_varlen_func(
                q, k, v, p.cu, p.cu, seqlen, seqlen, window_size=window)
    exact = {"padded": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
             "packed": lambda q, k, v: varlen_attention_ref(q, k, v, p.cu, window_size=window)}
    yield from _rows("attention+window", p, f" window{window[0]}+{window[1]}", padded, packed, exact, device, dtype)


def _compiled():
    """Every head_dim in half precision (float16 is what a GPU without bfloat16 trains in), three in float32;
    the relative-position bias (MPNet's) with dropout, as MPNet trains, at its head widths and the widest."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for dim in HEAD_DIMS if dtype != torch.float32 else (16, 64, 128):
            for dropout in (False, True):
                yield CompileCall(dtype, dim, dict(dropout=dropout))
        for dim in (32, 64, 128):
            yield CompileCall(dtype, dim, dict(dropout=True, bias=True))
        # The rotary encoders: ModernBERT's local window (heads of 64), EuroBERT's grouped heads (64 and 128), both.
        for dim, flags in ((64, dict(window=True)), (64, dict(grouped=True)), (128, dict(grouped=True)),
                           (128, dict(window=True, grouped=True))):
            yield CompileCall(dtype, dim, dict(dropout=True, **flags))


def _call(dtype, dim, dropout=True, bias=False, window=False, grouped=False):
    """Forward and backward of two sequences (13 and 24 tokens) of 2 heads of width dim (grouped: k and v with
    one head; window: 4 positions each side)."""
    cu = _cu_seqlens((13, 24), "cpu")
    q = torch.randn(37, 2, dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(37, 1 if grouped else 2, dim, dtype=dtype, requires_grad=True) for _ in range(2))
    table = RelativePositionBias(torch.randn(32, 2, requires_grad=True)) if bias else None
    varlen_attention(q, k, v, cu, 24, dropout_p=0.1 if dropout else 0.0, seed=1, position_bias=table,
                     window_size=(4, 4) if window else (-1, -1)).sum().backward()


def tune_batch(shape, size, dtype, device):
    """(cu_seqlens, q, k, v) of the tuner's attention problem: `batch` sequences of seq // 2 .. seq tokens (a
    fixed draw), `heads` heads of width `size`, packed; q, k, v leaves wanting gradients."""
    batch, seq, heads = shape
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=torch.Generator().manual_seed(0))
    q, k, v = (randn(int(lengths.sum()), heads, size, seed=i, device=device, dtype=dtype, grad=True)
               for i in range(3))
    return _cu_seqlens(lengths, device), q, k, v


def _tune_setup(shape, size, dtype, device, part=None):
    seq = shape[1]
    cu, q, k, v = tune_batch(shape, size, dtype, device)

    def fn(q, k, v):
        return varlen_attention(q, k, v, cu, seq, dropout_p=0.1, seed=1234, validate=False)
    return fn, (q, k, v), {"dkdv": (k, v), "dq": (q,)}


def _at(seq_len: int, padding: float) -> dict:
    return dict(seq_len=seq_len, padding=padding, head_dim=64)


RECORD = Record(
    name="attention",
    smoke={"attention": lambda s, device: _smoke(s, device, 0.0),
           "attention_dropout": lambda s, device: _smoke(s, device, 0.1),
           # 8-wide heads (transformers' tiny test models), zero-padded to 16 inside the kernels
           "attention_head_dim_8": lambda s, device: _smoke(s._replace(head_dim=8), device, 0.0)},
    bench_shapes=BenchShapes(quick=[(256, 128, 12), (64, 512, 12)],
                             full=[(b, s, h) for b, s in ((256, 128), (64, 512)) for h in (12, 16)],
                             tiny=[(2, 24, 2)]),
    bench=_bench,
    tuning=Tuning(shapes=(TuneShape(64, 128, (192, 128, 12)), TuneShape(64, 512, (48, 512, 12), rank=1)),
                  setup=_tune_setup),
    compiled=_compiled,
    call=_call,
    goals=(Goal("attention fwd, d64 s512 bf16", ">= 350 TFLOP/s (H200)", "attention", "fwd_TFLOPs", ">=", 350,
                where=_at(512, 0.0), fmt="{:.0f} TFLOP/s", scale="matmul_TFLOPs"),
           Goal("attention bwd, d64 s512 bf16", ">= 250 TFLOP/s (H200)", "attention", "bwd_TFLOPs", ">=", 250,
                where=_at(512, 0.0), fmt="{:.0f} TFLOP/s", scale="matmul_TFLOPs"),
           Goal("attention vs torch varlen_attn, s512", ">= 1x", "attention", "fwd_bwd_ms", ">=", 1.0,
                peer="torch-varlen_attn", where=_at(512, 0.0)),
           Goal("attention vs flash-attn varlen, every shape", ">= 1x", "attention", "fwd_bwd_ms", ">=", 1.0,
                peer="flash_attn-varlen"),
           Goal("attention at 50% padding vs SDPA + padding mask, s512", ">= 2x", "attention", "fwd_bwd_ms", ">=",
                2.0, peer="sdpa-masked", where=_at(512, 0.5)),
           Goal("local attention (window 128) vs flash-attn varlen with window_size", ">= 1x", "attention+window",
                "fwd_bwd_ms", ">=", 1.0, peer="flash_attn-varlen")),
)

"""Per-kernel benchmarks against torch eager and torch.compile at BERT shapes (GPU), and the MLM-loss memory
comparison (GPU and CPU).

Times are medians from triton.testing.do_bench. Bandwidth counts the bytes a kernel must move (each input read
once, each output written once); attention TFLOP/s counts real tokens only, with the backward taken as 2.5x the
forward's FLOPs (FlashAttention's convention: the recomputed QK^T included).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .peaks import timeit

# Set in bench.precompile's workers: each suite then runs only this project's implementations, once, untimed,
# so that their kernels compile (in parallel processes) into Triton's on-disk cache before the timed run.
WARM_ONLY = False


def _fwd_bwd_times(fn, inputs, device):
    """(forward, backward, forward+backward) seconds of fn(*inputs) -> tensor."""
    out = fn(*inputs)
    grad = torch.randn_like(out)
    t_fwd = timeit(lambda: fn(*inputs), device)
    t_bwd = timeit(lambda: out.backward(grad, retain_graph=True), device)
    t_all = timeit(lambda: fn(*inputs).backward(grad), device)
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None
    return t_fwd, t_bwd, t_all


def _impls(eager, ours, device):
    impls = {"torch-eager": eager, "ours": ours}
    if device.type == "cuda":  # compiling on a CPU takes minutes and says nothing about the kernels
        impls["torch-compile"] = torch.compile(eager)
    return impls


def _dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _rows_for(kernel, shape, impls, inputs_fn, bytes_fwd, bytes_bwd, flops_fwd, peaks, device, **extra):
    """One row per implementation; an implementation given as a string is reported as skipped for that reason."""
    cuda = device.type == "cuda"
    rows = []
    for name, fn in impls.items():
        row = {"kernel": kernel, "shape": shape, "impl": name, "dtype": str(_dtype(device)).replace("torch.", ""),
               **extra}
        if isinstance(fn, str):
            rows.append(dict(row, status=f"skipped: {fn}"))
            continue
        if WARM_ONLY:
            if name.startswith("ours"):
                fn(*inputs_fn()).float().sum().backward()
            continue
        try:
            inputs = inputs_fn()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t_fwd, t_bwd, t_all = _fwd_bwd_times(fn, inputs, device)
            row.update(fwd_ms=t_fwd * 1e3, bwd_ms=t_bwd * 1e3, fwd_bwd_ms=t_all * 1e3)
            if cuda:
                row["peak_extra_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            if bytes_fwd:
                gbps = (bytes_fwd + bytes_bwd) / t_all / 1e9
                row.update(fwd_bwd_GBps=gbps, copy_share=gbps / peaks["copy_GBps"])
            if flops_fwd:
                row.update(fwd_TFLOPs=flops_fwd / t_fwd / 1e12, bwd_TFLOPs=2.5 * flops_fwd / t_bwd / 1e12)
            row["status"] = "ok"
        except Exception as e:
            row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def layer_norm_rows(peaks, quick, device, shapes=None):
    """shapes: (tokens, hidden) pairs; default BERT's, 8,192-65,536 tokens x 768/1024."""
    import kernels

    shapes = shapes or [(t, h) for t in ([16384] if quick else [8192, 32768, 65536]) for h in (768, 1024)]
    dtype, rows = _dtype(device), []
    for tokens, h in shapes:
        def inputs():
            x = torch.randn(tokens, h, device=device, dtype=dtype, requires_grad=True)
            r = torch.randn_like(x, requires_grad=True)
            return x, r, torch.ones(h, device=device, requires_grad=True), torch.zeros(h, device=device,
                                                                                    requires_grad=True)

        def eager(x, r, w, b):
            return F.layer_norm(F.dropout(x, 0.1) + r, (h,), w.to(x.dtype), b.to(x.dtype), 1e-12)

        def ours(x, r, w, b):
            return kernels.layer_norm(x, w, b, 1e-12, residual=r, dropout_p=0.1)

        n = tokens * h * x_bytes(dtype)
        rows += _rows_for("layer_norm+residual+dropout", f"{tokens}x{h}", _impls(eager, ours, device), inputs,
                          3 * n, 5 * n, 0, peaks, device)
    return rows


def x_bytes(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bias_gelu_rows(peaks, quick, device, shapes=None):
    """shapes: (tokens, intermediate) pairs; default 8,192-65,536 tokens x 3072/4096."""
    import kernels

    shapes = shapes or [(t, i) for t in ([16384] if quick else [8192, 32768, 65536]) for i in (3072, 4096)]
    dtype, rows = _dtype(device), []
    for tokens, i in shapes:
        def inputs():
            return (torch.randn(tokens, i, device=device, dtype=dtype, requires_grad=True),
                    torch.randn(i, device=device, dtype=dtype, requires_grad=True))

        n = tokens * i * x_bytes(dtype)
        rows += _rows_for("bias_gelu", f"{tokens}x{i}",
                          _impls(lambda x, b: F.gelu(x + b), lambda x, b: kernels.bias_gelu(x, b), device),
                          inputs, 2 * n, 3 * n, 0, peaks, device)
    return rows


def attention_rows(peaks, quick, device, shapes=None):
    """shapes: (batch, seq, heads) triples at head_dim 64, each at 0%, 25% and 50% padding."""
    import numpy as np

    import kernels

    from .lengths import sample_lengths

    shapes = shapes or ([(256, 128, 12), (64, 512, 12)] if quick else [(b, s, h) for b, s in ((256, 128), (64, 512)) for h in (12, 16)])
    dtype, rows = _dtype(device), []
    for batch, seqlen, heads in shapes:
        for padding in (0.0, 0.25, 0.5):
            lengths = torch.from_numpy(sample_lengths(batch, seqlen, padding, np.random.default_rng(0)))
            mask = (torch.arange(seqlen)[None] < lengths[:, None]).to(device)
            total = int(lengths.sum())
            cu = torch.zeros(batch + 1, dtype=torch.int32, device=device)
            cu[1:] = lengths.cumsum(0).to(device)
            flops = 4 * heads * 64 * float((lengths.double() ** 2).sum())

            def padded_inputs():
                return tuple(torch.randn(batch, heads, seqlen, 64, device=device, dtype=dtype, requires_grad=True)
                             for _ in range(3))

            def packed_inputs():
                return tuple(torch.randn(total, heads, 64, device=device, dtype=dtype, requires_grad=True)
                             for _ in range(3))

            bias = torch.zeros(batch, 1, 1, seqlen, device=device, dtype=dtype)
            bias.masked_fill_(~mask[:, None, None, :].bool(), float("-inf"))
            shape = f"b{batch} s{seqlen} h{heads} d64 pad{int(padding * 100)}%"
            padded = {"sdpa-masked": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)}
            if not quick:  # BERT trains with attention dropout 0.1: what it costs each side
                padded["sdpa-masked dropout0.1"] = lambda q, k, v: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=bias, dropout_p=0.1)
            extra = dict(seq_len=seqlen, padding=padding, head_dim=64)
            rows += _rows_for("attention", shape, padded, padded_inputs, 0, 0, flops, peaks, device, **extra)

            def sdpa_unpadded(q, k, v):
                nested = [torch.nested.nested_tensor_from_jagged(t, cu.long()).transpose(1, 2) for t in (q, k, v)]
                return F.scaled_dot_product_attention(*nested).transpose(1, 2).values()

            impls = {"ours": lambda q, k, v: kernels.varlen_attention(q, k, v, cu, seqlen, validate=False)}
            if not quick:
                impls["ours dropout0.1"] = lambda q, k, v: kernels.varlen_attention(q, k, v, cu, seqlen, 0.1,
                                                                                   validate=False)
            if device.type == "cuda":
                impls["sdpa-unpadded"] = sdpa_unpadded
                impls.update(packed_peers(cu, seqlen))
            rows += _rows_for("attention", shape, impls, packed_inputs, 0, 0, flops, peaks, device, **extra)
    return rows


def packed_peers(cu, max_seqlen) -> dict:
    """The variable-length attentions a user could pick instead, on the same packed [tokens, heads, 64] inputs:
    PyTorch's own (torch >= 2.10, FlashAttention kernels inside) and the flash-attn package's. An absent one is
    the reason it is skipped."""
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


def _mlm_problem(tokens, h, device, dtype):
    vocab = 30522
    g = torch.Generator().manual_seed(0)
    labels = torch.where(torch.rand(tokens, generator=g) < 0.15, torch.randint(0, vocab, (tokens,), generator=g),
                         -100).to(device)
    rows = (labels != -100).nonzero().squeeze(1)
    hidden = torch.randn(tokens, h, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=g) * 0.02).to(device, dtype).requires_grad_()
    bias = torch.zeros(vocab, device=device, dtype=dtype, requires_grad=True)
    return hidden, weight, bias, labels, rows


def _mlm_impl(name, hidden, weight, bias, labels, rows):
    if name == "(a) full logits":        # HF's path: the decoder on every position
        return F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)
    if name == "(b) gather+linear+CE":   # gather labelled rows, then a plain linear + cross-entropy
        return F.cross_entropy(F.linear(hidden[rows], weight, bias).float(), labels[rows])
    import kernels

    return kernels.masked_lm_loss(hidden[rows], weight, bias, labels[rows])


def _mlm_cpu_child(name, tokens, h):
    """In a fresh process: (peak RSS growth in bytes during one forward+backward, median seconds)."""
    import resource

    from .e2e import rss_mb

    problem = _mlm_problem(tokens, h, torch.device("cpu"), torch.float32)
    before = rss_mb()
    _mlm_impl(name, *problem).backward()
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before) * 2**20
    t = timeit(lambda: _mlm_impl(name, *problem).backward(), torch.device("cpu"), warmup=1, reps=3)
    return extra, t


def mlm_loss_rows(peaks, quick, device, tokens=None):
    """Time and extra peak memory of the MLM loss at pre-training shapes (15% of tokens labelled).

    GPU: 32,768 tokens, bfloat16, allocator counters. CPU: 4,096 tokens, float32, peak RSS growth of a fresh
    process per implementation; the Triton kernel is left out there (the interpreter is far too slow at this size).
    """
    from .e2e import in_fresh_process

    cuda = device.type == "cuda"
    tokens = tokens or (32768 if cuda else 4096)
    impls = ["(a) full logits", "(b) gather+linear+CE"] + (["(c) ours"] if cuda else [])
    rows = []
    for h in ((768,) if quick or not cuda else (768, 1024)):
        for name in impls:
            if WARM_ONLY:
                if name == "(c) ours":
                    _mlm_impl(name, *_mlm_problem(tokens, h, device, torch.bfloat16)).backward()
                continue
            if cuda:
                problem = _mlm_problem(tokens, h, device, torch.bfloat16)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                _mlm_impl(name, *problem).backward()
                torch.cuda.synchronize()
                extra = torch.cuda.max_memory_allocated() - base
                t = timeit(lambda: _mlm_impl(name, *problem).backward(), device)
                labelled = problem[4].numel()
                del problem
                torch.cuda.empty_cache()
            else:
                extra, t = in_fresh_process(_mlm_cpu_child, name, tokens, h)
                labelled = int(tokens * 0.15)
            rows.append({"kernel": "mlm_loss", "shape": f"{tokens} tok (~{labelled} labelled) x V30522 x H{h}",
                         "impl": name, "hidden": h, "dtype": "bfloat16" if cuda else "float32",
                         "fwd_bwd_ms": t * 1e3, "peak_extra_MB": extra / 2**20, "status": "ok"})
    return rows

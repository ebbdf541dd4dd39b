"""What the benchmark, tuner and compile checks know about kernels.disentangled (bench/record.py)."""
import copy

import torch

from bertfuse.kernels.disentangled import (DisentangledPositions, disentangled_attention, disentangled_attention_ref,
                                  disentangled_dropout_mask)

from ..record import Bench, Case, CompileCall, Goal, Record, Tuning, optional_peer, randn
from .attention import RECORD as _ATTENTION, _at, _cu_seqlens, _problem, tune_batch

V3_RULE = (256, 512)    # DeBERTa-v3's position_buckets and max_relative_positions
SMALL_RULE = (8, 20)    # the interpreter's: short test sequences still cross the log range


def _positions(pos_key, pos_query, rule) -> DisentangledPositions:
    return DisentangledPositions(pos_key, pos_query, *rule)


def _smoke(s, device, p: float) -> Case:
    rule = V3_RULE if device.type == "cuda" else SMALL_RULE
    seed, cu = 4321, _cu_seqlens(s.lengths, device)
    max_len = max(s.lengths)
    keep = disentangled_dropout_mask(cu, s.heads, max_len, p, seed) if p else None
    span2 = 2 * (rule[0] if rule[0] > 0 else rule[1])
    inputs = [randn(s.tokens, s.heads, s.head_dim, device=device, seed=i) for i in range(3)]
    inputs += [randn(span2, s.heads, s.head_dim, device=device, seed=3 + i) for i in range(2)]

    def ours(q, k, v, pk, pq):
        return disentangled_attention(q, k, v, cu, max_len, _positions(pk, pq, rule), dropout_p=p, seed=seed)

    def reference(q, k, v, pk, pq):
        return disentangled_attention_ref(q, k, v, cu, _positions(pk, pq, rule), dropout_p=p, keep=keep)

    return Case("disentangled attention" + (f" dropout{p}" if p else ""), inputs, ours, reference,
                ["o", "dq", "dk", "dv", "dpos_key", "dpos_query"])


def _deberta_attention(heads: int, dim: int, device, dtype):
    """transformers' DeBERTa-v2/v3 attention (relative attention, "p2c|c2p", separate position projections,
    256 buckets, 512 positions), seeded, dropout off: the module every implementation here takes its weights from."""
    from transformers import DebertaV2Config
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

    config = DebertaV2Config(hidden_size=heads * dim, num_attention_heads=heads, relative_attention=True,
                             position_buckets=V3_RULE[0], max_relative_positions=V3_RULE[1],
                             pos_att_type=["p2c", "c2p"], attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    return config, DisentangledSelfAttention(config).to(device=device, dtype=dtype).eval()


def _ours(module, cu, max_len):
    """Packed hidden states [tokens, hidden] and the relative embeddings [512, hidden] through the module's
    projections, then our kernel."""
    heads, dim = module.num_attention_heads, module.attention_head_size

    def run(hidden, rel, attention=disentangled_attention):
        def split(x):
            return x.view(x.shape[0], heads, dim)
        pos = _positions(split(module.pos_key_proj(rel)), split(module.pos_query_proj(rel)), V3_RULE)
        q, k, v = (split(p(hidden)) for p in (module.query_proj, module.key_proj, module.value_proj))
        if attention is disentangled_attention:
            return attention(q, k, v, cu, max_len, pos, validate=False).flatten(1)
        return attention(q, k, v, cu, pos).flatten(1)
    return run


def _flashdeberta(module, cu, max_len):
    """flashdeberta's varlen Triton attention (its position scores q Kr^T and k Qr^T formed per token in memory)
    on the module's projections."""
    from flashdeberta.ops.flash_attention_varlen import flash_attention_with_disentangled_varlen
    heads, dim = module.num_attention_heads, module.attention_head_size
    scale = 1.0 / (3 * dim) ** 0.5

    def run(hidden, rel):
        def split(x):
            return x.view(x.shape[0], heads, dim)
        q, k, v = (split(p(hidden)) for p in (module.query_proj, module.key_proj, module.value_proj))
        pk, pq = (split(p(rel)).transpose(0, 1)[None] for p in (module.pos_key_proj, module.pos_query_proj))
        return flash_attention_with_disentangled_varlen(q, k, v, pk, pq, cu, cu, max_len, max_len, False, scale,
                                                        *V3_RULE).flatten(1)
    return run


def _disentangled_flash(config, module, cu, max_len):
    """disentangled-flash's trainable Triton attention on packed tokens, with the module's weights."""
    from disentangled_flash import TritonTrainingDisentangledSelfAttention
    peer = TritonTrainingDisentangledSelfAttention(config).to(device=module.query_proj.weight.device,
                                                               dtype=module.query_proj.weight.dtype).eval()
    peer.load_state_dict(module.state_dict())
    return lambda hidden, rel: peer.forward_packed(hidden, cu, max_len, rel_embeddings=rel)[0]


def _bench(shape, device, dtype, full):
    """One DeBERTa-v3 attention layer (projections included, every implementation on the same weights) at 0% and
    50% padding: transformers' eager attention on the padded batch (the only path transformers has), then ours and
    the peers packed."""
    for padding in (0.0, 0.5):
        yield from _bench_at(*shape, padding, device, dtype)


def _bench_at(batch, seqlen, heads, padding, device, dtype):
    dim = 64
    p = _problem(batch, seqlen, heads, padding, device)
    config, module = _deberta_attention(heads, dim, device, dtype)
    exact_module = copy.deepcopy(module).double()
    keep = (p.pad == 0).expand(batch, 1, seqlen, seqlen)
    mask = keep & keep.transpose(-1, -2)                       # DeBERTa's [B, 1, L, L] pair mask
    tokens, hidden = int(p.lengths.sum()), heads * dim

    def eager(m):
        return lambda x, rel: m(x, mask, relative_pos=None, rel_embeddings=rel)[0] * keep[:, 0, 0, :, None]

    padded = {"hf-eager": eager(module)}
    packed = {"ours": _ours(module, p.cu, seqlen)}
    if device.type == "cuda":
        packed["disentangled_flash"] = optional_peer(
            "disentangled-flash", lambda: _disentangled_flash(config, module, p.cu, seqlen))
        packed["flashdeberta-varlen"] = optional_peer("flashdeberta", lambda: _flashdeberta(module, p.cu, seqlen))
    exact = {"padded": eager(exact_module),
             "packed": lambda x, rel: _ours(exact_module, p.cu, seqlen)(x, rel, disentangled_attention_ref)}
    name = f"b{batch} s{seqlen} h{heads} d64 pad{int(padding * 100)}%"
    flops = 4 * heads * dim * float((p.lengths.double() ** 2).sum()) * 2  # qk, pv and the two position dots
    extra = dict(seq_len=seqlen, padding=padding, head_dim=dim)
    rel = 2 * V3_RULE[0]
    for impls, dims, layout in ((padded, (batch, seqlen, hidden), "padded"), (packed, (tokens, hidden), "packed")):
        yield Bench("disentangled", name, impls, lambda dims=dims: (
            torch.randn(*dims, device=device, dtype=dtype, requires_grad=True),
            torch.randn(rel, hidden, device=device, dtype=dtype, requires_grad=True)),
            flops_fwd=flops, extra=extra, reference=exact[layout])


def _compiled():
    """DeBERTa's attention at heads of 32, 64 and 128 with dropout, as it trains; at 64 also without dropout
    (inference) and with one position term alone."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for dim in (32, 64, 128):
            yield CompileCall(dtype, dim, dict(dropout=True))
        yield CompileCall(dtype, 64, dict(dropout=False))
        for terms in ("c2p", "p2c"):
            yield CompileCall(dtype, 64, dict(dropout=True, terms=terms))


def _call(dtype, dim, dropout=True, terms="c2p|p2c"):
    """Forward and backward of two sequences (13 and 24 tokens) of 2 heads of width dim, 8 buckets."""
    cu = _cu_seqlens((13, 24), "cpu")
    q, k, v = (torch.randn(37, 2, dim, dtype=dtype, requires_grad=True) for _ in range(3))
    pk, pq = (torch.randn(16, 2, dim, dtype=dtype, requires_grad=True) for _ in range(2))
    pos = _positions(pk if "c2p" in terms else None, pq if "p2c" in terms else None, SMALL_RULE)
    disentangled_attention(q, k, v, cu, 24, pos, dropout_p=0.1 if dropout else 0.0, seed=1).sum().backward()


def _tune_setup(shape, size, dtype, device, part=None):
    seq, heads = shape[1:]
    cu, q, k, v = tune_batch(shape, size, dtype, device)   # attention's problem, plus the two tables
    pk, pq = (randn(2 * V3_RULE[0], heads, size, seed=3 + i, device=device, dtype=dtype, grad=True)
              for i in range(2))

    def fn(q, k, v, pk, pq):
        return disentangled_attention(q, k, v, cu, seq, _positions(pk, pq, V3_RULE), dropout_p=0.1, seed=1234,
                                      validate=False)
    return fn, (q, k, v, pk, pq), {"dq": (q,), "dkdv": (k, v), "tables": (pk, pq)}


RECORD = Record(
    name="disentangled",
    smoke={"disentangled": lambda s, device: _smoke(s, device, 0.0),
           "disentangled_dropout": lambda s, device: _smoke(s, device, 0.1)},
    bench_shapes=_ATTENTION.bench_shapes,           # BERT-base and -large heads at 128 and 512, as attention's
    bench=_bench,
    tuning=Tuning(shapes=_ATTENTION.tuning.shapes, setup=_tune_setup),
    compiled=_compiled,
    call=_call,
    goals=(Goal("DeBERTa attention layer vs transformers' eager, s512", ">= 2x", "disentangled", "fwd_bwd_ms", ">=",
                2.0, peer="hf-eager", where=_at(512, 0.0)),
           Goal("DeBERTa attention layer vs disentangled-flash, every shape", ">= 1x", "disentangled", "fwd_bwd_ms",
                ">=", 1.0, peer="disentangled_flash"),
           Goal("DeBERTa attention layer vs flashdeberta varlen, every shape", ">= 1x", "disentangled",
                "fwd_bwd_ms", ">=", 1.0, peer="flashdeberta-varlen")),
)

"""What the benchmark, tuner and compile checks know about kernels.rotary (bench/record.py)."""
import torch

from bertfuse.kernels.rotary import Rotary, rotary, rotary_positions, rotary_ref

from ..record import Bench, BenchShapes, Case, CompileCall, Goal, Record, TuneShape, Tuning, \
    memory_bound_goals, optional_peer, randn


def _inv_freq(dim: int, device, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)


def _tables(rows: int, dim: int, device):
    """cos and sin [rows, dim // 2] as a model keeps them (RoFormer: sin then cos in one weight; views of it)."""
    angle = torch.arange(rows, dtype=torch.float64, device=device)[:, None] * _inv_freq(dim, device).double()
    weight = torch.cat([angle.sin(), angle.cos()], dim=1).float()
    return weight[:, dim // 2:], weight[:, :dim // 2]


def _smoke(s, device, interleaved=False, table=False) -> Case:
    cu = torch.tensor([0, *torch.tensor(s.lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = rotary_positions(cu, s.tokens)
    rot = Rotary(_inv_freq(s.head_dim, device), 1.0, interleaved)
    if table:
        rot = Rotary(None, 1.0, interleaved, *_tables(s.tokens, s.head_dim, device))
    return Case("rotary" + (" interleaved" if interleaved else "") + (" table" if table else ""),
                [randn(s.tokens, s.heads, s.head_dim, device=device)],
                lambda x: rotary(x, positions, rot), lambda x: rotary_ref(x, positions, rot), ["y", "dx"])


def _bench(shape, device, dtype, full):
    """q and k of a layer, packed [tokens, heads, 64], rotated by their positions in sequences of 512: what
    transformers does (cos and sin tables [tokens, 64] built once per forward, outside the timing, then
    q * cos + rotate_half(q) * sin), Liger-Kernel's RoPE kernel on the same tables, flash-attn's rotary kernel on
    the packed tokens (a [512, 32] table) where installed, and ours: cos and sin inside, and ("ours-table") read
    from a model's own [512, 32] tables, as for RoFormer and ESM."""
    tokens, heads, dim = shape
    positions = torch.arange(tokens, device=device, dtype=torch.int32) % 512
    rot = Rotary(_inv_freq(dim, device))
    angle = positions.float()[:, None] * rot.inv_freq[None, :]
    emb = torch.cat([angle, angle], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def inputs():
        return tuple(torch.randn(tokens, heads, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))

    def eager(q, k):
        def turn(x):
            x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
            return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]
        return turn(q) + turn(k)

    def ours(q, k):
        return rotary(q, positions, rot) + rotary(k, positions, rot)

    table = Rotary(None, 1.0, False, cos[:512, :dim // 2], sin[:512, :dim // 2])  # rows 0..511 = positions

    def ours_table(q, k):
        return rotary(q, positions, table, validate=False) + rotary(k, positions, table, validate=False)

    def liger():
        from liger_kernel.transformers.functional import liger_rope

        def run(q, k):  # its layout: [batch, heads, seq, dim] views of [batch, seq, heads, dim] memory
            qq, kk = liger_rope(q[None].transpose(1, 2), k[None].transpose(1, 2), cos[None], sin[None])
            return (qq + kk).transpose(1, 2)[0]
        return run

    def flash():  # flash-attn's Triton rotary kernel, packed by cu_seqlens (positions inside each sequence)
        from flash_attn.layers.rotary import apply_rotary_emb
        cu = torch.arange(0, tokens + 1, 512, device=device, dtype=torch.int32)
        cu = torch.cat([cu, cu.new_tensor([tokens])]) if cu[-1] != tokens else cu
        table = torch.arange(512, device=device).float()[:, None] * rot.inv_freq[None, :]
        c, s = table.cos().to(dtype), table.sin().to(dtype)
        return lambda q, k: (apply_rotary_emb(q, c, s, cu_seqlens=cu, max_seqlen=512)
                             + apply_rotary_emb(k, c, s, cu_seqlens=cu, max_seqlen=512))

    def exact(q, k):
        return rotary_ref(q, positions, rot) + rotary_ref(k, positions, rot)

    n = tokens * heads * dim * dtype.itemsize  # per tensor: read x, write y; backward: read dy, write dx
    impls = {"torch-eager": eager, "ours": ours, "ours-table": ours_table,
             "liger-rope": optional_peer("liger-kernel", liger)}
    if device.type == "cuda":
        impls["flash_attn-rotary"] = optional_peer("flash-attn", flash)
    yield Bench("rotary", f"{tokens}x{heads}x{dim}", impls, inputs, 4 * n, 4 * n, reference=exact)


def _compiled():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for dim, interleaved, rotary_dim in ((64, False, 64), (128, False, 128), (64, True, 64), (64, False, 32)):
            yield CompileCall(dtype, dim, dict(interleaved=interleaved, rotary_dim=rotary_dim))
        # A model's own tables: RoFormer's interleaved sinusoids, ESM's half-rotation cos and sin.
        for interleaved in (True, False):
            yield CompileCall(dtype, 64, dict(interleaved=interleaved, table=True))


def _call(dtype, dim, interleaved=False, rotary_dim=None, table=False):
    """Forward and backward of 37 tokens of 3 heads of width dim, rotated on rotary_dim of them (by the
    frequencies, or read from cos and sin tables)."""
    x = torch.randn(37, 3, dim, dtype=dtype, requires_grad=True)
    rot = Rotary(_inv_freq(rotary_dim or dim, "cpu"), 1.0, interleaved)
    if table:
        rot = Rotary(None, 1.0, interleaved, *_tables(37, rotary_dim or dim, "cpu"))
    rotary(x, torch.arange(37, dtype=torch.int32), rot).sum().backward()


def _tune_setup(shape, size, dtype, device, part=None):
    tokens, heads, dim = shape
    positions = torch.arange(tokens, device=device, dtype=torch.int32) % 512
    rot = Rotary(_inv_freq(dim, device))
    x = randn(tokens, heads, dim, device=device, dtype=dtype, grad=True)
    return (lambda x: rotary(x, positions, rot)), (x,), {}


RECORD = Record(
    name="rotary",
    smoke={"rotary": _smoke, "rotary_interleaved": lambda s, device: _smoke(s, device, True),
           "rotary_table": lambda s, device: _smoke(s, device, True, True)},
    bench_shapes=BenchShapes(quick=[(16384, 12, 64)], full=[(t, h, 64) for t in (16384, 65536) for h in (12, 16)],
                             tiny=[(24, 2, 16)]),
    bench=_bench,
    # The kernel's table key is the number of pairs: 32 for head_dim 64.
    tuning=Tuning(shapes=(TuneShape(32, None, (16384, 12, 64)), TuneShape(64, None, (16384, 16, 128), rank=1)),
                  setup=_tune_setup),
    compiled=_compiled,
    call=_call,
    goals=(*memory_bound_goals("RoPE", "rotary"),
           Goal("RoPE vs Liger-Kernel's RoPE", "faster", "rotary", "fwd_bwd_ms", ">", 1.0, peer="liger-rope")),
)

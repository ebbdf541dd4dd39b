"""kernels.masked_lm_loss against F.linear + F.cross_entropy in float64: loss and grads of hidden, weight, bias,
for both strategies ("chunked": logits by torch per chunk of rows; "fused": no logits in memory) and "auto"."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kernel_utils import check_against_reference

kernels = pytest.importorskip("bertfuse.kernels")


def make(n, v, h, seed=0, ignore_every=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    bias = torch.randn(v, generator=g) * 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    return hidden, weight, bias, labels


STRATEGIES = ["chunked", "fused"]


def run_case(n, v, h, dtype, device, reduction="mean", with_bias=True, seed=0, ignore_every=3, strategy="auto",
             chunk_rows=None, validate=True):
    hidden, weight, bias, labels = make(n, v, h, seed, ignore_every)
    bias = bias if with_bias else None
    labels = labels.to(device)

    def leaves(dt):
        return [t.to(device=device, dtype=dt).requires_grad_() if t is not None else None
                for t in (hidden, weight, bias)]

    ours = leaves(dtype)
    out = kernels.masked_lm_loss(*ours, labels, reduction=reduction, return_correct=True, strategy=strategy,
                                 chunk_rows=chunk_rows, validate=validate)
    grad_out = torch.randn(out.loss.shape, generator=torch.Generator().manual_seed(1)).to(device)
    inputs = [t for t in ours if t is not None]
    grads = torch.autograd.grad(out.loss, inputs, grad_out.to(out.loss.dtype))

    def reference(ls, dt):
        logits = F.linear(ls[0], ls[1], ls[2])
        used = labels != -100
        if reduction == "mean" and not used.any():
            return logits.sum() * 0.0, logits
        return F.cross_entropy(logits.to(dt), labels, reduction=reduction), logits

    ref64 = [t.to(dtype).double().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    loss64, logits64 = reference([t.to(device) if t is not None else None for t in ref64], torch.float64)
    grads64 = torch.autograd.grad(loss64, [t for t in ref64 if t is not None], grad_out.double().cpu())
    same = leaves(dtype)
    loss_same, _ = reference(same, dtype)
    grads_same = torch.autograd.grad(loss_same, [t for t in same if t is not None], grad_out.to(loss_same.dtype))

    check_against_reference("loss", out.loss.float(), loss64, loss_same.float(), dtype)
    for name, a, r, s in zip(("dhidden", "dweight", "dbias"), grads, grads64, grads_same):
        check_against_reference(name, a, r, s, dtype)
    used = labels.cpu() != -100
    expected_hits = (logits64.argmax(-1)[used] == labels.cpu()[used]).sum().item()
    assert out.correct.item() == expected_hits
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("v", [7, 1000])
def test_float32_reductions_and_vocab_sizes(device, reduction, v, strategy):
    run_case(29, v, 40, torch.float32, device, reduction, strategy=strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bert_vocab_size(device, strategy):
    run_case(3, 30522, 16, torch.float32, device, ignore_every=0, strategy=strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype, strategy):
    """bfloat16 too on a CPU: in the interpreter (whose bf16 tl.dot is wrong) the dots run on float32 copies."""
    run_case(21, 300, 48, dtype, device, strategy=strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_row_no_bias_and_odd_hidden(device, strategy):
    run_case(1, 50, 17, torch.float32, device, with_bias=False, ignore_every=0, strategy=strategy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_rows", [1, 4, 7])
def test_chunked_in_chunks_of_any_size(device, chunk_rows, reduction, dtype):
    """31 rows (20 labelled) in chunks of 1, 4 (uneven: 5 chunks of 4) and 7: the chunks' d weight and d bias
    sum in float32, d hidden lands in each chunk's rows."""
    run_case(31, 97, 24, dtype, device, reduction, strategy="chunked", chunk_rows=chunk_rows)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_unvalidated_rows(device, strategy, reduction):
    """validate=False: every row computed (no gather, no sync), the ignored ones zeroed in loss and gradients."""
    run_case(23, 61, 16, torch.float32, device, reduction, strategy=strategy, chunk_rows=5, validate=False)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_labelled_rows_gives_zero_loss_and_zero_grads(device, reduction, strategy):
    hidden = torch.randn(5, 16, device=device, requires_grad=True)
    weight = torch.randn(30, 16, device=device, requires_grad=True)
    bias = torch.randn(30, device=device, requires_grad=True)
    labels = torch.full((5,), -100, device=device)
    for validate in (True, False):
        loss = kernels.masked_lm_loss(hidden, weight, bias, labels, reduction=reduction, strategy=strategy,
                                      validate=validate)
        assert torch.isfinite(loss).all() and (loss == 0).all()
        loss.sum().backward()
        for t in (hidden, weight, bias):
            assert torch.equal(t.grad, torch.zeros_like(t))
            t.grad = None
    empty = kernels.masked_lm_loss(hidden[:0], weight, bias, labels[:0], strategy=strategy)
    assert empty.item() == 0.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accuracy_counts_hits(device, strategy):
    hidden, weight, bias, labels = make(40, 60, 24, seed=3, ignore_every=4)
    logits = F.linear(hidden, weight, bias)
    labels = torch.where(labels == -100, labels, logits.argmax(-1))  # make every labelled row a hit...
    labels[1] = (logits[1].argmax() + 1) % 60                      # ...but two
    labels[2] = (logits[2].argmax() + 7) % 60
    out = kernels.masked_lm_loss(hidden.to(device), weight.to(device), bias.to(device), labels.to(device),
                                 return_correct=True, strategy=strategy)
    assert out.correct.item() == int((labels != -100).sum()) - 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vocabulary_splits_merge_to_the_first_maximum(device, strategy):
    """All logits equal: every vocabulary split ties, and the merged top-1 must be index 0, as torch.argmax;
    the loss is ln V whichever split holds the label."""
    n, v, h = 6, 1000, 8   # 8 vocabulary tiles, cut into several splits for so few rows
    labels = torch.tensor([0, 0, 999, 500, 1, 0], device=device)
    hidden = torch.zeros(n, h, device=device, requires_grad=True)
    weight = torch.randn(v, h, device=device, requires_grad=True)
    out = kernels.masked_lm_loss(hidden, weight, torch.zeros(v, device=device), labels, reduction="none",
                                 return_correct=True, strategy=strategy)
    assert out.correct.item() == 3
    torch.testing.assert_close(out.loss, torch.full((n,), math.log(v), device=device))
    out.loss.sum().backward()
    expected = (weight.detach().mean(0) - weight.detach()[labels]).to(hidden.grad.dtype)
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-5, atol=1e-5)


class _Seen(TorchDispatchMode):
    """Records, while active, the name of every op dispatched (our custom ops included), the shape of every tensor
    an op creates, and the size in bytes of the largest."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()
        self.shapes: set[tuple] = set()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.name())
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_rows_by_vocab_tensor_is_allocated(device, strategy):
    """fused: nothing larger than the weight; chunked: nothing larger than one chunk of logits (8 rows here)."""
    n, v, h = 64, 2053, 8   # n * v is 8x the weight's size, so any [n, v] tensor would stand out
    hidden, weight, bias, labels = make(n, v, h, ignore_every=0)
    hidden, weight, bias = (t.to(device).requires_grad_() for t in (hidden, weight, bias))
    with _Seen() as seen:
        kernels.masked_lm_loss(hidden, weight, bias, labels.to(device), strategy=strategy, chunk_rows=8).backward()
    weight_bytes, logits_bytes = v * h * 4, n * v * 4
    assert seen.largest <= max(weight_bytes, 8 * v * 4 if strategy == "chunked" else 0) < logits_bytes
    with _Seen() as seen:  # the same check catches the plain implementation
        F.cross_entropy(F.linear(hidden, weight, bias), labels.to(device)).backward()
    assert seen.largest >= logits_bytes


@pytest.mark.parametrize("call, err, match", [
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), None,
                                      torch.tensor([1, 10, -100, 2], device=d)), ValueError,
     r"labels must be in \[0, 10\) or ignore_index=-100; got values in \[1, 10\]"),
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), None,
                                      torch.tensor([1, -5, 3, 2], device=d)), ValueError, "labels must be in"),
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 9, device=d), None,
                                      torch.zeros(4, dtype=torch.long, device=d)), ValueError, "8 features"),
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 8, device=d).half(), None,
                                      torch.zeros(4, dtype=torch.long, device=d)), TypeError, "share a dtype"),
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 8, device=d),
                                      torch.randn(9, device=d), torch.zeros(4, dtype=torch.long, device=d)),
     ValueError, r"bias has shape \(9,\)"),
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), None,
                                      torch.zeros(3, dtype=torch.long, device=d)), ValueError, "labels has shape"),
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), None,
                                      torch.zeros(4, device=d)), TypeError, "integer tensor"),
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), None,
                                      torch.zeros(4, dtype=torch.long, device=d), reduction="max"), ValueError,
     "reduction"),
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), None,
                                      torch.zeros(4, dtype=torch.long, device=d), strategy="cublas"), ValueError,
     "strategy must be one of"),
    (lambda d: kernels.masked_lm_loss(torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), None,
                                      torch.zeros(4, dtype=torch.long, device=d), chunk_rows=0), ValueError,
     "chunk_rows must be a positive int"),
])
def test_bad_inputs(device, call, err, match):
    with pytest.raises(err, match=match):
        call(device)


def _ops_called(fn) -> set[str]:
    with _Seen() as seen:
        fn()
    return {n for n in seen.ops if n.startswith("bertfuse::")}


def test_auto_is_chunked_without_a_table_and_follows_the_table(device):
    """No table entry (the CPU): auto runs chunked. An entry for this launch site picks the strategy; one naming
    no strategy is ignored with a warning."""
    from bertfuse.kernels import tuned
    from bertfuse.kernels.mlm_loss import pick_strategy

    hidden, weight, bias, labels = (t.to(device) for t in make(9, 30, 8))

    def run():
        kernels.masked_lm_loss(hidden, weight, bias, labels)

    assert pick_strategy(hidden, 9) == "chunked" and _ops_called(run) == {"bertfuse::masked_lm_loss_chunked"}
    with tuned.forced("mlm_loss.strategy", {"strategy": "fused"}):
        assert pick_strategy(hidden, 9) == "fused" and _ops_called(run) == {"bertfuse::masked_lm_loss_fwd"}
    with tuned.forced("mlm_loss.strategy", {"strategy": "cublas"}), pytest.warns(UserWarning, match="ignoring"):
        assert pick_strategy(hidden, 9) == "chunked"


def test_chunked_computes_no_gradient_when_none_is_wanted(device):
    """The chunked forward computes the gradients, but only when autograd will want them: under no_grad, or for a
    weight (and no bias) that does not require one, no weight-sized tensor is made."""
    n, v, h = 12, 50, 16
    hidden, weight, bias, labels = (t.to(device) for t in make(n, v, h))
    with torch.no_grad(), _Seen() as seen:
        kernels.masked_lm_loss(hidden.requires_grad_(), weight.requires_grad_(), bias, labels, strategy="chunked")
    assert (v, h) not in seen.shapes
    frozen = weight.detach()
    with _Seen() as seen:
        kernels.masked_lm_loss(hidden, frozen, None, labels, strategy="chunked")
    assert (v, h) not in seen.shapes


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("h", [768, 1024])
def test_gpu_compiled(dtype, h, strategy):
    run_case(1000, 30522, h, dtype, torch.device("cuda"), ignore_every=5, strategy=strategy)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gpu_memory_stays_small(strategy):
    """fused: the gradients plus far less than one bf16 [n, V] tensor; chunked, in chunks of 1,000 rows: the
    gradients, d weight's float32 sum and a chunk's product, and one chunk of logits."""
    n, v, h = 4915, 30522, 768
    hidden, weight, bias, labels = (t.cuda() for t in make(n, v, h, ignore_every=0))
    hidden, weight, bias = (t.bfloat16().requires_grad_() for t in (hidden, weight, bias))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kernels.masked_lm_loss(hidden, weight, bias, labels, strategy=strategy, chunk_rows=1000).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = sum(t.numel() * t.element_size() for t in (hidden, weight, bias))
    allowed = n * v * 2 // 10 if strategy == "fused" else 1000 * v * 2 + v * h * 6 + v * 4
    assert extra < grads + allowed


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_strided_and_expanded_weight_and_bias(device, layout):
    n, v, h = 7, 40, 16
    hidden, weight, bias, labels = make(n, v, h, seed=5)
    if layout == "strided":
        w_base, b_base = weight.t().contiguous().to(device).requires_grad_(), bias.repeat(2).to(device).requires_grad_()

        def views():
            return w_base.t(), b_base[::2]
    else:
        w_base, b_base = weight[:1].to(device).requires_grad_(), bias[:1].to(device).requires_grad_()

        def views():
            return w_base.expand(v, h), b_base.expand(v)

    hid = hidden.to(device)
    loss = kernels.masked_lm_loss(hid, *views(), labels.to(device))
    grads = torch.autograd.grad(loss, [w_base, b_base])
    w, b = views()
    ref = F.cross_entropy(F.linear(hid.double(), w.double(), b.double()), labels.to(device))
    ref_grads = torch.autograd.grad(ref, [w_base, b_base])
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), r.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_unvalidated_labels_outside_the_vocabulary_count_for_nothing_on_both_backends(device, backend):
    """validate=False (a packed batch): a label outside [0, V) acts as an ignored row on both backends (it was
    counted by the kernel and raised in PyTorch): the loss, hits and gradients equal those without that row."""
    from bertfuse.bert.model import ops

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 16, generator=g).to(device).requires_grad_()
    weight, bias = torch.randn(30, 16, generator=g).to(device), torch.randn(30, generator=g).to(device)
    labels = torch.tensor([3, 31, -100, 7, -5, 29], device=device)
    out = ops.masked_lm_loss(hidden, weight, bias, labels, backend=backend)
    clean = labels.masked_fill((labels < 0) | (labels >= 30), -100)
    ref = ops.masked_lm_loss(hidden, weight, bias, clean, backend="torch")
    torch.testing.assert_close(out.loss, ref.loss)
    assert int(out.correct) == int(ref.correct)
    g1, = torch.autograd.grad(out.loss, hidden)
    g2, = torch.autograd.grad(ref.loss, hidden)
    torch.testing.assert_close(g1, g2)
    assert torch.equal(g1[[1, 2, 4]], torch.zeros_like(g1[[1, 2, 4]]))


@pytest.mark.compile
def test_chunked_ops_pass_opcheck_and_compile(device):
    """The chunked custom ops' schemas, fake implementations and autograd registration (torch.library.opcheck),
    and a fullgraph torch.compile of an unvalidated call giving eager's loss and gradients."""
    from bertfuse.kernels import mlm_loss as m

    hidden, weight, bias, labels = make(20, 40, 16)
    hidden, weight, bias, labels = hidden.to(device), weight.to(device), bias.to(device), labels.to(device)
    scale = torch.rand(20, generator=torch.Generator().manual_seed(2)).to(device)
    sure = labels.masked_fill(labels < 0, -1)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    for op, args in ((m._mlm_loss_chunked, (*leaves, sure, scale, torch.tensor(0.25, device=device), 7, True, True)),
                     (m._mlm_loss_chunked_rows, (*leaves, sure, 7))):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result

    def call(h, w, b):
        return kernels.masked_lm_loss(h, w, b, labels, validate=False, strategy="chunked", chunk_rows=7)

    outs = []
    for fn in (call, torch.compile(call, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss = fn(*leaves)
        outs.append([loss, *torch.autograd.grad(loss, leaves)])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


@pytest.mark.compile
def test_validated_call_compiles_into_one_graph_for_every_labelled_count(device):
    """validate=True (the default) gathers the labelled rows, a data-dependent count: compiled, without
    fullgraph, it makes one graph with no break, eager's loss and gradients, no recompilation when only the
    count changes, and a device assertion (not a sync) for a label outside the vocabulary."""
    from torch._dynamo.utils import counters
    from bertfuse.kernels import mlm_loss as m

    hidden, weight, bias, labels = (t.to(device) for t in make(20, 40, 16))
    result = torch.library.opcheck(m._labelled_rows, (labels, -100))
    assert set(result.values()) == {"SUCCESS"}, result
    with pytest.raises(ValueError, match="1-D integer tensor"):
        kernels.labelled_rows(labels.view(4, 5))
    call = lambda h, w, b, y: kernels.masked_lm_loss(h, w, b, y, strategy="chunked", chunk_rows=7)  # noqa: E731
    torch._dynamo.reset()
    explained = torch._dynamo.explain(call)(hidden, weight, bias, labels)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(call, backend="aot_eager")
    counts = set()
    for ignored in (labels < 0, labels % 3 == 0, labels % 2 == 0):
        y = labels.masked_fill(ignored, -100)
        counts.add(int((y != -100).sum()))
        outs = []
        for fn in (call, compiled):
            leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
            loss = fn(*leaves, y)
            outs.append([loss, *torch.autograd.grad(loss, leaves)])
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b)
    assert len(counts) == 3 and counters["stats"]["unique_graphs"] == 1, (counts, dict(counters["stats"]))
    with pytest.raises(RuntimeError, match=r"labels must be in \[0, 40\)"):
        compiled(hidden, weight, bias, labels.masked_fill(labels == labels.max(), 40))
    torch._dynamo.reset()


def test_default_chunks_bound_the_logits():
    """The default chunk: BERT-base pre-training's labelled rows (256 x 128 tokens, ~4,915) in one chunk of
    bfloat16 logits, BERT-large's (256 x 512, ~19,660) in four equal ones; each chunk's logits within CHUNK_BYTES."""
    from bertfuse.kernels._mlm_chunked import CHUNK_BYTES, _chunk_bounds

    assert _chunk_bounds(4915, 30522, 2, None) == [(0, 4915)]
    large = _chunk_bounds(19660, 30522, 2, None)
    assert large == [(i * 4915, (i + 1) * 4915) for i in range(4)]
    assert all((end - start) * 30522 * 2 <= CHUNK_BYTES for start, end in large)
    assert _chunk_bounds(10, 30522, 4, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)] and _chunk_bounds(0, 7, 4, None) == []


@pytest.mark.parametrize("strategy,n,v,h,reduction,factor", [
    ("chunked", 512, 8192, 64, "mean", 2.0 ** 16), ("chunked", 300, 4000, 48, "sum", 2.0 ** 4),
    ("fused", 160, 2048, 32, "mean", 2.0 ** 16)])
@pytest.mark.slow
def test_float16_gradients_under_a_gradient_scaler(device, strategy, n, v, h, reduction, factor):
    """fp16 training multiplies the loss by a GradScaler's factor (2^16 at first) before the backward: the
    gradients must come out of that as PyTorch's own fp16 ones do (within twice its error against float64), not
    with the small probabilities of many rows flushed to zero on the way."""
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.05, \
        torch.randn(v, generator=g) * 0.1
    labels = torch.randint(0, v, (n,), generator=g).to(device)

    def grads(dtype, fn):
        leaves = [t.to(dtype).to(device).requires_grad_() for t in (hidden, weight, bias)]
        return torch.autograd.grad(fn(leaves) * factor, leaves)

    def plain(ls):  # autocast's way: fp16 logits, the softmax in float32
        return F.cross_entropy(F.linear(*ls).float(), labels, reduction=reduction)

    ref = [t.double() for t in grads(torch.float64, lambda ls: F.cross_entropy(
        F.linear(*[t.half().double() for t in ls]), labels, reduction=reduction))]
    torch16 = grads(torch.float16, plain)
    ours = grads(torch.float16, lambda ls: kernels.masked_lm_loss(*ls, labels, reduction=reduction,
                                                                  strategy=strategy))
    for name, a, p, r in zip(("hidden", "weight", "bias"), ours, torch16, ref):
        err = float((a.double().cpu() - r.cpu()).norm() / r.norm())
        own = float((p.double().cpu() - r.cpu()).norm() / r.norm())
        assert torch.isfinite(a).all() and err <= 2 * own + 1e-6, (name, err, own)

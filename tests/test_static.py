"""bert.train.static and the packed training step at static shapes: traced whole by torch.compile, no host sync, and
(on a GPU) captured in a CUDA graph."""
import random

import pytest
import torch

from bertfuse import bert
from bertfuse.bert.data.masking import SpecialIds
from bertfuse.bert.train.optim import adamw, lamb
from bertfuse.bert.data.packing import PackedShapes
from bertfuse.bert.train.static import GraphedStep
from batch_utils import DictMasker, DictPacker
from sync_utils import HostSyncError, forbid_host_sync

SPECIAL = SpecialIds(cls=2, sep=3, mask=4, pad=0, vocab_size=1000, special=(0, 1, 2, 3, 4))
BACKENDS = ["torch", "triton"]


def packed_batch(rows=((30,), (7, 19)), seed=4):
    """Three rows of 32 tokens: one instance, two, and an unused row."""
    rng = random.Random(seed)
    insts = []
    for row in rows:
        insts.append([])
        for n in row:
            ids = [2] + [rng.randint(5, 999) for _ in range(n - 2)] + [3]
            insts[-1].append({"input_ids": ids, "token_type_ids": [0] * (n // 2) + [1] * (n - n // 2),
                              "next_sentence_label": n % 2})
    shapes = PackedShapes.for_rows(3, 32, 2, 0.15)
    return DictPacker(DictMasker(SPECIAL, seed=5), shapes)(insts, keys=range(sum(map(len, rows))))


def tiny(backend, dropout=0.1):
    torch.manual_seed(0)
    cfg = bert.BertConfig.preset("tiny", vocab_size=1000, backend=backend, hidden_dropout_prob=dropout,
                                 attention_probs_dropout_prob=dropout)
    return bert.BertForPreTraining(cfg)


def twin_of(model):
    twin = bert.BertForPreTraining(model.config)
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.compile
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_forward_has_no_graph_breaks(backend):
    explained = torch._dynamo.explain(tiny(backend))(**packed_batch())
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.compile
@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_compiled_training_step_matches_eager(backend):
    """Dropout on: the compiled step draws the same seeds and masks from the same generator state."""
    batch = packed_batch()
    model = tiny(backend)
    compiled_model = twin_of(model)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    losses = []
    for m in (model, compiled):
        torch.manual_seed(1)
        out = m(**batch)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-6), losses
    grads = dict(compiled_model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_training_step_reads_nothing_from_the_device(backend):
    model = tiny(backend)
    batch = packed_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    with forbid_host_sync():
        out = model(**batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()  # the CPU's AdamW reads its step count with .item(); on CUDA the fused one does not (GPU test)
    if backend == "torch":  # LAMB reads nothing, on any device: the whole step, optimizer included
        steps = lamb(model.parameters(), 1e-3, torch.device("cpu"), capturable=True)
        for _ in range(2):
            with forbid_host_sync():
                model(**batch).loss.backward()
                steps.step()
                steps.zero_grad(set_to_none=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The check itself works: the padded call validates its inputs with one sync, and is refused.
    with pytest.raises(HostSyncError, match="inside forbid_host_sync"), forbid_host_sync():
        model(input_ids=torch.randint(5, 999, (2, 9)))
    assert torch.tensor(3).item() == 3  # and everything is put back


def _cpu_record(fn, warmup, prepare):
    """A stand-in for record_cuda_graph on a CPU: the "capture" runs fn once (a real capture only records it;
    GraphedStep undoes either), and replay runs fn again, writing its results into the captured outputs."""
    for _ in range(warmup):
        fn()
    prepare()
    outputs = fn()

    def replay():
        for mine, new in zip(outputs, fn()):
            for k in mine:
                mine[k].copy_(new[k])
    return replay, outputs


def _train_step(model, opt, autocast=torch.autocast("cpu", enabled=False)):
    """One packed training step as the trainer runs it, minus its bookkeeping."""
    def step(batches, denominators):
        with autocast:
            out = model(**batches[0])
        (out.loss / denominators["n"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return [{"loss": out.loss.detach().float()}]
    return step


def test_graphed_step_warm_up_trains_nothing_and_replays_train_as_eager():
    """GraphedStep's bookkeeping, on a CPU: warm-up and capture are undone (parameters, fresh optimizer state,
    RNG), each call loads its batch into the static buffers, and the replays train exactly as eager steps."""
    eager_model = tiny("torch", dropout=0.0)
    graph_model = twin_of(eager_model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    graph_opt = torch.optim.AdamW(graph_model.parameters(), lr=1e-3)
    eager = _train_step(eager_model, eager_opt)
    graphed = GraphedStep(_train_step(graph_model, graph_opt), graph_model, graph_opt, record=_cpu_record)
    for seed in range(3):
        b = packed_batch(seed=seed)
        want, got = eager([b], {"n": 2.0})[0]["loss"], graphed([b], {"n": 2.0})[0]["loss"]
        assert torch.equal(want, got), (seed, want, got)
    for (name, p), q in zip(eager_model.named_parameters(), graph_model.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-8), name
    b = packed_batch()
    with pytest.raises(ValueError, match="static shapes"):
        graphed([{**b, "input_ids": b["input_ids"][:-1]}], {"n": 1.0})
    with pytest.raises(ValueError, match="the same max_seqlen every step"):
        graphed([{**b, "max_seqlen": 16}], {"n": 1.0})


# ---- on a GPU ----------------------------------------------------------------------------------------------
def _gpu_step(model, opt):
    return _train_step(model, opt, torch.autocast("cuda", dtype=torch.bfloat16))


def _capturable(model, optimizer="adamw"):
    return (adamw if optimizer == "adamw" else lamb)(model.parameters(), 1e-3, torch.device("cuda"), capturable=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,optimizer", [("torch", "adamw"), ("triton", "adamw"), ("triton", "lamb")])
def test_packed_step_has_no_sync_on_the_gpu(backend, optimizer):
    model = tiny(backend).cuda()
    opt = _capturable(model, optimizer)
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in packed_batch().items()}
    step = _gpu_step(model, opt)
    step([batch], {"n": torch.ones((), device="cuda")})  # first calls compile kernels and make the state
    torch.cuda.synchronize()
    with forbid_host_sync("cuda"):
        out = step([batch], {"n": torch.ones((), device="cuda")})
    assert torch.isfinite(out[0]["loss"]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend,optimizer", [("torch", "adamw"), ("triton", "adamw"), ("triton", "lamb")])
def test_cuda_graph_replay_matches_eager(backend, optimizer):
    """Dropout off: the graphed step and the eager one train identically; warm-up trains nothing."""
    eager_model = tiny(backend, dropout=0.0).cuda()
    graph_model = twin_of(eager_model).cuda()
    batches = [{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in packed_batch(seed=s).items()}
               for s in range(4)]
    eager_opt, graph_opt = _capturable(eager_model, optimizer), _capturable(graph_model, optimizer)
    eager = _gpu_step(eager_model, eager_opt)
    graphed = GraphedStep(_gpu_step(graph_model, graph_opt), graph_model, graph_opt)
    for b in batches:
        want = eager([b], {"n": 1.0})[0]["loss"]
        got = graphed([b], {"n": 1.0})[0]["loss"]
        assert torch.allclose(want, got, rtol=1e-3), (want, got)
    for (name, p), q in zip(eager_model.named_parameters(), graph_model.parameters()):
        assert torch.allclose(p, q, rtol=1e-3, atol=1e-5), name
    with pytest.raises(ValueError, match="static shapes"):
        graphed([{**batches[0], "input_ids": batches[0]["input_ids"][:-1]}], {"n": 1.0})

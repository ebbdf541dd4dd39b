"""kernels.lamb: the LAMB step of the kernels against the same formulas in float64 (lamb_ref), itself checked by
hand; the optimizer's groups, state, skipped steps, errors, resume, torch.compile and the step that never reads
the device."""
import math

import pytest
import torch

from kernel_utils import check_against_reference
from sync_utils import forbid_host_sync

kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.kernels import _multi_tensor, tuned  # noqa: E402
from bertfuse.bench.ops.lamb import PlainLamb  # noqa: E402
from bertfuse.kernels.lamb import Lamb, LambGroup, lamb_ref, lamb_step  # noqa: E402

# Odd sizes, one element, an empty tensor, a 0-d one, a zero tensor (trust ratio 1), several chunks of 16,384
# with a tail.
SHAPES = [(7,), (33, 5), (0,), (1,), (), (4,), (40000,), (3, 12001)]
ZERO = 5  # SHAPES[ZERO] starts at zero


def make_params(dtype=torch.float32, device="cpu", shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in shapes]
    if len(params) > ZERO:
        params[ZERO].data.zero_()
    return params


def set_grads(params, step, dtype=None, scale=None):
    """Gradients of step `step`: small at step 0 (below max_grad_norm 1), large after (pre-normalised)."""
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * (scale or (0.01 if step == 0 else 3.0))).to(p.device,
                                                                                                  dtype or p.dtype)


def groups_of(params, lr=0.02):
    """Two groups with their own hyperparameters: weight decay (trust ratio) on the first, none on the second."""
    return [{"params": params[::2], "weight_decay": 0.01},
            {"params": params[1::2], "weight_decay": 0.0, "lr": lr / 2, "betas": (0.8, 0.99), "eps": 1e-4}]


def run(params, steps=3, max_grad_norm=1.0, grad_dtype=None, **kwargs):
    opt = Lamb(groups_of(params), lr=0.02, max_grad_norm=max_grad_norm, **kwargs)
    norms = []
    for step in range(steps):
        set_grads(params, step, grad_dtype)
        opt.step()
        norms.append(opt.grad_norm.clone())
    return opt, norms


def exact_copy(params):
    return [torch.nn.Parameter(p.detach().cpu().double()) for p in params]


# ---- the reference is the formulas ----------------------------------------------------------------------------
def test_the_reference_is_the_formulas_by_hand():
    """Two steps of one weighted tensor and one without weight decay, each formula written out in float64."""
    w = [torch.tensor([3.0, -4.0], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)]
    g = [torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64)]
    lr, (b1, b2), eps, wd, clip_at = 0.1, (0.9, 0.999), 1e-6, 0.01, 2.0
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    steps = [torch.zeros(()) for _ in w]
    want, wm, wv = [t.clone() for t in w], [t.clone() for t in m], [t.clone() for t in v]
    for t in (1, 2):
        stats = lamb_ref(w, g, m, v, steps, [LambGroup(1, lr, b1, b2, eps, wd), LambGroup(1, lr, b1, b2, eps, 0.0)],
                         clip_at)
        norm = math.sqrt(1 + 4 + 4)  # ||g|| = 3 > 2: every gradient divided by 1.5
        for i, decay in enumerate((wd, 0.0)):
            gi = g[i] / (norm / clip_at)
            wm[i] = b1 * wm[i] + (1 - b1) * gi
            wv[i] = b2 * wv[i] + (1 - b2) * gi * gi
            u = (wm[i] / (1 - b1 ** t)) / ((wv[i] / (1 - b2 ** t)).sqrt() + eps) + decay * want[i]
            ratio = (want[i].norm() / u.norm()).item() if decay else 1.0
            want[i] = want[i] - lr * ratio * u
        assert stats.tolist() == pytest.approx([norm, clip_at / norm, 0.0])
        for i in range(2):
            assert torch.allclose(w[i], want[i], rtol=1e-12, atol=0), (t, i)
            assert torch.allclose(m[i], wm[i], rtol=1e-12) and torch.allclose(v[i], wv[i], rtol=1e-12)
    assert [s.item() for s in steps] == [2.0, 2.0]


# ---- the kernels against the float64 reference --------------------------------------------------------------
def assert_state_close(opt, exact, params, exact_params, rtol=2e-5):
    for p, q in zip(params, exact_params):
        if not p.numel():
            continue
        scale = q.detach().abs().max().item() or 1.0
        assert (p.detach().double().cpu() - q.detach()).abs().max().item() <= rtol * max(scale, 1e-2), p.shape
        got, want = opt.state[p], exact.state[q]
        assert got["step"].item() == want["step"].item()
        assert got["exp_avg"].dtype == torch.float32 and got["exp_avg"].device == p.device
        for k in ("exp_avg", "exp_avg_sq"):
            ref = want[k].abs().max().item()
            assert (got[k].double().cpu() - want[k]).abs().max().item() <= rtol * max(ref, 1e-30), (p.shape, k)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_matches_the_float64_formulas_over_several_steps(device, max_grad_norm):
    params = make_params(device=device)
    exact_params = exact_copy(params)
    opt, norms = run(params, max_grad_norm=max_grad_norm)
    exact, exact_norms = run(exact_params, max_grad_norm=max_grad_norm)
    assert_state_close(opt, exact, params, exact_params)
    for got, want in zip(norms, exact_norms):
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert opt._stats[1].item() == pytest.approx(1 / max(1.0, norms[-1].item() / max_grad_norm)
                                                 if max_grad_norm else 1.0, rel=1e-6)


def test_several_blocks_and_tails_per_chunk(device):
    """Blocks of 64 elements: every chunk loops over whole blocks and ends on a masked tail."""
    params = make_params(device=device, shapes=[(20000,), (65,), (16385,), (63,)])
    exact_params = exact_copy(params)
    with tuned.forced("lamb.sumsq", {"BLOCK": 64}), tuned.forced("lamb.moments", {"BLOCK": 64}), \
            tuned.forced("lamb.update", {"BLOCK": 64, "num_warps": 2}):
        opt, _ = run(params)
    exact, _ = run(exact_params)
    assert_state_close(opt, exact, params, exact_params)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_parameters_keep_float32_state(device, dtype):
    """Weights rounded once per step: within twice PyTorch's own error (lamb_ref on the same half-precision
    weights) of the float64 result."""
    shapes = [(33, 5), (1,), (16390,), (6,)]
    params, same = make_params(dtype, device, shapes), make_params(dtype, device, shapes)
    exact_params = exact_copy(params)
    opt, _ = run(params)
    run(exact_params)
    plain = PlainLamb(groups_of(same), lr=0.02)  # the same groups, stepped by lamb_ref
    for step in range(3):
        set_grads(same, step)
        plain.step()
    for p, s, q in zip(params, same, exact_params):
        assert p.dtype == dtype and opt.state[p]["exp_avg"].dtype == torch.float32
        check_against_reference("weights", p.detach().cpu(), q.detach(), s.detach().cpu(), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_gradients_of_half_precision_weights(device, dtype):
    """A launch group per (weight, gradient) dtype pair: bfloat16 weights with float32 gradients beside float32
    weights, in one group."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(s, generator=g) for s in [(5, 7), (300,), (9,)]]
    grads = [torch.randn(w.shape, generator=g) for w in weights]
    state = lambda ws: [[Lamb._new_state(w)[k] for w in ws] for k in ("exp_avg", "exp_avg_sq", "step")]
    ours = [weights[0].to(device, dtype), weights[1].to(device), weights[2].to(device, dtype)]
    same = [w.clone() for w in ours]  # lamb_ref on the same weights: PyTorch's own rounding
    exact = [w.detach().cpu().double() for w in ours]
    groups = [LambGroup(3, 0.05, 0.9, 0.999, 1e-6, 0.01)]
    states = [state(ours), state(same), state(exact)]  # float32 moments; float64 for the float64 weights
    for _ in range(2):
        lamb_step(ours, [g.to(device) for g in grads], *states[0], groups)
        lamb_ref(same, [g.to(device) for g in grads], *states[1], groups)
        lamb_ref(exact, [g.double() for g in grads], *states[2], groups)
    for w, s, e in zip(ours, same, exact):
        if w.dtype == torch.float32:
            assert torch.allclose(w.double().cpu(), e, rtol=1e-5, atol=1e-7)
        else:
            check_against_reference("weights", w.cpu(), e, s.cpu(), dtype)


def test_deterministic_and_strided_gradients(device):
    a, b = make_params(device=device), make_params(device=device)
    run(a)
    opt = Lamb(groups_of(b), lr=0.02)
    for step in range(3):
        set_grads(b, step)
        for p in b:  # the same values through a transposed copy's strided view
            if p.dim() == 2:
                p.grad = p.grad.t().contiguous().t()
                assert not p.grad.is_contiguous()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))


# ---- skipped steps ------------------------------------------------------------------------------------------
def snapshot(opt, params):
    return [p.detach().clone() for p in params] + [t.clone() for p in params for t in opt.state[p].values()]


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_step_with_a_gradient_that_is_not_finite_changes_nothing(device, bad):
    params = make_params(device=device, shapes=[(7,), (33, 5)])
    opt, _ = run(params, steps=1)
    before = snapshot(opt, params)
    set_grads(params, 1)
    params[1].grad[3, 2] = bad
    opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, snapshot(opt, params)))
    assert not math.isfinite(opt.grad_norm.item()) and opt._stats[2].item() == 1.0
    set_grads(params, 1)
    opt.step()  # the next good step is step 2
    assert opt.state[params[0]]["step"].item() == 2.0 and opt._stats[2].item() == 0.0


def test_found_inf_skips_the_step_on_the_device(device):
    params = make_params(device=device, shapes=[(7,), (9,)])
    opt, _ = run(params, steps=1)
    before = snapshot(opt, params)
    opt.found_inf = torch.ones((), device=device)
    set_grads(params, 1)
    opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, snapshot(opt, params)))
    opt.found_inf.zero_()
    opt.step()
    assert opt.state[params[0]]["step"].item() == 2.0 and not torch.equal(before[0], params[0].detach())


# ---- the optimizer ------------------------------------------------------------------------------------------
def test_state_dict_round_trip_resumes_exactly(device):
    """Two steps, save, a new optimizer loads them, two more: the same bits as four steps in a row; bfloat16
    weights keep float32 moments through the load (torch would cast them to the weights' dtype)."""
    for dtype in (torch.float32, torch.bfloat16):
        straight, resumed = make_params(dtype, device), make_params(dtype, device)
        opt = Lamb(groups_of(straight), lr=0.02)
        first = Lamb(groups_of(resumed), lr=0.02)
        for step in range(4):
            set_grads(straight, step)
            opt.step()
            if step < 2:
                set_grads(resumed, step)
                first.step()
        saved = torch.load(_saved(first.state_dict()), weights_only=True)
        second = Lamb(groups_of(resumed), lr=0.5)  # the saved rates win
        second.load_state_dict(saved)
        assert second.state[resumed[0]]["exp_avg"].dtype == torch.float32
        assert second.state[resumed[0]]["step"].device == resumed[0].device
        for step in (2, 3):
            set_grads(resumed, step)
            second.step()
        assert all(torch.equal(p, q) for p, q in zip(straight, resumed)), dtype


def _saved(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_learning_rate_as_a_device_tensor_and_parameters_without_gradients(device):
    params = make_params(device=device, shapes=[(7,), (5,), (3,)])
    opt = Lamb([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}],
               lr=torch.tensor(0.05, device=device))
    frozen = params[1].detach().clone()
    set_grads(params, 1)
    params[1].grad = None
    opt.param_groups[0]["lr"].fill_(0.0)  # what a scheduler does to a capturable rate: the step reads it
    before = params[0].detach().clone()
    opt.step()
    assert torch.equal(params[0].detach(), before) and torch.equal(params[1].detach(), frozen)
    assert params[1] not in opt.state and opt.state[params[0]]["step"].item() == 1.0


def test_float64_and_strided_parameters_step_in_pytorch(device):
    params = [torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
    with pytest.warns(UserWarning, match="Lamb steps in PyTorch"):
        opt, _ = run(params, steps=1)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float64
    strided = [torch.nn.Parameter(torch.randn(6, 5).to(device).t()), torch.nn.Parameter(torch.randn(3).to(device))]
    exact = exact_copy(strided)
    with pytest.warns(UserWarning, match="parameter 0 is not contiguous"):
        opt, _ = run(strided, steps=2)
    run(exact, steps=2)
    assert all(torch.allclose(p.detach().double().cpu(), q, rtol=1e-5, atol=1e-7) for p, q in zip(strided, exact))


def test_the_address_tables_are_built_once_per_set_of_tensors(device):
    params = make_params(device=device, shapes=[(7,), (9,)])
    opt, _ = run(params, steps=1)
    _multi_tensor._PLANS.clear()
    for step in range(3):
        for p in params:  # the same gradient buffers each step, as a caching allocator hands them out
            p.grad.mul_(0.5)
        opt.step()
    assert len(_multi_tensor._PLANS) == 1
    set_grads(params, 4)  # new gradient tensors: a new plan
    opt.step()
    assert len(_multi_tensor._PLANS) == 2


def test_bad_arguments_are_refused_with_their_names():
    p = torch.nn.Parameter(torch.ones(3))
    for kwargs, match in [({"lr": -1.0}, "lr must be >= 0"), ({"lr": 0.1, "betas": (0.9, 1.0)}, "betas"),
                          ({"lr": 0.1, "eps": -1.0}, "eps, weight_decay and max_grad_norm")]:
        with pytest.raises(ValueError, match=match):
            Lamb([p], **kwargs)
    opt = Lamb([{"params": [p]}, {"params": [torch.nn.Parameter(torch.ones(2))], "max_grad_norm": 2.0}], lr=0.1)
    for q in (p, opt.param_groups[1]["params"][0]):
        q.grad = torch.ones_like(q)
    with pytest.raises(ValueError, match="max_grad_norm is one norm over all groups"):
        opt.step()
    w, g = torch.ones(4), torch.ones(4)
    state = [[torch.zeros(4)], [torch.zeros(4)], [torch.zeros(())]]
    group = [LambGroup(1, 0.1, 0.9, 0.999, 1e-6, 0.0)]
    with pytest.raises(ValueError, match="1 params but 2 grads"):
        lamb_step([w], [g, g], *state, group)
    with pytest.raises(ValueError, match="param 0 has shape"):
        lamb_step([w], [torch.ones(5)], *state, group)
    with pytest.raises(TypeError, match="param 0 is torch.float64 .* the kernels take float32"):
        lamb_step([w.double()], [g.double()], [torch.zeros(4, dtype=torch.float64)],
                  [torch.zeros(4, dtype=torch.float64)], state[2], group)
    with pytest.raises(TypeError, match="state must be torch.float32 moments"):
        lamb_step([w], [g], [torch.zeros(4, dtype=torch.float16)], *state[1:], group)
    with pytest.raises(ValueError, match="must be contiguous"):
        lamb_step([torch.ones(4, 2).t()], [torch.ones(2, 4)], [torch.zeros(2, 4)], [torch.zeros(2, 4)],
                  state[2], group)
    with pytest.raises(ValueError, match="the groups count 2 tensors"):
        lamb_step([w], [g], *state, group * 2)
    with pytest.raises(TypeError, match="dense gradients"):
        lamb_step([w], [g.to_sparse()], *state, group)
    with pytest.raises(ValueError, match="found_inf must be one element"):
        lamb_step([w], [g], *state, group, found_inf=torch.zeros(2))


def test_the_step_never_reads_the_device(device):
    params = make_params(device=device, shapes=[(7,), (33, 5)])
    opt, _ = run(params, steps=1)
    set_grads(params, 1)
    opt.found_inf = torch.zeros((), device=device)
    with forbid_host_sync(device):
        opt.step()
    assert opt.state[params[0]]["step"].item() == 2.0


@pytest.mark.compile
def test_under_torch_compile_the_same_steps(device):
    eager, compiled = make_params(device=device, shapes=[(7,), (33, 5)]), make_params(device=device,
                                                                                      shapes=[(7,), (33, 5)])
    opt, opt_c = Lamb(groups_of(eager), lr=0.02), Lamb(groups_of(compiled), lr=0.02)
    step = torch.compile(opt_c.step, backend="aot_eager")
    for s in range(3):
        set_grads(eager, s)
        set_grads(compiled, s)
        opt.step()
        step()
    assert all(torch.equal(p, q) for p, q in zip(eager, compiled))


@pytest.mark.gpu
def test_a_cuda_graph_replays_the_step_as_eager():
    """A step captured after one eager warm-up step (gradients in fixed buffers, learning rates on the device)
    replays as eager steps do, bit for bit, the rate a scheduler writes included."""
    eager, graphed = make_params(device="cuda"), make_params(device="cuda")
    lr = torch.tensor(0.02, device="cuda")
    opts = [Lamb(groups_of(p, lr=lr), lr=lr.clone()) for p in (eager, graphed)]
    for params in (eager, graphed):
        set_grads(params, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opts[1].step()
    opts[0].step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opts[1].step()
    for step in (1, 2, 3):
        set_grads(eager, step)
        for p, q in zip(graphed, eager):
            p.grad.copy_(q.grad)
        for opt in opts:
            for group in opt.param_groups:
                group["lr"].fill_(0.02 / step)
        opts[0].step()
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(eager, graphed))
    assert opts[1].state[graphed[0]]["step"].item() == 4.0

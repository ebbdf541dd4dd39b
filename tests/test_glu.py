"""kernels.glu against act(a) * b in float64: output and the gradients of both halves, every activation, the two
halves of one projection (strided views) and two separate tensors."""
import pytest
import torch
import torch.nn.functional as F

from kernel_utils import DTYPES, case_seed, check_against_reference

kernels = pytest.importorskip("bertfuse.kernels")
ACTS = ["gelu", "gelu_tanh", "silu"]


def run_case(shape, dtype, device, activation, halves=True):
    """halves: a and b are the two halves of one [..., 2N] tensor (ModernBERT's Wi); else two tensors."""
    g = torch.Generator().manual_seed(case_seed(shape, str(dtype), activation, halves))
    n = shape[-1]
    h = (3 * torch.randn(*shape[:-1], 2 * n, generator=g)).to(device)
    dy = torch.randn(shape, generator=g).to(device)

    def run(cast):
        leaf = h.to(dtype).to(cast).requires_grad_()
        a, b = leaf.chunk(2, -1) if halves else (leaf[..., :n].contiguous(), leaf[..., n:].contiguous())
        fn = kernels.glu if cast == dtype and not run.ref else kernels.glu_ref
        y = fn(a, b, activation)
        return y, torch.autograd.grad(y, leaf, dy.to(dtype).to(cast))[0]

    run.ref = False
    y, dh = run(dtype)
    run.ref = True
    exact, same = run(torch.float64), run(dtype)
    assert y.dtype == dtype and y.shape == shape
    check_against_reference("y", y, exact[0], same[0], dtype)
    check_against_reference("da|db", dh, exact[1], same[1], dtype)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("n", [1, 7, 1000, pytest.param(1536, marks=pytest.mark.slow)])
def test_float32_shapes(device, activation, n):
    run_case((19, n), torch.float32, device, activation)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(device, activation, dtype):
    run_case((3, 11, 384), dtype, device, activation)


def test_two_tensors_one_row_and_empty(device):
    run_case((1, 1, 5), torch.float32, device, "silu", halves=False)
    a = torch.zeros(0, 16, device=device, requires_grad=True)
    kernels.glu(a, a, "gelu").sum().backward()
    assert a.grad.shape == (0, 16)


def test_saturation_and_non_finite_as_pytorch(device):
    """GeLU's tails as bias_gelu's; SiLU's too: huge inputs give finite outputs and gradients, NaN stays NaN."""
    a = torch.tensor([-1e4, -30.0, 0.0, 30.0, 1e4, float("nan")], device=device, requires_grad=True)
    b = torch.ones(6, device=device)
    for act in ACTS:
        y = kernels.glu(a, b, act)
        ref = kernels.glu_ref(a, b, act)
        torch.testing.assert_close(y, ref, equal_nan=True)
        torch.testing.assert_close(torch.autograd.grad(y.sum(), a)[0], torch.autograd.grad(ref.sum(), a)[0],
                                   equal_nan=True)


@pytest.mark.parametrize("activation", ACTS)
def test_gated_linear_is_a_drop_in(device, activation):
    """GatedLinear holds a Linear to 2N (state_dict keys weight and bias) and returns act(a) * b of its split."""
    lin = torch.nn.Linear(24, 40).to(device)
    ours = kernels.GatedLinear(24, 20, activation=activation).to(device)
    assert set(ours.state_dict()) == set(lin.state_dict())
    ours.load_state_dict(lin.state_dict())
    x = torch.randn(2, 5, 24, device=device)
    a, b = lin(x).chunk(2, -1)
    ref = (F.silu(a) if activation == "silu" else F.gelu(a, approximate="tanh" if "tanh" in activation else "none")) * b
    out = ours(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    torch.testing.assert_close(ours.weight.grad, torch.autograd.grad(ref.sum(), lin.weight)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, err, match", [
    (lambda d: kernels.glu(torch.randn(3, 8, device=d), torch.randn(3, 9, device=d)), ValueError,
     "a and b must share shape and dtype"),
    (lambda d: kernels.glu(torch.randn(3, 8, device=d), torch.randn(3, 8, device=d).half()), ValueError,
     "a and b must share shape and dtype"),
    (lambda d: kernels.glu(torch.ones(3, 8, dtype=torch.int32, device=d), torch.ones(3, 8, device=d)), TypeError,
     "a must be float32"),
    (lambda d: kernels.glu(torch.randn(3, 8, device=d), torch.randn(3, 8, device=d), "relu"), ValueError,
     "activation must be one of gelu, gelu_tanh, silu"),
    (lambda d: kernels.glu(torch.randn(3, 8, device=d), torch.randn(3, 8, device="meta")), ValueError,
     "b is on meta"),
    (lambda d: kernels.GatedLinear(4, 4, activation="swish"), ValueError, "activation must be one of"),
])
def test_bad_inputs(device, call, err, match):
    with pytest.raises(err, match=match):
        call(device)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_compiled(dtype, activation):
    for n in (1152, 2624, 3072):  # ModernBERT-base's and large's intermediate halves, and BERT's width
        run_case((4099, n), dtype, torch.device("cuda"), activation)

"""kernels.bias_gelu against F.gelu(x + b) in float64: output and the gradients of x and bias."""
import pytest
import torch
import torch.nn.functional as F

from kernel_utils import DTYPES, case_seed, check_against_reference

kernels = pytest.importorskip("bertfuse.kernels")


def run_case(shape, dtype, device, approximate):
    g = torch.Generator().manual_seed(case_seed(shape, str(dtype), approximate))
    n = shape[-1]
    x = (3 * torch.randn(shape, generator=g)).to(device)
    b = torch.randn(n, generator=g).to(device)
    dy = torch.randn(shape, generator=g).to(device)
    x1, b1 = x.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
    y = kernels.bias_gelu(x1, b1, approximate)
    assert y.dtype == dtype and y.shape == x.shape
    dx, db = torch.autograd.grad(y, (x1, b1), dy.to(dtype))
    x64, b64 = x.double().requires_grad_(), b.double().requires_grad_()
    y64 = F.gelu(x64 + b64, approximate=approximate)
    dx64, db64 = torch.autograd.grad(y64, (x64, b64), dy.double())
    xs, bs = x.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
    ys = F.gelu(xs + bs, approximate=approximate)
    dxs, dbs = torch.autograd.grad(ys, (xs, bs), dy.to(dtype))
    check_against_reference("y", y, y64, ys, dtype)
    check_against_reference("dx", dx, dx64, dxs, dtype)
    # dbias sums dx over the rows: its rounding scales with the sum of |dx|.
    check_against_reference("dbias", db, db64, dbs, dtype, terms=dx64.abs().reshape(-1, n).sum(0))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("n", [1, 7, 1000, 1536, 3072])
def test_float32_shapes(device, approximate, n):
    run_case((19, n), torch.float32, device, approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(device, approximate, dtype):
    run_case((3, 11, 1536), dtype, device, approximate)


def test_one_row_leading_dims_and_empty(device):
    run_case((1, 1, 5), torch.float32, device, "none")
    x = torch.zeros(0, 16, device=device, requires_grad=True)
    b = torch.zeros(16, device=device, requires_grad=True)
    kernels.bias_gelu(x, b).sum().backward()
    assert torch.equal(b.grad, torch.zeros(16, device=device))


def test_non_contiguous_input(device):
    x = torch.randn(64, 9, device=device).t()
    b = torch.randn(64, device=device)
    assert torch.allclose(kernels.bias_gelu(x, b), F.gelu(x + b), atol=1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_gelu_is_a_drop_in(device, approximate):
    lin = torch.nn.Linear(24, 40).to(device)
    ours = kernels.LinearGeLU(24, 40, approximate=approximate).to(device)
    assert set(ours.state_dict()) == set(lin.state_dict())
    ours.load_state_dict(lin.state_dict())
    x = torch.randn(2, 5, 24, device=device)
    ref = F.gelu(lin(x), approximate=approximate)
    out = ours(x)
    assert torch.allclose(out, ref, atol=1e-5)
    out.sum().backward()
    ref_w = torch.autograd.grad(F.gelu(lin(x), approximate=approximate).sum(), lin.weight)[0]
    assert torch.allclose(ours.weight.grad, ref_w, atol=1e-5)


@pytest.mark.parametrize("call, err, match", [
    (lambda d: kernels.bias_gelu(torch.randn(3, 8, device=d), torch.randn(9, device=d)), ValueError,
     r"bias has shape \(9,\)"),
    (lambda d: kernels.bias_gelu(torch.ones(3, 8, dtype=torch.int32, device=d), torch.randn(8, device=d)),
     TypeError, "x must be float32"),
    (lambda d: kernels.bias_gelu(torch.randn(3, 8, device=d), torch.randn(8, device=d), "erf"), ValueError,
     "approximate must be"),
    (lambda d: kernels.bias_gelu(torch.randn(3, 8, device=d), torch.randn(8, device="meta")), ValueError,
     "bias is on meta"),
])
def test_bad_inputs(device, call, err, match):
    with pytest.raises(err, match=match):
        call(device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gpu_compiled(dtype, approximate):
    run_case((8192, 3072), dtype, torch.device("cuda"), approximate)


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_strided_and_expanded_bias(device, layout):
    n = 40
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, n, generator=g).to(device)
    base = torch.randn(2 * n if layout == "strided" else 1, generator=g).to(device).requires_grad_()

    def view():
        return base[::2] if layout == "strided" else base.expand(n)

    y = kernels.bias_gelu(x, view())
    (grad,) = torch.autograd.grad(y.pow(2).sum(), base)
    ref = F.gelu(x.double() + view().double())
    (ref_grad,) = torch.autograd.grad(ref.pow(2).sum(), base)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_saturates_for_huge_inputs(device, approximate):
    """GeLU(z) -> 0 and its slope -> 0 as z -> -inf, GeLU(z) -> z and slope -> 1 as z -> +inf, as in PyTorch: no
    -inf, NaN or overflowing cube on the way."""
    z = torch.tensor([-3e38, -1e20, -1e15, -1e6, -50.0, -9.0, 9.0, 50.0, 1e6, 1e15, 1e20, 3e38], device=device)
    x = z.clone().requires_grad_()
    y = kernels.bias_gelu(x[None], torch.zeros(z.numel(), device=device), approximate)[0]
    (dx,) = torch.autograd.grad(y.sum(), x)
    expected = F.gelu(z.double(), approximate=approximate).float()
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(dx, (z > 0).float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_nan_and_infinity_propagate_as_in_pytorch(device, approximate):
    """A non-finite activation is never made finite, forward or backward: NaN stays NaN, -inf gives NaN
    (-inf * 0), +inf gives +inf, and the gradient at any of them, and of the bias summed over them, is NaN, as
    PyTorch's GeLU gives (its CPU vector path also gives NaN for +inf with erf; its scalar path gives +inf, the
    limit, as here). Upstream NaN and infinite gradients pass through like PyTorch's."""
    inf, nan = float("inf"), float("nan")
    z = torch.tensor([[nan, inf, -inf, 0.5, -20.0, 20.0], [1.0, 2.0, -1.0, 0.0, 3.0, -3.0]], device=device)
    dy = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [nan, inf, -inf, 1.0, 1.0, 1.0]], device=device)
    x, b = z.clone().requires_grad_(), torch.zeros(6, device=device, requires_grad=True)
    y = kernels.bias_gelu(x, b, approximate)
    dx, db = torch.autograd.grad(y, (x, b), dy)
    xr, br = z.double().clone().requires_grad_(), torch.zeros(6, dtype=torch.float64, requires_grad=True)
    yr = F.gelu(xr + br, approximate=approximate)
    dxr, dbr = torch.autograd.grad(yr, (xr, br), dy.double())
    yr = yr.detach().clone()
    yr[0, 1] = inf  # +inf: the limit (PyTorch's own paths differ here)
    for ours, ref in ((y, yr), (dx, dxr), (db, dbr)):
        ours, ref = ours.detach().double().cpu(), ref.detach().cpu()
        assert torch.equal(ours.isnan(), ref.isnan()), (ours, ref)
        assert torch.equal(ours.isinf(), ref.isinf()) and torch.equal(ours[ours.isinf()], ref[ref.isinf()])
        finite = ours.isfinite()
        torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-5, atol=1e-6)

"""kernels.layer_norm (and its RMS and pre-norm forms) against F.layer_norm / F.rms_norm in float64: outputs and
every gradient, with and without residual."""
import pytest
import torch
import torch.nn.functional as F

from kernel_utils import DTYPES, binomial_ok, case_seed, check_against_reference

kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.kernels.layer_norm import dropout_mask  # noqa: E402


def reference(x, w, b, eps, residual=None, keep=None, p=0.0, rms=False, return_sum=False):
    s = x * keep / (1 - p) if keep is not None else x
    if residual is not None:
        s = s + residual
    y = F.rms_norm(s, (x.shape[-1],), w, eps) if rms else F.layer_norm(s, (x.shape[-1],), w, b, eps)
    return (y, s) if return_sum else y


def run_case(shape, dtype, device, with_residual, p=0.0, seed=0, affine=True, eps=1e-5, rms=False,
             return_sum=False, floor=1e-2):
    """rms: RMSNorm (no bias); return_sum: the pre-norm form, whose second output (the sum) gets a gradient too;
    floor: of the error scale (kernel_utils)."""
    g = torch.Generator().manual_seed(case_seed(shape, str(dtype), with_residual, rms, return_sum))
    n = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(device)
    r = torch.randn(shape, generator=g).to(device) if with_residual else None
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(device) if affine else None
    b = (0.3 * torch.randn(n, generator=g)).to(device) if affine and not rms else None
    dy = torch.randn(shape, generator=g).to(device)
    dsum = torch.randn(shape, generator=g).to(device) if return_sum else None
    leaves64 = [t.double().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (x, r, w, b)]
    keep = None
    if p > 0:
        keep = dropout_mask(seed, x.numel() // n, n, p, device).view(shape)

    def outputs(y, cast):
        ys = y if return_sum else (y,)
        return ys, [d.to(dtype).to(cast) for d in (dy, dsum) if d is not None]

    y, dys = outputs(kernels.layer_norm(leaves[0], leaves[2], leaves[3], eps, residual=leaves[1], dropout_p=p,
                                        seed=seed, rms=rms, return_sum=return_sum), dtype)
    assert all(t.dtype == dtype and t.shape == x.shape for t in y)
    inputs = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(y, inputs, dys)

    y64, dys = outputs(reference(leaves64[0], leaves64[2], leaves64[3], eps, leaves64[1], keep, p, rms, return_sum),
                       torch.float64)
    inputs64 = [t for t in leaves64 if t is not None]
    grads64 = torch.autograd.grad(y64, inputs64, dys)

    # PyTorch's own error in the same dtype is the yardstick for half precision.
    same = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (x, r, w, b)]
    y_same, dys = outputs(reference(same[0], same[2], same[3], eps, same[1], keep, p, rms, return_sum), dtype)
    grads_same = torch.autograd.grad(y_same, [t for t in same if t is not None], dys)

    # dweight and dbias sum dy * xhat and dy over the rows: their rounding scales with the sums of magnitudes.
    with torch.no_grad():
        xhat = reference(leaves64[0], None, None, eps, leaves64[1], keep, p, rms).reshape(-1, n)
        dy_rows = dy.double().reshape(-1, n)
    terms = {"dweight": (dy_rows * xhat).abs().sum(0), "dbias": dy_rows.abs().sum(0)}
    for name, a, ref, same_y in zip(("y", "sum"), y, y64, y_same):
        check_against_reference(name, a, ref, same_y, dtype, floor=floor)
    names = [nm for nm, t in zip(("dx", "dresidual", "dweight", "dbias"), leaves) if t is not None]
    for nm, a, ref, same_g in zip(names, grads, grads64, grads_same):
        check_against_reference(nm, a, ref, same_g, dtype, terms=terms.get(nm), floor=floor)


@pytest.mark.parametrize("n", [1, 7, 384, 768, 1000, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_float32_shapes(device, n, with_residual):
    run_case((13, n), torch.float32, device, with_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_dtypes(device, dtype, with_residual):
    run_case((2, 9, 384), dtype, device, with_residual)


@pytest.mark.parametrize("n", [4097, 8192])
def test_wide_rows(device, n):
    run_case((3, n), torch.float32, device, with_residual=True)


def test_one_row_and_no_affine(device):
    run_case((1, 1, 33), torch.float32, device, with_residual=True)
    run_case((5, 48), torch.float32, device, with_residual=False, affine=False)


def test_large_eps_is_used(device):
    run_case((4, 16), torch.float32, device, with_residual=False, eps=0.5)


def test_empty_input(device):
    x = torch.zeros(0, 64, device=device, requires_grad=True)
    w, b = torch.ones(64, device=device, requires_grad=True), torch.zeros(64, device=device, requires_grad=True)
    y = kernels.layer_norm(x, w, b)
    y.sum().backward()
    assert y.shape == (0, 64) and torch.equal(w.grad, torch.zeros(64, device=device))


def test_non_contiguous_input(device):
    base = torch.randn(48, 10, device=device)
    x = base.t()  # [10, 48], row stride 1: not unit stride along the normalised dimension
    w, b = torch.randn(48, device=device), torch.randn(48, device=device)
    assert torch.allclose(kernels.layer_norm(x, w, b), F.layer_norm(x, (48,), w, b), atol=1e-5)
    sliced = torch.randn(6, 100, device=device)[:, 10:74]  # strided rows, unit stride inside
    w, b = torch.randn(64, device=device), torch.randn(64, device=device)
    assert torch.allclose(kernels.layer_norm(sliced, w, b), F.layer_norm(sliced, (64,), w, b), atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_against_reference_with_kernel_mask(device, dtype):
    run_case((6, 200), dtype, device, with_residual=True, p=0.3, seed=1234)


@pytest.mark.parametrize("n", [1, 5, 37])
def test_dropout_on_widths_that_are_not_multiples_of_eight(device, n):
    """Random bits come in groups of 8 columns; rows of other widths are padded in offset space only."""
    run_case((9, n), torch.float32, device, with_residual=True, p=0.3, seed=77)


def test_dropout_keep_rate_and_determinism(device):
    m, n, p = 64, 1000, 0.1
    keep = dropout_mask(7, m, n, p, device)
    assert binomial_ok(int(keep.sum()), m * n, 1 - p)
    x, w, b = torch.randn(m, n, device=device), torch.ones(n, device=device), torch.zeros(n, device=device)
    a = kernels.layer_norm(x, w, b, dropout_p=p, seed=7)
    assert torch.equal(a, kernels.layer_norm(x, w, b, dropout_p=p, seed=7))
    assert not torch.equal(a, kernels.layer_norm(x, w, b, dropout_p=p, seed=8))
    # The kernel drops exactly the masked elements.
    assert torch.allclose(a, F.layer_norm(x * keep / (1 - p), (n,), w, b), atol=1e-5)
    # Seeds drawn from torch's generator follow torch.manual_seed.
    torch.manual_seed(3)
    c = kernels.layer_norm(x, w, b, dropout_p=p)
    torch.manual_seed(3)
    assert torch.equal(c, kernels.layer_norm(x, w, b, dropout_p=p))


def test_p_zero_and_eval_equal_no_dropout(device):
    x, r = torch.randn(8, 96, device=device), torch.randn(8, 96, device=device)
    w, b = torch.randn(96, device=device), torch.randn(96, device=device)
    plain = kernels.layer_norm(x, w, b, residual=r)
    assert torch.equal(plain, kernels.layer_norm(x, w, b, residual=r, dropout_p=0.0, seed=1))
    assert torch.equal(plain, kernels.layer_norm(x, w, b, residual=r, dropout_p=0.5, training=False))
    ln = kernels.LayerNorm(96).to(device).eval()
    ln.load_state_dict({"weight": w, "bias": b})
    assert torch.equal(plain, ln(x, residual=r, dropout_p=0.5))


def test_module_is_a_drop_in_for_nn_layernorm(device):
    ref = torch.nn.LayerNorm(40, eps=1e-6).to(device)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = kernels.LayerNorm(40, eps=1e-6).to(device)
    assert set(ours.state_dict()) == set(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 40, device=device)
    assert torch.allclose(ours(x), ref(x), atol=1e-5)


@pytest.mark.parametrize("n", [1, 7, 768, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_float32_shapes(device, n, with_residual):
    # Over one feature, y = w * s / sqrt(s^2 + eps): dx is of the size of eps, where float32 holds only the
    # rounding of 1 - s^2 / (s^2 + eps); its error is judged at the inputs' scale (1), not 1e-2.
    run_case((5, n), torch.float32, device, with_residual, rms=True, eps=1e-6, floor=1.0 if n == 1 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
def test_pre_norm_sum_every_dtype(device, dtype, rms):
    """return_sum: the normalised output and the sum dropout(x) + residual, both with gradients, through one
    kernel each way (a pre-norm layer's residual stream)."""
    run_case((3, 11, 384), dtype, device, True, rms=rms, return_sum=True)


@pytest.mark.parametrize("rms", [False, True])
def test_pre_norm_sum_with_dropout_and_without_residual(device, rms):
    run_case((7, 37), torch.float32, device, True, p=0.2, seed=4, rms=rms, return_sum=True)
    run_case((7, 37), torch.float32, device, False, p=0.2, seed=4, rms=rms, return_sum=True)


def test_rms_norm_module_is_a_drop_in_for_nn_rmsnorm_and_transformers_rmsnorm(device):
    """kernels.RMSNorm: nn.RMSNorm's state_dict and output (eps None: the dtype's eps); rms_norm computes what
    transformers' Llama-style RMSNorm (EuroBERT's) computes."""
    ref = torch.nn.RMSNorm(40).to(device)
    with torch.no_grad():
        ref.weight.normal_()
    ours = kernels.RMSNorm(40).to(device)
    assert set(ours.state_dict()) == set(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    x, r = torch.randn(3, 5, 40, device=device), torch.randn(3, 5, 40, device=device)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    y, s = ours(x, r, return_sum=True)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, ref(x + r), rtol=1e-5, atol=1e-5)
    pytest.importorskip("transformers")
    from transformers.models.eurobert.modeling_eurobert import EuroBertRMSNorm

    theirs = EuroBertRMSNorm(40, eps=1e-5).to(device)
    with torch.no_grad():
        theirs.weight.normal_()
    torch.testing.assert_close(kernels.rms_norm(x, theirs.weight, theirs.variance_epsilon), theirs(x), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("call, err, match", [
    (lambda d: kernels.layer_norm(torch.randn(4, 8, device=d), torch.ones(7, device=d), None), ValueError,
     r"weight has shape \(7,\), expected \(8,\)"),
    (lambda d: kernels.layer_norm(torch.ones(4, 8, dtype=torch.int64, device=d), None, None), TypeError,
     "x must be float32, float16 or bfloat16, got torch.int64"),
    (lambda d: kernels.layer_norm(torch.randn(4, 8, device=d), torch.ones(8, device="meta"), None), ValueError,
     "weight is on meta"),
    (lambda d: kernels.layer_norm(torch.randn(4, 8, device=d), None, None, residual=torch.randn(4, 9, device=d)),
     ValueError, "residual has shape"),
    (lambda d: kernels.layer_norm(torch.randn(4, 8, device=d), None, None, dropout_p=1.0), ValueError,
     r"dropout_p must be in \[0, 1\)"),
    (lambda d: kernels.layer_norm(torch.randn(2, 20000, device=d), None, None), ValueError, "1..16384 features"),
])
def test_bad_inputs(device, call, err, match):
    with pytest.raises(err, match=match):
        call(device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [768, 1024, 4096])
def test_gpu_compiled(dtype, n):
    run_case((4096, n), dtype, torch.device("cuda"), with_residual=True)
    run_case((512, n), dtype, torch.device("cuda"), with_residual=True, p=0.1, seed=11)
    run_case((4096, n), dtype, torch.device("cuda"), with_residual=True, rms=True, return_sum=True, eps=1e-6)


def test_fuse_layer_norms_swaps_in_place_and_shares_parameters(device):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Sequential(torch.nn.LayerNorm(16, eps=1e-3))).to(device)
    x = torch.randn(5, 8, device=device)
    ref = model(x)
    weight = model[1].weight
    assert kernels.fuse_layer_norms(model) == 2
    assert isinstance(model[1], kernels.LayerNorm) and isinstance(model[2][0], kernels.LayerNorm)
    assert model[1].weight is weight and model[2][0].eps == 1e-3
    assert torch.allclose(model(x), ref, atol=1e-5)


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_strided_and_expanded_weight_and_bias(device, layout):
    """The kernel indexes weight and bias as plain arrays: views must be read as what they mean."""
    n = 24
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, n, generator=g).to(device)
    if layout == "strided":
        bases = [torch.randn(2 * n, generator=g).to(device).requires_grad_() for _ in range(2)]
        views = lambda: (bases[0][::2], bases[1][1::2])  # noqa: E731
    else:
        bases = [torch.randn(1, generator=g).to(device).requires_grad_() for _ in range(2)]
        views = lambda: (bases[0].expand(n), bases[1].expand(n))  # noqa: E731
    y = kernels.layer_norm(x, *views())
    grads = torch.autograd.grad(y.pow(2).sum(), bases)
    ref = F.layer_norm(x.double(), (n,), *(v.double() for v in views()))
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), bases)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-4)

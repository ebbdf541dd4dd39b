"""kernels.launches: every op's launch sites declared once, launches recorded instead of started, and the recorded
arguments specialised as the JIT specialises them."""
import importlib

import pytest
import torch

kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.kernels import launches, targets  # noqa: E402

SM90 = targets.named("sm_90")


def test_every_op_declares_its_sites_and_each_launcher_reads_its_own():
    names = [s.name for s in launches.sites()]
    assert len(names) == len(set(names))
    for s in launches.sites():
        importlib.import_module(f"bertfuse.kernels.{s.op}")  # named after its op module
        assert s.choice or hasattr(s.kernel, "run"), s.name  # a jit function
        size = 64 if s.op == "attention" else 768
        default = s.default(torch.bfloat16, size, SM90)
        assert type(s.config(torch.bfloat16, size, SM90)) is type(default)
        assert all(set(c) <= set(default._fields) for c in s.candidates), s.name
    with pytest.raises(KeyError, match="no launch site 'nope.fwd'"):
        launches.site("nope.fwd")


def test_recording_starts_nothing_and_takes_the_configs_of_the_family():
    x = torch.randn(37, 768, dtype=torch.bfloat16, requires_grad=True)
    with launches.recording(SM90) as got:
        kernels.layer_norm(x, torch.ones(768), None, 1e-5, dropout_p=0.1, seed=3).sum().backward()
        with pytest.raises(RuntimeError, match="does not nest"):
            with launches.recording(SM90):
                pass
    assert [g.site for g in got] == ["layer_norm.fwd", "layer_norm.bwd"] and not launches.recording_active()
    fwd = launches.site("layer_norm.fwd").config(torch.bfloat16, 768, SM90)
    assert got[0].args["BLOCK_M"] == fwd.BLOCK_M and got[0].num_warps == fwd.num_warps
    assert targets.of(torch.device("cpu")) is None  # the family is assumed only inside the block


def test_the_signature_is_the_jit_specialisation_of_what_was_passed():
    x = torch.randn(37, 768, dtype=torch.bfloat16, requires_grad=True)
    with launches.recording(SM90) as got:
        kernels.layer_norm(x, torch.ones(768), None, 1e-5, dropout_p=0.1, seed=3)
    sig = launches.signature(got[0])
    assert sig["X"] == torch.bfloat16 and sig["W"] == torch.float32 and sig["B"] is None  # absent bias: constexpr
    assert sig["M"] == "i32" and sig["N"] == "i32:16" and sig["stride_x_m"] == "i32:16" and sig["eps"] == "fp32"
    assert sig["HAS_DROPOUT"] is True and sig["HAS_BIAS"] is False
    one = got[0]._replace(args=dict(got[0].args, M=1))
    big = got[0]._replace(args=dict(got[0].args, M=2**31 + 16))
    assert launches.signature(one)["M"] == 1 and launches.signature(big)["M"] == "i64"
    odd = got[0]._replace(args=dict(got[0].args, M="37"))
    with pytest.raises(TypeError, match="M is a str"):
        launches.signature(odd)


def test_a_launch_out_of_step_with_its_kernel_is_named():
    site = launches.site("bias_gelu.fwd")
    with launches.recording(SM90):
        with pytest.raises(TypeError, match="bias_gelu.fwd: .* got arguments"):
            site.launch((1,), torch.zeros(1))

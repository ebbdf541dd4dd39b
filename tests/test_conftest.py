"""conftest.py makes Triton's interpreter cheaper to run without changing what it computes (the speed-ups live in
tests/interpreter_site/sitecustomize.py): the kernels give the same bits with them as in a plain interpreter (a
fresh process that never loads them), the overflow check skipped while the interpreter's debugging is off still
runs when debugging is on, a repeated launch derives no block type again, and a subprocess started with the
interpreter site gets the same speed-ups."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="conftest.py changes Triton's interpreter only; it is off here")
HERE = Path(__file__).resolve().parent


def compute() -> dict:
    """Outputs and gradients of kernels whose programs do much integer offset arithmetic: varlen attention
    with dropout, LayerNorm with a residual and dropout, bias + GeLU, the masked-only MLM loss."""
    from bertfuse import kernels

    g = torch.Generator().manual_seed(7)
    leaf = lambda *shape: torch.randn(*shape, generator=g).requires_grad_()  # noqa: E731
    out = {}
    q, k, v = leaf(28, 4, 16), leaf(28, 4, 16), leaf(28, 4, 16)
    cu = torch.tensor([0, 17, 26, 28], dtype=torch.int32)
    o = kernels.varlen_attention(q, k, v, cu, 17, dropout_p=0.25, seed=11)
    out["attention"] = o
    out.update(zip(("dq", "dk", "dv"), torch.autograd.grad((o * o).sum(), (q, k, v))))
    x, r, w, b = leaf(19, 40), leaf(19, 40), leaf(40), leaf(40)
    y = kernels.layer_norm(x, w, b, residual=r, dropout_p=0.2, seed=5)
    out["layer_norm"] = y
    out.update(zip(("dx", "dr", "dw", "db"), torch.autograd.grad((y * y).sum(), (x, r, w, b))))
    h, bias = leaf(13, 50), leaf(50)
    out["bias_gelu"] = kernels.bias_gelu(h, bias)
    hidden, weight, mlm_bias = leaf(9, 24), leaf(37, 24), leaf(37)
    labels = torch.tensor([3, -100, 36, 0, -100, 5, 9, -100, 1])
    loss = kernels.masked_lm_loss(hidden, weight, mlm_bias, labels)
    out["mlm_loss"] = loss
    out.update(zip(("dhidden", "dweight", "dbias"), torch.autograd.grad(loss, (hidden, weight, mlm_bias))))
    return {name: t.detach() for name, t in out.items()}


def test_the_kernels_give_the_same_bits_as_in_a_plain_interpreter(tmp_path):
    from triton.runtime import interpreter

    # The changes are in place here (else this compares the plain interpreter with itself) ...
    assert "binary_op_sanitize_overflow_impl" in vars(interpreter.interpreter_semantic)
    assert "patch_once" in interpreter._patch_lang.__qualname__
    assert "remembered" in interpreter._get_np_dtype.__qualname__
    assert "remembered" in triton.language.core.block_type.__init__.__qualname__
    # ... and not in a process that never loads conftest.py.
    # The same torch thread count as here (pytest-xdist's processes run one each): its reductions then add in the
    # same order.
    program = (f"import sys, torch; torch.set_num_threads({torch.get_num_threads()}); "
               f"sys.path.insert(0, {str(HERE)!r}); from test_conftest import compute; "
               "from triton.runtime import interpreter; assert 'remembered' not in interpreter._get_np_dtype."
               f"__qualname__; torch.save(compute(), {str(tmp_path / 'plain.pt')!r})")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("PYTHONPATH", None)  # no interpreter site, if this process was started with one
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    plain, ours = torch.load(tmp_path / "plain.pt"), compute()
    assert plain.keys() == ours.keys()
    assert all(torch.equal(ours[name], plain[name]) for name in plain), \
        [name for name in plain if not torch.equal(ours[name], plain[name])]


def test_a_process_started_with_the_interpreter_site_speeds_up_its_interpreter(tmp_path):
    """What conftest.py does here, a subprocess gets through tests/interpreter_site (sitecustomize.py), when
    TRITON_INTERPRET=1 is set at its start; without it, its interpreter is left alone."""
    from interpreter_site.sitecustomize import subprocess_env

    program = "from triton.runtime import interpreter; print(interpreter._get_np_dtype.__qualname__)"
    for interpret, speed_up in (("1", True), ("0", False)):
        env = subprocess_env(dict(os.environ, TRITON_INTERPRET=interpret))
        done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("remembered" in done.stdout) == speed_up, done.stdout


@triton.jit
def _times_a_billion(X, Y):
    tl = triton.language
    tl.store(Y, tl.load(X) * 1_000_000_000)


def test_the_overflow_check_runs_when_the_interpreter_debugs():
    """Off by default (a GPU build without debug does not check either: int32 wraps); on, an int32 product
    past 2^31 stops the kernel with the interpreter's message."""
    from triton.runtime import interpreter

    x, y = torch.tensor([3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _times_a_billion[(1,)](x, y)
    assert y.item() == (3_000_000_000 + 2 ** 31) % 2 ** 32 - 2 ** 31  # wrapped, as a GPU build does
    builder = interpreter.interpreter_builder
    options = builder.options
    builder.options = dataclasses.replace(options, debug=True)
    try:
        with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
            _times_a_billion[(1,)](x, y)
    finally:
        builder.options = options


def test_a_repeated_launch_derives_no_block_type_again(monkeypatch):
    """The block types are remembered as the interpreter passes them (Triton's own tuple, constexpr dimensions,
    pointer elements): a second launch at the same shapes never runs Triton's derivation (its shape check)."""
    from triton.language import core

    derived = []
    check = core.validate_block_shape  # by Triton's own block_type.__init__, and by tl.full's or tl.reshape's check
    init_code = core.block_type.__init__.derive.__code__  # Triton's own, which the speed-up calls on a miss

    def counted(shape):
        if sys._getframe(1).f_code is init_code:
            derived.append(shape)
        return check(shape)

    monkeypatch.setattr(core, "validate_block_shape", counted)
    blocks = core.block_type.__init__.blocks
    remembered = dict(blocks)  # by the tests before this one in this process
    blocks.clear()
    try:
        compute()
        first = len(derived)
        compute()
    finally:
        blocks.update(remembered)
    assert first > 0 and len(derived) == first, (first, len(derived) - first)

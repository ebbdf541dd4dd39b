"""`kernels/` is a library of its own: copied alone into an empty `bertfuse` package, with bertfuse.bert and
bertfuse.bench made unimportable, it imports and every op runs forward and backward against its plain-PyTorch
reference (the CPU, under Triton's interpreter); and no module of it imports either package."""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

PROGRAM = r'''
import importlib.abc, sys

class NoProject(importlib.abc.MetaPathFinder):  # bert and bench are not there, even if installed
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("bert", "bench") or name.split(".")[:2] in (["bertfuse", "bert"],
                                                                              ["bertfuse", "bench"]):
            raise ImportError(f"{name} is not available to the kernels")

sys.meta_path.insert(0, NoProject())
import torch
from bertfuse import kernels

assert kernels.__file__.startswith(sys.argv[1]), kernels.__file__
torch.manual_seed(0)

def leaves(*shapes):
    return [torch.randn(*s, dtype=torch.float64).requires_grad_() for s in shapes]

def check(name, fn, ref, inputs):
    got, want = fn(*inputs), ref(*inputs)
    grads = torch.autograd.grad(got.sum(), inputs)
    wants = torch.autograd.grad(want.sum(), inputs)
    for a, b in zip((got, *grads), (want, *wants)):
        assert torch.allclose(a.float(), b.float(), atol=1e-4, rtol=1e-4), name
    print("ok", name, getattr(kernels, name).__module__)

cu = torch.tensor([0, 3, 8], dtype=torch.int32)
check("varlen_attention", lambda q, k, v: kernels.varlen_attention(q.float(), k.float(), v.float(), cu, 5),
      lambda q, k, v: kernels.varlen_attention_ref(q, k, v, cu), leaves((9, 2, 16), (9, 2, 16), (9, 2, 16)))
mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
check("padded_attention", lambda q, k, v: kernels.padded_attention(q.float(), k.float(), v.float(), mask),
      lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None].bool())
      * mask[:, None, :, None], leaves((2, 2, 3, 16), (2, 2, 3, 16), (2, 2, 3, 16)))
check("bias_gelu", lambda x, b: kernels.bias_gelu(x.float(), b.float()), kernels.bias_gelu_ref, leaves((5, 24), (24,)))
check("layer_norm", lambda x, r, w, b: kernels.layer_norm(x.float(), w.float(), b.float(), 1e-5, residual=r.float()),
      lambda x, r, w, b: kernels.layer_norm_ref(x, w, b, 1e-5, residual=r), leaves((5, 24), (5, 24), (24,), (24,)))
check("rms_norm", lambda x, r, w: kernels.rms_norm(x.float(), w.float(), 1e-6, residual=r.float()),
      lambda x, r, w: kernels.rms_norm_ref(x, w, 1e-6, residual=r), leaves((5, 24), (5, 24), (24,)))
check("glu", lambda a, b: kernels.glu(a.float(), b.float(), "silu"), lambda a, b: kernels.glu_ref(a, b, "silu"),
      leaves((5, 24), (5, 24)))
rot = kernels.Rotary(1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))
pos = kernels.rotary_positions(cu, 9)
check("rotary", lambda x: kernels.rotary(x.float(), pos, rot), lambda x: kernels.rotary_ref(x, pos, rot),
      leaves((9, 2, 16)))
def deberta(q, k, v, pk, pq, attention):
    positions = kernels.DisentangledPositions(pk, pq, 4, 6)
    return attention(q, k, v, cu, positions)
def ours(q, k, v, c, p):
    return kernels.disentangled_attention(q, k, v, c, 5, p)
check("disentangled_attention", lambda *t: deberta(*(x.float() for x in t), ours),
      lambda *t: deberta(*t, kernels.disentangled_attention_ref),
      leaves((9, 2, 16), (9, 2, 16), (9, 2, 16), (8, 2, 16), (8, 2, 16)))
labels = torch.tensor([3, -100, 0, 9, 5])
check("masked_lm_loss", lambda h, w, b: kernels.masked_lm_loss(h.float(), w.float(), b.float(), labels),
      lambda h, w, b: kernels.masked_lm_loss_ref(h, w, b, labels), leaves((5, 16), (11, 16), (11,)))
def lamb(step, dtype):  # three LAMB steps, no autograd: the weights after them
    weights = [t.to(dtype).clone() for t in lamb_start]
    state = [[torch.zeros_like(t) for t in weights] for _ in range(2)] + [[torch.zeros(()) for _ in weights]]
    for g in lamb_grads:
        step(weights, [t.to(dtype) for t in g], *state, [kernels.LambGroup(2, 0.02, 0.9, 0.999, 1e-6, 0.01)], 1.0)
    return weights
lamb_start, lamb_grads = [torch.randn(37, 5), torch.randn(300)], [[torch.randn(37, 5), torch.randn(300)] for _ in range(3)]
for a, b in zip(lamb(kernels.lamb_step, torch.float32), lamb(kernels.lamb_ref, torch.float64)):
    assert torch.allclose(a.double(), b, atol=1e-6, rtol=1e-5), "Lamb"
print("ok Lamb", kernels.Lamb.__module__)
ln, lin = kernels.LayerNorm(24), kernels.LinearGeLU(16, 24)
x = torch.randn(3, 16)
assert torch.allclose(ln(lin(x)), torch.nn.functional.layer_norm(
    torch.nn.functional.gelu(torch.nn.functional.linear(x, lin.weight, lin.bias)), (24,), ln.weight, ln.bias),
    atol=1e-5)
print("ok modules")
print("ops", *sorted({s.op for s in kernels.launches.sites()}))  # every op module, as the package declares them
'''


@pytest.mark.slow
def test_kernels_copied_alone_import_and_run_every_op(tmp_path):
    shutil.copytree(ROOT / "kernels", tmp_path / "bertfuse" / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "bertfuse" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env=dict(env, TRITON_INTERPRET="1", PYTHONPATH=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")[:-1]
    assert lines[-2] == "ok modules" and all(line.startswith("ok ") for line in lines[:-1])
    checked = {line.split()[2].removeprefix("bertfuse.kernels.") for line in lines[:-2]}
    assert checked == set(lines[-1].split()[1:]), lines  # every op of the package ran against its reference


def test_no_kernels_module_imports_the_project_or_its_tools():
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & {"bert", "bench"}, (path.name, names)
            assert not [n for n in names if n.split(".")[:2] in (["bertfuse", "bert"], ["bertfuse", "bench"])], \
                (path.name, names)

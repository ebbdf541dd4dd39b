"""bert.hf.fuse changes speed, never meaning: one test per way a fuser could change what a transformers model
means (causal LMs, gradient checkpointing, the forward signature, output positions, torch.export, float 4-D masks,
head_dim 8). The whole of transformers' own model tests runs fused and unfused in bench/hf_suite.py."""
import copy
import inspect
import re
import warnings

import pytest
import torch

from hf_utils import TOL, grad_errors, needs_transformers, random_batch, rel_err

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.bert.hf import fuse, fuse_report, unfuse  # noqa: E402

# transformers' tester sizes: hidden 32 in 4 heads of 8 (head_dim 8, padded to 16 inside the attention kernel).
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert(cls="BertModel", **changes):
    torch.manual_seed(0)
    return getattr(transformers, cls)(transformers.BertConfig(**dict(TINY, **changes))).eval()


def inputs(seed=0, lengths=(13, 6, 1)):
    ids, mask, tt = random_batch(99, batch=3, seqlen=13, lengths=list(lengths), seed=seed)
    return dict(input_ids=ids.clamp_min(1), attention_mask=mask, token_type_ids=tt)  # 0 is the padding id


def count_calls(monkeypatch, name):
    calls = []
    original = getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


# ---- 1. causal LMs keep the shifted next-token loss, their logits, shift_labels and the KV cache ----------------
@pytest.mark.parametrize("mlm_logits", [True, False])
@pytest.mark.parametrize("cls, config", [("BertLMHeadModel", transformers.BertConfig),
                                         ("RobertaForCausalLM", transformers.RobertaConfig)])
@pytest.mark.slow
def test_causal_lm_keeps_its_loss_logits_and_cache(cls, config, mlm_logits):
    torch.manual_seed(0)
    ref = getattr(transformers, cls)(config(**TINY, is_decoder=True, pad_token_id=0)).eval()
    fused = fuse(copy.deepcopy(ref), mlm_logits=mlm_logits)
    x = inputs(1)
    labels = torch.randint(0, 99, x["input_ids"].shape, generator=torch.Generator().manual_seed(2))
    shift = torch.roll(labels, -1, 1)
    for kw in (dict(labels=labels), dict(shift_labels=shift)):
        a, b = ref(**x, **kw), fused(**x, **kw)
        assert b.logits is not None and b.logits.shape == a.logits.shape
        torch.testing.assert_close(b.loss, a.loss)
    ids = x["input_ids"][:1, :6]
    with torch.no_grad():
        full = fused(torch.cat([ids, ids[:, :2] + 1], 1)).logits[:, -2:]
        past = fused(ids, use_cache=True).past_key_values
        step = fused(ids[:, :2] + 1, past_key_values=past).logits
        torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
        assert torch.equal(fused.generate(ids, max_new_tokens=3, do_sample=False),
                           ref.generate(ids, max_new_tokens=3, do_sample=False))
    assert "MLM" not in str(fuse_report(fused))  # a causal LM head is neither patched nor reported as one


# ---- 2. gradient checkpointing goes through the fused layers ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_recomputes_the_fused_layers(use_reentrant, monkeypatch):
    ref = bert("BertForSequenceClassification").train()
    fused = fuse(copy.deepcopy(ref)).train()
    calls = count_calls(monkeypatch, "varlen_attention")
    x, y = inputs(3), torch.tensor([0, 1, 0])
    fused(**x, labels=y).loss.backward()
    plain = len(calls)
    assert plain == TINY["num_hidden_layers"]  # the fused attention ran, once per layer
    fused.zero_grad()
    for model in (fused, ref):  # transformers 5 renamed it; 4 has only the old name
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": use_reentrant})
    calls.clear()
    fused(**x, labels=y).loss.backward()
    assert len(calls) == 2 * plain  # every layer ran again in the backward: recomputed, not stored
    ref(**x, labels=y).loss.backward()
    errs = grad_errors(fused, ref)
    assert max(errs.values()) <= TOL, max(errs, key=errs.get)


def test_forward_hooks_on_fused_layers_fire():
    fused = fuse(bert())
    seen = []
    fused.encoder.layer[1].register_forward_hook(lambda m, a, out: seen.append(out.shape))
    fused(**inputs())
    assert seen and seen[0][-1] == TINY["hidden_size"]
    assert isinstance(fused.encoder.layer[1], transformers.models.bert.modeling_bert.BertLayer)


# ---- 3. the forward signature is the original's: transformers.Trainer keeps token_type_ids ---------------------
@pytest.mark.parametrize("mlm_logits", [True, False])
@pytest.mark.parametrize("cls", ["BertForMaskedLM", "BertForPreTraining"])
def test_signature_is_kept_and_trainer_keeps_token_type_ids(cls, mlm_logits, tmp_path):
    pytest.importorskip("accelerate")
    ref = bert(cls)
    fused = fuse(copy.deepcopy(ref), mlm_logits=mlm_logits)
    assert inspect.signature(fused.forward) == inspect.signature(ref.forward)
    x = inputs()
    rows = [{k: v[i] for k, v in x.items()} | {"unused_column": i} for i in range(3)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, report_to=[],
                                          use_cpu=True, remove_unused_columns=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = next(iter(transformers.Trainer(model=fused, args=args, train_dataset=rows).get_train_dataloader()))
    assert "token_type_ids" in batch and "unused_column" not in batch


# ---- 4. output positions and loss semantics ----------------------------------------------------------------------
@pytest.mark.slow
def test_pretraining_outputs_mean_what_transformers_outputs_mean():
    ref = bert("BertForPreTraining")
    x = inputs()
    labels = torch.where(x["attention_mask"].bool(), x["input_ids"], -100)
    nsp = torch.tensor([0, 1, 0])
    fused = fuse(copy.deepcopy(ref))  # mlm_logits=True: transformers' contract
    a, b = ref(**x, labels=labels, next_sentence_label=nsp), fused(**x, labels=labels, next_sentence_label=nsp)
    assert len(b.to_tuple()) == len(a.to_tuple()) == 3
    assert b[1].shape == a[1].shape == (3, 13, 99)  # prediction_logits, not seq_relationship_logits
    assert rel_err(b.loss, a.loss) <= TOL
    assert ref(**x, labels=labels).loss is None and fused(**x, labels=labels).loss is None
    lean = fuse(copy.deepcopy(ref), mlm_logits=False)
    c = lean(**x, labels=labels, next_sentence_label=nsp)
    assert c.prediction_logits is None and rel_err(c.loss, a.loss) <= TOL
    assert rel_err(c["seq_relationship_logits"], a.seq_relationship_logits) <= TOL
    for positional in (lambda o: o[1], lambda o: o.to_tuple()):
        with pytest.raises(TypeError, match="mlm_logits=False"):
            positional(c)
    assert lean(**x, labels=labels).loss is None  # no MLM-only loss where transformers returns None
    with pytest.raises(ValueError, match="already fused with mlm_logits=False"):
        fuse(lean)


def test_masked_lm_logits_both_ways():
    ref = bert("BertForMaskedLM")
    x = inputs(4)
    labels = torch.where(x["attention_mask"].bool(), x["input_ids"], -100)
    a = ref(**x, labels=labels)
    b = fuse(copy.deepcopy(ref))(**x, labels=labels)
    keep = x["attention_mask"].bool()
    assert rel_err(b.logits[keep], a.logits[keep]) <= TOL and rel_err(b.loss, a.loss) <= TOL
    c = fuse(copy.deepcopy(ref), mlm_logits=False)(**x, labels=labels)
    assert c.logits is None and rel_err(c.loss, a.loss) <= TOL


# ---- 5. torch.export ---------------------------------------------------------------------------------------------
def test_torch_export_of_a_fused_encoder_matches_the_unfused_export():
    ref = bert(num_attention_heads=2)
    fused = fuse(copy.deepcopy(ref))
    x = inputs(5)
    x.pop("token_type_ids")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the original attention while exporting
        program = torch.export.export(fused, (), x)
    targets = {str(n.target) for n in program.graph.nodes}
    assert any("varlen_attention" in t for t in targets), targets
    theirs = torch.export.export(ref, (), x).module()
    for mask in (x["attention_mask"], torch.ones_like(x["attention_mask"])):  # shapes fixed, values free
        keep = mask.bool()
        a = theirs(input_ids=x["input_ids"], attention_mask=mask).last_hidden_state
        b = program.module()(input_ids=x["input_ids"], attention_mask=mask).last_hidden_state
        assert rel_err(b[keep], a[keep]) <= TOL
        assert torch.equal(b[~keep], torch.zeros_like(b[~keep]))  # padding is 0, as in the eager fused model


# ---- 6. float 4-D masks are additive, as transformers reads them ---------------------------------------------------
def test_float_4d_masks_mean_what_they_mean_in_transformers(monkeypatch):
    needs_transformers("5.0", "4-D attention masks in BERT's models")
    ref = bert(num_attention_heads=2)
    fused = fuse(copy.deepcopy(ref))
    x = inputs(6)
    ids, keep = x["input_ids"], x["attention_mask"].bool()
    causal = torch.tril(torch.ones(13, 13, dtype=torch.bool))[None, None] & keep[:, None, None, :]
    zero_one = causal.float()  # 0/1 values: transformers *adds* them to the scores
    additive = torch.zeros(3, 1, 1, 13).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    calls, before = count_calls(monkeypatch, "varlen_attention"), 0
    for mask, fused_attention in ((zero_one, False), (zero_one[:, :, :1].expand(3, 1, 13, 13), False),
                                  (additive, True), (keep[:, None, None, :].expand(3, 1, 13, 13), True)):
        calls.clear()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = ref(input_ids=ids, attention_mask=mask).last_hidden_state
            b = fused(input_ids=ids, attention_mask=mask).last_hidden_state
        assert bool(calls) == fused_attention
        assert (sum(fuse_report(fused)[0].calls.values()) == before + 1) != fused_attention  # listed when it fell back
        before = sum(fuse_report(fused)[0].calls.values())
        rows = keep if fused_attention else torch.ones_like(keep)  # the original code fills padding as it does
        assert rel_err(b[rows], a[rows]) <= TOL
    assert "2 call(s) ran the original attention (an attention mask the fused attention cannot express" \
        in str(fuse_report(fused)[0])


# ---- 7. head_dim 8: the fused attention runs on transformers' tiny test configurations ----------------------------
def test_head_dim_8_runs_the_fused_attention(monkeypatch):
    ref = bert("BertForSequenceClassification")
    fused = fuse(copy.deepcopy(ref))
    assert "attention (varlen, padding removed once)" in fuse_report(fused)[0].fused
    calls = count_calls(monkeypatch, "varlen_attention")
    x, y = inputs(7), torch.tensor([1, 0, 1])
    a, b = ref(**x, labels=y), fused(**x, labels=y)
    assert len(calls) == TINY["num_hidden_layers"]
    assert rel_err(b.logits, a.logits) <= TOL
    a.loss.backward()
    b.loss.backward()
    errs = grad_errors(fused, ref)
    assert max(errs.values()) <= TOL, max(errs, key=errs.get)
    unfuse(fused)
    assert type(fused.bert.encoder.layer[0]) is transformers.models.bert.modeling_bert.BertLayer


def test_unfuse_keeps_parameters_assigned_while_fused():
    """load_state_dict(assign=True) on a fused model puts new Parameter objects on the fused modules; unfuse
    hands them to the original modules instead of bringing back the old values."""
    ref = bert("BertForMaskedLM")
    fused = fuse(copy.deepcopy(ref))
    new = {k: v + 0.5 for k, v in ref.state_dict().items()}
    fused.load_state_dict(new, assign=True)
    unfuse(fused)
    for k, v in fused.state_dict().items():
        assert torch.equal(v, new[k]), k
    loaded = bert("BertForMaskedLM")
    loaded.load_state_dict(new)
    with torch.no_grad():  # every module computes with the loaded values, not only the state_dict holds them
        assert torch.equal(fused(**inputs()).logits, loaded(**inputs()).logits)


# ---- 8. only attention whose math is known is fused: look-alikes, overriding subclasses, swapped functions -------
def _fused_attention(model) -> bool:
    return any("attention (varlen, padding removed once)" in r.fused for r in fuse_report(model))


def _same_outputs(ref, fused):
    x = inputs(seed=2)
    if ref.config.type_vocab_size < 2:  # MRA's and YOSO's: one segment
        del x["token_type_ids"]
    keep = x["attention_mask"].bool()
    with torch.no_grad():
        a, b = ref(**x).last_hidden_state, fused(**x).last_hidden_state
    return rel_err(b[keep], a[keep]) <= TOL


@pytest.mark.parametrize("name", ["Mra", "Nystromformer", "Yoso"])
def test_look_alike_encoders_keep_their_attention_with_one_warning(name):
    """BERT's submodule names around other attention (multi-resolution, Nystrom, LSH): nothing of their
    code is fused; the report and one warning say why; the outputs are the unfused model's."""
    torch.manual_seed(0)
    cfg = getattr(transformers, name + "Config")(**TINY)
    ref = getattr(transformers, name + "Model")(cfg).eval()
    kernels._common._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = fuse(copy.deepcopy(ref))
    ours = [w for w in caught if "fuse:" in str(w.message)]
    assert len(ours) == 1 and "attention stays unfused" in str(ours[0].message)
    (report,) = fuse_report(fused)
    kept = dict(report.kept)
    assert f"{name}SelfAttention is not a class whose math the fused op is known to match" in kept["attention"]
    assert not _fused_attention(fused) and "Linear + GeLU" not in " ".join(report.fused)
    assert _same_outputs(ref, fused)


def test_a_subclass_is_fused_only_if_it_adds_no_code():
    class Quiet(transformers.models.bert.modeling_bert.BertSelfAttention):
        def __init__(self, config, **kw):  # construction only: fused
            super().__init__(config, **kw)

    class Louder(transformers.models.bert.modeling_bert.BertSelfAttention):
        def forward(self, hidden_states, *args, **kwargs):  # changes the math: kept
            out, w = super().forward(hidden_states * 2, *args, **kwargs)
            return out, w

    for cls, fused_expected in ((Quiet, True), (Louder, False)):
        ref = bert()
        for layer in ref.encoder.layer:
            old = layer.attention.self
            new = cls(ref.config)
            new.load_state_dict(old.state_dict())
            layer.attention.self = new.eval()
        fused = fuse(copy.deepcopy(ref))
        assert _fused_attention(fused) == fused_expected, fuse_report(fused)[0]
        assert _same_outputs(ref, fused)
        if not fused_expected:
            assert "Louder overrides forward of BertSelfAttention" in dict(fuse_report(fused)[0].kept)["attention"]


def test_a_forward_replaced_on_an_instance_keeps_attention():
    ref = bert()
    inner = ref.encoder.layer[1].attention.self
    original = inner.forward
    inner.forward = lambda hidden_states, *a, **k: original(hidden_states * 0.5, *a, **k)
    fused = fuse(copy.deepcopy(ref))
    assert not _fused_attention(fused)
    # BertSelfAttention, or (transformers 4) its BertSdpaSelfAttention subclass
    assert re.search(r"Bert(Sdpa)?SelfAttention\.forward is replaced on this instance",
                     dict(fuse_report(fused)[0].kept)["attention"])
    assert _same_outputs(ref, fused)


def test_an_intermediate_block_of_unknown_code_keeps_its_linear_and_gelu():
    class Scaled(transformers.models.bert.modeling_bert.BertIntermediate):
        def forward(self, hidden_states):
            return self.intermediate_act_fn(self.dense(hidden_states) * 3.0)

    ref = bert()
    layer = ref.encoder.layer[0]
    new = Scaled(ref.config)
    new.load_state_dict(layer.intermediate.state_dict())
    layer.intermediate = new
    fused = fuse(copy.deepcopy(ref))
    report = fuse_report(fused)[0]
    assert "1 Linear + GeLU" in report.fused and not _fused_attention(fused)  # layer 1's block fused, not layer 0's
    assert "Linear + GeLU in Scaled" in dict(report.kept)
    assert _same_outputs(ref, fused)


def test_an_attention_function_registered_in_transformers_place_keeps_attention(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    stock = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def doubled(module, q, k, v, mask, **kw):  # a user's attention, registered under transformers' own name
        return stock(module, q * 2, k, v, mask, **kw)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", doubled)
    ref = bert()
    ref.config._attn_implementation = "sdpa"
    fused = fuse(copy.deepcopy(ref))
    assert not _fused_attention(fused)
    assert "registered to" in dict(fuse_report(fused)[0].kept)["attention"]
    assert _same_outputs(ref, fused)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", stock)
    assert _fused_attention(fuse(copy.deepcopy(ref)))  # transformers' own sdpa: fused


def test_encoder_arguments_the_fused_layers_would_drop_run_the_original_code():
    """An argument holding something the original layers read (here a made-up per-layer tensor BertLayer passes
    on to its attention function) is not silently dropped: that call runs the original encoder."""
    needs_transformers("5.0", "keyword arguments passed on through BERT's encoder")
    ref = bert()
    fused = fuse(copy.deepcopy(ref))
    x = inputs()
    hidden = fused.embeddings(input_ids=x["input_ids"], token_type_ids=x["token_type_ids"])
    mask = x["attention_mask"][:, None, None, :].float().sub(1).mul(torch.finfo(torch.float32).max)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused.encoder(hidden, attention_mask=mask, position_ids=None, use_cache=False)
        assert not fuse_report(fused)[0].calls
        fused.encoder(hidden, attention_mask=mask, s_aux=torch.zeros(1))
    assert any("s_aux" in why for why in fuse_report(fused)[0].calls)


def test_an_mlm_head_of_unknown_code_keeps_the_full_logits_loss():
    """fuse(mlm_logits=False) stands in for the task model's and its head's forwards: a head whose class adds
    code of its own keeps them (and computes what the unfused model computes)."""
    class Scaled(transformers.models.bert.modeling_bert.BertLMPredictionHead):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 0.5

    ref = bert("BertForMaskedLM")
    old = ref.cls.predictions
    new = Scaled(ref.config)
    new.load_state_dict(old.state_dict())
    new.decoder.weight = ref.bert.embeddings.word_embeddings.weight
    ref.cls.predictions = new
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    report = fuse_report(fused)[0]
    assert "Scaled overrides forward" in dict(report.kept)["MLM loss (BertForMaskedLM)"]
    x = inputs(seed=3)
    labels = x["input_ids"].masked_fill(x["attention_mask"] == 0, -100)
    a, b = ref(**x, labels=labels), fused(**x, labels=labels)
    assert b.logits is not None and rel_err(b.loss, a.loss) <= TOL

"""bert.hf.fuse across the BERT family: RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA (generator with a projected
embedding, discriminator), DistilBERT (learned and sinusoidal positions), MPNet (relative-position bias), ALBERT
(shared layers, a factorised embedding, SOP pre-training), on small random configurations built
offline, float32 in the interpreter, padded inputs of uneven lengths: outputs, the MLM loss and every parameter
gradient against the unfused model; the kernels really called; unfuse bit-identical; state_dict unchanged;
float16 autocast; families whose attention the kernel cannot express; sentence-transformers; transformers.Trainer."""
import collections
import copy
import inspect
import sys
import warnings

import pytest
import torch

from hf_utils import TOL, assert_grads_no_worse, assert_same_gradients, grad_errors, rel_err

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("bertfuse.kernels")
import bertfuse.kernels._common as kernels_common  # noqa: E402
from bertfuse.bert import hf  # noqa: E402
from bertfuse.bert.hf import PAIR_HEADS, fuse, fuse_report, unfuse  # noqa: E402
from bertfuse.bert.model import ops  # noqa: E402

from bertfuse.bench.hf_parity import FAMILIES as ALL_FAMILIES, SMALL, batch, build  # noqa: E402  (the parity table's models)


class Calls:
    """Records the kernel calls the fused model makes (a silent fallback to PyTorch would make none): each
    call's entry point and its arguments by name. fixed_seeds: a call that takes a seed gets 1000 + its index,
    so that a test can rebuild the dropout mask the kernel drew."""

    def __init__(self, monkeypatch, fixed_seeds=False):
        self.calls = []
        for module, name in ops.TRITON.items():  # each op's entry point of kernels (the model's table)
            original = getattr(kernels, name)

            def recorded(*a, _name=name, _original=original, _signature=inspect.signature(original), **k):
                bound = _signature.bind(*a, **k)
                bound.apply_defaults()
                if fixed_seeds and "seed" in bound.arguments:
                    bound.arguments["seed"] = 1000 + len(self.calls)
                self.calls.append((_name, dict(bound.arguments)))
                return _original(*bound.args, **bound.kwargs)
            # the package's name (bert.model.ops calls it) and the op module's own (its drop-in module calls that)
            monkeypatch.setattr(kernels, name, recorded)
            monkeypatch.setattr(sys.modules[f"bertfuse.kernels.{module}"], name, recorded)

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(name for name, _ in self.calls)

    def of(self, name: str) -> list[dict]:
        """The arguments of every call of entry point `name`, in order."""
        return [arguments for n, arguments in self.calls if n == name]


SLOW = pytest.mark.slow
FAMILIES = [f for f in ALL_FAMILIES if f != "bert"]  # BERT itself: tests/test_hf.py
ROTARY = {"modernbert", "nomicbert", "eurobert", "esm", "roformer"}
GATED = {"modernbert", "nomicbert", "eurobert"}  # gated MLPs
DISENTANGLED = {"deberta-v2", "deberta"}  # DeBERTa's attention: the disentangled kernel, not varlen_attention


@pytest.mark.parametrize("family", FAMILIES)
def test_family_fused_matches_original(family, monkeypatch):
    ref = build(family)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)  # the masked-only loss kernel, called below
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    assert list(fused.state_dict()) == list(before)
    ids, mask, labels = batch(family)
    keep = mask.bool()
    calls = Calls(monkeypatch)
    a = ref(input_ids=ids, attention_mask=mask, labels=labels)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels)
    rotary = ({"rotary"} if family in ROTARY else set()) | ({"glu"} if family in GATED else set())
    dense = hf.family(family.removesuffix("-sinusoidal")).mlm_head.dense
    # ModernBERT's head dense has no bias (GeLU alone); EuroBERT's head is the decoder alone.
    gelu = {"bias_gelu"} if dense and ref.get_submodule(dense).bias is not None else set()
    attention = "disentangled_attention" if family in DISENTANGLED else "varlen_attention"
    assert set(calls.counts) == {"layer_norm", attention, "masked_lm_loss"} | gelu | rotary, calls.counts
    assert b.logits is None and rel_err(b.loss, a.loss) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)
    with torch.no_grad():  # without labels: the original head over the fused encoder, logits formed
        la = ref(input_ids=ids, attention_mask=mask).logits
        lb = fused(input_ids=ids, attention_mask=mask).logits
    assert rel_err(lb[keep], la[keep]) <= TOL
    unfuse(fused)
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids, attention_mask=mask).logits, la)
    assert all(torch.equal(v, before[k]) for k, v in ref.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_under_float16_autocast(family):
    ref = build(family)
    fused = fuse(copy.deepcopy(ref))
    ids, mask, labels = batch(family, seed=5)
    truth = copy.deepcopy(ref)
    want = truth(input_ids=ids, attention_mask=mask, labels=labels).loss
    want.backward()
    if family == "deberta":
        # transformers' DeBERTa (v1) cannot run under autocast: its float32 q_bias makes q float32, and the float32
        # minimum it fills the half-precision scores with overflows. Fused, against the float32 model.
        with torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError, match="overflow"):
            ref(input_ids=ids, attention_mask=mask, labels=labels)
        with torch.autocast("cpu", dtype=torch.float16):
            b = fused(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(b.loss.item() - want.item()) < 1e-2 * abs(want.item())
        b.loss.backward()
        errors = grad_errors(fused, truth)
        assert max(errors.values()) < 1e-2, errors
        return
    with torch.autocast("cpu", dtype=torch.float16):
        a = ref(input_ids=ids, attention_mask=mask, labels=labels)
        b = fused(input_ids=ids, attention_mask=mask, labels=labels)
    assert abs(a.loss.item() - b.loss.item()) < 1e-2 * abs(a.loss.item())
    a.loss.backward()
    b.loss.backward()
    assert_grads_no_worse(fused, ref, truth)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_row_equals_the_row_alone(family):
    """Fused, each row of a padded batch (left-aligned, lengths 17, 9, 2) gets the hidden states it gets alone,
    without padding: relative positions (MPNet) and shared layers (ALBERT) see only the row's own tokens."""
    fused = fuse(build(family, "Model"))
    ids, mask, _ = batch(family)
    with torch.no_grad():
        together = fused(input_ids=ids, attention_mask=mask).last_hidden_state
        for row, n in enumerate(mask.sum(1).tolist()):
            alone = fused(input_ids=ids[row:row + 1, :n], attention_mask=mask[row:row + 1, :n]).last_hidden_state
            assert rel_err(together[row, :n], alone[0]) <= TOL, (row, n)


@pytest.mark.parametrize("family,head", [("roberta", "ForSequenceClassification"),
                                         ("electra", "ForPreTraining"), ("electra", "ForSequenceClassification"),
                                         ("distilbert", "ForSequenceClassification"),
                                         ("xlm-roberta", "ForTokenClassification"),
                                         ("mpnet", "ForSequenceClassification"), ("mpnet", "ForTokenClassification"),
                                         ("mpnet", "ForQuestionAnswering"), ("mpnet", "ForMultipleChoice"),
                                         ("albert", "ForSequenceClassification"), ("albert", "ForTokenClassification"),
                                         ("albert", "ForQuestionAnswering"), ("albert", "ForMultipleChoice"),
                                         ("modernbert", "ForSequenceClassification"),
                                         ("modernbert", "ForTokenClassification"),
                                         ("modernbert", "ForQuestionAnswering"), ("modernbert", "ForMultipleChoice"),
                                         ("nomicbert", "ForSequenceClassification"),
                                         ("nomicbert", "ForTokenClassification"),
                                         ("eurobert", "ForSequenceClassification"),
                                         ("eurobert", "ForTokenClassification"),
                                         ("esm", "ForSequenceClassification"), ("esm", "ForTokenClassification"),
                                         ("roformer", "ForSequenceClassification"),
                                         ("roformer", "ForTokenClassification"), ("roformer", "ForQuestionAnswering"),
                                         ("roformer", "ForMultipleChoice"),
                                         ("deberta-v2", "ForSequenceClassification"),
                                         ("deberta-v2", "ForTokenClassification"),
                                         ("deberta-v2", "ForQuestionAnswering"), ("deberta-v2", "ForMultipleChoice"),
                                         ("deberta", "ForSequenceClassification"),
                                         ("deberta", "ForTokenClassification"), ("deberta", "ForQuestionAnswering")])
@pytest.mark.slow
def test_task_heads_of_the_families(family, head):
    ref = build(family, head)
    fused = fuse(copy.deepcopy(ref))
    ids, mask, _ = batch(family, seed=7)
    if head == "ForMultipleChoice":  # the three rows as three choices of one question
        ids, mask = ids[None], mask[None]
    # QA's softmax spans padded positions too, and RoFormer's multiple-choice summary reads the last position:
    # padding in a shorter row, whose hidden states fused are 0.
    if head == "ForQuestionAnswering" or (family, head) == ("roformer", "ForMultipleChoice"):
        mask = torch.ones_like(mask)
    kw = {"ForSequenceClassification": dict(labels=torch.tensor([0, 1, 0])),
          "ForPreTraining": dict(labels=torch.randint(0, 2, ids.shape)),
          "ForTokenClassification": dict(labels=torch.randint(0, 2, ids.shape).masked_fill(mask == 0, -100)),
          "ForQuestionAnswering": dict(start_positions=torch.tensor([3, 1, 0]), end_positions=torch.tensor([5, 4, 1])),
          "ForMultipleChoice": dict(labels=torch.tensor([2]))}[head]
    a = ref(input_ids=ids, attention_mask=mask, **kw)
    b = fused(input_ids=ids, attention_mask=mask, **kw)
    if head == "ForPreTraining":  # ELECTRA's discriminator: a loss over real tokens only, as HF computes it
        assert rel_err(b.logits[mask.bool()], a.logits[mask.bool()]) <= TOL
    assert rel_err(b.loss, a.loss) <= TOL
    # One bias shared by every choice of the softmax: its gradient is exactly 0, and either side holds rounding noise.
    exempt = ("classifier.bias",) if head == "ForMultipleChoice" else ()
    assert_same_gradients(fused, ref, b.loss, a.loss, exempt)
    assert all(fused.get_parameter(n).grad.abs().max() <= 1e-6 for n in exempt)


def test_report_lists_what_was_fused_and_kept():
    model = fuse(build("electra", "ForMaskedLM"))
    (report,) = fuse_report(model)
    assert report.path == "electra" and report.family == "ElectraModel" and report.layers == "bert"
    text = str(report)
    assert "attention (varlen" in text and "Linear + GeLU" in text and "MLM loss at labelled positions" not in text
    assert [what for what, _ in report.kept] == ["MLM loss (ElectraForMaskedLM)"]  # mlm_logits=True (the default)
    unfuse(model)
    fuse(model, mlm_logits=False)
    assert "MLM loss at labelled positions, no logits" in str(fuse_report(model)[0]) and not fuse_report(model)[0].kept
    unfuse(model)
    assert fuse_report(model) == []


def test_a_custom_subclass_is_matched_by_structure():
    class MyEncoder(transformers.RobertaModel):
        pass

    torch.manual_seed(0)
    ref = MyEncoder(transformers.RobertaConfig(**SMALL, pad_token_id=1)).eval()
    fused = fuse(copy.deepcopy(ref))
    ids, mask, _ = batch("roberta")
    with torch.no_grad():
        a, b = ref(input_ids=ids, attention_mask=mask), fused(input_ids=ids, attention_mask=mask)
    assert rel_err(b.last_hidden_state[mask.bool()], a.last_hidden_state[mask.bool()]) <= TOL
    assert "attention (varlen, padding removed once)" in fuse_report(fused)[0].fused


@pytest.mark.parametrize("name, changes, layers", [("Deberta", {"talking_head": True}, "deberta"),
                                                   ("DebertaV2", {"conv_kernel_size": 3}, "deberta-v2")])
def test_attention_the_kernel_cannot_express_is_kept_with_a_warning(name, changes, layers):
    """A DeBERTa with talking heads (scores mixed across heads) and a DeBERTa-v2 whose encoder runs a
    convolution after its first layer keep their attention; LayerNorm and GeLU still fuse."""
    kernels_common._warned.clear()
    torch.manual_seed(0)
    cfg = getattr(transformers, name + "Config")(**SMALL, **changes)
    ref = getattr(transformers, name + "Model")(cfg).eval()
    with pytest.warns(UserWarning, match="attention stays unfused"):
        fused = fuse(copy.deepcopy(ref))
    (report,) = fuse_report(fused)
    assert report.layers == layers and "attention" in dict(report.kept)
    assert "Linear + GeLU" in str(report) and "LayerNorms" in str(report)
    ids, mask, _ = batch("bert")
    with torch.no_grad():
        a, b = ref(input_ids=ids, attention_mask=mask), fused(input_ids=ids, attention_mask=mask)
    assert rel_err(b.last_hidden_state[mask.bool()], a.last_hidden_state[mask.bool()]) <= TOL


def test_mpnet_with_another_bucket_rule_stays_unfused():
    """An MPNet whose encoder buckets relative positions by another rule keeps its attention, with the reason;
    a mask with holes (where MPNet counts the padded slots) runs the original code for that call."""
    from transformers.models.mpnet import modeling_mpnet

    class OtherRule(modeling_mpnet.MPNetEncoder):
        @staticmethod
        def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
            return relative_position.clamp(0, num_buckets - 1)

    ref = build("mpnet", "Model")
    ref.encoder.__class__ = OtherRule
    with pytest.warns(UserWarning, match="attention stays unfused: OtherRule overrides relative_position_bucket"):
        fuse(copy.deepcopy(ref))
    ref.encoder.__class__ = modeling_mpnet.MPNetEncoder
    fused = fuse(copy.deepcopy(ref))
    ids, mask, _ = batch("mpnet")
    mask[0, 5] = 0  # a hole inside the first row
    with torch.no_grad(), pytest.warns(UserWarning, match="an attention mask with holes"):
        b = fused(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask)
    assert rel_err(b.last_hidden_state, a.last_hidden_state) <= TOL  # its LayerNorms and GeLUs still fused
    assert any("holes" in why for why in fuse_report(fused)[0].calls)


def _sentence_transformer(tmp_path, family):
    st = pytest.importorskip("sentence_transformers")
    from bertfuse.bert.data.tokenizer import train_tokenizer

    tok = train_tokenizer([f"word{i} and word{i + 1} went to town {i}" for i in range(50)], vocab_size=99)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    model = build(family, "Model")
    model.config.pad_token_id = fast.pad_token_id
    model.save_pretrained(tmp_path / family)
    fast.save_pretrained(tmp_path / family)
    with warnings.catch_warnings():  # "no sentence-transformers model found, creating one with mean pooling"
        warnings.simplefilter("ignore")
        return st.SentenceTransformer(str(tmp_path / family), device="cpu")


@pytest.mark.parametrize("family", ["bert", "roberta", "mpnet"])
def test_sentence_transformers_on_bert_roberta_and_mpnet(tmp_path, family):
    model = _sentence_transformer(tmp_path, family)
    sentences = ["word1 and word2", "word3 went to town 4 and word5 and word6 went to town 7", "town"]
    ref = model.encode(sentences, convert_to_tensor=True)
    fuse(model)
    assert "attention (varlen, padding removed once)" in fuse_report(model)[0].fused
    assert rel_err(model.encode(sentences, convert_to_tensor=True), ref) <= TOL
    unfuse(model)
    assert torch.equal(model.encode(sentences, convert_to_tensor=True), ref)


@pytest.mark.slow
def test_one_training_step_through_transformers_trainer(tmp_path):
    """transformers.Trainer trains the fused model as it trains the original: the same losses and weights."""
    pytest.importorskip("accelerate")
    original = build("roberta")
    model = fuse(copy.deepcopy(original))
    ids, mask, labels = batch("roberta")
    rows = [{"input_ids": i, "attention_mask": m, "labels": lab} for i, m, lab in zip(ids, mask, labels)]
    before = model.roberta.encoder.layer[0].attention.self.query.weight.detach().clone()
    results = []
    for m, out in ((model, "fused"), (original, "original")):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / out), max_steps=2,
                                              per_device_train_batch_size=3, learning_rate=1e-2, report_to=[],
                                              use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
                                              seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results.append(transformers.Trainer(model=m, args=args, train_dataset=rows).train())
    assert results[0].training_loss == pytest.approx(results[1].training_loss, rel=1e-5)
    assert not torch.equal(model.roberta.encoder.layer[0].attention.self.query.weight, before)
    theirs = dict(original.named_parameters())
    for name, p in model.named_parameters():
        # 1e-4, a hundredth of one step (lr 1e-2): Adam divides by sqrt(v), so where a gradient is small its
        # rounding (~1e-7 relative, fused or not) moves the weight by more than the rounding itself.
        assert torch.allclose(p, theirs[name], atol=1e-4), name
    assert "MLM loss (RobertaForMaskedLM)" in dict(fuse_report(model)[0].kept)  # mlm_logits=True: logits formed


MLM_CLASSES = [("bert", "ForPreTraining"), ("bert", "ForMaskedLM"), ("roberta", "ForMaskedLM"),
               ("xlm-roberta", "ForMaskedLM"), ("camembert", "ForMaskedLM"), ("electra", "ForMaskedLM"),
               ("distilbert", "ForMaskedLM"), ("mpnet", "ForMaskedLM"), ("albert", "ForMaskedLM"),
               ("albert", "ForPreTraining"), ("modernbert", "ForMaskedLM"), ("nomicbert", "ForMaskedLM"),
               ("eurobert", "ForMaskedLM"), ("esm", "ForMaskedLM"), ("roformer", "ForMaskedLM")]
PAIR_LABELS = tuple(h.label for h in PAIR_HEADS)  # BERT's and ALBERT's pre-training pair heads


def _positional(model, ids, mask, labels):
    """Arguments in the order of the model's own forward, up to the labels (a pre-training pair head's label
    too): ids, mask, token type ids (all zero) where the family has them, None for the rest."""
    pair = torch.tensor([0, 1, 0]) if labels is not None else None
    values = {"input_ids": ids, "attention_mask": mask, "labels": labels, "token_type_ids": torch.zeros_like(ids),
              **dict.fromkeys(PAIR_LABELS, pair)}
    names = [n for n, p in inspect.signature(type(model).forward).parameters.items()
             if n != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    last = next((n for n in PAIR_LABELS if n in names), "labels")
    return [values.get(n) for n in names[:names.index(last) + 1]]


@pytest.mark.slow
@pytest.mark.parametrize("family, head", MLM_CLASSES)
def test_positional_calls_mean_the_same_fused_and_unfused(family, head):
    """The fused forward binds arguments as the model's own does: `model(ids, mask, token_type_ids)` took the third
    as labels when fused (a loss, no logits) and as token_type_ids unfused."""
    ref = build(family, head)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    ids, mask, labels = batch(family)
    three = _positional(ref, ids, mask, None)[:3]
    with torch.no_grad():
        a, b = ref(*three), fused(*three)
    assert a.loss is None and b.loss is None
    logits = "prediction_logits" if head == "ForPreTraining" else "logits"
    assert rel_err(getattr(b, logits)[mask.bool()], getattr(a, logits)[mask.bool()]) <= TOL
    args = _positional(ref, ids, mask, labels)
    a, b = ref(*args), fused(*args)
    assert getattr(b, logits) is None and rel_err(b.loss, a.loss) <= TOL


def test_a_fused_model_pickles_both_ways(tmp_path):
    """torch.save of a fused model used to load into an error ('no attribute _fused_mlm_forward'); now it loads
    fused, computes the same, and unfuses."""
    ref = build("bert", "ForPreTraining")
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)  # the patched forward and the fused layers' classes
    ids, mask, labels = batch("bert")
    labels = dict(labels=labels, next_sentence_label=torch.tensor([0, 1, 0]))
    torch.save(fused, tmp_path / "fused.pt")
    loaded = torch.load(tmp_path / "fused.pt", weights_only=False)
    assert fuse_report(loaded)
    want = fused(input_ids=ids, attention_mask=mask, **labels)
    assert want.prediction_logits is None
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask, **labels).loss, want.loss)
    unfuse(loaded)
    assert "forward" not in loaded.__dict__
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).prediction_logits,
                                   ref(input_ids=ids, attention_mask=mask).prediction_logits)


def _albert(head: str, **changes):
    """bench.hf_parity's small ALBERT with `changes` to its config: 2 passes through one group of 2 shared layers
    unless told otherwise."""
    return build("albert", head, **{"num_hidden_groups": 1, "inner_group_num": 2, **changes})


def test_albert_shared_layers_are_fused_once_and_stay_shared():
    """ALBERT runs its layer groups several times with one set of parameters: each shared layer is fused once,
    the parameters stay the same objects (and shared), every module's hooks fire as often as unfused, and the
    outputs and gradients equal the original's; unfuse gives the classes back."""
    from transformers.models.albert import modeling_albert as ma

    ref = _albert("ForMaskedLM")
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    (report,) = fuse_report(fused)
    assert report.layers == "albert" and not report.kept and "attention (varlen, padding removed once)" in report.fused
    assert list(fused.state_dict()) == list(ref.state_dict())
    assert len(list(fused.parameters())) == len(list(ref.parameters()))  # still shared: no copy per pass
    encoder = fused.albert.encoder
    assert all(type(g) is not ma.AlbertLayerGroup and isinstance(g, ma.AlbertLayerGroup)
               for g in encoder.albert_layer_groups)

    def count(model):
        """{module: forward calls} for the projection, the group, a layer and a layer's Linear."""
        enc = model.albert.encoder
        group = enc.albert_layer_groups[0]
        parts = {"projection": enc.embedding_hidden_mapping_in, "group": group, "layer0": group.albert_layers[0],
                 "ffn1": group.albert_layers[1].ffn}
        seen = {}
        for name, m in parts.items():
            m.register_forward_hook(lambda *_, n=name: seen.__setitem__(n, seen.get(n, 0) + 1))
        return seen

    seen_ref, seen_fused = count(ref), count(fused)
    ids, mask, labels = batch("albert")
    a = ref(input_ids=ids, attention_mask=mask, labels=labels)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels)
    assert seen_fused == seen_ref == {"projection": 1, "group": 2, "layer0": 2, "ffn1": 2}
    assert rel_err(b.loss, a.loss) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)
    unfuse(fused)
    assert all(type(g) is ma.AlbertLayerGroup and all(type(m) is ma.AlbertLayer for m in g.albert_layers)
               for g in encoder.albert_layer_groups)
    with torch.no_grad():
        a, b = ref(input_ids=ids, attention_mask=mask), fused(input_ids=ids, attention_mask=mask)
    assert torch.equal(b.logits, a.logits)


@pytest.mark.slow
def test_albert_group_schedule():
    """num_hidden_layers passes through num_hidden_groups groups, picked by ALBERT's own index rule (6 passes
    over 3 groups: 0 0 1 1 2 2), padded batch, hidden states at real positions."""
    ref = _albert("Model", num_hidden_layers=6, num_hidden_groups=3, inner_group_num=1)
    fused = fuse(copy.deepcopy(ref))
    ids, mask, _ = batch("albert")
    with torch.no_grad():
        a, b = ref(input_ids=ids, attention_mask=mask), fused(input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    assert rel_err(b.last_hidden_state[keep], a.last_hidden_state[keep]) <= TOL
    assert rel_err(b.pooler_output, a.pooler_output) <= TOL


@pytest.mark.slow
def test_albert_pretraining_adds_the_sentence_order_loss():
    """AlbertForPreTraining fused with the masked-only loss: MLM loss + sentence-order loss as transformers
    computes it, its sop_logits, no vocabulary logits; without the sentence-order label transformers' loss is
    None, so the original code runs (logits formed)."""
    ref = _albert("ForPreTraining", inner_group_num=1)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    assert "MLM loss at labelled positions, no logits (AlbertForPreTraining)" in fuse_report(fused)[0].fused
    ids, mask, labels = batch("albert")
    order = torch.tensor([0, 1, 1])
    a = ref(input_ids=ids, attention_mask=mask, labels=labels, sentence_order_label=order)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels, sentence_order_label=order)
    assert b.prediction_logits is None and rel_err(b.loss, a.loss) <= TOL
    assert rel_err(b.sop_logits, a.sop_logits) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)
    with torch.no_grad():
        c = fused(input_ids=ids, attention_mask=mask, labels=labels)
        d = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert c.loss is None and rel_err(c.prediction_logits[mask.bool()], d.prediction_logits[mask.bool()]) <= TOL


@pytest.mark.slow
def test_albert_training_passes_its_dropouts_and_tanh_gelu_to_the_kernels(monkeypatch):
    """In training, each pass's attention kernel drops the probabilities with attention_probs_dropout_prob, the
    attention output's LayerNorm kernel drops dense's output with hidden_dropout_prob (the layer's last LayerNorm
    and the embeddings' drop nothing: ALBERT has no dropout there), and the feed-forward's gelu_new is the tanh
    GeLU kernel. Each call's seed is fixed here, and the keep-mask the kernel draws for it drops p of its
    entries."""
    p_attn, p_hidden = 0.25, 0.125
    model = fuse(_albert("ForMaskedLM", attention_probs_dropout_prob=p_attn, hidden_dropout_prob=p_hidden,
                         hidden_act="gelu_new", inner_group_num=1)).train()
    calls = Calls(monkeypatch, fixed_seeds=True)
    ids, mask, labels = batch("albert")
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    attn, norms, gelus = (calls.of(op) for op in ("varlen_attention", "layer_norm", "bias_gelu"))
    passes = 2  # through the one shared layer
    assert len(attn) == passes and all(a["dropout_p"] == p_attn for a in attn)
    # the attention outputs' LayerNorms drop; the layers' last ones, the embeddings' and the MLM head's do not
    assert sorted(a["dropout_p"] for a in norms) == [0.0] * (passes + 2) + [p_hidden] * passes
    assert len(gelus) == passes + 1 and all(a["approximate"] == "tanh" for a in gelus)  # + the MLM head's
    a, n = attn[0], next(a for a in norms if a["dropout_p"])
    kept_attn = sys.modules["bertfuse.kernels.attention"].attention_dropout_mask(a["cu_seqlens"], a["q"].shape[1],
                                                                        a["max_seqlen"], p_attn, a["seed"])
    kept_norm = sys.modules["bertfuse.kernels.layer_norm"].dropout_mask(n["seed"], *n["x"].shape, p_hidden, n["x"].device)
    for kept, p in ((kept_attn, p_attn), (kept_norm, p_hidden)):
        rate, count = 1 - kept.float().mean().item(), kept.numel()
        assert abs(rate - p) < 5 * (p * (1 - p) / count) ** 0.5, (rate, p, count)


def test_albert_with_a_group_of_unknown_code_keeps_its_attention():
    """The layer groups stand between the encoder and its shared layers: one whose class overrides forward (here
    running its layers twice) keeps the attention unfused, with the reason, and computes what it computes."""
    from transformers.models.albert import modeling_albert as ma

    class Twice(ma.AlbertLayerGroup):
        def forward(self, hidden_states, attention_mask=None, **kwargs):
            return super().forward(super().forward(hidden_states, attention_mask, **kwargs), attention_mask, **kwargs)

    ref = _albert("Model", num_hidden_groups=1, inner_group_num=1)
    ref.encoder.albert_layer_groups[0].__class__ = Twice
    with pytest.warns(UserWarning, match="attention stays unfused: Twice overrides forward of AlbertLayerGroup"):
        fused = fuse(copy.deepcopy(ref))
    assert fuse_report(fused)[0].kept[0][0] == "attention"
    ids, mask, _ = batch("albert")
    with torch.no_grad():
        a, b = ref(input_ids=ids, attention_mask=mask), fused(input_ids=ids, attention_mask=mask)
    assert rel_err(b.last_hidden_state, a.last_hidden_state) <= TOL


# ---- ModernBERT: rotary embeddings, local windows, gated MLPs, pre-norm layers ----------------------------
def _modernbert(head="ForMaskedLM", **changes):
    return build("modernbert", head, **changes)


def test_modernbert_each_layer_type_reaches_the_kernels_with_its_rotation_and_window(monkeypatch):
    """Two layers, global then local (local_attention 8: 4 positions each side): the kernels get each layer
    type's inv_freq (the global base 160,000, the local 10,000), the local window, the attention and MLP
    dropouts in training; the fused loss and every gradient equal the original's, dropout off."""
    ref = _modernbert()
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    report = str(fuse_report(fused)[0])
    assert "RoPE by each token's position id" in report and "local windows" in report and "gated MLP" in report
    emb = ref.model.rotary_emb
    assert not torch.equal(emb.full_attention_inv_freq, emb.sliding_attention_inv_freq)
    ids, mask, labels = batch("modernbert")
    calls = Calls(monkeypatch)
    a, b = ref(input_ids=ids, attention_mask=mask, labels=labels), fused(input_ids=ids, attention_mask=mask,
                                                                         labels=labels)
    assert [c["window_size"] for c in calls.of("varlen_attention")] == [(-1, -1), (4, 4)]
    freqs = [c["rot"].inv_freq for c in calls.of("rotary")]  # q and k of each layer
    assert all(torch.equal(f, emb.full_attention_inv_freq) for f in freqs[:2])
    assert all(torch.equal(f, emb.sliding_attention_inv_freq) for f in freqs[2:])
    assert [c["activation"] for c in calls.of("glu")] == ["gelu", "gelu"]
    assert [c["return_sum"] for c in calls.of("layer_norm")].count(True) == 2  # each layer's add + mlp_norm
    assert rel_err(b.loss, a.loss) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)
    fused.train()
    fused.config.attention_dropout = 0.0
    for layer in fused.model.layers:
        layer.attn.attention_dropout = 0.25
    calls.calls.clear()
    fused(input_ids=ids, attention_mask=mask, labels=labels)
    assert [c["dropout_p"] for c in calls.of("varlen_attention")] == [0.25, 0.25]


@pytest.mark.parametrize("sparse", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_modernbert_masked_lm_sparse_prediction_and_position_ids(sparse):
    """ModernBERT's sparse_prediction (the head on labelled tokens only) means the same loss either way; position
    ids given by the caller (shifted) and left padding rotate q and k as the original code does: hidden states
    equal at every real token. A mask with holes, whose padded slots the original sliding windows count, runs
    the original code (counted in fuse_report)."""
    ref = _modernbert(sparse_prediction=sparse)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    ids, mask, labels = batch("modernbert")
    a, b = ref(input_ids=ids, attention_mask=mask, labels=labels), fused(input_ids=ids, attention_mask=mask,
                                                                         labels=labels)
    assert rel_err(b.loss, a.loss) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)
    left = mask.flip(1)
    positions = torch.arange(17)[None].expand(3, 17) + 5
    holes = mask.clone()
    holes[1, [0, 3]] = 0
    with torch.no_grad():
        for kw in (dict(attention_mask=left), dict(attention_mask=mask, position_ids=positions),
                   dict(attention_mask=holes)):
            want = ref.model(input_ids=ids, **kw).last_hidden_state
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the holes' warning (once per process)
                got = fused.model(input_ids=ids, **kw).last_hidden_state
            keep = kw["attention_mask"].bool()
            assert rel_err(got[keep], want[keep]) <= TOL
    (why, n), = fuse_report(fused)[0].calls.items()  # the holes' call alone ran the original code
    assert n == 1 and "holes" in why and "sliding windows" in why


def test_modernbert_sparse_prediction_with_another_ignore_index_keeps_transformers_loss():
    """Sparse prediction dropping the rows labelled 0 (not -100) means a loss the masked-only kernel does not
    compute: that head keeps transformers' code, with the reason; the encoder stays fused."""
    ref = _modernbert(sparse_prediction=True, sparse_pred_ignore_index=0)
    with pytest.warns(UserWarning, match="sparse_prediction drops the rows labelled 0"):
        fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    ids, mask, labels = batch("modernbert")
    labels = labels.masked_fill(labels == -100, 0)
    a, b = ref(input_ids=ids, attention_mask=mask, labels=labels), fused(input_ids=ids, attention_mask=mask,
                                                                         labels=labels)
    assert b.logits is not None and rel_err(b.loss, a.loss) <= TOL


def test_modernbert_with_a_dynamic_rope_keeps_its_attention():
    """A rope type whose frequencies change with the length (dynamic) is not what the kernels rotate by: that
    model's attention stays unfused, with the reason in fuse_report."""
    ref = _modernbert("Model")
    ref.rotary_emb.rope_type["full_attention"] = "dynamic"
    with pytest.warns(UserWarning, match="rope type 'dynamic'"):
        fused = fuse(ref)
    (report,) = fuse_report(fused)
    assert any(what == "attention" and "rope type 'dynamic'" in why for what, why in report.kept)
    assert "RoPE" not in str(report.fused)


def test_eurobert_grouped_heads_rmsnorm_and_swiglu_reach_the_kernels(monkeypatch):
    """EuroBERT (two k/v heads for four query heads, SiLU, RMSNorm pre-norm): k and v reach the attention kernel
    with their two heads, never repeated; every RMSNorm runs the kernel (the add before post_attention_layernorm
    in it); the gate is SwiGLU; the loss and every gradient equal the original's."""
    ref = build("eurobert")
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    assert "5 RMSNorms" in str(fuse_report(fused)[0])
    ids, mask, labels = batch("eurobert")
    calls = Calls(monkeypatch)
    a, b = ref(input_ids=ids, attention_mask=mask, labels=labels), fused(input_ids=ids, attention_mask=mask,
                                                                         labels=labels)
    heads = [(c["q"].shape[1], c["k"].shape[1], c["v"].shape[1]) for c in calls.of("varlen_attention")]
    assert heads == [(4, 2, 2), (4, 2, 2)]
    norms = calls.of("layer_norm")
    assert len(norms) == 5 and all(c["rms"] for c in norms) and [c["return_sum"] for c in norms].count(True) == 2
    assert [c["activation"] for c in calls.of("glu")] == ["silu", "silu"]
    assert rel_err(b.loss, a.loss) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)


@pytest.mark.parametrize("changes", [
    {},                                                           # v3: shared projections, 8 log buckets
    pytest.param(dict(legacy=True), marks=SLOW),                  # the BERT-style MLM head (cls.predictions)
    dict(share_att_key=False),                                    # v2: pos_key_proj and pos_query_proj
    pytest.param(dict(position_buckets=-1, max_relative_positions=6), marks=SLOW),  # plain distances, clamped
    pytest.param(dict(pos_att_type=["c2p"], norm_rel_ebd="none"), marks=SLOW),  # one term, no LayerNorm
    pytest.param(dict(relative_attention=False, norm_rel_ebd="none"), marks=SLOW),  # no position terms at all
    pytest.param(dict(position_biased_input=True, type_vocab_size=2), marks=SLOW)])  # v2's absolute positions too
def test_deberta_v2_configurations_fused_equal_the_original(changes, monkeypatch):
    """DeBERTa-v2/v3 configurations: every layer's attention runs the disentangled kernel with the tables its
    code would form (c2p through the key projection, p2c through the query's), and the loss and every
    gradient, the relative embeddings' and their LayerNorm's included, equal the original's."""
    run_deberta("deberta-v2", changes, monkeypatch)


def run_deberta(family, changes, monkeypatch):
    """A DeBERTa masked-LM model of `family` with `changes`, unfused and fused on the same batch: both layers'
    attention in the disentangled kernel with the tables its config names, the loss in the masked-only kernel,
    the loss and every gradient equal, the relative embeddings' one nonzero where there are position terms.
    (ref, fused, the kernel calls)."""
    ref = build(family, **changes)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    ids, mask, labels = batch(family)
    calls = Calls(monkeypatch)
    a = ref(input_ids=ids, attention_mask=mask, labels=labels)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels)
    attention = calls.of("disentangled_attention")
    assert len(attention) == 2 and not calls.of("varlen_attention") and len(calls.of("masked_lm_loss")) == 1
    cfg, got = ref.config, attention[0]["positions"]
    terms = [t for t in ("c2p", "p2c") if cfg.relative_attention and t in cfg.pos_att_type]
    assert (got.pos_key is not None, got.pos_query is not None) == ("c2p" in terms, "p2c" in terms)
    assert rel_err(b.loss, a.loss) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)
    if terms:
        assert fused.deberta.encoder.rel_embeddings.weight.grad.abs().max() > 0
    return ref, fused, calls


@pytest.mark.parametrize("family", ["deberta-v2", pytest.param("deberta", marks=SLOW)])
def test_deberta_dropouts_reach_the_kernels_and_hidden_states_run_the_original(family, monkeypatch):
    """In training the attention dropout goes into the kernel, pos_dropout (a module, its hooks firing) onto the
    relative embeddings each layer reads; a call asking for hidden states runs the original encoder code."""
    ref = build(family, "Model", attention_probs_dropout_prob=0.25, hidden_dropout_prob=0.125)
    fused = fuse(copy.deepcopy(ref)).train()
    ids, mask, _ = batch(family)
    seen = []
    fused.encoder.layer[1].attention.self.pos_dropout.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    calls = Calls(monkeypatch)
    fused(input_ids=ids, attention_mask=mask)
    assert [c["dropout_p"] for c in calls.of("disentangled_attention")] == [0.25, 0.25]
    assert seen == [fused.encoder.rel_embeddings.weight.shape]
    fused.eval()
    calls.calls.clear()
    with torch.no_grad():
        out = fused(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        want = ref.eval()(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert not calls.of("disentangled_attention") and len(out.hidden_states) == 3
    assert all(rel_err(x[mask.bool()], y[mask.bool()]) <= TOL for x, y in zip(out.hidden_states, want.hidden_states))
    assert "output_hidden_states" in str(fuse_report(fused)[0])


@pytest.mark.parametrize("family", ["deberta-v2", "deberta"])
def test_deberta_mask_holes_and_refused_bucket_rules_run_the_original_code(family, monkeypatch):
    """DeBERTa (both versions) counts the padded slots inside a row in its relative distances: a mask with holes
    runs the original code for that call (counted), as for MPNet. A bucket rule the kernels refuse keeps the
    attention unfused, with the kernels' reason."""
    kernels_common._warned.clear()  # MPNet's test may have given the same warning, once per process
    ref = build(family, "Model")
    fused = fuse(copy.deepcopy(ref))
    ids, mask, _ = batch(family)
    mask[0, 5] = 0  # a hole inside the first row
    calls = Calls(monkeypatch)
    with torch.no_grad(), pytest.warns(UserWarning, match="an attention mask with holes"):
        b = fused(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    assert not calls.of("disentangled_attention")
    assert rel_err(b.last_hidden_state[keep], a.last_hidden_state[keep]) <= TOL
    assert any("holes" in why and "relative positions" in why for why in fuse_report(fused)[0].calls)
    if family == "deberta-v2":
        narrow = build("deberta-v2", "Model", position_buckets=8, max_relative_positions=5)
        with pytest.warns(UserWarning, match="attention stays unfused: .*position_buckets=8 needs"):
            fuse(narrow)


@pytest.mark.parametrize("changes", [
    {},                                                          # c2p and p2c over 12 plain distances
    pytest.param(dict(legacy=True), marks=SLOW),                 # the BERT-style MLM head (cls.predictions)
    pytest.param(dict(pos_att_type=["p2c"]), marks=SLOW),        # one term
    pytest.param(dict(pos_att_type=["c2p", "p2c", "p2p"]), marks=SLOW),  # a name it does not compute, in the scale
    pytest.param(dict(max_relative_positions=-1), marks=SLOW),   # the span of max_position_embeddings
    pytest.param(dict(relative_attention=False, pos_att_type=None), marks=SLOW),  # no position terms at all
    pytest.param(dict(position_biased_input=True, type_vocab_size=2), marks=SLOW)])  # absolute positions, segments
def test_deberta_v1_configurations_fused_equal_the_original(changes, monkeypatch):
    """DeBERTa (v1): q, k, v from its one in_proj plus q_bias and v_bias, the tables through pos_proj and
    pos_q_proj, plain clamped distances, into the disentangled kernel; every DebertaLayerNorm a LayerNorm kernel
    (the output blocks' with their dropout and residual); the loss and every gradient, q_bias, v_bias and the
    relative embeddings' included, equal the original's."""
    ref, fused, calls = run_deberta("deberta", changes, monkeypatch)
    attention = calls.of("disentangled_attention")[0]
    assert attention["positions"].position_buckets == -1
    cfg = ref.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    root = torch.sqrt(torch.tensor(head_dim * (1.0 + len(ref.deberta.encoder.layer[0].attention.self.pos_att_type))))
    assert attention["softmax_scale"] == pytest.approx(1 / float(root))
    with_residual = [c for c in calls.of("layer_norm") if c["residual"] is not None]
    assert len(with_residual) == 4  # two DebertaLayerNorms per layer, each with its block's add
    layer = fused.deberta.encoder.layer[0].attention.self
    assert layer.q_bias.grad.abs().max() > 0 and layer.v_bias.grad.abs().max() > 0


def test_nomicbert_post_norm_dropouts_and_token_types_reach_the_kernels(monkeypatch):
    """NomicBERT (post-norm, base 1,000, no biases): in training each layer's two dropouts go into their
    LayerNorm kernels and the attention dropout into the attention kernel; with dropout off, token type ids
    given by the caller, the loss and every gradient equal the original's."""
    ref = build("nomicbert", hidden_dropout_prob=0.0)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    ids, mask, labels = batch("nomicbert")
    types = (torch.arange(ids.shape[1]) >= 5).long().expand_as(ids)
    calls = Calls(monkeypatch)
    a = ref(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    b = fused(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    freqs = [c["rot"].inv_freq for c in calls.of("rotary")]
    assert len(freqs) == 4 and all(torch.equal(f, ref.nomic_bert.rotary_emb.inv_freq) for f in freqs)
    assert rel_err(b.loss, a.loss) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)
    fused.train()
    for layer in fused.nomic_bert.layers:
        layer.self_attn.attention_dropout = 0.25
        layer.post_attention_dropout.p = layer.post_mlp_dropout.p = 0.125
    calls.calls.clear()
    fused(input_ids=ids, attention_mask=mask, labels=labels)
    assert [c["dropout_p"] for c in calls.of("varlen_attention")] == [0.25, 0.25]
    assert [c["dropout_p"] for c in calls.of("layer_norm") if c["residual"] is not None] == [0.125] * 4


@pytest.mark.parametrize("family", ["modernbert", *(pytest.param(f, marks=pytest.mark.slow)
                                                     for f in ("eurobert", "roberta"))])
def test_num_items_in_batch_means_what_it_means_unfused(family):
    """transformers.Trainer passes num_items_in_batch (its count of labelled tokens): heads computing their loss
    by transformers' loss_function (ModernBERT's, EuroBERT's) divide the sum by it, the others ignore it; fused,
    the masked-only loss does the same, and the encoder still runs fused."""
    ref = build(family)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    ids, mask, labels = batch(family)
    items = torch.tensor(40)
    a = ref(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
    assert rel_err(b.loss, a.loss) <= TOL
    assert fuse_report(fused)[0].calls == {}


@pytest.mark.parametrize("positions", ["rotary-ids", *(pytest.param(p, marks=pytest.mark.slow)
                                                        for p in ("rotary", "absolute"))])
def test_esm_reads_the_cos_and_sin_its_model_forms(positions, monkeypatch):
    """ESM's encoder is handed the cos and sin its model forms (from position ids, which a caller may give per
    row: then one table row per token): the kernel reads them; with absolute positions there is no rotation.
    The loss and every gradient equal the original's, and its LM head's own bias is in the masked-only loss."""
    kind = "absolute" if positions == "absolute" else "rotary"
    ref = build("esm", position_embedding_type=kind)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    with torch.no_grad():
        ref.lm_head.bias.normal_()
        fused.lm_head.bias.copy_(ref.lm_head.bias)
    ids, mask, labels = batch("esm")
    kw = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if positions == "rotary-ids":  # every row shifted by its own offset
        kw["position_ids"] = torch.arange(ids.shape[1])[None] + torch.tensor([[2], [0], [5]])
    calls = Calls(monkeypatch)
    a, b = ref(**kw), fused(**kw)
    rotations = calls.of("rotary")
    assert len(rotations) == (0 if kind == "absolute" else 4) and calls.of("varlen_attention")
    assert all(c["rot"].cos is not None and c["rot"].inv_freq is None for c in rotations)
    assert fuse_report(fused)[0].calls == {}
    assert rel_err(b.loss, a.loss) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)


@pytest.mark.parametrize("rotary_value", [pytest.param(False, marks=pytest.mark.slow), True])
def test_roformer_rotates_from_its_table_with_left_padding(rotary_value, monkeypatch):
    """RoFormer's positions are each token's place in its padded row (left padding counts), its table's sin and
    cos read as they are; rotary_value turns v as well. Hidden states at real tokens, the loss and every
    gradient equal the original's."""
    ref = build("roformer", rotary_value=rotary_value)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    ids, mask, labels = batch("roformer")
    ids, mask, labels = ids.flip(1), mask.flip(1), labels.flip(1)  # left padding
    calls = Calls(monkeypatch)
    a = ref(input_ids=ids, attention_mask=mask, labels=labels)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels)
    table = ref.roformer.encoder.embed_positions.weight
    rotations = calls.of("rotary")
    assert len(rotations) == (6 if rotary_value else 4)
    assert all(c["rot"].interleaved and torch.equal(c["rot"].sin, table[:, :table.shape[1] // 2]) for c in rotations)
    assert rel_err(b.loss, a.loss) <= TOL
    assert_same_gradients(fused, ref, b.loss, a.loss)
    with torch.no_grad():
        h_ref = ref.roformer(input_ids=ids, attention_mask=mask).last_hidden_state
        h = fused.roformer(input_ids=ids, attention_mask=mask).last_hidden_state
    assert rel_err(h[mask.bool()], h_ref[mask.bool()]) <= TOL

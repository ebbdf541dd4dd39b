"""bert.hf.fuse on every family it knows (bertfuse.bert.hf.families): RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA
(generator with a projected embedding, discriminator), DistilBERT (learned and sinusoidal positions), MPNet,
ALBERT, ModernBERT, NomicBERT, EuroBERT, ESM, RoFormer, DeBERTa-v2 and DeBERTa, on small random configurations
built offline, float32 in the interpreter, padded inputs of uneven lengths: outputs, the MLM loss and every
parameter gradient against the unfused model; the kernels really called; unfuse bit-identical; state_dict
unchanged; float16 autocast; task heads; sentence-transformers; transformers.Trainer; positional calls; pickling.
What only one family group has is tested in its own file (tests/test_hf_albert.py, test_hf_rotary.py,
test_hf_esm_roformer.py, test_hf_deberta.py, test_hf_mpnet.py; BERT itself in test_hf.py)."""
import copy
import inspect
import warnings

import pytest
import torch

from hf_utils import (TOL, Calls, assert_grads_no_worse, assert_same_gradients, grad_errors, needs_transformers,
                      rel_err)

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.bert import hf  # noqa: E402
from bertfuse.bert.hf import PAIR_HEADS, fuse, fuse_report, unfuse  # noqa: E402

from bertfuse.bench.hf_parity import FAMILIES as ALL_FAMILIES, SMALL, batch, build  # noqa: E402  (the parity table's models)

SLOW = pytest.mark.slow

FAMILIES = [f for f in ALL_FAMILIES if f != "bert"]  # BERT itself: tests/test_hf.py

ROTARY = {"modernbert", "nomicbert", "eurobert", "esm", "roformer"}

GATED = {"modernbert", "nomicbert", "eurobert"}  # gated MLPs

DISENTANGLED = {"deberta-v2", "deberta"}  # DeBERTa's attention: the disentangled kernel, not varlen_attention


@pytest.mark.parametrize("family", FAMILIES)
def test_family_fused_matches_original(family, monkeypatch):
    if family in DISENTANGLED:
        needs_transformers("5.0", "DeBERTa's masked-LM model with the enhanced mask decoder (legacy=False) that runs")
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
    # padding in a shorter row, computed there (DeBERTa's QA over padding runs its original code).
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


def _sentence_transformer(tmp_path, family):
    st = pytest.importorskip("sentence_transformers")
    from bertfuse.bert.data.tokenizer import train_tokenizer

    tok = train_tokenizer([f"word{i} and word{i + 1} went to town {i}" for i in range(50)], vocab_size=99)
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if hf.family(family).segments else \
        ["input_ids", "attention_mask"]  # as DistilBERT's own tokenizers: no token types
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                                model_input_names=inputs)
    model = build(family, "Model")
    model.config.pad_token_id = fast.pad_token_id
    model.save_pretrained(tmp_path / family)
    fast.save_pretrained(tmp_path / family)
    with warnings.catch_warnings():  # "no sentence-transformers model found, creating one with mean pooling"
        warnings.simplefilter("ignore")
        return st.SentenceTransformer(str(tmp_path / family), device="cpu")


@pytest.mark.parametrize("family", ["bert", "roberta", "mpnet", "distilbert"])
def test_sentence_transformers_on_bert_roberta_mpnet_and_distilbert(tmp_path, family):
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

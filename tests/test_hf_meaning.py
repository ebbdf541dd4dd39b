"""bert.hf.fuse never changes meaning, for configurations and inputs a user can build that sit at the edges: a mask
means what the chosen attention implementation makes of it (eager adds a boolean 4-D mask, sdpa keeps it, flex
hands a BlockMask); a 4-D mask is every layer's mask, ModernBERT's sliding layers included; rotations that are not
the whole head; heads that read padded positions; float64 models on the Triton path; the masked-only loss with
no labelled token; configurations transformers 5 no longer reads. Each case: fused against unfused on small
random models, float32, in Triton's interpreter on CPU (the real kernels), and where the fused code cannot
compute it exactly, the original code with the reason in fuse_report."""
import copy
import warnings

import pytest
import torch

from hf_utils import TOL, assert_same_gradients, flattened, rel_err

transformers = pytest.importorskip("transformers")
from bertfuse.bench.hf_parity import batch, build  # noqa: E402
from bertfuse.bert import hf  # noqa: E402
from bertfuse.bert.hf import fuse, fuse_report  # noqa: E402

LENGTHS = (6, 3)


def pair(family, head="Model", impl=None, fuse_args=None, **changes):
    """(unfused, fused) copies of one small random model, its attention implementation set to `impl`."""
    ref = build(family, head, **changes)
    if impl:
        ref.set_attn_implementation(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ref, fuse(copy.deepcopy(ref), **(fuse_args or {}))


def ids_keys(lengths=LENGTHS, seqlen=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]
    return torch.randint(5, 99, (len(lengths), seqlen), generator=g), keys


def calls(model) -> dict:
    return dict(fuse_report(model)[0].calls)


def same_at_real(ref, fused, ids, keys, **kwargs):
    a, b = ref(ids, **kwargs)[0], fused(ids, **kwargs)[0]
    assert rel_err(b[keys], a[keys]) <= TOL


# ---- a 3-D/4-D mask means what the implementation reading it makes of it -------------------------------------
MASK_FAMILIES = ["bert", "distilbert", "albert", "mpnet", "modernbert", "eurobert"]


@pytest.mark.parametrize("family", MASK_FAMILIES)
def test_eager_attention_adds_a_boolean_4d_mask_to_the_scores(family):
    """Eager attention adds a 4-D mask as it is: a boolean one adds 1 to kept keys and masks nothing, which the
    fused attention cannot express (keys of a row differ) and so the original code computes."""
    ref, fused = pair(family, impl="eager")
    ids, keys = ids_keys()
    mask = keys[:, None, None, :].expand(2, 1, 6, 6)
    same_at_real(ref, fused, ids, keys, attention_mask=mask)
    assert any("cannot express" in why for why in calls(fused))


@pytest.mark.parametrize("family", [f for f in MASK_FAMILIES if f != "mpnet"])  # MPNet's own code adds any mask
def test_sdpa_reads_a_boolean_4d_mask_as_kept_keys_and_runs_fused(family):
    ref, fused = pair(family, impl="sdpa")
    ids, keys = ids_keys()
    same_at_real(ref, fused, ids, keys, attention_mask=keys[:, None, None, :].expand(2, 1, 6, 6))
    assert calls(fused) == {}


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_a_boolean_4d_mask_alike_along_each_row_adds_a_constant_and_runs_fused(family):
    """Every key of a row kept (True everywhere): eager adds 1 to every score of the row, which the softmax
    cancels: the padding-free answer, fused."""
    ref, fused = pair(family, impl="eager")
    ids, keys = ids_keys(lengths=(6, 6))
    same_at_real(ref, fused, ids, keys, attention_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool))
    assert calls(fused) == {}


def test_a_3d_mask_to_a_model_fused_whole_raises_as_transformers_does():
    ref, fused = pair("modernbert")
    ids, keys = ids_keys()
    mask = keys[:, None, :].expand(2, 6, 6)
    for model in (ref, fused):
        with pytest.raises(Exception):
            model(ids, attention_mask=mask)


def test_deberta_reads_any_mask_as_nonzero_kept():
    """DeBERTa's code reads a mask as mask.bool(): an integer 4-D mask of 0 and 1 is a key mask there."""
    ref, fused = pair("deberta-v2", impl="eager")
    ids, keys = ids_keys()
    same_at_real(ref, fused, ids, keys, attention_mask=keys.long()[:, None, None, :])
    assert calls(fused) == {}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_4d_mask_is_every_layers_mask_in_modernbert_local_layers_too(impl):
    """Given a 4-D mask, transformers builds no sliding-window mask: local layers see the whole sequence, and
    the fused layers then run without windows."""
    ref, fused = pair("modernbert", impl=impl, local_attention=4)
    ids, keys = ids_keys(lengths=(12, 7), seqlen=12)
    blocked = torch.finfo(torch.float32).min
    mask = torch.where(keys, 0.0, blocked)[:, None, None, :]
    same_at_real(ref, fused, ids, keys, attention_mask=mask)
    assert calls(fused) == {}
    same_at_real(ref, fused, ids, keys, attention_mask=keys.long())  # a 2-D mask: the windows apply
    assert calls(fused) == {}


FLEX = ["bert", "distilbert", "albert", "esm"]


def _packed_row(family, lengths=(5, 1, 4)):
    """One padding-free row (transformers' DataCollatorWithFlattening) of MLM features of these lengths."""
    row = flattened(lengths, seed=1)
    if family == "distilbert":  # its model takes no position ids
        row.pop("position_ids")
    return row


def _flex_pair(family, head="Model", **changes):
    ref, fused = pair(family, head, impl="flex_attention", **changes)
    if ref.config._attn_implementation != "flex_attention":
        pytest.skip(f"{family}'s model takes no flex attention on transformers {transformers.__version__}")
    return ref, fused


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "padding-free"])
@pytest.mark.parametrize("family", FLEX)
def test_flex_attention_block_masks_run_fused(family, packed):
    """flex's BlockMask read as flex computes it (its blocks and its mask_mod at every position): padding, and
    the packed sequences transformers builds it from, run fused. Loss and logits only: flex has no backward on
    this CPU."""
    ref, fused = _flex_pair(family, "ForMaskedLM")
    if packed:
        x = _packed_row(family)
        real = torch.ones_like(x["input_ids"], dtype=torch.bool)
    else:
        ids, real = ids_keys()
        x = dict(input_ids=ids, attention_mask=real.long(), labels=torch.where(real, ids, -100))
    with torch.no_grad():
        a, b = ref(**x), fused(**x)
    assert rel_err(b.loss, a.loss) <= TOL and rel_err(b.logits[real], a.logits[real]) <= TOL
    assert calls(fused) == {}


def test_flex_attention_refuses_attention_dropout_in_training_and_so_does_the_fused_model():
    ref, fused = _flex_pair("bert", attention_probs_dropout_prob=0.1)
    ids, keys = ids_keys()
    for model in (ref.train(), fused.train()):
        with torch.no_grad(), pytest.raises(ValueError, match="dropout"):
            model(ids, attention_mask=keys.long())
    assert any("flex attention refuses" in why for why in calls(fused))


def test_a_block_mask_means_its_blocks_and_its_mask_mod():
    """Full blocks attend everywhere, partial ones where mask_mod says, absent ones nowhere; a causal mask_mod is
    no key mask, and runs the original code."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    from bertfuse.bert.masks import block_mask_allowed, packed_rows

    def causal(b, h, q, k):
        return q >= k

    seqlen, block = 8, 4
    made = fa.create_block_mask(causal, 1, 1, seqlen, seqlen, device="cpu", BLOCK_SIZE=block)
    allowed, why = block_mask_allowed(made, 1, seqlen, "cpu")
    assert why is None and torch.equal(allowed[0, 0], torch.ones(seqlen, seqlen).tril().bool())
    # Blocks (0, 0) full, (1, 1) partial (causal inside), (1, 0) absent though the mask_mod allows it.
    hand = fa.BlockMask.from_kv_blocks(torch.tensor([[[0, 1]]]), torch.tensor([[[[0, 0], [1, 0]]]]),
                                       torch.tensor([[[1, 0]]]), torch.tensor([[[[0, 0], [0, 0]]]]), BLOCK_SIZE=block,
                                       mask_mod=causal, seq_lengths=(seqlen, seqlen))
    allowed, why = block_mask_allowed(hand, 1, seqlen, "cpu")
    want = torch.zeros(seqlen, seqlen, dtype=torch.bool)
    want[:4, :4] = True
    want[4:, 4:] = torch.ones(4, 4).tril().bool()
    assert why is None and torch.equal(allowed[0, 0], want)
    cfg = transformers.BertConfig(attn_implementation="flex_attention")
    assert packed_rows(cfg, made, {}, None, 1, seqlen, "cpu").keys is None
    assert "lengths" in block_mask_allowed(made, 1, seqlen + 1, "cpu")[1]


# ---- rotations that are not the whole head ----------------------------------------------------------------
ROTARY = ["modernbert", "nomicbert", "eurobert", "esm"]


def _heads(family, hidden, heads):
    return dict(hidden_size=hidden, num_attention_heads=heads, intermediate_size=24,
                **({"num_key_value_heads": heads} if family == "eurobert" else {}))


@pytest.mark.parametrize("family", ROTARY)
def test_rotary_head_dim_one_keeps_transformers_broadcast(family):
    """A 1-wide head against 2-wide cos and sin: transformers broadcasts and runs; the kernels rotate pairs, so
    the attention keeps its code, with the reason."""
    ref, fused = pair(family, **_heads(family, 8, 8))
    ids, keys = ids_keys()
    same_at_real(ref, fused, ids, keys, attention_mask=keys.long())
    assert any("rotation 2 wide for head_dim 1" in why for _, why in fuse_report(fused)[0].kept)


@pytest.mark.parametrize("family", ROTARY)
def test_rotary_with_an_odd_head_dim_raises_as_transformers_does(family):
    ref, fused = pair(family, **_heads(family, 12, 4))
    ids, keys = ids_keys()
    for model in (ref, fused):
        with pytest.raises(RuntimeError, match="size of tensor"):
            model(ids, attention_mask=keys.long())
    assert any("rotation 4 wide for head_dim 3" in why for _, why in fuse_report(fused)[0].kept)


@pytest.mark.parametrize("family", ["eurobert", "nomicbert"])
def test_a_partial_rotation_raises_as_transformers_does(family):
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5}
    ref, fused = pair(family, rope_parameters=rope)
    ids, keys = ids_keys()
    for model in (ref, fused):
        with pytest.raises(RuntimeError, match="size of tensor"):
            model(ids, attention_mask=keys.long())


def test_proportional_rope_is_fixed_at_construction_and_runs_fused():
    rope = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    ref, fused = pair("eurobert", rope_parameters=rope)
    ids, keys = ids_keys()
    same_at_real(ref, fused, ids, keys, attention_mask=keys.long())
    assert fuse_report(fused)[0].kept == [] and calls(fused) == {}


def test_relative_position_type_that_transformers_5_no_longer_reads_runs_fused():
    ref, fused = pair("bert", position_embedding_type="relative_key")
    if getattr(ref.encoder.layer[0].attention.self, "distance_embedding", None) is not None:
        pytest.skip("this transformers computes relative_key positions (a distance embedding)")
    ids, keys = ids_keys()
    same_at_real(ref, fused, ids, keys, attention_mask=keys.long())
    assert not any(what == "attention" for what, _ in fuse_report(fused)[0].kept)


# ---- heads that read padded positions ----------------------------------------------------------------------
QA = dict(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 2]))


# Families of each family module but DeBERTa's (below): ModernBERT's sliding windows and MPNet's relative positions
# read distances, which the layout keeps; ESM and RoFormer rotate by each token's own position.
READERS = ["bert", "distilbert", "albert", "mpnet", "modernbert", "eurobert", "esm", "roformer"]
QA_READERS = [f for f in READERS if f not in ("esm", "eurobert")]  # they have no question-answering head


def _train_pair(family, head, fuse_args=None):
    """(unfused, fused) in training mode, every dropout module at 0 (the heads' own too: qa_dropout...)."""
    ref, fused = pair(family, head, fuse_args=fuse_args)
    for model in (ref, fused):
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    return ref.train(), fused.train()


def _same_step(ref, fused, check, **call):
    """One training step of each (dropout 0): loss, the outputs `check` names at every position, and every
    parameter gradient the same; the fused one ran no original code."""
    a, b = ref(**call), fused(**call)
    for name in ("loss", *check):
        assert rel_err(getattr(b, name), getattr(a, name)) <= TOL, name
    assert_same_gradients(fused, ref, b.loss, a.loss)
    assert calls(fused) == {}


@pytest.mark.parametrize("family", QA_READERS)
@pytest.mark.parametrize("padding", ["right", "left"])
def test_question_answering_over_padded_positions_runs_fused_and_exact(family, padding):
    """The start and end logits, and their loss, span every position, padded ones too: the fused encoder keeps
    padded positions as queries over their row's real tokens, so every logit, the loss and every gradient are
    transformers', in training and in eval, on the kernels."""
    ids, keys = ids_keys()
    mask = (keys if padding == "right" else keys.flip(-1)).long()
    ref, fused = _train_pair(family, "ForQuestionAnswering")
    _same_step(ref, fused, ("start_logits", "end_logits"), input_ids=ids, attention_mask=mask, **QA)
    ref.eval(), fused.eval()
    a, b = ref(ids, attention_mask=mask), fused(ids, attention_mask=mask)
    assert rel_err(b.end_logits, a.end_logits) <= TOL and calls(fused) == {}


def test_padded_positions_zero_leaves_them_zero():
    """padded_positions="zero" removes padding entirely: those heads read 0 there (another loss), for speed."""
    ids, keys = ids_keys()
    ref, fast = pair("bert", "ForQuestionAnswering", fuse_args={"padded_positions": "zero"})
    a, c = ref(ids, attention_mask=keys.long(), **QA), fast(ids, attention_mask=keys.long(), **QA)
    assert calls(fast) == {} and rel_err(c.loss, a.loss) > 1e-4


@pytest.mark.parametrize("family", ["bert", "modernbert", "roformer"])
def test_question_answering_with_holes_in_the_mask(family):
    """Padding between tokens: the real tokens are one run of keys in the layout, the padded ones queries after
    them, each rotated by its own position (ModernBERT's sliding windows count the padded slots: its original
    code runs, as for any mask with holes)."""
    ids, keys = ids_keys()
    mask = keys.long()
    mask[0, 2] = 0
    ref, fused = pair(family, "ForQuestionAnswering")
    a, b = ref(ids, attention_mask=mask, **QA), fused(ids, attention_mask=mask, **QA)
    assert rel_err(b.start_logits, a.start_logits) <= TOL and rel_err(b.loss, a.loss) <= TOL
    assert calls(fused) == ({} if family != "modernbert" else {next(iter(calls(fused))): 1})


def test_a_row_without_a_real_token_runs_the_original_code():
    """Eager and sdpa attend uniformly over the masked keys of a row with no real token: the original code runs
    for such a call, named in fuse_report."""
    ids, keys = ids_keys()
    mask = keys.long()
    mask[1] = 0
    ref, fused = pair("bert", "ForQuestionAnswering")
    a, b = ref(ids, attention_mask=mask, **QA), fused(ids, attention_mask=mask, **QA)
    assert rel_err(b.start_logits, a.start_logits) <= TOL
    assert any("without a real token" in why for why in calls(fused))


@pytest.mark.parametrize("family", READERS)
def test_a_classifier_reading_a_left_padded_first_position_runs_fused_and_exact(family):
    """Left padding pads the first position, which a pooler or classifier reads: the layout keeps it (alone of
    the padding, or with every position up to the real tokens where the layers read distances) as a query."""
    ids, keys = ids_keys()
    left = keys.flip(-1).long()
    ref, fused = _train_pair(family, "ForSequenceClassification")
    _same_step(ref, fused, ("logits",), input_ids=ids, attention_mask=left, labels=torch.tensor([0, 1]))


def test_a_left_padded_first_position_keeps_only_what_is_read():
    """Only the first position of the padding joins the layout (BERT reads no distance), and the rest of the
    padding stays 0 in the encoder's output, as padded_positions="exact" promises nothing there."""
    ids, keys = ids_keys(lengths=(6, 2))
    left = keys.flip(-1).long()
    ref, fused = pair("bert")
    a, b = ref(ids, attention_mask=left), fused(ids, attention_mask=left)
    assert rel_err(b.pooler_output, a.pooler_output) <= TOL
    assert rel_err(b.last_hidden_state[1, 0], a.last_hidden_state[1, 0]) <= TOL
    assert not b.last_hidden_state[1, 1:4].any() and calls(fused) == {}


@pytest.mark.parametrize("family", ["deberta-v2", "deberta"])
def test_deberta_runs_its_original_code_where_padded_positions_are_read(family):
    """DeBERTa masks padded queries as well as keys (every key of their row masked: uniform attention over the
    row in transformers 5, zero before), which no key span expresses: QA over padding, a left-padded classifier
    and hidden states at padded positions run its original code, named in fuse_report; without padding they
    run fused, hidden states too."""
    ids, keys = ids_keys()
    ref, fused = pair(family, "ForQuestionAnswering")
    a, b = ref(ids, attention_mask=keys.long(), **QA), fused(ids, attention_mask=keys.long(), **QA)
    assert rel_err(b.loss, a.loss) <= TOL and rel_err(b.start_logits, a.start_logits) <= TOL
    assert any("masks every key of a padded query" in why for why in calls(fused))
    full = torch.ones_like(keys).long()
    ref, fused = pair(family)
    a, b = (m(ids, attention_mask=full, output_hidden_states=True) for m in (ref, fused))
    assert all(rel_err(x, y) <= TOL for x, y in zip(b.hidden_states, a.hidden_states)) and calls(fused) == {}


def test_a_bare_models_pooler_reads_the_first_position():
    ids, keys = ids_keys()
    ref, fused = pair("bert")
    left = keys.flip(-1).long()
    assert rel_err(fused(ids, attention_mask=left).pooler_output, ref(ids, attention_mask=left).pooler_output) <= TOL


@pytest.mark.parametrize("head", ["ForTokenClassification", "ForMaskedLM"])
@pytest.mark.parametrize("mlm_logits", [True, False])
def test_labels_on_padded_positions_get_transformers_loss(head, mlm_logits):
    """A token-level label where the mask is 0 reads a padded position: that call runs the original encoder code
    (the task model's pre-hook sees it); labels on real tokens only stay fused. unfuse removes the hooks."""
    ids, keys = ids_keys()
    ref, fused = pair("bert", head, fuse_args={"mlm_logits": mlm_logits})
    labels = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(1))
    a, b = ref(ids, attention_mask=keys.long(), labels=labels), fused(ids, attention_mask=keys.long(), labels=labels)
    assert rel_err(b.loss, a.loss) <= TOL and any("labels at padded" in why for why in calls(fused))
    real = labels.masked_fill(~keys, -100)
    assert rel_err(fused(ids, attention_mask=keys.long(), labels=real).loss,
                   ref(ids, attention_mask=keys.long(), labels=real).loss) <= TOL
    assert sum(calls(fused).values()) == 1
    hf.unfuse(fused)
    assert not fused._forward_pre_hooks and not fused._forward_hooks


def test_padded_positions_takes_exact_or_zero():
    with pytest.raises(ValueError, match="padded_positions"):
        fuse(build("bert", "Model"), padded_positions="fast")
    model = fuse(build("bert", "Model"), padded_positions="zero")
    with pytest.raises(ValueError, match="already fused"):
        fuse(model)


# ---- dtypes and losses -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_a_float64_model_runs_the_pytorch_path_in_float64(family):
    """The kernels take float32 and half precision: a float64 model runs the fused modules' PyTorch path (the
    backend is chosen by dtype as well as device), its loss in float64 too."""
    ref = build(family, hidden_size=32, num_attention_heads=4, intermediate_size=40).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    ids, mask, labels = batch(family)
    a, b = ref(ids, attention_mask=mask, labels=labels).loss, fused(ids, attention_mask=mask, labels=labels).loss
    assert b.dtype == torch.float64 and rel_err(b, a) <= 1e-12


def test_the_masked_only_loss_without_a_labelled_token_is_nan_as_in_transformers():
    ref = build("bert")
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    ids, mask, _ = batch("bert")
    none = torch.full_like(ids, -100)
    assert torch.isnan(ref(ids, attention_mask=mask, labels=none).loss)
    assert torch.isnan(fused(ids, attention_mask=mask, labels=none).loss)
    counted = dict(attention_mask=mask, labels=none, num_items_in_batch=4)  # transformers' sum / count, where read
    assert torch.isnan(fused(ids, **counted).loss) == torch.isnan(ref(ids, **counted).loss)


def test_fuse_report_names_the_backend_the_fused_layers_take_now(monkeypatch):
    """Read when the report is asked for, from the encoder's parameters: a model moved to another dtype or device
    after fuse() reports where its fused layers run then."""
    from bertfuse import kernels
    from bertfuse.kernels import targets

    fused = fuse(build("bert"))
    (report,) = fuse_report(fused)
    assert report.backend == "Triton's interpreter on the CPU (TRITON_INTERPRET=1: the kernels' code, slowly), float32"
    assert str(report).endswith("; runs " + report.backend)
    (report,) = fuse_report(fused.double())
    assert report.backend == "the PyTorch path: the kernels take float32, float16 and bfloat16, not torch.float64"
    monkeypatch.setattr(targets, "INTERPRET", False)
    monkeypatch.setattr(kernels._common, "INTERPRET", False)
    monkeypatch.setattr(targets, "_device_target", lambda index: targets.named(["sm_90", "sm_75"][index]))
    assert kernels.backend_of(torch.device("cuda", 0), torch.bfloat16) == (
        "triton", "the Triton kernels on cuda:0 (sm_90), bfloat16")
    backend, words = kernels.backend_of(torch.device("cuda", 1), torch.bfloat16)
    assert backend == "torch" and words.startswith("the PyTorch path: fused layers: bfloat16 needs a GPU with bfloat16")
    assert kernels.backend_of(torch.device("cpu"), torch.float32) == (
        "torch", "the PyTorch path: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 set before triton "
                 "is imported, for CPU tensors)")


def test_backend_for_picks_the_pytorch_path_for_float64_tensors():
    from bertfuse.kernels import backend_for

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert backend_for(torch.zeros(2, dtype=torch.float64)) == "torch"
        assert backend_for(torch.zeros(2)) == "triton"  # the interpreter, on CPU


def test_a_read_padded_position_outside_every_real_tokens_window_runs_the_original_code():
    """ModernBERT's sliding layers: a padded position farther from the real tokens than the window sees none of
    them, and eager and sdpa give such a row different values of their own: the original code runs."""
    ref, fused = pair("modernbert", "ForQuestionAnswering")
    ids = torch.randint(5, 99, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(20)[None] < torch.tensor([[20], [4]])).long()
    a, b = ref(ids, attention_mask=mask, **QA), fused(ids, attention_mask=mask, **QA)
    assert rel_err(b.start_logits, a.start_logits) <= TOL
    assert any("sliding window" in why for why in calls(fused))


# ---- every layer's hidden states ----------------------------------------------------------------------------
def _hidden_case():
    """A batch with right and left padding and a full row."""
    ids = torch.randint(5, 99, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 5:] = 0
    mask[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("family", READERS)
def test_output_hidden_states_runs_fused_at_every_position(family):
    """output_hidden_states=True (BERTScore, layer pooling): every layer's states as transformers returns them,
    padded positions included, and last_hidden_state at every position too, with the gradients of a loss over
    all of them; fused (the layers handed padded states for the hooks recording them)."""
    ids, mask = _hidden_case()
    ref, fused = _train_pair(family, "Model")
    a = ref(ids, attention_mask=mask, output_hidden_states=True)
    b = fused(ids, attention_mask=mask, output_hidden_states=True)
    assert len(b.hidden_states) == len(a.hidden_states) == ref.config.num_hidden_layers + 1
    for mine, theirs in zip(b.hidden_states, a.hidden_states):
        assert rel_err(mine, theirs) <= TOL
    assert rel_err(b.last_hidden_state, a.last_hidden_state) <= TOL
    weights = torch.randn(a.last_hidden_state.shape, generator=torch.Generator().manual_seed(3))
    loss = [sum((h * weights).sum() for h in out.hidden_states) for out in (b, a)]
    assert_same_gradients(fused, ref, *loss)
    assert calls(fused) == {}
    c = fused(ids, attention_mask=mask, output_hidden_states=True, return_dict=False)
    assert rel_err(c[-1][-1], a.hidden_states[-1]) <= TOL


@pytest.mark.parametrize("selected", [2, -1, [0, 2]])
def test_output_hidden_states_selecting_layers(selected):
    """transformers 5's selection of layers by index, as this release reads it (where it takes no such value,
    both raise or both return the same)."""
    ids, mask = _hidden_case()
    for family in ("bert", "modernbert"):
        ref, fused = pair(family)
        try:
            a = ref(ids, attention_mask=mask, output_hidden_states=selected)
        except Exception as error:
            with pytest.raises(type(error)):
                fused(ids, attention_mask=mask, output_hidden_states=selected)
            continue
        b = fused(ids, attention_mask=mask, output_hidden_states=selected)
        assert len(b.hidden_states) == len(a.hidden_states)
        for mine, theirs in zip(b.hidden_states, a.hidden_states):
            assert (mine is None) == (theirs is None) and (mine is None or rel_err(mine, theirs) <= TOL)
        assert calls(fused) == {}


def test_output_hidden_states_with_a_row_without_a_real_token_runs_the_original_code():
    ids, mask = _hidden_case()
    mask[2] = 0
    ref, fused = pair("bert")
    a, b = (m(ids, attention_mask=mask, output_hidden_states=True) for m in (ref, fused))
    assert rel_err(b.hidden_states[1], a.hidden_states[1]) <= TOL
    assert any("without a real token" in why for why in calls(fused))

"""bert.hf.fuse on DeBERTa-v2/v3 and DeBERTa (bertfuse.bert.hf.deberta): configurations through the
disentangled kernel, dropouts, masks with holes and refused bucket rules, talking heads and the convolution kept
unfused. Small random models of bench.hf_parity, float32 in the interpreter, against the unfused model."""
import copy

import pytest
import torch

from hf_utils import assert_same_gradients, Calls, needs_transformers, rel_err, TOL

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("bertfuse.kernels")
import bertfuse.kernels._common as kernels_common  # noqa: E402
from bertfuse.bert.hf import fuse, fuse_report  # noqa: E402
from bertfuse.bench.hf_parity import SMALL, batch, build  # noqa: E402  (the parity table's models)

SLOW = pytest.mark.slow


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
    needs_transformers("5.0", "DeBERTa's masked-LM model with the enhanced mask decoder (legacy=False) that runs")
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
def test_deberta_dropouts_reach_the_kernels_and_padded_hidden_states_run_the_original(family, monkeypatch):
    """In training the attention dropout goes into the kernel, pos_dropout (a module, its hooks firing) onto the
    relative embeddings each layer reads; a call asking for hidden states at padded positions runs the original
    encoder code (DeBERTa masks padded queries: tests/test_hf_meaning.py)."""
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

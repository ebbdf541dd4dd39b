"""bert.hf.fuse on the rotary encoders fused whole (bertfuse.bert.hf.rotary): ModernBERT's layer types, rotations
and windows, sparse prediction and position ids; EuroBERT's grouped heads, RMSNorm and SwiGLU; NomicBERT's
post-norm dropouts and token types; a dynamic rope kept unfused. Small random models of bench.hf_parity, float32
in the interpreter, against the unfused model, the kernels really called."""
import copy
import warnings

import pytest
import torch

from hf_utils import assert_same_gradients, Calls, rel_err, TOL

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.bert.hf import fuse, fuse_report  # noqa: E402
from bertfuse.bench.hf_parity import batch, build  # noqa: E402  (the parity table's models)


def _modernbert(head="ForMaskedLM", **changes):
    return build("modernbert", head, **changes)


def _layer_inv_freqs(model) -> list[torch.Tensor]:
    """Each layer's frequencies as the installed release holds them: the model's per layer type, or (before
    transformers 5) each attention's own rotary module."""
    emb = getattr(model, "rotary_emb", None)
    if emb is None:
        return [layer.attn.rotary_emb.inv_freq for layer in model.layers]
    return [getattr(emb, f"{kind}_inv_freq") for kind in model.config.layer_types]


def test_modernbert_each_layer_type_reaches_the_kernels_with_its_rotation_and_window(monkeypatch):
    """Two layers, global then local (local_attention 8: 4 positions each side): the kernels get each layer
    type's inv_freq (the global base 160,000, the local 10,000), the local window, the attention and MLP
    dropouts in training; the fused loss and every gradient equal the original's, dropout off."""
    ref = _modernbert()
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)
    report = str(fuse_report(fused)[0])
    assert "RoPE by each token's position id" in report and "local windows" in report and "gated MLP" in report
    global_freq, local_freq = _layer_inv_freqs(ref.model)
    assert not torch.equal(global_freq, local_freq)
    ids, mask, labels = batch("modernbert")
    calls = Calls(monkeypatch)
    a, b = ref(input_ids=ids, attention_mask=mask, labels=labels), fused(input_ids=ids, attention_mask=mask,
                                                                         labels=labels)
    assert [c["window_size"] for c in calls.of("varlen_attention")] == [(-1, -1), (4, 4)]
    freqs = [c["rot"].inv_freq for c in calls.of("rotary")]  # q and k of each layer
    assert all(torch.equal(f, global_freq) for f in freqs[:2])
    assert all(torch.equal(f, local_freq) for f in freqs[2:])
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
    if getattr(ref, "rotary_emb", None) is None:  # before transformers 5: each attention's own
        ref.layers[0].attn.rotary_emb.rope_type = "dynamic"
    else:
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

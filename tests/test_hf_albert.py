"""bert.hf.fuse on ALBERT (bertfuse.bert.hf.albert): shared layers fused once and run by its group schedule,
the sentence-order loss beside the masked-only one, its dropouts and tanh GeLU in the kernels, a layer group of
unknown code. Small random models of bench.hf_parity, float32 in the interpreter, against the unfused model."""
import copy
import sys

import pytest
import torch

from hf_utils import assert_same_gradients, Calls, rel_err, TOL

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.bert.hf import fuse, fuse_report, unfuse  # noqa: E402
from bertfuse.bench.hf_parity import batch, build  # noqa: E402  (the parity table's models)


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
        def forward(self, hidden_states, *args, **kwargs):
            once = super().forward(hidden_states, *args, **kwargs)  # a tuple before transformers 5
            return super().forward(once[0] if isinstance(once, tuple) else once, *args, **kwargs)

    ref = _albert("Model", num_hidden_groups=1, inner_group_num=1)
    ref.encoder.albert_layer_groups[0].__class__ = Twice
    with pytest.warns(UserWarning, match="attention stays unfused: Twice overrides forward of AlbertLayerGroup"):
        fused = fuse(copy.deepcopy(ref))
    assert fuse_report(fused)[0].kept[0][0] == "attention"
    ids, mask, _ = batch("albert")
    with torch.no_grad():
        a, b = ref(input_ids=ids, attention_mask=mask), fused(input_ids=ids, attention_mask=mask)
    assert rel_err(b.last_hidden_state, a.last_hidden_state) <= TOL

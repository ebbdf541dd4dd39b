"""bert.hf.fuse on ESM and RoFormer (bertfuse.bert.hf.esm_roformer): the kernels read the cos and sin tables their
models form, per row and with left padding. Small random models of bench.hf_parity, float32 in the interpreter,
against the unfused model."""
import copy

import pytest
import torch

from hf_utils import assert_same_gradients, Calls, rel_err, TOL

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.bert.hf import fuse, fuse_report  # noqa: E402
from bertfuse.bench.hf_parity import batch, build  # noqa: E402  (the parity table's models)


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

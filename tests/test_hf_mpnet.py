"""bert.hf.fuse on MPNet (bertfuse.bert.hf.mpnet): another bucket rule keeps the attention unfused, and a mask
with holes runs the original code. (Its parity with the unfused model: tests/test_hf_families.py.)"""
import copy

import pytest
import torch

from hf_utils import rel_err, TOL

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.bert.hf import fuse, fuse_report  # noqa: E402
from bertfuse.bench.hf_parity import batch, build  # noqa: E402  (the parity table's models)


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

"""bert.train.optim: BERT's decay groups, AdamW as each trainer wants it, learning-rate types that never read the
device."""
import pytest
import torch

from bertfuse import bert
from bertfuse.bert.train.optim import adamw, warmup_decay_schedule, param_groups, set_lr_types


def test_no_weight_decay_on_biases_and_layer_norms_and_none_for_frozen_parameters():
    model = bert.BertForMaskedLM(bert.BertConfig.tiny(vocab_size=50))
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(not (names[id(p)].endswith("bias") or "LayerNorm" in names[id(p)]) for p in decay["params"])
    assert all(names[id(p)].endswith("bias") or "LayerNorm" in names[id(p)] for p in no_decay["params"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(decay["params"]) + len(no_decay["params"]) == len(trainable)
    frozen = model.bert.embeddings.word_embeddings.weight
    assert all(p is not frozen for p in decay["params"] + no_decay["params"])
    assert any("LayerNorm" in names[id(p)] for p in no_decay["params"])


def test_adamw_on_the_cpu_and_capturable_learning_rates():
    w = torch.nn.Parameter(torch.ones(3))
    opt = adamw([w], lr=0.1, device=torch.device("cpu"), weight_decay=0.0)
    assert not opt.defaults.get("fused") and opt.param_groups[0]["lr"] == 0.1
    w.grad = torch.ones(3)
    opt.step()
    assert torch.allclose(w.detach(), torch.full((3,), 0.9), atol=1e-6)  # Adam's first step moves lr x sign
    cap = adamw([torch.nn.Parameter(torch.ones(2))], lr=0.5, device=torch.device("cpu"), capturable=True)
    group = cap.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and group["lr"].item() == 0.5 and group["initial_lr"] == 0.5
    # A state dict saved with a float rate comes back as the tensor the captured step reads.
    state = cap.state_dict()
    state["param_groups"][0]["lr"] = 0.25
    cap.load_state_dict(state)
    set_lr_types(cap, torch.device("cpu"))
    assert isinstance(group := cap.param_groups[0], dict) and isinstance(group["lr"], torch.Tensor)
    assert group["lr"].item() == 0.25 and isinstance(group["initial_lr"], float)


def test_warmup_decay_schedule_shape():
    f = warmup_decay_schedule(4, 10)
    assert [f(s) for s in (0, 2, 4, 7, 10, 12)] == [0.0, 0.5, 1.0, pytest.approx(0.5), 0.0, 0.0]
    assert warmup_decay_schedule(0, 5)(0) == 1.0

"""Optimizer pieces shared by pre-training and fine-tuning."""
from __future__ import annotations


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on weights, none on biases and LayerNorm parameters (as BERT)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def linear_schedule(warmup: int, total: int):
    """LambdaLR factor: linear warm-up over `warmup` steps, then linear decay to 0 at `total`."""
    def factor(step):
        if step < warmup:
            return (step + 1) / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return factor

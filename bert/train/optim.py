"""Optimizer pieces shared by pre-training and fine-tuning."""
from __future__ import annotations

import torch


def adamw(params, lr: float, device: torch.device, capturable: bool = False, **kwargs) -> torch.optim.AdamW:
    """AdamW, fused on CUDA; `capturable` for a step captured as a CUDA graph, its step count and learning rate
    then living on the device (see `set_lr_types`)."""
    cuda = torch.device(device).type == "cuda"
    opt = torch.optim.AdamW(params, lr=lr, **({"fused": True} if cuda else {}),
                            **({"capturable": True} if capturable else {}), **kwargs)
    set_lr_types(opt, device)
    return opt


def lamb(params, lr: float, device: torch.device, capturable: bool = False, **kwargs):
    """LAMB as fused Triton kernels (bertfuse.kernels.Lamb; PyTorch where they cannot run), its learning rates
    device tensors for a step captured as a CUDA graph (`capturable`: its step never reads the device anyway)."""
    from bertfuse.bert.model.ops import TRITON, kernels_package  # imports triton: only for a run that asks for LAMB

    opt = getattr(kernels_package(), TRITON["lamb"])(params, lr=lr, **kwargs)
    set_lr_types(opt, device, capturable)
    return opt


def set_lr_types(opt: torch.optim.Optimizer, device, capturable: bool | None = None) -> None:
    """Each group's learning rate as the step reads it: a device tensor for a capturable optimizer (`capturable`,
    by default the optimizer's own flag: the captured graph reads it; a scheduler fills it in place), a float
    otherwise; its base rate (`initial_lr`, which a scheduler scales) always a float, so that setting the rate
    never reads the device. Called on a new optimizer and again after load_state_dict, which brings back the
    saved types."""
    if capturable is None:
        capturable = opt.defaults.get("capturable", False)
    for group in opt.param_groups:
        lr = float(group["lr"])
        group["initial_lr"] = float(group.get("initial_lr", lr))
        group["lr"] = torch.tensor(lr, device=device) if capturable else lr


def param_groups(model, weight_decay: float) -> list[dict]:
    """The optimizer's groups: weight decay on weights, none on biases and LayerNorm parameters (as BERT)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_decay_schedule(warmup: int, total: int, power: float = 1.0):
    """LambdaLR factor: linear warm-up over `warmup` steps, then polynomial decay to 0 at `total`,
    ((total - step) / (total - warmup)) ** power. power 1 is linear decay, the same numbers as transformers'
    get_linear_schedule_with_warmup (so step 0 of a warm-up has learning rate 0), and any power those of its
    get_polynomial_decay_schedule_with_warmup with lr_end 0, so that curves compare step for step. (NVIDIA's BERT
    recipe writes (1 - step / total) ** power after its warm-up: the same power, measured from step 0, so its rate
    drops at the end of the warm-up; this one starts its decay from the peak.)"""
    def factor(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup)) ** power
    return factor

"""`python -m bertfuse.bench.hf_parity`: how closely bert.hf.fuse reproduces each BERT-family model, float32.

Small random configurations built offline (2 layers, hidden 64, 4 heads, intermediate 100; ELECTRA with a
32-wide embedding projected up, ALBERT with a 16-wide one and one layer shared by both passes, DistilBERT with
learned or sinusoidal positions, ModernBERT with a global and a local layer, EuroBERT with two k/v heads, ESM
with rotary positions), a padded batch of lengths 17,
9 and 2: the relative error (max |fused - original| / max |original|) of the MLM logits at real positions, the
MLM loss, and the worst gradient of every parameter after that loss (scaled as tests/hf_utils.grad_errors
does). tests/test_hf_families.py builds the same models and asserts at most 1e-5. Runs on the GPU when there is
one, else in Triton's interpreter.
"""
from __future__ import annotations

import copy
import os
import sys

from bertfuse.bert import hf

SMALL = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=100,
             max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# Every family the drop-in knows (bert.hf.FAMILIES), and DistilBERT once more with sinusoidal positions.
FAMILIES = [*(f.name for f in hf.FAMILIES), "distilbert-sinusoidal"]

# The model types the drop-in fuses as BERT's code under their own class names (the modeling modules
# bert.hf.bert lists beside BERT's): BERT's (or RoBERTa's, padding with 1) record under their own prefix, for the
# fuzz (bench.hf_fuzz) and the release table (bench.hf_versions). BertGeneration's bare model is its Encoder.
COPIES = {"ernie": ("Ernie", "bert"), "layoutlm": ("LayoutLM", "bert"), "markuplm": ("MarkupLM", "bert"),
          "roc_bert": ("RoCBert", "bert"), "splinter": ("Splinter", "bert"), "tapas": ("Tapas", "bert"),
          "visual_bert": ("VisualBert", "bert"), "data2vec-text": ("Data2VecText", "roberta"),
          "bert-generation": ("BertGeneration", "bert")}
_HEAD_CLASSES = {("BertGeneration", "Model"): "BertGenerationEncoder"}


def _record(name: str):
    if name in COPIES:
        prefix, like = COPIES[name]
        return hf.family(like)._replace(name=name, prefix=prefix)
    return hf.family(name.removesuffix("-sinusoidal"))


def model_class(family: str, head: str):
    """The transformers class of `family` with the task head `head` ("Model": the bare one), or None where
    transformers has none."""
    import transformers

    prefix = _record(family).prefix
    return getattr(transformers, _HEAD_CLASSES.get((prefix, head), prefix + head), None)


def build(family: str, head: str = "ForMaskedLM", **changes):
    """A small random transformers model of `family` with the task head `head` ("Model" for the bare one);
    `changes` to its configuration (in the family's own field names) on top."""
    import torch
    import transformers

    torch.manual_seed(0)
    record = _record(family)
    names = dict(record.config_names)  # the family's own field names, its test extras (bert.hf.Family)
    sizes = {names.get(k, k): v for k, v in SMALL.items()}
    extra = dict(record.test_config, **({"sinusoidal_pos_embds": True} if family.endswith("-sinusoidal") else {}))
    sizes.update(extra, **changes)
    cfg = getattr(transformers, record.prefix + "Config")(**sizes, pad_token_id=record.pad_token_id)
    return model_class(family, head)(cfg).eval()


def batch(family: str, seed: int = 3, device="cpu"):
    """(input_ids, attention_mask, MLM labels): lengths 17, 9, 2, the family's padding id at padded positions."""
    import torch

    lengths = torch.tensor([17, 9, 2])
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(17)[None] < lengths[:, None]).long()
    ids = torch.randint(3, 99, (3, 17), generator=g).masked_fill(mask == 0, _record(family).pad_token_id)
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.3) & mask.bool(), ids, -100)
    labels[0, 1] = ids[0, 1]
    return ids.to(device), mask.to(device), labels.to(device)


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def worst_grad(fused, ref) -> float:
    """The worst parameter-gradient error, each scaled by max(its own largest reference gradient, 1e-2 of the
    model's largest): some gradients are zero in exact arithmetic and hold only rounding noise."""
    grads = dict(ref.named_parameters())
    floor = 1e-2 * max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    unused = [n for n, p in fused.named_parameters() if p.grad is None and grads[n].grad is None]  # ESM's contact head
    return max((p.grad.double() - grads[n].grad.double()).abs().max().item()
               / max(grads[n].grad.abs().max().item(), floor) for n, p in fused.named_parameters() if n not in unused)


def parity(family: str, device) -> dict:
    import torch

    from bertfuse.bert.hf import fuse

    ref = build(family).to(device)
    fused = fuse(copy.deepcopy(ref), mlm_logits=False)  # the masked-only loss; logits compared without labels
    ids, mask, labels = batch(family, device=device)
    a, b = ref(input_ids=ids, attention_mask=mask, labels=labels), fused(input_ids=ids, attention_mask=mask,
                                                                          labels=labels)
    a.loss.backward()
    b.loss.backward()
    with torch.no_grad():
        la, lb = ref(input_ids=ids, attention_mask=mask).logits, fused(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    return {"family": family, "logits": rel_err(lb[keep], la[keep]), "loss": rel_err(b.loss, a.loss),
            "worst_grad": worst_grad(fused, ref)}


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by bert.hf's kernels)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print("| family | MLM logits | MLM loss | worst parameter gradient |\n|---|---|---|---|")
    for family in FAMILIES:
        r = parity(family, device)
        print(f"| {family} | {r['logits']:.1e} | {r['loss']:.1e} | {r['worst_grad']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

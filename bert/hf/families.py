"""Where the family modules are registered: one line each in GROUPS, and what the rest of the drop-in reads of
them all (every family, layer structure, stack, MLM head, sentence-pair head, GeLU block and family norm).

A new family is one module beside these (its forwards, its `Layers` and `Family` records, its refusal rules,
as bert.py or mpnet.py hold theirs, ending in a `GROUP`) and its line here. The order of GROUPS is the order
in which look-alikes are tried: BERT's layer structure before RoFormer's, whose paths it shares.
"""
from __future__ import annotations

from bertfuse.bert.hf import albert, bert, deberta, esm_roformer, mpnet, rotary
from bertfuse.bert.hf.compute import _unique
from bertfuse.bert.hf.records import Family, Group

GROUPS: tuple[Group, ...] = (
    bert.GROUP,          # BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT
    mpnet.GROUP,         # MPNet
    albert.GROUP,        # ALBERT
    rotary.GROUP,        # ModernBERT, NomicBERT, EuroBERT
    esm_roformer.GROUP,  # ESM, RoFormer
    deberta.GROUP,       # DeBERTa-v2/v3, DeBERTa
)

FAMILIES: tuple[Family, ...] = tuple(f for g in GROUPS for f in g.families)
LAYERS = _unique(f.layers for f in FAMILIES)
STACKS = _unique(kind.stack for kind in LAYERS)
MLM_HEADS = _unique(f.mlm_head for f in FAMILIES)
PAIR_HEADS = tuple(h for g in GROUPS for h in g.pair_heads)
GELU_BLOCKS = tuple(b for g in GROUPS for b in g.gelu_blocks)
FAMILY_NORMS = tuple(n for g in GROUPS for n in g.norms)
# The modeling modules of every layer structure: besides the fused encoders' own classes, their intermediate
# and output blocks are BERT's code (DeBERTa's with its own LayerNorm class), fused wherever they appear.
BLOCK_MODELS = _unique(m for kind in LAYERS for m in kind.models)
# The task models whose forward the masked-only MLM loss stands in for: the families' own.
MLM_MODELS = tuple(m for m in BLOCK_MODELS if m[1] in {f.prefix for f in FAMILIES})


def family(name: str) -> Family:
    found = [f for f in FAMILIES if f.name == name]
    if not found:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")
    return found[0]

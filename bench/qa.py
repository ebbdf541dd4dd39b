"""Extractive question answering, fine-tuning: one training step of transformers' BertForQuestionAnswering on
SQuAD-shaped padded batches, as a user fine-tuning on SQuAD runs it, unfused and fused.

Every feature is padded to the sequence length (384, as SQuAD fine-tuning pads), its real length drawn from the
feature lengths of SQuAD v1.1 dev (bench.lengths.SQUAD_PERCENTILES: about half of each row is padding). The start
and end logits, and their loss, span every position, so the exact fused model (`fuse(model)`, padded_positions
"exact") keeps the padded positions as queries over their row's real tokens, the work the original code does on
them too; `padded_positions="zero"` removes padding entirely, and those heads read 0 there (another loss: for speed
only). Reported per variant, each in a fresh process: the median step time and real tokens/s (forward, backward,
AdamW). On a CPU the fused model runs its PyTorch path (the Triton kernels need a GPU).
"""
from __future__ import annotations

import time
import traceback

from .encode import SHAPES

VARIANTS = {"hf-eager": "transformers BertForQuestionAnswering, SDPA attention, unfused",
            "hf-fused": "the same with bert.hf.fuse (padded_positions='exact': transformers' answer everywhere)",
            "hf-fused-zero": "the same with fuse(padded_positions='zero'): padding removed, 0 read there"}


def build(shape: str, variant: str, device, dtype):
    import torch
    import transformers

    config_cls, kwargs = SHAPES[shape]
    cfg = getattr(transformers, config_cls)(**kwargs, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(cfg).to(device, dtype).train()
    if variant != "hf-eager":
        from bertfuse.bert.hf import fuse

        fuse(model, padded_positions="zero" if variant == "hf-fused-zero" else "exact")
    return model


def make_batch(batch: int, seq_len: int, device, seed: int = 0) -> tuple[dict, int]:
    """(the step's arguments, its real token count): rows padded to seq_len, answers inside the real tokens."""
    import numpy as np
    import torch

    from .lengths import SQUAD_PERCENTILES

    rng = np.random.default_rng(seed)
    lengths = np.interp(rng.uniform(0, 100, batch), np.arange(0, 101, 5), SQUAD_PERCENTILES)
    lengths = torch.from_numpy(np.clip(np.round(lengths), 8, seq_len).astype(np.int64))
    mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 30000, (batch, seq_len), generator=g).masked_fill(mask == 0, 0)
    start = (torch.rand(batch, generator=g) * (lengths - 4)).long() + 1
    end = start + (torch.rand(batch, generator=g) * 3).long()
    args = {"input_ids": ids, "attention_mask": mask, "start_positions": start, "end_positions": end}
    return {k: v.to(device) for k, v in args.items()}, int(lengths.sum())


def run_variant(variant: str, spec: dict) -> dict:
    """In a fresh process: one row. The fused model must run every call fused (fuse_report counts none that ran
    the original code), or the row says so."""
    from .e2e import pytorch_path_on_cpu

    pytorch_path_on_cpu(spec["device"])
    import torch

    row = {"suite": "qa", "variant": variant, **{k: spec[k] for k in ("model", "batch", "seq_len", "dtype")}}
    try:
        device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
        model = build(spec["model"], variant, device, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
        batches = [make_batch(spec["batch"], spec["seq_len"], device, seed=s) for s in range(3)]
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        times, tokens = [], 0
        for i in range(spec["warmup"] + spec["steps"]):
            args, real = batches[i % len(batches)]
            sync()
            t0 = time.perf_counter()
            model(**args).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - t0)
                tokens += real
        row.update(status="ok", step_ms=1e3 * sorted(times)[len(times) // 2], tokens_per_s=tokens / sum(times),
                   padding=round(1 - tokens / (len(times) * spec["batch"] * spec["seq_len"]), 3))
        if variant != "hf-eager":
            from bertfuse.bert.hf import fuse_report

            unfused = sum(sum(r.calls.values()) for r in fuse_report(model))
            if unfused:
                row["status"] = f"ok, but {unfused} call(s) ran the original code"
    except Exception as e:  # a variant that cannot run is reported, not fatal to the others
        row.update(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                   traceback=traceback.format_exc(limit=3))
    return row


def specs(cuda: bool, full: bool, batch: int | None, models: list[str] | None):
    """GPU: BERT-base at batch 32 in bfloat16 (--full adds MiniLM). CPU: MiniLM at batch 8 in float32 (--full adds
    BERT-base). Sequence length 384."""
    models = models or (["bert-base", "minilm"] if cuda and full else ["bert-base"] if cuda else
                        ["minilm", "bert-base"] if full else ["minilm"])
    for model in models:
        yield {"model": model, "batch": batch or (32 if cuda else 8), "seq_len": 384,
               "device": "cuda" if cuda else "cpu", "dtype": "bfloat16" if cuda else "float32",
               "warmup": 3 if cuda else 1, "steps": (20 if cuda else 3) * (2 if full else 1),
               "variants": list(VARIANTS)}

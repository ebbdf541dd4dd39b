"""Encoding throughput for people who serve BERT-family models: forward only, no gradients, realistic lengths.

For each model shape (BERT-base and MiniLM; RoBERTa-base on a GPU) and batch size (1, 32, 256), a Hugging Face
model runs eager (SDPA attention), under torch.compile, and fused with bert.hf.fuse, each in a fresh process.
Lengths follow tokenised Wikipedia paragraphs (bench.lengths), cut at the sequence length. Reported: median
latency per batch, sentences/s and real tokens/s. On a CPU the fused model runs its PyTorch path (the Triton
kernels need a GPU; TRITON_INTERPRET is ignored here): what it measures there is removing padding once per
forward.
"""
from __future__ import annotations

import time
import traceback

SHAPES = {  # name -> (transformers config class, its arguments)
    "bert-base": ("BertConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                     intermediate_size=3072, vocab_size=30522)),
    "minilm": ("BertConfig", dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                  intermediate_size=1536, vocab_size=30522)),
    "roberta-base": ("RobertaConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                           intermediate_size=3072, vocab_size=50265, max_position_embeddings=514,
                                           pad_token_id=1)),
}
VARIANTS = {"hf-eager": "transformers, eager (SDPA attention)", "hf-compile": "the same under torch.compile",
            "hf-fused": "transformers with bert.hf.fuse"}


def build(shape: str, variant: str, device, dtype):
    import torch
    import transformers

    config_cls, kwargs = SHAPES[shape]
    cfg = getattr(transformers, config_cls)(**kwargs)
    cfg._attn_implementation = "sdpa"
    model_cls = transformers.RobertaModel if config_cls == "RobertaConfig" else transformers.BertModel
    model = model_cls(cfg).to(device, dtype).eval()
    if variant == "hf-fused":
        from bertfuse.bert.hf import fuse

        fuse(model)
    if variant == "hf-compile":
        model = torch.compile(model)
    return model


def make_inputs(shape: str, batch: int, seq_len: int, device, seed: int = 0):
    import numpy as np
    import torch

    from .lengths import sample_lengths

    lengths = torch.from_numpy(sample_lengths(batch, seq_len, "wiki", np.random.default_rng(seed)))
    width = int(lengths.max())  # a tokenizer pads to the longest sentence of the batch
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    pad_id = SHAPES[shape][1].get("pad_token_id", 0)
    ids = torch.randint(5, 30000, (batch, width), generator=torch.Generator().manual_seed(seed))
    ids = ids.masked_fill(mask == 0, pad_id)
    return ids.to(device), mask.to(device), int(lengths.sum())


def run_variant(variant: str, spec: dict) -> dict:
    """In a fresh process: one row of latency and throughput. On a CPU the fused model's PyTorch path is what is
    measured, even where TRITON_INTERPRET is set (the interpreter's speed says nothing)."""
    from .e2e import pytorch_path_on_cpu

    pytorch_path_on_cpu(spec["device"])
    import torch

    row = {"suite": "encode", "variant": variant, **{k: spec[k] for k in ("model", "batch", "seq_len", "dtype")}}
    try:
        device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
        torch.manual_seed(0)
        model = build(spec["model"], variant, device, dtype)
        inputs = [make_inputs(spec["model"], spec["batch"], spec["seq_len"], device, seed=s) for s in range(3)]
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        times, tokens = [], 0
        with torch.inference_mode():
            for i in range(spec["warmup"] + spec["reps"]):
                ids, mask, real = inputs[i % len(inputs)]
                sync()
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=mask)
                sync()
                if i >= spec["warmup"]:
                    times.append(time.perf_counter() - t0)
                    tokens += real
        total = sum(times)
        row.update(status="ok", latency_ms=1e3 * sorted(times)[len(times) // 2],
                   sentences_per_s=spec["batch"] * len(times) / total, tokens_per_s=tokens / total)
    except Exception as e:  # a variant that cannot run is reported, not fatal to the others
        row.update(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                   traceback=traceback.format_exc(limit=3))
    return row


def specs(cuda: bool, full: bool, seq_len: int | None, batches: list[int] | None, models: list[str] | None):
    """GPU: BERT-base, MiniLM, RoBERTa-base at batch 1, 32, 256 in bfloat16. CPU: MiniLM at 1 and 32 in float32
    (--full adds BERT-base and batch 256)."""
    models = models or (["bert-base", "minilm", "roberta-base"] if cuda else
                        ["minilm", "bert-base"] if full else ["minilm"])
    batches = batches or ([1, 32, 256] if cuda or full else [1, 32])
    for model in models:
        for batch in batches:
            yield {"model": model, "batch": batch, "seq_len": seq_len or 128, "device": "cuda" if cuda else "cpu",
                   "dtype": "bfloat16" if cuda else "float32", "warmup": 3 if cuda else 1,
                   "reps": (20 if cuda else 3) * (2 if full else 1), "variants": variants(cuda, full)}


def variants(cuda: bool, full: bool) -> list[str]:
    """On a CPU the quick run leaves out torch.compile (minutes of compilation; --full runs it)."""
    return list(VARIANTS) if cuda or full else ["hf-eager", "hf-fused"]

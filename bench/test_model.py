"""pytest-benchmark of one pre-training step, this project against transformers (`pytest bench --benchmark-only
--import-mode=importlib`).

CPU: BERT-tiny, float32, backend torch. GPU: BERT-base, bfloat16, both backends.
"""
import pytest
import torch

from bertfuse import bert
from bertfuse.bench.batches import make_batch, model_kwargs

transformers = pytest.importorskip("transformers")
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
IMPLS = ["hf", "ours-torch"] + (["ours-triton"] if CUDA else [])


@pytest.mark.parametrize("impl", IMPLS)
def test_pretraining_step(benchmark, impl):
    cfg = bert.BertConfig.preset("base" if CUDA else "tiny")
    batch = make_batch(64 if CUDA else 8, 128 if CUDA else 64, cfg.vocab_size, "wiki", seed=0).to(DEV)
    if impl == "hf":
        model = transformers.BertForPreTraining(transformers.BertConfig(**cfg.to_dict())).to(DEV)
    else:
        model = bert.BertForPreTraining(cfg.replace(backend=impl.split("-")[1])).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=CUDA):
            loss = model(**model_kwargs(batch)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if CUDA:
            torch.cuda.synchronize()

    benchmark(step)

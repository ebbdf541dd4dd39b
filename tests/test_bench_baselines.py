"""The transformers baselines of the end-to-end suite (bench/baselines.py, the MLM-only and padding-free rows of
bench/e2e.py): padding-free batches hold the padded batch's tokens and score them as the padded model does, the
probe tells a transformers that keeps flattened sequences apart from one that does not, and a variant that
cannot run here is a row that says why."""
import os

import pytest
import torch
import transformers
from packaging import version

from bertfuse.bench import baselines, e2e
from bertfuse.bench.batches import make_batch, make_flat_batch, mlm_only
from bertfuse.bench.cli import main

CPU = torch.device("cpu")
SEPARATES = version.parse(transformers.__version__) >= version.parse("5.25")


def _model(attention: str):
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).eval()


def test_a_flattened_batch_holds_the_padded_batchs_tokens_and_labels():
    padded = make_batch(6, 24, 1000, "wiki", seed=3)
    flat = make_flat_batch(padded)
    ids, labels, positions = (flat.features[k][0] for k in ("input_ids", "labels", "position_ids"))
    real = padded.attention_mask.bool()
    assert flat.lengths == padded.lengths and flat.slots == sum(padded.lengths)
    assert torch.equal(ids, padded.input_ids[real]) and flat.labelled == mlm_only(padded).labelled
    assert torch.equal(labels, mlm_only(padded).labels[real])
    assert torch.equal(positions, torch.cat([torch.arange(n) for n in padded.lengths]))
    assert mlm_only(padded).next_sentence_label is None and not mlm_only(padded).token_type_ids.any()
    assert "cu_seq_lens_q" in make_flat_batch(padded, flash_kwargs=True).features


@pytest.mark.skipif(not SEPARATES, reason="transformers before 5.25 lets flattened sequences attend to each other")
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_padding_free_loss_is_the_padded_loss(attention):
    """What makes the padding-free rows a fair baseline: the same tokens scored the same way."""
    model = _model(attention)
    padded = mlm_only(make_batch(6, 24, 1000, "wiki", seed=3))
    with torch.no_grad():
        expected = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask,
                         token_type_ids=padded.token_type_ids, labels=padded.labels).loss
        got = model(**make_flat_batch(make_batch(6, 24, 1000, "wiki", seed=3)).features).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_probe_reads_what_the_installed_transformers_does(monkeypatch):
    assert (baselines.flattening_refusal("sdpa", CPU) is None) == SEPARATES
    # A release that lets flattened sequences see each other: the probe names it, whatever its version says.
    from transformers.models.bert import modeling_bert

    def mixing(*args, **kwargs):
        kwargs.pop("position_ids", None)
        return original(*args, **kwargs)

    original = modeling_bert.BertModel.forward
    monkeypatch.setattr(modeling_bert.BertModel, "forward", mixing)
    why = baselines.flattening_refusal("sdpa", CPU)
    assert why.startswith(f"transformers {transformers.__version__} with attn_implementation='sdpa' lets flattened "
                          "sequences attend to each other")


def test_a_variant_that_cannot_run_here_is_left_out_with_the_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    spec = {"config": "tiny", "seq_len": 16, "batch": 2, "padding": "wiki", "dtype": "float32", "device": "cpu",
            "warmup": 1, "steps": 1}
    row = e2e.run_variant("hf-flat-fa", spec)
    assert row["status"] == "left out: flash attention needs a CUDA GPU" and "traceback" not in row
    monkeypatch.setattr(baselines, "flattening_refusal", lambda attention, device: "it mixes sequences")
    assert e2e.run_variant("hf-flat", spec)["status"] == "left out: it mixes sequences"
    monkeypatch.setattr(baselines, "installed_flash", lambda: (None, list(baselines.FLASH)))
    with pytest.raises(baselines.LeftOut, match="none of flash_attention_4, flash_attention_3, flash_attention_2"):
        baselines.attention_of("hf-flat-fa", torch.device("cuda"))
    assert baselines.attention_of("hf-flat-flex-compile", CPU) == "flex_attention"


@pytest.mark.slow
def test_the_mlm_only_rows_run_on_the_same_tokens(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    spec = {"config": "tiny", "seq_len": 32, "batch": 4, "padding": "wiki", "dtype": "float32", "device": "cpu",
            "warmup": 1, "steps": 2}
    rows = {v: e2e.run_variant(v, spec) for v in ("hf-mlm-eager", "hf-flat", "ours-mlm", "ours-mlm-packed")}
    if not SEPARATES:
        assert rows.pop("hf-flat")["status"].startswith("left out: transformers")
    for v, row in rows.items():
        assert row["status"] == "ok" and row["objective"] == "mlm", row
        assert row["tokens_per_s_min"] <= row["tokens_per_s_median"] <= row["tokens_per_s_max"]
    same = {rows[v]["tokens_per_step"] for v in rows if v != "ours-mlm-packed"}
    assert len(same) == 1  # padded, flattened and ours: one batch's real tokens
    assert rows["ours-mlm-packed"]["padding_share"] < 0.1 < rows["hf-mlm-eager"]["padding_share"]
    assert rows["hf-mlm-eager"]["runs"] == "sdpa" and rows["ours-mlm"]["runs"] == "torch"


def test_the_dry_run_plans_a_gpu_run_without_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--dry-run", "--device", "cuda", "--suite", "e2e"]) == 0
    text = capsys.readouterr().out
    assert "Plan: end to end: ours-triton, hf-eager, hf-compile," in text and "17 runs" in text
    assert f"Padding-free rows on transformers {transformers.__version__}: hf-flat (sdpa), hf-flat-flex " \
           "(flex_attention), hf-flat-fa (the newest flash attention the GPU machine has installed" in text
    assert ("it keeps flattened sequences apart" in text) == SEPARATES
    assert not os.listdir(tmp_path)  # nothing measured, nothing written

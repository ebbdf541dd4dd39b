"""bert.hf.fuse on every model type transformers ships: fusing never changes a number.

For each model type of transformers' CONFIG_MAPPING with a base model, a tiny random model (every size field of
its config and sub-configs shrunk, dropout off) is built offline. Without an encoder inside, fuse refuses and
nothing changes. Otherwise every encoder inside is run fused and unfused on the same padded inputs (token ids,
or pixel values for a vision encoder), on the PyTorch path of the fused ops (what a fused layer computes there is
the kernels' reference, checked against the kernels elsewhere): outputs at real positions and every parameter's
gradient agree within float32 noise, and attention is fused only where the layers are the classes the fused
attention knows. The types it cannot build or feed are listed with the reason (skipped).
"""
from __future__ import annotations

import copy
import gc
import inspect
import warnings

import pytest
import torch

from hf_utils import TOL, grad_errors, rel_err

transformers = pytest.importorskip("transformers")
import bertfuse.kernels._common as kernels_common  # noqa: E402
from bertfuse.bert.hf import encoder_parts, fuse, fuse_report  # noqa: E402

# What a tiny model sets, on every config and sub-config that has the field. Heads of 8 (a head_dim the kernel
# supports, 32 / 4); a hidden size divisible by the heads of every family tried.
pytestmark = pytest.mark.slow  # the slow tier (RUN_SLOW=1)

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=99,
             dim=32, n_layers=2, n_heads=4, hidden_dim=37, d_model=32, encoder_layers=2, decoder_layers=1,
             encoder_attention_heads=4, decoder_attention_heads=4, num_layers=2, embed_dim=32, num_heads=4,
             encoder_ffn_dim=37, decoder_ffn_dim=37, ffn_dim=37, image_size=32, patch_size=8, num_frames=2,
             max_position_embeddings=64, type_vocab_size=2, embedding_size=32, projection_dim=32)
DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout",
            "hidden_dropout", "classifier_dropout", "activation_dropout")
# Sizes tied to others that SIZES changed (LayoutLMv3 splits its hidden size 4:2 between box coordinates and
# shapes, LiLT in sixths; RADIO's patch_dim is 3 x patch_size^2).
OVERRIDES = {"layoutlmv3": dict(coordinate_size=4, shape_size=8), "lilt": dict(hidden_size=48),
             "radio": dict(patch_dim=192), "eurobert": dict(num_key_value_heads=2)}  # k/v heads dividing the 4
MAX_PARAMETERS = 200_000_000   # a "tiny" config still larger than this keeps some size we do not know of
# The model types whose attention stays fused: the true copies of BERT's layer (and DistilBERT's), MPNet, ALBERT,
# the rotary encoders (ModernBERT, NomicBERT, EuroBERT, ESM, RoFormer), DeBERTa and DeBERTa-v2, and the models
# holding one as a part (DPR's encoders are BertModels; ModernVBERT's and PE Audio's text towers are ModernBertModels).
FUSED_ATTENTION = {"bert", "bert-generation", "camembert", "roberta", "xlm-roberta", "data2vec-text", "electra",
                   "ernie", "layoutlm", "markuplm", "roc_bert", "splinter", "tapas", "visual_bert", "distilbert",
                   "dpr", "mpnet", "albert", "modernbert", "modernvbert", "pe_audio", "nomic_bert", "eurobert", "esm",
                   "roformer", "deberta", "deberta-v2", "grounding-dino", "mm-grounding-dino", "vision-text-dual-encoder"}
LOOK_ALIKES = {"mra", "nystromformer", "yoso"}   # BERT's submodule names, other attention math


def _shrink(config, seen=None) -> None:
    seen = set() if seen is None else seen
    if id(config) in seen:
        return
    seen.add(id(config))
    for name, value in SIZES.items():
        if isinstance(getattr(config, name, None), int) and not isinstance(getattr(config, name), bool):
            setattr(config, name, value)
    for name in DROPOUTS:
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    ids = [getattr(config, n, None) for n in ("pad_token_id", "bos_token_id", "eos_token_id")]
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    if isinstance(getattr(config, "vocab_size", None), int) and ids and max(ids) >= config.vocab_size:
        config.vocab_size = max(ids) + 1  # the special ids index the shrunk embedding table
    for value in vars(config).values():
        if isinstance(value, transformers.PretrainedConfig):
            _shrink(value, seen)


def _model_types():
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return sorted(t for t in transformers.CONFIG_MAPPING if t in MODEL_MAPPING_NAMES)


def _config(model_type: str):
    config = transformers.AutoConfig.for_model(model_type)
    _shrink(config)
    for name, value in OVERRIDES.get(model_type, {}).items():
        setattr(config, name, value)
    return config


def _build(model_type: str, device=None):
    """A tiny random base model of `model_type` (on `device`), or pytest.skip with why it cannot be built here."""
    try:
        config = _config(model_type)
        torch.manual_seed(0)
        with torch.device(device or "cpu"):
            return transformers.AutoModel.from_config(config).eval()
    except Exception as e:  # noqa: BLE001  a type needing a package, a checkpoint or a config we cannot guess
        pytest.skip(f"not built offline: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")


def _inputs(module: torch.nn.Module) -> dict | None:
    """Padded token ids (lengths 9 and 5) or pixel values for the encoder model `module`, by its main input."""
    config = module.config
    name = getattr(module, "main_input_name", "input_ids")
    params = inspect.signature(module.forward).parameters
    g = torch.Generator().manual_seed(3)
    if name == "input_ids" and "input_ids" in params:
        ids = torch.randint(3, min(config.vocab_size, 99), (2, 9), generator=g)
        mask = (torch.arange(9)[None] < torch.tensor([[9], [5]])).long()
        pad = getattr(config, "pad_token_id", None)
        ids = ids.masked_fill(mask == 0, pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else 0)
        return dict(input_ids=ids, attention_mask=mask) if "attention_mask" in params else dict(input_ids=ids)
    if name == "pixel_values" and "pixel_values" in params:
        size = getattr(config, "image_size", 32)
        h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
        shape = (2, getattr(config, "num_channels", 3), h, w)
        if hasattr(config, "num_frames"):  # video encoders: frames first
            shape = (2, config.num_frames, *shape[1:])
        return dict(pixel_values=torch.randn(shape, generator=g))
    return None


def _extra_inputs(model_type: str, module, inputs: dict) -> dict:
    """What a few encoders need besides their main input: boxes, visual features, a language."""
    config, g = module.config, torch.Generator().manual_seed(5)
    if model_type in ("bros", "lilt", "layoutlmv3", "layoutlm") and "input_ids" in inputs:
        corners = torch.randint(0, 500, (2, 9, 2, 2), generator=g).sort(dim=2).values.flatten(2)
        return dict(inputs, bbox=corners)
    if model_type == "lxmert":
        return dict(inputs, visual_feats=torch.randn(2, 3, config.visual_feat_dim, generator=g),
                    visual_pos=torch.rand(2, 3, config.visual_pos_dim, generator=g))
    if model_type == "tvp":  # text and video frames
        return dict(inputs, pixel_values=torch.randn(2, 2, 3, 32, 32, generator=g))
    if model_type == "vilt":
        return dict(inputs, pixel_values=torch.randn(2, config.num_channels, config.image_size, config.image_size,
                                                     generator=g))
    return inputs


def _tensors(out) -> list[torch.Tensor]:
    """Every floating-point tensor of an output, nested tuples and ModelOutputs flattened."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else []
    return [t for v in values for t in _tensors(v)]


def _compare(part_ref, part_fused, inputs) -> tuple[float, float, str]:
    """(output error, worst gradient error, worst gradient's name) of one encoder model, fused against unfused:
    every output tensor, at real positions where it is per token."""
    mask = inputs.get("attention_mask")
    torch.manual_seed(6)  # the same draws for models that draw (ViLT samples image patches)
    a = _tensors(part_ref(**inputs))
    torch.manual_seed(6)
    b = _tensors(part_fused(**inputs))
    assert [t.shape for t in a] == [t.shape for t in b]
    keep = [mask.bool() if mask is not None and t.dim() >= 2 and t.shape[:2] == mask.shape else slice(None)
            for t in a]
    a, b = torch.cat([t[k].flatten() for t, k in zip(a, keep)]), torch.cat([t[k].flatten() for t, k in zip(b, keep)])
    weights = torch.randn(a.shape, generator=torch.Generator().manual_seed(4))
    (a * weights).sum().backward()
    (b * weights).sum().backward()
    _with_grads(part_ref)
    _with_grads(part_fused)
    errs = grad_errors(part_fused, part_ref) if any(p.grad.any() for p in part_ref.parameters()) else {"": 0.0}
    worst = max(errs, key=errs.get)
    return rel_err(b, a), errs[worst], worst


def _with_grads(module):
    """Parameters that take no part in the output have no gradient on either side: compared as zero."""
    for p in module.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)


@pytest.mark.parametrize("model_type", _model_types())
def test_fusing_any_model_type_changes_no_number(model_type, monkeypatch):
    monkeypatch.setattr(kernels_common, "INTERPRET", False)  # the fused ops' PyTorch path (see the docstring)
    meta = _build(model_type, "meta")  # what is inside, without spending time or memory on weights
    parts = encoder_parts(meta)
    if not parts:
        with pytest.raises(ValueError, match="no encoder inside"):
            fuse(meta)
        assert model_type not in FUSED_ATTENTION
        return
    size = sum(p.numel() for p in meta.parameters())
    del meta
    if size > MAX_PARAMETERS:
        pytest.skip(f"an encoder inside, and still {size:,} parameters after shrinking")
    ref = _build(model_type)
    if model_type == "xmod":  # its adapters are per language: the first one
        ref.set_default_language(ref.config.languages[0])
    try:
        parts = encoder_parts(ref)
        fused = copy.deepcopy(ref)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fuse(fused)
        reports = {r.path: r for r in fuse_report(fused)}
        attention = any(f.startswith("attention (varlen, padding removed once") for r in reports.values()
                        for f in r.fused)
        assert attention == (model_type in FUSED_ATTENTION), [str(r) for r in reports.values()]
        if model_type in LOOK_ALIKES:
            assert all(what != "attention" or "known" in why for r in reports.values() for what, why in r.kept)
        fused_modules = dict(fused.named_modules())
        checked = 0
        for path, part, _ in parts:
            inputs = _inputs(part)
            if inputs is None:
                continue
            inputs = _extra_inputs(model_type, part, inputs)
            twin = fused if path == type(ref).__name__ else fused_modules[path]
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    part(**inputs)
            except Exception as e:  # noqa: BLE001  needs inputs of its own (boxes, visual features...)
                if model_type in FUSED_ATTENTION:
                    raise
                warnings.warn(f"{model_type} at {path}: not run ({type(e).__name__}: {str(e)[:80]})")
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out_err, grad_err, worst = _compare(part, twin, inputs)
            assert out_err <= TOL, (path, out_err)
            assert grad_err <= TOL, (path, worst, grad_err)
            checked += 1
        if not checked:
            pytest.skip(f"fused ({'; '.join(str(r) for r in reports.values())}) but no input we can build runs it")
    finally:
        gc.collect()

"""Hugging Face checkpoint interop: `from_pretrained` / `save_pretrained` for our BERT models.

Reads an HF directory (config.json plus model.safetensors, pytorch_model.bin loaded with weights_only=True, or
their sharded index) and writes config.json plus model.safetensors that transformers loads with no missing or
unexpected keys. Files are written atomically (temporary name, then rename), so a crash never leaves a torn file.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

from bertfuse.bert.common.files import atomic_write, atomic_write_text

logger = logging.getLogger("bert")


# Keys that alias another parameter (the MLM decoder is tied to the word embeddings and the head's bias);
# HF leaves them out of saved files, and so do we.
TIED_ALIASES = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


@dataclass
class LoadingInfo:
    missing_keys: list[str] = field(default_factory=list)      # initialised fresh (e.g. a new task head)
    unexpected_keys: list[str] = field(default_factory=list)   # in the checkpoint, unused by this model


def _load_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def has_weights(directory: str) -> bool:
    """Whether `directory` holds model weights read_state_dict reads (a file or a sharded index)."""
    return any(os.path.isfile(os.path.join(directory, name + suffix)) for name in WEIGHT_FILES
               for suffix in ("", ".index.json"))


def read_state_dict(directory: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory, preferring safetensors."""
    for name in WEIGHT_FILES:
        single, index = os.path.join(directory, name), os.path.join(directory, name + ".index.json")
        if os.path.isfile(single):
            return _load_file(single)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            sd = {}
            for shard in shards:
                sd.update(_load_file(os.path.join(directory, shard)))
            return sd
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or sharded index) in {directory}")


def _normalise_keys(sd: dict[str, torch.Tensor], own_keys: set[str], prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in sd.items():
        if key.endswith("embeddings.position_ids") or key.endswith("embeddings.token_type_ids"):
            continue  # buffers some versions saved; ours are not state
        if "LayerNorm.gamma" in key or "LayerNorm.beta" in key:  # checkpoints converted from TF
            key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if prefix and key not in own_keys and f"{prefix}.{key}" in own_keys:
            key = f"{prefix}.{key}"          # a bare BertModel checkpoint loaded into a task model
        elif not prefix and key.startswith("bert.") and key[5:] in own_keys:
            key = key[5:]                     # a task-model checkpoint loaded into a bare BertModel
        out[key] = value
    # An old file may carry the decoder bias only under its tied alias.
    if "cls.predictions.bias" in own_keys and "cls.predictions.bias" not in out and TIED_ALIASES[1] in out:
        out["cls.predictions.bias"] = out[TIED_ALIASES[1]]
    for alias in TIED_ALIASES:
        out.pop(alias, None)
    return out


class PretrainedMixin:
    """from_pretrained / save_pretrained for nn.Modules that have `config` and `tie_weights()`."""

    loading_info: LoadingInfo | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **config_overrides):
        """Build the model from an HF directory. Keyword arguments override config fields (e.g. backend="torch")."""
        from bertfuse.bert.model.config import BertConfig

        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} is not a directory with config.json and model weights")
        model = cls(BertConfig.from_json_file(path, **config_overrides))
        model.loading_info = model.load_hf_state_dict(read_state_dict(path))
        info = model.loading_info
        if info.missing_keys:
            logger.warning("%s: newly initialised (not in %s): %s", cls.__name__, path, ", ".join(info.missing_keys))
        if info.unexpected_keys:
            logger.warning("%s: unused weights of %s: %s", cls.__name__, path, ", ".join(info.unexpected_keys))
        return model

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> LoadingInfo:
        """Load HF-named tensors (with or without the `bert.` prefix) and report what was new and unused."""
        own = self.state_dict()
        own_keys = set(own) - set(TIED_ALIASES)
        sd = _normalise_keys(sd, own_keys, self.base_model_prefix)
        for key in own_keys & set(sd):
            if tuple(sd[key].shape) != tuple(own[key].shape):
                raise ValueError(f"checkpoint tensor {key} has shape {tuple(sd[key].shape)}, "
                                 f"the model expects {tuple(own[key].shape)} (does config.json match the weights?)")
        usable = {k: v for k, v in sd.items() if k in own_keys}
        self.load_state_dict(usable, strict=False)
        self.tie_weights()
        return LoadingInfo(sorted(own_keys - set(usable)), sorted(set(sd) - own_keys))

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write config.json and model.safetensors (tied aliases left out, as HF does), each atomically."""
        from safetensors.torch import save_file

        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items() if k not in TIED_ALIASES}
        atomic_write(os.path.join(path, "model.safetensors"),
                     lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        atomic_write_text(os.path.join(path, "config.json"),
                          self.config.to_json_string(architectures=[type(self).__name__]))

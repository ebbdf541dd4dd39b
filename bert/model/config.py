"""BERT configuration with Hugging Face's field names, read from and written to config.json."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from bertfuse.bert.common.files import read_json_object

BACKENDS = ("auto", "torch", "triton")


# HF activation names we implement, mapped to the GeLU flavour the kernels take.
ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


# Keys HF writes that mean nothing for an encoder-only BERT; dropped on read, not carried in `extra`.
_HF_BOOKKEEPING = {"transformers_version", "dtype", "torch_dtype", "_name_or_path", "architectures", "model_type"}


_PRESETS = {
    # The paper's two models.
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    # Small ones for tests and CPU runs (the shapes of Google's BERT-Mini and BERT-Tiny).
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
}


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    # Task heads (HF names).
    num_labels: int = 2
    id2label: dict[int, str] | None = None
    classifier_dropout: float | None = None
    # Runtime switch, never written to config.json: which implementation of the hot ops to run.
    backend: str = "auto"
    # Whatever else config.json held, written back unchanged so round trips keep it.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.id2label is not None:
            self.id2label = {int(k): v for k, v in self.id2label.items()}
            self.num_labels = len(self.id2label)
        self.validate()

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads ({self.num_attention_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; use one of {sorted(ACTIVATIONS)}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.extra.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported "
                             f"(config has position_embedding_type={self.extra['position_embedding_type']!r})")
        if self.extra.get("is_decoder") or self.extra.get("add_cross_attention"):
            raise ValueError("this BERT is encoder-only; is_decoder/add_cross_attention configs are not supported")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def gelu_approximate(self) -> str:
        return ACTIVATIONS[self.hidden_act]

    @property
    def label2id(self) -> dict[str, int] | None:
        return None if self.id2label is None else {v: k for k, v in self.id2label.items()}

    # ---- presets -------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    @classmethod
    def base(cls, **overrides) -> "BertConfig":
        return cls.preset("base", **overrides)

    @classmethod
    def large(cls, **overrides) -> "BertConfig":
        return cls.preset("large", **overrides)

    @classmethod
    def tiny(cls, **overrides) -> "BertConfig":
        return cls.preset("tiny", **overrides)

    @classmethod
    def mini(cls, **overrides) -> "BertConfig":
        return cls.preset("mini", **overrides)

    # ---- config.json ---------------------------------------------------------------------------
    def replace(self, **overrides) -> "BertConfig":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown BertConfig field(s): {sorted(unknown)}")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["extra"] = dict(self.extra)
        d.update(overrides)
        if "num_labels" in overrides and "id2label" not in overrides and self.id2label is not None \
                and overrides["num_labels"] != len(self.id2label):
            d["id2label"] = None
        return BertConfig(**d)

    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides) -> "BertConfig":
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "backend"}
        kwargs = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known and k not in _HF_BOOKKEEPING
                 and k not in ("label2id", "backend")}
        if d.get("model_type", "bert") != "bert":
            raise ValueError(f"config.json describes a {d['model_type']!r} model, not 'bert'")
        config = cls(**kwargs, extra=extra)
        return config.replace(**overrides) if overrides else config

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "backend")}
        d.update(self.extra)
        if self.id2label is None:
            d.pop("id2label")
        else:
            d["id2label"] = {str(k): v for k, v in self.id2label.items()}
            d["label2id"] = self.label2id
        if d.get("classifier_dropout") is None:
            d.pop("classifier_dropout")
        d["model_type"] = "bert"
        return d

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, **overrides) -> "BertConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_dict(read_json_object(path), **overrides)

    def to_json_string(self, architectures: list[str] | None = None) -> str:
        d = self.to_dict()
        if architectures:
            d["architectures"] = architectures
        return json.dumps(dict(sorted(d.items())), indent=2) + "\n"

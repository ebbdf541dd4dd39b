"""Where a run's weights start: `--init-from PATH`, the weights of another run or of a published checkpoint.

PATH is a run directory (its final model or, before it has one, its latest checkpoint), one of its checkpoints
(OUTPUT_DIR/checkpoints/step-N), or a Hugging Face BERT directory (config.json and weights). Only the weights
load: the optimizer, the schedule and the step count start fresh, which is what the second phase of a
pre-training recipe and continued pre-training of a published checkpoint do. The architecture is the weights'
(`StartingPoint.config`), so a --config given beside it must describe the same one and the positions must cover
--max-seq-len (`check_start`), and a tokenizer must have the weights' vocabulary (`check_tokenizer`): each a
clear error before any work. Every encoder tensor must load; a head the weights lack (the MLM and NSP heads of a checkpoint
that ships the encoder only, the pooler and NSP head of an MLM-only run) starts fresh, and `load_start` says so.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from bertfuse.bert.data.tokenizer import load_tokenizer, tokenizer_digest
from bertfuse.bert.model.checkpoint import LoadingInfo, has_weights, read_state_dict
from bertfuse.bert.model.config import BertConfig
from bertfuse.bert.train.rundir import latest_checkpoint

# What makes two configs the same network (the rest, dropout and initialisation, may differ).
ARCHITECTURE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
                "max_position_embeddings", "type_vocab_size", "layer_norm_eps")


class StartingPoint(NamedTuple):
    path: str                 # the directory whose weights load
    config: BertConfig        # its config.json
    tokenizer: str | None     # the tokenizer saved with the weights (a directory), if there is one


def starting_point(path: str, backend: str = "auto") -> StartingPoint:
    """The weights --init-from PATH names (see the module docstring); reads config.json only."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--init-from {path}: no such directory (give a run directory, one of its "
                                "checkpoints, or a Hugging Face BERT directory)")
    weights = path if has_weights(path) else latest_checkpoint(path)
    if weights is None:
        raise FileNotFoundError(f"--init-from {path}: no model weights (model.safetensors or pytorch_model.bin) "
                                "and no checkpoint in it")
    try:
        config = BertConfig.from_json_file(weights, backend=backend)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--init-from {weights}: {e}") from None
    candidates = (weights, os.path.join(path, "tokenizer"))
    tokenizer = next((c for c in candidates if any(os.path.isfile(os.path.join(c, name))
                                                   for name in ("tokenizer.json", "vocab.txt"))), None)
    return StartingPoint(weights, config, tokenizer)


def check_start(start: StartingPoint, given: BertConfig | None, given_name: str | None, max_seqlen: int) -> None:
    """The run's settings against the weights': a --config (`given`, named `given_name`) of another architecture,
    or fewer positions than `max_seqlen`, is one error naming both."""
    if given is not None:
        differ = [f"{k} {getattr(given, k)!r} (--config {given_name}) but {getattr(start.config, k)!r}"
                  for k in ARCHITECTURE if getattr(given, k) != getattr(start.config, k)]
        if differ:
            raise ValueError(f"--init-from {start.path}: the weights are another architecture than --config: "
                             f"{'; '.join(differ)}. Leave --config out (the architecture comes from the weights)")
    if max_seqlen > start.config.max_position_embeddings:
        raise ValueError(f"--max-seq-len {max_seqlen} is longer than the {start.config.max_position_embeddings} "
                         f"positions of the weights at {start.path}")


def check_tokenizer(start: StartingPoint, tokenizer, given: str | None) -> None:
    """The run's tokenizer against the weights': one given (`given`, --tokenizer) that is not the tokenizer saved
    with them (by content), or any of another vocabulary size than their embeddings, is one error naming both."""
    if given and start.tokenizer and tokenizer_digest(load_tokenizer(start.tokenizer)) != tokenizer_digest(tokenizer):
        raise ValueError(f"--tokenizer {given} is not the tokenizer saved with the --init-from weights "
                         f"({start.tokenizer}): not the vocabulary they were trained with; leave --tokenizer out to "
                         "use theirs")
    if tokenizer.get_vocab_size() != start.config.vocab_size:
        raise ValueError(f"--init-from {start.path}: its vocabulary has {start.config.vocab_size} tokens, the "
                         f"tokenizer {tokenizer.get_vocab_size()}; use the tokenizer saved with the weights"
                         + (f" ({start.tokenizer})" if start.tokenizer else ""))


def load_start(model, start: StartingPoint) -> LoadingInfo:
    """Load the weights into `model` (a BertForPreTraining or BertForMaskedLM built from start.config): every
    encoder tensor must be there; what else is missing starts fresh (LoadingInfo.missing_keys), what the model
    has no place for is left out (unexpected_keys)."""
    info = model.load_hf_state_dict(read_state_dict(start.path))
    encoder = [k for k in info.missing_keys if k.startswith("bert.") and not k.startswith("bert.pooler.")]
    if encoder:
        raise ValueError(f"--init-from {start.path}: the weights lack {len(encoder)} encoder tensor(s) "
                         f"({', '.join(encoder[:4])}{'...' if len(encoder) > 4 else ''}): not a BERT checkpoint "
                         "of this architecture")
    return info


def describe(start: StartingPoint, info: LoadingInfo) -> str:
    """One line for the console: where the weights came from, what started fresh and what was left out."""
    parts = [f"weights from {start.path} (fresh optimizer, schedule and step count)"]
    if info.missing_keys:
        parts.append(f"newly initialised, not in it: {', '.join(info.missing_keys)}")
    if info.unexpected_keys:
        parts.append(f"left out, no place in this model: {', '.join(info.unexpected_keys)}")
    return "; ".join(parts)

"""One family's small models run through transformers' own common model tests (`ModelTesterMixin`), plus a
few checks of our own in the spirit of transformers' per-model tests (causal LM loss, decoder caches, cross-
attention, pre-training outputs). Copied by bench/hf_suite.py next to the `hf_tests` package it unpacks from the
transformers source distribution; the family and the number of heads come from BERTFUSE_FAMILY / BERTFUSE_HEADS.
Written for this project (the upstream per-model testers were read, not copied)."""
from __future__ import annotations

import inspect
import os
import unittest

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_PRETRAINING_MAPPING_NAMES

from bertfuse.bert.hf import PAIR_HEADS, family
from hf_tests.test_configuration_common import ConfigTester
from hf_tests.test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor, random_attention_mask
from hf_tests.generation.test_utils import GenerationTesterMixin

FAMILY = family(os.environ.get("BERTFUSE_FAMILY", "bert"))
HEADS = int(os.environ.get("BERTFUSE_HEADS", "4"))
HEADS_SUFFIXES = ("Model", "ForMaskedLM", "ForPreTraining", "ForNextSentencePrediction", "LMHeadModel",
                  "ForCausalLM", "ForSequenceClassification", "ForMultipleChoice", "ForTokenClassification",
                  "ForQuestionAnswering")
MODEL_CLASSES = tuple(getattr(transformers, FAMILY.prefix + s) for s in HEADS_SUFFIXES
                      if hasattr(transformers, FAMILY.prefix + s))
CONFIG = getattr(transformers, FAMILY.prefix + "Config")
NAMES = dict(FAMILY.config_names)


def _pair_head(model_class):
    """The sentence-pair head (bert.hf.PAIR_HEADS) whose label `model_class`'s forward takes, or None."""
    params = inspect.signature(model_class.forward).parameters
    return next((h for h in PAIR_HEADS if h.label in params), None)


class FamilyTester:
    """Sizes as transformers' testers use them: hidden 32, 2 layers; 4 heads (head_dim 8) or 2 (head_dim 16)."""
    batch_size, seq_length, is_training = 13, 7, True
    vocab_size, hidden_size, num_hidden_layers, intermediate_size = 99, 32, 2, 37
    num_labels, num_choices, type_sequence_label_size, type_vocab_size = 3, 4, 2, 16

    def __init__(self, parent):
        self.parent = parent
        self.num_attention_heads = HEADS

    def get_config(self, **changes):
        sizes = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                     num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                     intermediate_size=self.intermediate_size, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1, max_position_embeddings=512, initializer_range=0.02)
        if FAMILY.name != "distilbert":  # DistilBERT names its activation otherwise, and uses GeLU
            sizes.update(hidden_act="gelu")
        if FAMILY.segments:
            sizes.update(type_vocab_size=self.type_vocab_size)
        sizes = {NAMES.get(k, k): v for k, v in sizes.items()}  # the family's test config wins (ALBERT's gelu_new)
        return CONFIG(**dict(sizes, **dict(FAMILY.test_config), pad_token_id=FAMILY.pad_token_id, **changes))

    def prepare_config_and_inputs(self):
        ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        ids[ids == FAMILY.pad_token_id] = FAMILY.pad_token_id + 2  # RoBERTa counts positions past its padding id
        inputs = {"input_ids": ids, "attention_mask": random_attention_mask([self.batch_size, self.seq_length])}
        if FAMILY.segments:
            inputs["token_type_ids"] = ids_tensor([self.batch_size, self.seq_length], 2)
        return self.get_config(), inputs

    def prepare_config_and_inputs_for_common(self):
        return self.prepare_config_and_inputs()


GENERATES = any(c.can_generate() for c in MODEL_CLASSES)


class FamilyModelTest(ModelTesterMixin, *((GenerationTesterMixin,) if GENERATES else ()), unittest.TestCase):
    all_model_classes = MODEL_CLASSES

    def setUp(self):
        self.model_tester = FamilyTester(self)
        self.config_tester = ConfigTester(self, config_class=CONFIG, **{NAMES.get("hidden_size", "hidden_size"): 37})

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class.__name__ in MODEL_FOR_PRETRAINING_MAPPING_NAMES.values():
            t = self.model_tester
            inputs_dict["labels"] = torch.zeros((t.batch_size, t.seq_length), dtype=torch.long)
            if pair := _pair_head(model_class):  # BERT's next-sentence or ALBERT's sentence-order label
                inputs_dict[pair.label] = torch.zeros(t.batch_size, dtype=torch.long)
        return inputs_dict

    def test_config(self):
        self.config_tester.run_common_tests()

    # ---- our own per-model checks -------------------------------------------------------------------
    def _model(self, suffix, **changes):
        cls = getattr(transformers, FAMILY.prefix + suffix, None)
        if cls is None:
            self.skipTest(f"{FAMILY.prefix} has no {suffix}")
        config, inputs = self.model_tester.prepare_config_and_inputs()
        for k, v in changes.items():
            setattr(config, k, v)
        return cls(config).eval(), inputs

    def test_model_shapes_with_and_without_masks(self):
        model, inputs = self._model("Model")
        t = self.model_tester
        for drop in ((), ("attention_mask",), ("attention_mask", "token_type_ids")):
            out = model(**{k: v for k, v in inputs.items() if k not in drop})
            self.assertEqual(out.last_hidden_state.shape, (t.batch_size, t.seq_length, t.hidden_size))

    def test_masked_lm_returns_logits_and_loss(self):
        model, inputs = self._model("ForMaskedLM")
        labels = ids_tensor([self.model_tester.batch_size, self.model_tester.seq_length], self.model_tester.vocab_size)
        out = model(**inputs, labels=labels)
        t = self.model_tester
        self.assertEqual(out.logits.shape, (t.batch_size, t.seq_length, t.vocab_size))
        ref = torch.nn.functional.cross_entropy(out.logits.reshape(-1, t.vocab_size), labels.reshape(-1))
        torch.testing.assert_close(out.loss, ref)

    def test_pretraining_outputs(self):
        model, inputs = self._model("ForPreTraining")
        pair = _pair_head(type(model))
        if pair is None:  # ELECTRA's pre-training model is its discriminator
            self.skipTest("pre-training heads of MLM + a sentence-pair head (BERT's NSP, ALBERT's SOP) only")
        t = self.model_tester
        labels = ids_tensor([t.batch_size, t.seq_length], t.vocab_size)
        out = model(**inputs, labels=labels, **{pair.label: ids_tensor([t.batch_size], 2)})
        self.assertEqual(out.prediction_logits.shape, (t.batch_size, t.seq_length, t.vocab_size))
        self.assertEqual(out[1].shape, (t.batch_size, t.seq_length, t.vocab_size))
        self.assertEqual(getattr(out, pair.logits).shape, (t.batch_size, 2))
        self.assertIsNone(model(**inputs, labels=labels).loss)

    def _causal(self):
        suffix = "LMHeadModel" if hasattr(transformers, FAMILY.prefix + "LMHeadModel") else "ForCausalLM"
        return self._model(suffix, is_decoder=True)

    def test_causal_lm_loss_is_next_token(self):
        model, inputs = self._causal()
        t = self.model_tester
        labels = ids_tensor([t.batch_size, t.seq_length], t.vocab_size)
        out = model(**inputs, labels=labels)
        self.assertEqual(out.logits.shape, (t.batch_size, t.seq_length, t.vocab_size))
        shifted = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, t.vocab_size).float(),
                                                    labels[:, 1:].reshape(-1))
        torch.testing.assert_close(out.loss, shifted)

    def test_decoder_cache_matches_full_forward(self):
        model, inputs = self._causal()
        ids, mask = inputs["input_ids"], torch.ones_like(inputs["input_ids"])
        past = model(ids, attention_mask=mask, use_cache=True).past_key_values
        more = ids_tensor([self.model_tester.batch_size, 3], self.model_tester.vocab_size)
        more[more == FAMILY.pad_token_id] = FAMILY.pad_token_id + 2
        full_mask = torch.ones(ids.shape[0], ids.shape[1] + 3, dtype=torch.long)
        full = model(torch.cat([ids, more], 1), attention_mask=full_mask).logits[:, -3:]
        step = model(more, attention_mask=full_mask, past_key_values=past).logits
        torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)

    def test_cross_attention_decoder(self):
        if FAMILY.name == "distilbert":
            self.skipTest("no cross-attention in this family")
        model, inputs = self._model("Model", is_decoder=True, add_cross_attention=True)
        t = self.model_tester
        enc = floats_tensor([t.batch_size, t.seq_length, t.hidden_size])
        out = model(**inputs, encoder_hidden_states=enc, encoder_attention_mask=ids_tensor(enc.shape[:2], 2))
        self.assertEqual(out.last_hidden_state.shape, (t.batch_size, t.seq_length, t.hidden_size))

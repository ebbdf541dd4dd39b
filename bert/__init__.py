"""A BERT whose hot ops can run as fused Triton kernels (see `kernels`), with Hugging Face interop."""
from bert.common.packages import collision, ours
from bert.data.tokenizer import load_tokenizer
from bert.model.config import BertConfig
from bert.model.modeling import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)

__all__ = [
    "load_tokenizer",
    "ours",
    "collision",
    "BertConfig",
    "BertModel",
    "BertForPreTraining",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertForQuestionAnswering",
]

__bertfuse__ = True  # this distribution's `bert`, not another of the same name (bert.common.packages)

"""A BERT whose hot ops can run as fused Triton kernels (see `bertfuse.kernels`), with Hugging Face interop."""

if __name__ == "bert":  # the bare folder name, from the repository root: not this package's name (bertfuse._bare)
    from bertfuse._bare import elsewhere

    elsewhere(__name__, __file__)
else:
    from bertfuse.bert.data.tokenizer import load_tokenizer
    from bertfuse.bert.model.config import BertConfig
    from bertfuse.bert.model.modeling import (
        BertForMaskedLM,
        BertForPreTraining,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertModel,
    )

    __all__ = [
        "load_tokenizer",
        "BertConfig",
        "BertModel",
        "BertForPreTraining",
        "BertForMaskedLM",
        "BertForSequenceClassification",
        "BertForTokenClassification",
        "BertForQuestionAnswering",
    ]

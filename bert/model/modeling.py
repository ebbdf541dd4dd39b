"""BERT (Devlin et al., 2019) on packed, unpadded tokens.

Module and parameter names follow Hugging Face's `modeling_bert.py`, so state_dicts load both ways. Padding is
removed once after validating the inputs; every layer then works on [total_tokens, hidden]; outputs are padded
back at the end. The hot ops go through `bert.model.ops`, which picks PyTorch or the Triton kernels by
`config.backend`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bertfuse.bert.data.batch import Packed, check_packed_labels, checks_are_free
from bertfuse.bert.model import ops
from bertfuse.bert.model.checkpoint import PretrainedMixin
from bertfuse.bert.model.config import BertConfig
from bertfuse.bert.model.padding import kept, pad, to_tokens, unpad


# ---- outputs (HF's field names) ------------------------------------------------------------------
@dataclass
class BertModelOutput:
    last_hidden_state: torch.Tensor           # [batch, seq, hidden], zeros at padded positions
    pooler_output: torch.Tensor | None        # [batch, hidden]


@dataclass
class BertForPreTrainingOutput:
    loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None   # [batch, seq, vocab] without labels; see BertForPreTraining
    seq_relationship_logits: torch.Tensor | None = None
    mlm_loss: torch.Tensor | None = None
    nsp_loss: torch.Tensor | None = None
    mlm_correct: torch.Tensor | None = None          # top-1 hits among labelled tokens
    mlm_count: torch.Tensor | None = None            # number of labelled tokens


@dataclass
class MaskedLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    mlm_correct: torch.Tensor | None = None
    mlm_count: torch.Tensor | None = None


@dataclass
class SequenceClassifierOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclass
class TokenClassifierOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclass
class QuestionAnsweringModelOutput:
    loss: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None
    end_logits: torch.Tensor | None = None


# ---- input checks --------------------------------------------------------------------------------
def check_labels(labels, high, name, shape, keep=None, ignore_index=-100):
    """labels must lie in [0, high) or equal ignore_index, and be ignore_index wherever keep is False."""
    if labels.is_floating_point():
        raise ValueError(f"{name} must be integer class ids, got dtype {labels.dtype}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(labels.shape)}, expected {tuple(shape)}")
    if labels.numel() == 0:
        return
    used = labels != ignore_index
    bad = (used & ((labels < 0) | (labels >= high))).sum()
    on_pad = (used & ~keep.bool()).sum() if keep is not None else torch.zeros_like(bad)
    if torch.compiler.is_compiling():  # no sync inside a compiled graph: a device assertion stops the step
        torch._assert_async((bad + on_pad) == 0, f"{name} must lie in [0, {high}) or be the ignore index "
                            f"{ignore_index}, and be {ignore_index} at padded positions (attention_mask == 0)")
        return
    bad, on_pad = torch.stack([bad, on_pad]).tolist()
    if bad:
        raise ValueError(f"{name} has {bad} value(s) outside [0, {high}) that are not the ignore index {ignore_index}")
    if on_pad:
        raise ValueError(f"{name} sets {on_pad} padded position(s) (attention_mask == 0); use {ignore_index} there")


def cross_entropy(logits, labels, ignore_index=-100):
    """Mean cross-entropy (float32) over the rows whose label is not ignore_index; 0, with zero gradients, when
    there are none (an all-ignored or empty batch), where F.cross_entropy's mean over nothing is NaN. No sync."""
    total = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")
    return total / (labels != ignore_index).sum().clamp_min(1)


def check_positions(positions, keep, name):
    """QA start/end positions: each in [0, seq_len] (seq_len and beyond: ignored) and never on padding."""
    if positions.is_floating_point() or tuple(positions.shape) != (keep.shape[0],):
        raise ValueError(f"{name} must be integer positions of shape ({keep.shape[0]},), got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    inside = (positions >= 0) & (positions < keep.shape[1])
    at = positions.clamp(0, max(keep.shape[1] - 1, 0))
    on_pad = int((inside & ~keep.bool().gather(1, at[:, None]).squeeze(1)).sum()) if keep.numel() else 0
    if on_pad:
        raise ValueError(f"{name} points at {on_pad} padded position(s) (attention_mask == 0)")


# ---- modules -------------------------------------------------------------------------------------
class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids, position_ids, backend):
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)
        x = ops.layer_norm(x, self.LayerNorm.weight, self.LayerNorm.bias, self.LayerNorm.eps, backend=backend)
        return self.dropout(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def forward(self, x, p: Packed, backend):
        # One matmul for q, k and v (ops.project_qkv); the parameters stay three HF-named Linears.
        return ops.self_attention(x, p, self.query, self.key, self.value, self.num_attention_heads,
                                  self.attention_head_size, self.dropout.p if self.training else 0.0, backend)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig, in_features: int | None = None):
        super().__init__()
        self.dense = nn.Linear(in_features or config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, residual, backend):
        p = self.dropout.p if self.training else 0.0
        ln = self.LayerNorm
        return ops.layer_norm(self.dense(x), ln.weight, ln.bias, ln.eps, residual=residual, dropout_p=p, backend=backend)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x, p, backend):
        return self.output(self.self(x, p, backend), x, backend)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.approximate = config.gelu_approximate

    def forward(self, x, backend):
        return ops.linear_gelu(x, self.dense.weight, self.dense.bias, self.approximate, backend=backend)


class BertOutput(BertSelfOutput):
    def __init__(self, config: BertConfig):
        super().__init__(config, in_features=config.intermediate_size)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x, p, backend):
        x = self.attention(x, p, backend)
        return self.output(self.intermediate(x, backend), x, backend)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x, p, backend):
        for layer in self.layer:
            x = layer(x, p, backend)
        return x


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, first_token):
        return self.activation(self.dense(first_token))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.approximate = config.gelu_approximate

    def forward(self, x, backend):
        x = ops.linear_gelu(x, self.dense.weight, self.dense.bias, self.approximate, backend=backend)
        return ops.layer_norm(x, self.LayerNorm.weight, self.LayerNorm.bias, self.LayerNorm.eps, backend=backend)


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        # The decoder's weight is tied to the word embeddings (set by the owning model: never allocated here, on
        # the meta device until then) and its bias is `bias`.
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.decoder.bias = self.bias

    def forward(self, x, backend):
        return self.decoder(self.transform(x, backend))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)


class BertPreTrainingHeads(BertOnlyMLMHead):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


# ---- models --------------------------------------------------------------------------------------
class BertPreTrainedModel(PretrainedMixin, nn.Module):
    base_model_prefix = "bert"

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config

    @property
    def backend(self) -> str:
        return ops.resolve_backend(self.config.backend)

    def init_weights(self):
        """HF's initialisation: N(0, initializer_range) for linear and embedding weights, zero biases."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            if isinstance(m, BertLMPredictionHead):
                nn.init.zeros_(m.bias)
        self.tie_weights()

    def tie_weights(self):
        head = getattr(getattr(self, "cls", None), "predictions", None)
        if head is not None:
            head.decoder.weight = self.bert.embeddings.word_embeddings.weight
            head.decoder.bias = head.bias


class BertModel(BertPreTrainedModel):
    base_model_prefix = ""

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True, init: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        if init:  # task models initialise everything once, their heads included
            self.init_weights()

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, cu_seqlens=None,
               max_seqlen=None, row_aligned: bool = False, validate: bool = False):
        """The model's one edge (bert.model.padding.to_tokens): a padded call or a packed one (cu_seqlens and
        max_seqlen), checked once, then the encoder on packed tokens. Returns (hidden [T, hidden], Packed)."""
        weight = self.embeddings.word_embeddings.weight
        if isinstance(input_ids, torch.Tensor) and input_ids.device != weight.device:
            raise ValueError(f"input_ids is on {input_ids.device} but the model is on {weight.device}")
        t = to_tokens(self.config, input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens, max_seqlen,
                      row_aligned, validate)
        x = self.embeddings(t.input_ids, t.token_type_ids, t.position_ids, self.backend)
        return self.encoder(x, t.layout, self.backend), t.layout

    def pool(self, hidden, p: Packed):
        """The pooled vector of each sequence's first token ([CLS]); zeros for an empty sequence. No sync."""
        if self.pooler is None:
            return None
        if hidden.shape[0] == 0:
            return self.pooler(hidden.new_zeros(p.sequences, hidden.shape[-1]))
        nonempty = (p.cu_seqlens[1:] > p.cu_seqlens[:-1])[:, None]
        first = hidden[p.cu_seqlens[:-1].long().clamp(0, hidden.shape[0] - 1)]
        return self.pooler(torch.where(nonempty, first, 0))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                **packed) -> BertModelOutput:
        """last_hidden_state is [batch, seq, hidden] for a padded call, [T, hidden] for a packed one."""
        hidden, p = self.encode(input_ids, attention_mask, token_type_ids, position_ids, **packed)
        return BertModelOutput(last_hidden_state=pad(hidden, p), pooler_output=self.pool(hidden, p))


class _MLMMixin:
    """Masked-LM loss on labelled positions only: gather, transform, decode, cross-entropy; one path for padded
    labels ([batch, seq], -100 where unlabelled) and packed ones (positions into the tokens and their labels)."""

    def _mlm_targets(self, p: Packed, labels, mlm_positions, mlm_labels, next_sentence_label, validate):
        """(positions [R], labels [R]) into the packed tokens, from either kind of labels, checked."""
        if p.origin is not None:
            if mlm_positions is not None or mlm_labels is not None:
                raise ValueError("mlm_positions and mlm_labels label a packed batch; a padded one takes labels")
            o = p.origin
            check_labels(labels, self.config.vocab_size, "labels", (o.batch, o.seqlen), keep=kept(p))
            flat = unpad(labels, p)
            rows = ops.labelled_rows(flat)
            return rows, flat[rows]
        if labels is not None:
            raise ValueError("a packed batch takes mlm_positions and mlm_labels, not labels")
        check_packed_labels(self.config, p, mlm_positions, mlm_labels, next_sentence_label,
                            validate or checks_are_free(p.cu_seqlens))
        return mlm_positions, mlm_labels

    def _mlm(self, hidden, positions, labels):
        """The loss at `positions` (hidden's rows). A slot whose position is outside the tokens or whose label is
        outside the vocabulary (-100: unused) counts for nothing and reads nothing out of bounds."""
        total = hidden.shape[0]
        usable = (positions >= 0) & (positions < total) & (labels >= 0) & (labels < self.config.vocab_size)
        labels = torch.where(usable, labels, -100)
        head, backend = self.cls.predictions, self.backend
        h = head.transform(hidden[positions.clamp(0, max(total - 1, 0))], backend)
        return ops.masked_lm_loss(h, head.decoder.weight, head.bias, labels, backend=backend), usable.sum()


def _nsp_loss(p: Packed, logits, next_sentence_label):
    if p.origin is not None:  # packed labels were checked with the MLM ones
        check_labels(next_sentence_label, 2, "next_sentence_label", (p.sequences,))
    return cross_entropy(logits, next_sentence_label)


class BertForPreTraining(_MLMMixin, BertPreTrainedModel):
    """BERT with the MLM head (decoder tied to the word embeddings) and the NSP head.

    A padded call (HF's) or a packed one (bert.data.batch.PackedBatch): labelled tokens
    are then mlm_positions [R] (indices into the tokens) with mlm_labels [R], next_sentence_label [S]; -100 marks
    unused slots, and a sequence whose next_sentence_label is -100 is filler (a row's tail, an unused slot). The
    same instances packed (any cu_seqlens) or padded give the same losses and gradients. A packed call has every
    shape fixed by (T, S, R) and waits for nothing, so torch.compile traces it whole and a CUDA graph captures it;
    its label values are checked (`check_packed_labels`) with `validate` (one sync) and whenever the batch is on
    the CPU (free).

    Without labels, `prediction_logits` is the full [batch, seq, vocab] (zeros at padding), as in HF. With labels,
    only labelled positions go through the head; `prediction_logits` then holds their logits [labelled, vocab] on
    the torch backend and is None on the triton backend, which never forms them.
    """

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, init=False)
        self.cls = BertPreTrainingHeads(config)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                next_sentence_label=None, *, cu_seqlens=None, max_seqlen=None, row_aligned: bool = False,
                mlm_positions=None, mlm_labels=None, validate: bool = False) -> BertForPreTrainingOutput:
        hidden, p = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens=cu_seqlens,
                                     max_seqlen=max_seqlen, row_aligned=row_aligned, validate=validate)
        nsp_logits = self.cls.seq_relationship(self.bert.pool(hidden, p))
        out = BertForPreTrainingOutput(seq_relationship_logits=nsp_logits)
        if labels is None and mlm_labels is None:
            out.prediction_logits = pad(self.cls.predictions(hidden, self.backend), p)
        else:
            positions, targets = self._mlm_targets(p, labels, mlm_positions, mlm_labels, next_sentence_label,
                                                   validate)
            mlm, out.mlm_count = self._mlm(hidden, positions, targets)
            out.mlm_loss, out.mlm_correct, out.prediction_logits = mlm
        if next_sentence_label is not None:
            out.nsp_loss = _nsp_loss(p, nsp_logits, next_sentence_label)
        losses = [l for l in (out.mlm_loss, out.nsp_loss) if l is not None]
        out.loss = sum(losses) if losses else None
        return out


class BertForMaskedLM(_MLMMixin, BertPreTrainedModel):
    """As BertForPreTraining without NSP (padded or packed); with labels, `logits` covers labelled positions only."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False, init=False)
        self.cls = BertOnlyMLMHead(config)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None, *,
                cu_seqlens=None, max_seqlen=None, row_aligned: bool = False, mlm_positions=None, mlm_labels=None,
                validate: bool = False) -> MaskedLMOutput:
        hidden, p = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens=cu_seqlens,
                                     max_seqlen=max_seqlen, row_aligned=row_aligned, validate=validate)
        if labels is None and mlm_labels is None:
            return MaskedLMOutput(logits=pad(self.cls.predictions(hidden, self.backend), p))
        positions, targets = self._mlm_targets(p, labels, mlm_positions, mlm_labels, None, validate)
        mlm, count = self._mlm(hidden, positions, targets)
        return MaskedLMOutput(loss=mlm.loss, logits=mlm.logits, mlm_correct=mlm.correct, mlm_count=count)


class BertForSequenceClassification(BertPreTrainedModel):
    """[CLS] pooled -> dropout -> linear. Integer labels: cross-entropy; num_labels == 1: regression (MSE)."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, init=False)
        p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                labels=None) -> SequenceClassifierOutput:
        hidden, p = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids)
        logits = self.classifier(self.dropout(self.bert.pool(hidden, p)))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
            elif labels.is_floating_point():  # multi-label targets in [0, 1]
                loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float())
            else:
                check_labels(labels, self.num_labels, "labels", (p.sequences,), ignore_index=-100)
                loss = cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class BertForTokenClassification(BertPreTrainedModel):
    """Per-token linear head; logits are zero at padded positions and labels there must be -100."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False, init=False)
        p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                labels=None) -> TokenClassifierOutput:
        hidden, p = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids)
        logits = self.classifier(self.dropout(hidden))
        loss = None
        if labels is not None:
            check_labels(labels, self.num_labels, "labels", input_ids.shape, keep=kept(p))
            loss = cross_entropy(logits, unpad(labels, p))
        return TokenClassifierOutput(loss=loss, logits=pad(logits, p))


class BertForQuestionAnswering(BertPreTrainedModel):
    """Start and end vectors (the two rows of `qa_outputs`) dotted with every token, softmax over the sequence.

    Padded positions get the dtype's lowest value as logit, so they never win and never enter the loss.
    Positions outside the input (e.g. an answer cut off by the window) are ignored in the loss, as in HF.
    """

    def __init__(self, config: BertConfig):
        # HF sizes qa_outputs by num_labels; start and end make it 2, and the saved config must say so.
        config = config.replace(num_labels=2) if config.num_labels != 2 else config
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False, init=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                start_positions=None, end_positions=None) -> QuestionAnsweringModelOutput:
        hidden, p = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids)
        logits = pad(self.qa_outputs(hidden), p, fill=torch.finfo(hidden.dtype).min)
        start_logits, end_logits = logits.float().unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            for name, positions in (("start_positions", start_positions), ("end_positions", end_positions)):
                check_positions(positions.view(-1), kept(p), name)
            ignored = p.origin.seqlen  # HF's convention: positions clamped to seq_len are ignored
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (cross_entropy(start_logits, start, ignore_index=ignored)
                    + cross_entropy(end_logits, end, ignore_index=ignored)) / 2
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)

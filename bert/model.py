"""BERT (Devlin et al., 2019) on packed, unpadded tokens.

Module and parameter names follow Hugging Face's `modeling_bert.py`, so state_dicts load both ways. Padding is
removed once after validating the inputs; every layer then works on [total_tokens, hidden]; outputs are padded
back at the end. The hot ops go through `bert.ops`, which picks PyTorch or the Triton kernels by `config.backend`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .checkpoint import PretrainedMixin
from .config import BertConfig
from .padding import Unpadded, checks_are_free, pack_check, packed_layout, pad, read_values, unpad, unpad_mask


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
def _check_int_tensor(name, t, shape, device):
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer ids, got dtype {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (the shape of input_ids)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but input_ids is on {device}")


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

    def forward(self, x, u: Unpadded, backend):
        # One matmul for q, k and v (ops.project_qkv); the parameters stay three HF-named Linears.
        return ops.self_attention(x, u, self.query, self.key, self.value, self.num_attention_heads,
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

    def forward(self, x, u, backend):
        return self.output(self.self(x, u, backend), x, backend)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.approximate = config.gelu_approximate

    def forward(self, x, backend):
        # The bias is added inside the GeLU so the fused kernel reads the matmul's output once.
        return ops.bias_gelu(F.linear(x, self.dense.weight), self.dense.bias, self.approximate, backend=backend)


class BertOutput(BertSelfOutput):
    def __init__(self, config: BertConfig):
        super().__init__(config, in_features=config.intermediate_size)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x, u, backend):
        x = self.attention(x, u, backend)
        return self.output(self.intermediate(x, backend), x, backend)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x, u, backend):
        for layer in self.layer:
            x = layer(x, u, backend)
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
        x = ops.bias_gelu(F.linear(x, self.dense.weight), self.dense.bias, self.approximate, backend=backend)
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

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        """Validate, unpad and run the encoder. Returns (hidden [total_tokens, hidden], Unpadded)."""
        cfg = self.config
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a [batch, seq_len] tensor, got {shape}")
        device, (batch, seqlen) = input_ids.device, input_ids.shape
        _check_int_tensor("input_ids", input_ids, None, device)
        if device != self.embeddings.word_embeddings.weight.device:
            raise ValueError(f"input_ids is on {device} but the model is on {self.embeddings.word_embeddings.weight.device}")
        if position_ids is None and seqlen > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {seqlen} is longer than max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if tuple(attention_mask.shape) != (batch, seqlen):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, seqlen)} "
                             "(the shape of input_ids)")
        if attention_mask.device != device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but input_ids is on {device}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        _check_int_tensor("token_type_ids", token_type_ids, (batch, seqlen), device)
        if position_ids is None:
            position_ids = torch.arange(seqlen, device=device).expand(batch, seqlen)
        _check_int_tensor("position_ids", position_ids, (batch, seqlen), device)

        keep = attention_mask != 0
        seqlens = keep.sum(1, dtype=torch.int32)
        # Every range check and the sizes the unpadding needs come back in one device sync.
        # Padded positions are not checked: their ids are never read.
        ranges = []
        for t in (input_ids, token_type_ids, position_ids):
            t = t.masked_fill(~keep, 0)
            ranges += [t.min(), t.max()] if t.numel() else [t.new_zeros(())] * 2
        stats = torch.stack([*ranges, seqlens.max() if batch else seqlens.new_zeros(()), seqlens.sum()]).tolist()
        (id_lo, id_hi, tt_lo, tt_hi, pos_lo, pos_hi, max_seqlen, total) = stats
        if id_lo < 0 or id_hi >= cfg.vocab_size:
            raise ValueError(f"input_ids must lie in [0, vocab_size={cfg.vocab_size}); got values in [{id_lo}, {id_hi}]")
        if tt_lo < 0 or tt_hi >= cfg.type_vocab_size:
            raise ValueError(f"token_type_ids must lie in [0, type_vocab_size={cfg.type_vocab_size}); "
                             f"got values in [{tt_lo}, {tt_hi}]")
        if pos_lo < 0 or pos_hi >= cfg.max_position_embeddings:
            raise ValueError(f"position_ids must lie in [0, max_position_embeddings={cfg.max_position_embeddings}); "
                             f"got values in [{pos_lo}, {pos_hi}]")

        u = unpad_mask(keep, seqlens, max_seqlen)
        backend = self.backend
        x = self.embeddings(unpad(input_ids, u), unpad(token_type_ids, u), unpad(position_ids, u), backend)
        return self.encoder(x, u, backend), u

    def pool(self, hidden, u: Unpadded):
        """The pooled vector of each sequence's first real token ([CLS]); zeros for an empty sequence."""
        if self.pooler is None:
            return None
        first = hidden.new_zeros(u.batch, hidden.shape[-1])
        nonempty = (u.cu_seqlens[1:] > u.cu_seqlens[:-1]).nonzero().squeeze(1)
        first = first.index_put((nonempty,), hidden[u.cu_seqlens[:-1].long()[nonempty]])
        return self.pooler(first)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> BertModelOutput:
        hidden, u = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        return BertModelOutput(last_hidden_state=pad(hidden, u), pooler_output=self.pool(hidden, u))

    def encode_packed(self, input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen: int,
                      validate: bool = False):
        """A packed batch (bert.packing), every shape fixed: input_ids, token_type_ids, position_ids [T] in rows of
        max_seqlen tokens that no sequence crosses, the sequences one after another as cu_seqlens [S + 1] says
        (empty ones allowed), filler after the last. Returns (hidden [T, hidden], Unpadded). No host sync, unless
        `validate` checks the values (one sync); a batch on the CPU is always checked (no sync to save)."""
        max_seqlen = pack_check(self.config, input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen,
                                validate)
        u = packed_layout(cu_seqlens, input_ids.shape[0], max_seqlen)
        x = self.embeddings(input_ids, token_type_ids, position_ids, self.backend)
        return self.encoder(x, u, self.backend), u

    def pool_packed(self, hidden, u: Unpadded):
        """pool() for a packed batch, without a sync: an empty sequence reads a clamped row and is zeroed."""
        if self.pooler is None:
            return None
        starts = u.cu_seqlens[:-1].long().clamp(max=hidden.shape[0] - 1)
        nonempty = (u.cu_seqlens[1:] > u.cu_seqlens[:-1]).to(hidden.dtype)[:, None]
        return self.pooler(hidden[starts] * nonempty)


class _MLMMixin:
    """Masked-LM loss on labelled positions only: gather, transform, decode, cross-entropy."""

    def _mlm(self, hidden, u, labels):
        check_labels(labels, self.config.vocab_size, "labels", (u.batch, u.seqlen), keep=self._keep(u))
        labels = unpad(labels, u)
        rows = (labels != -100).nonzero().squeeze(1)
        head, backend = self.cls.predictions, self.backend
        h = head.transform(hidden[rows], backend)
        out = ops.masked_lm_loss(h, head.decoder.weight, head.bias, labels[rows], backend=backend)
        return out, rows.new_tensor(rows.numel())

    @staticmethod
    def _keep(u: Unpadded):
        keep = torch.zeros(u.batch * u.seqlen, dtype=torch.bool, device=u.indices.device)
        return keep.index_fill(0, u.indices, True).view(u.batch, u.seqlen)


class BertForPreTraining(_MLMMixin, BertPreTrainedModel):
    """BERT with the MLM head (decoder tied to the word embeddings) and the NSP head.

    Without `labels`, `prediction_logits` is the full [batch, seq, vocab] (zeros at padding), as in HF.
    With `labels`, only labelled positions go through the head; `prediction_logits` then holds their logits
    [num_labelled, vocab] on the torch backend and is None on the triton backend, which never forms them.
    """

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, init=False)
        self.cls = BertPreTrainingHeads(config)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                labels=None, next_sentence_label=None, *, cu_seqlens=None, max_seqlen=None, mlm_positions=None,
                mlm_labels=None, validate: bool = False) -> BertForPreTrainingOutput:
        """HF's padded call; given cu_seqlens, a packed batch instead (see forward_packed), so that a trainer or
        DistributedDataParallel can call the module itself with either kind of batch."""
        if cu_seqlens is not None:
            return self.forward_packed(input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen,
                                       mlm_positions, mlm_labels, next_sentence_label, validate)
        hidden, u = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids)
        nsp_logits = self.cls.seq_relationship(self.bert.pool(hidden, u))
        out = BertForPreTrainingOutput(seq_relationship_logits=nsp_logits)
        if labels is None:
            out.prediction_logits = pad(self.cls.predictions(hidden, self.backend), u)
        else:
            mlm, out.mlm_count = self._mlm(hidden, u, labels)
            out.mlm_loss, out.mlm_correct, out.prediction_logits = mlm
        if next_sentence_label is not None:
            check_labels(next_sentence_label, 2, "next_sentence_label", (u.batch,))
            out.nsp_loss = cross_entropy(nsp_logits, next_sentence_label)
        losses = [l for l in (out.mlm_loss, out.nsp_loss) if l is not None]
        out.loss = sum(losses) if losses else None
        return out

    def forward_packed(self, input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen: int, mlm_positions,
                       mlm_labels, next_sentence_label, validate: bool = False) -> BertForPreTrainingOutput:
        """Pre-training on a packed batch (bert.packing.PackingCollator): the labelled tokens are given as
        mlm_positions [R] (indices into the tokens) with mlm_labels [R], next_sentence_label [S]; -100 marks
        unused slots, and a sequence whose next_sentence_label is -100 is filler (a row's tail, an unused slot).
        The same instances packed or padded give the same losses and gradients. Every shape is fixed by (T, S, R)
        and nothing waits for the device, so torch.compile traces it whole and a CUDA graph can capture it.

        The values are checked (`check_packed_labels`) with `validate` (one sync) and always when the batch is on
        the CPU (free). Unchecked, a slot whose position lies outside [0, T) or whose label lies outside the
        vocabulary counts for nothing, on both backends: never a read out of bounds."""
        hidden, u = self.bert.encode_packed(input_ids, token_type_ids, position_ids, cu_seqlens, max_seqlen,
                                            validate)
        check_packed_labels(self.config, cu_seqlens, input_ids.shape[0], mlm_positions, mlm_labels,
                            next_sentence_label, validate or checks_are_free(cu_seqlens))
        nsp_logits = self.cls.seq_relationship(self.bert.pool_packed(hidden, u))
        head, total = self.cls.predictions, input_ids.shape[0]
        usable = (mlm_positions >= 0) & (mlm_positions < total) & (mlm_labels >= 0) & \
            (mlm_labels < self.config.vocab_size)
        mlm_labels = torch.where(usable, mlm_labels, -100)
        h = head.transform(hidden[mlm_positions.clamp(0, max(total - 1, 0))], self.backend)
        mlm = ops.masked_lm_loss(h, head.decoder.weight, head.bias, mlm_labels, backend=self.backend)
        nsp_loss = cross_entropy(nsp_logits, next_sentence_label)
        return BertForPreTrainingOutput(loss=mlm.loss + nsp_loss, prediction_logits=mlm.logits,
                                        seq_relationship_logits=nsp_logits, mlm_loss=mlm.loss, nsp_loss=nsp_loss,
                                        mlm_correct=mlm.correct, mlm_count=(mlm_labels != -100).sum())


def check_packed_labels(config, cu_seqlens, total: int, positions, labels, nsp, check_values: bool) -> None:
    """The label side of a packed batch: shapes and dtypes always; with check_values (one read) that every used
    MLM slot (label != -100) has a label in the vocabulary and a position inside an instance (in [0, T), before
    cu_seqlens[-1], in a sequence with an NSP label), no position twice, and NSP labels in {0, 1, -100}, none on
    an empty sequence."""
    sequences = cu_seqlens.numel() - 1
    for name, t, shape in (("mlm_positions", positions, labels.shape), ("mlm_labels", labels, positions.shape),
                           ("next_sentence_label", nsp, (sequences,))):
        if t.is_floating_point() or t.dtype == torch.bool or tuple(t.shape) != tuple(shape) or t.dim() != 1:
            raise ValueError(f"packed {name} must be a 1-D integer tensor of shape {tuple(shape)}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if not check_values:
        return
    used, nsp_used = labels != -100, nsp != -100
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    inside = (positions >= 0) & (positions < total) & (positions < cu_seqlens[-1].long())
    # The sequence of each position (clamped: positions outside are counted apart), and whether it is an instance.
    seq = torch.searchsorted(cu_seqlens[1:].contiguous().long(), positions.clamp(0, max(total - 1, 0)), right=True)
    in_instance = nsp_used[seq.clamp(max=max(sequences - 1, 0))] if sequences else torch.zeros_like(used)
    key = torch.where(used, positions, -1 - torch.arange(positions.numel(), device=positions.device)).sort().values
    counts = read_values(torch.stack([
        (used & ((labels < 0) | (labels >= config.vocab_size))).sum(), (used & ~inside).sum(),
        (used & inside & ~in_instance).sum(), (key[1:] == key[:-1]).sum(),
        (nsp_used & ((nsp < 0) | (nsp > 1))).sum(), (nsp_used & (lens <= 0)).sum()]))
    problems = [f"{n} {message}" for n, message in zip(counts, (
        f"mlm_labels outside [0, {config.vocab_size}) (and not -100)",
        f"mlm_positions outside the sequences of the {total} tokens (negative, past cu_seqlens[-1] or the tokens)",
        "mlm_positions in filler (a sequence whose next_sentence_label is -100)",
        "mlm_positions given twice", "next_sentence_label(s) outside {0, 1, -100}",
        "next_sentence_label(s) on an empty sequence")) if n]
    if problems:
        raise ValueError("packed batch: " + "; ".join(problems))


class BertForMaskedLM(_MLMMixin, BertPreTrainedModel):
    """As BertForPreTraining without NSP; with `labels`, `logits` covers labelled positions only (see there)."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False, init=False)
        self.cls = BertOnlyMLMHead(config)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                labels=None) -> MaskedLMOutput:
        hidden, u = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids)
        if labels is None:
            return MaskedLMOutput(logits=pad(self.cls.predictions(hidden, self.backend), u))
        mlm, count = self._mlm(hidden, u, labels)
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
        hidden, u = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids)
        logits = self.classifier(self.dropout(self.bert.pool(hidden, u)))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
            elif labels.is_floating_point():  # multi-label targets in [0, 1]
                loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float())
            else:
                check_labels(labels, self.num_labels, "labels", (u.batch,), ignore_index=-100)
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
        hidden, u = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids)
        logits = self.classifier(self.dropout(hidden))
        loss = None
        if labels is not None:
            check_labels(labels, self.num_labels, "labels", (u.batch, u.seqlen), keep=_MLMMixin._keep(u))
            loss = cross_entropy(logits, unpad(labels, u))
        return TokenClassifierOutput(loss=loss, logits=pad(logits, u))


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
        hidden, u = self.bert.encode(input_ids, attention_mask, token_type_ids, position_ids)
        logits = pad(self.qa_outputs(hidden), u, fill=torch.finfo(hidden.dtype).min)
        start_logits, end_logits = logits.float().unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            for name, positions in (("start_positions", start_positions), ("end_positions", end_positions)):
                check_positions(positions.view(-1), _MLMMixin._keep(u), name)
            ignored = u.seqlen  # HF's convention: positions clamped to seq_len are ignored
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (cross_entropy(start_logits, start, ignore_index=ignored)
                    + cross_entropy(end_logits, end, ignore_index=ignored)) / 2
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)

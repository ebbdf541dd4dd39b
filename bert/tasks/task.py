"""The fine-tuning tasks (`TASKS`): for each, its command-line options, its head, its features and its metrics."""
from __future__ import annotations

import json

from bertfuse.bert.model.modeling import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification
from bertfuse.bert.tasks.metrics import accuracy_and_macro_f1, ner_scores, squad_scores
from bertfuse.bert.tasks.readers import (
    Features,
    classification_features,
    decode_answers,
    ner_features,
    qa_windows,
    read_classification,
    read_conll,
    read_squad,
)


class Task:
    """What a fine-tuning task supplies; adding one (GLUE pairs, multiple choice...) means adding a subclass
    and an entry in TASKS. `model_cls` is one of bert.model's heads."""
    name = ""
    model_cls = None
    prediction_file = "predictions.txt"
    # bert-finetune's defaults for this task (options left unset; a resumed run takes its saved values instead)
    defaults = {"max_seq_len": 128, "doc_stride": 128}

    def __init__(self, tokenizer, max_seqlen: int, **options):
        self.tok, self.max_seqlen, self.options = tokenizer, max_seqlen, options

    @classmethod
    def check_arguments(cls, args) -> None:
        """This task's checks of the parsed bert-finetune options, before any work (none by default)."""

    def read(self, source: str, split: str) -> list:
        raise NotImplementedError

    def labels_from(self, data, model_config: dict) -> dict[int, str] | None:
        """id -> label: the model's own when it names every label found, else the labels found, ordered."""
        found = self.labels_in(data)
        known = {int(k): v for k, v in (model_config.get("id2label") or {}).items()}
        if known and found <= set(known.values()) and not set(known.values()) <= {f"LABEL_{i}" for i in known}:
            return known
        return dict(enumerate(self.order(found)))

    def labels_in(self, data) -> set[str]:
        raise NotImplementedError

    def order(self, labels: set[str]) -> list[str]:
        return sorted(labels)

    def features(self, data, label2id, train: bool) -> Features:
        raise NotImplementedError

    def count(self, batch: dict):
        """How many items the model's loss averages over in this batch: a tensor on the batch's device (the loss
        terms scale by it without a host sync), or an int."""
        return (batch["labels"] != -100).sum()

    def hits(self, out, batch):
        """Correct predictions among the counted items (a device scalar), for the logged accuracy."""
        return (out.logits.argmax(-1) == batch["labels"]).sum()

    def predict(self, outputs, data, features: Features, id2label) -> tuple[dict, list]:
        """(metrics, predictions) from the model outputs of every evaluation batch."""
        raise NotImplementedError

    def write_predictions(self, data, predictions, path: str) -> None:
        raise NotImplementedError


class ClassifyTask(Task):
    """GLUE-style TSV, single sentences or pairs; [CLS] pooled -> dropout -> linear; accuracy and macro F1."""
    name = "classify"
    model_cls = BertForSequenceClassification

    def read(self, source, split):
        return read_classification(source, split)

    def labels_in(self, data):
        return {e.label for e in data}

    def order(self, labels):  # integers numerically, then names
        return sorted(labels, key=lambda x: (not x.lstrip("-").isdigit(), int(x) if x.lstrip("-").isdigit() else 0, x))

    def features(self, data, label2id, train):
        return Features(classification_features(data, self.tok, label2id, self.max_seqlen))

    def predict(self, outputs, data, features, id2label):
        pred_ids = [int(p) for out in outputs for p in out.logits.float().argmax(-1).cpu()]
        scores = accuracy_and_macro_f1(pred_ids, [f["labels"] for f in features.rows])
        return scores, [id2label[p] for p in pred_ids]

    def write_predictions(self, data, predictions, path):
        with open(path, "w", encoding="utf-8") as f:
            f.write("prediction\tlabel\n")
            f.writelines(f"{p}\t{e.label}\n" for p, e in zip(predictions, data))


class NerTask(Task):
    """CoNLL-2003; labels on each word's first sub-token; entity-level P/R/F1 (seqeval); predictions per word."""
    name = "ner"
    model_cls = BertForTokenClassification

    def read(self, source, split):
        return read_conll(source, split)

    def labels_in(self, data):
        return {t for s in data for t in s.tags}

    def order(self, labels):  # O first, then entity types with B- before I-
        return sorted(labels, key=lambda t: (t != "O", t[2:], t[:2]))

    def features(self, data, label2id, train):
        return Features(ner_features(data, self.tok, label2id, self.max_seqlen))

    def predict(self, outputs, data, features, id2label):
        tags = [row for out in outputs for row in out.logits.float().argmax(-1).cpu()]
        predicted = []
        for s, f, p in zip(data, features.rows, tags):
            words = [id2label[int(p[t])] for t in f["first_token"]]
            predicted.append(words + ["O"] * (len(s.words) - len(words)))  # words cut off by max_seqlen
        return ner_scores([s.tags for s in data], predicted), predicted

    def write_predictions(self, data, predictions, path):
        with open(path, "w", encoding="utf-8") as f:
            for s, tags in zip(data, predictions):
                f.writelines(f"{w} {g} {p}\n" for w, g, p in zip(s.words, s.tags, tags))
                f.write("\n")


class QATask(Task):
    """SQuAD v1.1; question as segment A, passage as B in overlapping windows; start/end vectors; n-best
    decoding over windows; exact match and F1."""
    name = "qa"
    prediction_file = "predictions.json"
    model_cls = BertForQuestionAnswering
    defaults = {"max_seq_len": 384, "doc_stride": 128}  # BERT's SQuAD settings

    @classmethod
    def check_arguments(cls, args):
        if args.doc_stride >= args.max_seq_len:
            raise ValueError(f"--doc-stride {args.doc_stride} must be smaller than --max-seq-len {args.max_seq_len}")

    def read(self, source, split):
        return read_squad(source, split)

    def labels_from(self, data, model_config):
        return None

    def features(self, data, label2id, train):
        windows = qa_windows(data, self.tok, self.max_seqlen, self.options["doc_stride"])
        rows = [{"input_ids": w.input_ids, "token_type_ids": w.token_type_ids} for w in windows]
        if train:
            for r, w in zip(rows, windows):
                r.update(start_positions=w.start_position, end_positions=w.end_position)
        return Features(rows, windows)

    def count(self, batch):
        return len(batch["start_positions"])

    def hits(self, out, batch):
        return ((out.start_logits.argmax(-1) == batch["start_positions"])
                & (out.end_logits.argmax(-1) == batch["end_positions"])).sum()

    def predict(self, outputs, data, features, id2label):
        starts = [row for out in outputs for row in out.start_logits.float().cpu()]
        ends = [row for out in outputs for row in out.end_logits.float().cpu()]
        answers = decode_answers(data, features.windows, starts, ends, self.options["n_best"],
                                 self.options["max_answer_len"])
        return squad_scores(answers, {ex.qid: ex.answers for ex in data if ex.answers}), answers

    def write_predictions(self, data, predictions, path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(predictions, f, indent=1, ensure_ascii=False)


TASKS = {task.name: task for task in (ClassifyTask, NerTask, QATask)}

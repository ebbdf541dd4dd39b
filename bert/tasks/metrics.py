"""Evaluation metrics: accuracy and macro F1, entity-level NER scores (seqeval), SQuAD v1.1 exact match and F1."""
from __future__ import annotations

import collections
import re
import string


def accuracy_and_macro_f1(predictions: list[int], labels: list[int]) -> dict[str, float]:
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    if not labels:
        return {"accuracy": 0.0, "macro_f1": 0.0}
    f1s = []
    for c in sorted(set(labels) | set(predictions)):
        tp = sum(p == c and y == c for p, y in zip(predictions, labels))
        fp = sum(p == c and y != c for p, y in zip(predictions, labels))
        fn = sum(p != c and y == c for p, y in zip(predictions, labels))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return {"accuracy": sum(p == y for p, y in zip(predictions, labels)) / len(labels),
            "macro_f1": sum(f1s) / len(f1s)}


def ner_scores(gold: list[list[str]], predicted: list[list[str]]) -> dict[str, float]:
    """Entity-level precision, recall and F1 (seqeval, IOB2, strict matching of type and span)."""
    from seqeval.metrics import f1_score, precision_score, recall_score
    from seqeval.scheme import IOB2

    kw = dict(mode="strict", scheme=IOB2, zero_division=0)
    return {"precision": precision_score(gold, predicted, **kw), "recall": recall_score(gold, predicted, **kw),
            "f1": f1_score(gold, predicted, **kw)}


def normalize_answer(text: str) -> str:
    """SQuAD v1.1's normalisation: lower case, drop punctuation and the articles a/an/the, squeeze spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def squad_exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def squad_f1(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], answers: dict[str, list[str]]) -> dict[str, float]:
    """Exact match and F1 in percent, each the best over a question's gold answers, averaged over questions."""
    if not answers:
        return {"exact_match": 0.0, "f1": 0.0}
    em = f1 = 0.0
    for qid, golds in answers.items():
        pred = predictions.get(qid, "")
        em += max(squad_exact_match(pred, g) for g in golds)
        f1 += max(squad_f1(pred, g) for g in golds)
    return {"exact_match": 100 * em / len(answers), "f1": 100 * f1 / len(answers)}

"""Metrics against values worked out by hand."""
import pytest

from bertfuse.bert.tasks.metrics import accuracy_and_macro_f1, ner_scores, normalize_answer, squad_exact_match, squad_f1, squad_scores


def test_accuracy_and_macro_f1():
    # class 0: tp=2 fp=1 fn=0 -> F1 0.8; class 1: tp=1 fp=0 fn=1 -> F1 2/3
    out = accuracy_and_macro_f1([0, 0, 1, 0], [0, 0, 1, 1])
    assert out["accuracy"] == 0.75
    assert out["macro_f1"] == pytest.approx((0.8 + 2 / 3) / 2)


def test_seqeval_entity_level_iob2():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O"]]
    # gold entities: PER, LOC, ORG; predicted: PER, ORG(wrong span type), ORG -> 2 correct of 3 and 3
    out = ner_scores(gold, pred)
    assert out["precision"] == pytest.approx(2 / 3) and out["recall"] == pytest.approx(2 / 3)
    assert out["f1"] == pytest.approx(2 / 3)
    # A span cut short is wrong under strict matching.
    assert ner_scores([["B-PER", "I-PER"]], [["B-PER", "O"]])["f1"] == 0.0


@pytest.mark.parametrize("text, expected", [
    ("The Denver Broncos!", "denver broncos"),
    ("an apple, a pear and the plum.", "apple pear and plum"),
    ("  Théâtre   du  Soleil ", "théâtre du soleil"),
    ("Anthem", "anthem"),            # 'an' inside a word stays
    ("1,000 years", "1000 years"),
])
def test_squad_normalisation(text, expected):
    assert normalize_answer(text) == expected


def test_squad_em_and_f1():
    assert squad_exact_match("the Broncos", "Broncos") == 1.0
    # pred tokens [denver, broncos, team], gold [broncos]: precision 1/3, recall 1 -> F1 0.5
    assert squad_f1("Denver Broncos team", "Broncos") == pytest.approx(0.5)
    assert squad_f1("", "Broncos") == 0.0
    scores = squad_scores({"q1": "Denver Broncos", "q2": "Carolina"},
                          {"q1": ["Broncos", "Denver Broncos"], "q2": ["Carolina Panthers"]})
    assert scores["exact_match"] == pytest.approx(50.0)
    assert scores["f1"] == pytest.approx(100 * (1.0 + 2 / 3) / 2)

"""bert.data.instances: NSP instances as spans of the flat corpus, drawn without touching a token."""
import numpy as np

from bertfuse.bert.data.instances import SPAN, draw_spans, gather, span_lengths
from batch_utils import materialize
from test_pipeline import SPECIAL, corpus


def test_spans_are_the_instances_and_trimming_stays_inside_their_sentences():
    """A true continuation starts after A in A's document; a random B comes from another document (a token of
    this corpus names its document: (t - 100) // 37)."""
    c = corpus(20)
    spans = draw_spans(c, np.arange(20), 48, seed=1)
    assert spans.dtype == SPAN and (span_lengths(spans) <= 48).all() and (spans["a_len"] > 0).all()
    assert (spans["b_len"] > 0).all() and 0.3 < spans["label"].mean() < 0.7
    doc = (c.tokens.astype(np.int64) - 100) // 37
    a_doc, b_doc = doc[spans["a_start"]], doc[spans["b_start"]]
    true_next = spans["label"] == 0
    assert (a_doc[true_next] == b_doc[true_next]).all() and (a_doc[~true_next] != b_doc[~true_next]).all()
    assert (spans["b_start"][true_next] >= spans["a_start"][true_next] + spans["a_len"][true_next]).all()
    ends = spans["a_start"] + spans["a_len"] - 1  # A never runs past its document
    assert (doc[ends] == a_doc).all()
    for x, span in zip(materialize(c, spans[:50], SPECIAL.cls, SPECIAL.sep), spans[:50]):
        assert x["input_ids"][1:1 + span["a_len"]] == c.tokens[span["a_start"]:span["a_start"] + span["a_len"]].tolist()
    assert np.array_equal(draw_spans(c, np.arange(20), 48, 1), spans)


def test_gather_lays_out_cls_a_sep_b_sep_with_segment_ids():
    c = corpus(4)
    spans = np.array([(3, 2, 10, 3, 1), (0, 1, 5, 1, 0)], dtype=SPAN)
    ids, types = gather(c, spans, cls=2, sep=3)
    t = c.tokens.tolist()
    assert ids.tolist() == [2, t[3], t[4], 3, t[10], t[11], t[12], 3, 2, t[0], 3, t[5], 3]
    assert types.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1]
    assert span_lengths(spans).tolist() == [8, 5]
    assert [x["next_sentence_label"] for x in materialize(c, spans, 2, 3)] == [1, 0]
    assert gather(c, spans[:0], 2, 3)[0].shape == (0,)


def test_a_corpus_of_one_sentence_documents_is_named_for_its_skewed_nsp_labels():
    """Sentence-per-row files: every B comes from another document, so "random next" is far more than half."""
    from bertfuse.bert.data.corpus import TokenisedCorpus
    from bertfuse.bert.data.instances import nsp_skew

    rows = TokenisedCorpus.from_documents([[[5 + d] * 6] for d in range(10)])
    why = nsp_skew(rows, np.arange(10))
    assert why.startswith("100% of the training documents hold one sentence, so about 100% of the next-sentence")
    mixed = TokenisedCorpus.from_documents([[[5] * 6, [6] * 6]] * 6 + [[[7] * 6]] * 4)
    assert nsp_skew(mixed, np.arange(10)) is None
    spans = draw_spans(rows, np.arange(10), 32, seed=0)
    assert len(spans) and (spans["label"] == 1).all()  # what the warning is about


def test_mlm_only_instances_are_each_document_cut_into_contiguous_runs():
    """[CLS] A [SEP] with A max_seqlen - 2 tokens of one document (the last run shorter): every token of every
    document once, in order, none across a document boundary, all of segment 0."""
    from bertfuse.bert.data.instances import NO_NSP

    c = corpus(12)
    docs = np.array([3, 0, 7, 11])
    spans = draw_spans(c, docs, 20, seed=0, nsp=False)
    assert (spans["b_len"] == 0).all() and (spans["label"] == NO_NSP).all()
    assert (spans["a_len"] <= 18).all() and (span_lengths(spans) == spans["a_len"] + 2).all()
    covered = np.concatenate([np.arange(s["a_start"], s["a_start"] + s["a_len"]) for s in spans])
    expected = np.concatenate([np.arange(c.sentence_bounds(d)[0], c.sentence_bounds(d)[-1]) for d in docs])
    assert np.array_equal(covered, expected)
    ids, types = gather(c, spans[:2], cls=2, sep=3)
    t, (a, b) = c.tokens.tolist(), spans[:2]
    assert ids.tolist() == [2, *t[a["a_start"]:a["a_start"] + a["a_len"]], 3,
                            2, *t[b["a_start"]:b["a_start"] + b["a_len"]], 3]
    assert not types.any()
    assert np.array_equal(draw_spans(c, docs, 20, seed=5, nsp=False), spans)  # nothing drawn at random

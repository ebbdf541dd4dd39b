"""bert.data.packing: best-fit packing into fixed token budgets, and packed micro-batches of fixed shapes."""
import random

import numpy as np
import pytest
import torch

from bertfuse.bert.data.masking import SpecialIds
from bertfuse.bert.data.packing import PackedShapes, efficiency, pack
from batch_utils import DictMasker, DictPacker

SPECIAL = SpecialIds(cls=2, sep=3, mask=4, pad=0, vocab_size=1000, special=(0, 1, 2, 3, 4))


def test_every_instance_once_within_budget_and_sequence_limit():
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(5, 40), 128]) for _ in range(3000)]
    rows = pack(lengths, budget=512, max_seqs=32)
    assert rows.shape[1] == 32 and sorted(rows[rows >= 0].tolist()) == list(range(len(lengths)))
    for row in rows:
        members = row[row >= 0]
        assert len(members) >= 1 and (row[len(members):] == -1).all()  # instances first, then -1
        assert sum(lengths[i] for i in members) <= 512
    assert np.array_equal(pack(lengths, 512, 32), rows)  # deterministic
    assert pack(lengths, 512, 3).shape[1] == 3
    # Histogram best fit beats padding each instance to the longest of a batch of 4 by far on such lengths.
    padded = sum(lengths) / (len(lengths) * 128)
    assert efficiency(lengths, rows, 512) > 0.95 > padded
    with pytest.raises(ValueError, match="more than the budget"):
        pack([10, 600], budget=512, max_seqs=4)


def test_packing_is_best_fit_on_a_case_worked_by_hand():
    """Longest first, each into the open row with the least room that still takes it: 6 and 5 open rows (room 4
    and 5); the two 4s go to rooms 4 and 5 (the least room first: the 6's row fills to 10); the 1s then fill the
    5's row (room 1) and open nothing new: two rows, [6, 4] and [5, 4, 1], and a 1 left for a third."""
    lengths = [6, 5, 4, 4, 1, 1]
    rows = pack(lengths, budget=10, max_seqs=3)
    assert sorted(sorted(lengths[i] for i in row if i >= 0) for row in rows) == [[1], [1, 4, 5], [4, 6]]
    assert pack([], budget=10, max_seqs=3).shape == (0, 3)
    assert sorted(pack([0, 10], budget=10, max_seqs=2)[:, 0].tolist()) == [0, 1]  # an empty instance: a place


def instance(n, rng, nsp):
    ids = [2] + [rng.randint(5, 999) for _ in range(n - 2)] + [3]
    return {"input_ids": ids, "token_type_ids": [0] * (n // 2) + [1] * (n - n // 2), "next_sentence_label": nsp}


@pytest.mark.parametrize("whole_word", [False, True])
def test_packed_micro_batch_has_fixed_shapes_aligned_rows_and_exact_label_counts(whole_word):
    rng = random.Random(1)
    masker = DictMasker(SPECIAL, whole_word=whole_word, continuation_ids=range(500, 700), seed=3)
    shapes = PackedShapes.for_rows(rows=3, max_seqlen=48, per_row=2, mlm_probability=0.15)
    assert (shapes.tokens, shapes.sequences, shapes.labels) == (144, 9, 22 + 3)
    collate = DictPacker(masker, shapes)
    insts = [instance(n, rng, nsp) for n, nsp in ((40, 0), (9, 1), (31, 1))]
    rows = [[insts[0]], [insts[1], insts[2]]]  # the third row is unused
    b = collate(rows, keys=[10, 11, 12])
    assert b["max_seqlen"] == 48 and b["row_aligned"] is True
    assert {k: tuple(v.shape) for k, v in b.items() if isinstance(v, torch.Tensor)} == {
        "input_ids": (144,), "token_type_ids": (144,), "position_ids": (144,), "cu_seqlens": (10,),
        "mlm_positions": (shapes.labels,), "mlm_labels": (shapes.labels,), "next_sentence_label": (9,)}
    # Row 0: the instance, then its filler tail as a sequence; row 1: two instances and a tail; then unused.
    assert b["cu_seqlens"].tolist() == [0, 40, 48, 57, 88, 96, 96, 96, 96, 96]
    assert b["next_sentence_label"].tolist() == [0, -100, 1, 1, -100, -100, -100, -100, -100]
    assert b["position_ids"][48:57].tolist() == list(range(9)) and (b["input_ids"][88:] == 0).all()
    used = b["mlm_labels"] != -100
    labelled = b["mlm_positions"][used]
    for (s, e), x in zip([(0, 40), (48, 57), (57, 88)], insts):  # about 15% of each instance's real tokens
        n = int(((labelled >= s) & (labelled < e)).sum())
        assert 1 <= n <= max(1, round(0.15 * (e - s - 2)))
        if not whole_word:
            assert n == max(1, round(0.15 * (e - s - 2)))
    original = torch.zeros(144, dtype=torch.long)
    for (s, e), x in zip([(0, 40), (48, 57), (57, 88)], insts):
        original[s:e] = torch.tensor(x["input_ids"])
    assert torch.equal(b["mlm_labels"][used], original[labelled])  # labels are the original ids
    assert torch.equal(collate(rows, keys=[10, 11, 12])["input_ids"], b["input_ids"])  # keyed, repeatable
    with pytest.raises(ValueError, match="does not fit 2 instances of 48 tokens"):
        collate([[instance(30, rng, 0), instance(20, rng, 0)]], keys=[0, 1])
    with pytest.raises(ValueError, match="4 rows do not fit"):
        collate([[insts[1]]] * 4, keys=range(4))


def test_labels_past_the_bound_are_undone_as_bert_caps_them():
    """A masker choosing half the tokens overflows R = ceil(0.15 T) + rows: the pack keeps R labels, and the
    extra chosen tokens get their original ids back (unlabelled tokens must be unchanged)."""
    rng = random.Random(3)
    insts = [instance(n, rng, 0) for n in (40, 44)]
    shapes = PackedShapes.for_rows(rows=2, max_seqlen=48, per_row=1, mlm_probability=0.15)
    b = DictPacker(DictMasker(SPECIAL, mlm_probability=0.5, seed=1), shapes)([[insts[0]], [insts[1]]],
                                                                                  keys=[0, 1])
    original = torch.zeros(96, dtype=torch.long)
    original[:40], original[48:92] = torch.tensor(insts[0]["input_ids"]), torch.tensor(insts[1]["input_ids"])
    labelled = b["mlm_positions"][b["mlm_labels"] != -100]
    assert len(labelled) == shapes.labels == 17
    assert torch.equal(b["mlm_labels"], original[labelled])
    unlabelled = torch.ones(96, dtype=torch.bool).index_fill(0, labelled, False)
    assert torch.equal(b["input_ids"][unlabelled], original[unlabelled])


def test_epoch_rows_are_deterministic_rows_of_every_instance():
    from bertfuse.bert.data.packing import epoch_rows

    rng = random.Random(2)
    lengths = np.array([rng.choice([rng.randint(5, 60), 128]) for _ in range(500)])
    rows = epoch_rows(lengths, 128, 3, np.random.default_rng(1))
    assert np.array_equal(rows, epoch_rows(lengths, 128, 3, np.random.default_rng(1)))
    assert not np.array_equal(rows, epoch_rows(lengths, 128, 3, np.random.default_rng(2)))
    assert sorted(rows[rows >= 0].tolist()) == list(range(500))
    assert all(lengths[row[row >= 0]].sum() <= 128 and 1 <= (row >= 0).sum() <= 3 for row in rows)
    assert efficiency(lengths, rows, 128) > 0.9


def test_bench_packing_reports_both_padding_shares(tmp_path, capsys):
    from bertfuse.bench.packing import main, measure
    from bertfuse.bert.data.tokenizer import train_tokenizer
    from corpus_utils import topic_documents, write_corpus

    corpus = write_corpus(tmp_path / "c.txt", n_docs=40, sentences=12)
    train_tokenizer(topic_documents(40, 12), vocab_size=200, output_dir=str(tmp_path / "tok"))
    assert main([str(corpus), "--tokenizer", str(tmp_path / "tok")]) == 0
    printed = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith(("| 128", "| 512"))]
    measured = measure(str(corpus), str(tmp_path / "tok"))
    assert [r["seq_len"] for r in measured] == [128, 512] and len(printed) == 2
    for cells, r in zip(printed, measured):  # the table prints what was measured: both shares, in [0, 1)
        assert 0 <= r["padded_padding_share"] < 1 and 0 <= r["packed_padding_share"] < 1
        assert cells[3] == f"{r['padded_padding_share']:.1%}" and cells[5] == f"{r['packed_padding_share']:.1%} |"


def padded_twin(b):
    """The padded batch holding the same instances, tokens and labels as packed batch `b` (its real sequences:
    those with an NSP label; the rows' filler tails and unused slots have none)."""
    cu, nsp = b["cu_seqlens"].tolist(), b["next_sentence_label"]
    real = [s for s in range(len(nsp)) if nsp[s] != -100]
    spans = [(cu[s], cu[s + 1]) for s in real]
    width = max(e - a for a, e in spans)
    ids = torch.zeros(len(real), width, dtype=torch.long)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (a, e) in enumerate(spans):
        ids[i, :e - a] = b["input_ids"][a:e]
        types[i, :e - a] = b["token_type_ids"][a:e]
        mask[i, :e - a] = 1
    for p, lab in zip(b["mlm_positions"].tolist(), b["mlm_labels"].tolist()):
        if lab != -100:
            i = next(i for i, (a, e) in enumerate(spans) if a <= p < e)
            labels[i, p - spans[i][0]] = lab
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels,
                next_sentence_label=nsp[real])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_and_padded_give_the_same_loss_and_gradients(backend):
    """The same instances, packed (fixed shapes, an empty slot, filler) or padded: same losses and gradients,
    float32; the filler tokens get no gradient and leave everything finite."""
    rng = random.Random(4)
    insts = [instance(n, rng, nsp) for n, nsp in ((30, 0), (7, 1), (19, 1))]
    masker = DictMasker(SPECIAL, seed=5)
    b = DictPacker(masker, PackedShapes.for_rows(3, 32, 2, 0.15))([[insts[0]], [insts[1], insts[2]]],
                                                                     keys=[1, 2, 3])
    assert_same_step(backend, {**b, "validate": True}, padded_twin(b))


def assert_same_step(backend, packed_kwargs, padded_kwargs):
    """BertForPreTraining (tiny, float32, no dropout) called packed and padded: same losses, label count and
    gradients (finite)."""
    from bertfuse import bert

    torch.manual_seed(0)
    cfg = bert.BertConfig.preset("tiny", vocab_size=1000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 backend=backend)
    model = bert.BertForPreTraining(cfg)
    twin = bert.BertForPreTraining(cfg)
    twin.load_state_dict(model.state_dict())
    packed, padded = model(**packed_kwargs), twin(**padded_kwargs)
    for name in ("loss", "mlm_loss", "nsp_loss"):
        a, r = getattr(packed, name), getattr(padded, name)
        assert abs(a.item() - r.item()) <= 1e-5 * abs(r.item()), name
    assert packed.mlm_count.item() == padded.mlm_count.item()
    packed.loss.backward()
    padded.loss.backward()
    grads = dict(twin.named_parameters())
    floor = 1e-2 * max(p.grad.abs().max().item() for p in twin.parameters() if p.grad is not None)
    for name, p in model.named_parameters():
        r = grads[name].grad
        assert torch.isfinite(p.grad).all(), name
        assert (p.grad - r).abs().max() <= 1e-5 * max(r.abs().max().item(), floor), name


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("row_aligned", [False, True])
def test_any_cu_seqlens_gives_the_padded_results(backend, row_aligned):
    """Sequences that cross row boundaries (lengths 7, 12, 5 in 36 tokens with max_seqlen 12), unvalidated, and
    the packer's row-aligned batch told or not told that it is aligned: the padded call's losses and gradients
    on both backends (the PyTorch attention must not assume rows unless promised)."""
    g = torch.Generator().manual_seed(5)
    lengths, total, nsp = [7, 12, 5], 36, torch.tensor([1, 0, 1])
    ids = torch.randint(5, 999, (total,), generator=g)
    types = torch.cat([torch.arange(n) >= n // 2 for n in lengths] + [torch.zeros(total - sum(lengths))]).long()
    cu = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    positions = torch.tensor([1, 5, 8, 12, 18, 20, 30])  # 30 lies in the filler: an unused slot
    labels = torch.tensor([17, 400, 999, 6, 250, 31, -100])
    packed = dict(input_ids=ids, token_type_ids=types, cu_seqlens=cu, max_seqlen=12, mlm_positions=positions,
                  mlm_labels=labels, next_sentence_label=nsp)
    twin = padded_twin(packed)
    if row_aligned:  # the packer's layout of the same sequences: one row each, so the promise holds
        rows = torch.tensor([0, 12, 24, 36], dtype=torch.int32)
        spread = torch.cat([torch.arange(a, a + n) for a, n in zip(rows.tolist(), lengths)])
        packed = dict(packed, input_ids=torch.zeros_like(ids).index_put((spread,), ids[:24]),
                      token_type_ids=torch.zeros_like(types).index_put((spread,), types[:24]),
                      cu_seqlens=torch.tensor([0, 7, 12, 24, 29, 36], dtype=torch.int32),
                      mlm_positions=torch.cat([spread[positions[:-1]], positions[-1:]]),
                      next_sentence_label=torch.tensor([1, -100, 0, 1, -100]), row_aligned=True)
    assert_same_step(backend, packed, twin)


def test_packed_validation_names_the_problem():
    from bertfuse import bert

    model = bert.BertForPreTraining(bert.BertConfig.preset("tiny", vocab_size=1000, backend="torch"))
    ids = torch.randint(5, 999, (16,))
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    encode = model.bert.encode
    with pytest.raises(ValueError, match="cu_seqlens ends at 20, past the 16 tokens"):
        encode(ids, None, torch.zeros_like(ids), torch.arange(16), cu_seqlens=cu, max_seqlen=16, validate=True)
    with pytest.raises(ValueError, match=r"token_type_ids has shape \(15,\), expected \(16,\)"):
        encode(ids, None, torch.zeros(15, dtype=torch.long), torch.arange(16), cu_seqlens=cu, max_seqlen=16)
    with pytest.raises(ValueError, match="position_ids must hold integer ids, got dtype torch.float32"):
        encode(ids, None, None, torch.arange(16.0), cu_seqlens=cu, max_seqlen=16)  # the padded call's words
    with pytest.raises(ValueError, match=r"packed input_ids must be a \[tokens\] tensor, got shape \(2, 8\)"):
        encode(ids.view(2, 8), None, None, None, cu_seqlens=cu, max_seqlen=16)
    with pytest.raises(ValueError, match="16 tokens are not a multiple of max_seqlen=6"):
        encode(ids, None, torch.zeros_like(ids), torch.arange(16), cu_seqlens=cu, max_seqlen=6, row_aligned=True)
    with pytest.raises(ValueError, match="a sequence is longer than max_seqlen=6"):
        encode(ids, None, None, torch.arange(16) % 6, cu_seqlens=cu, max_seqlen=6)
    crossing = torch.tensor([0, 5, 12], dtype=torch.int32)  # rows of 8: the second sequence spans both
    with pytest.raises(ValueError, match="row_aligned, but 1 sequence\\(s\\) cross a row boundary"):
        encode(ids, None, None, torch.arange(16) % 8, cu_seqlens=crossing, max_seqlen=8, row_aligned=True,
               validate=True)
    encode(ids, None, None, None, cu_seqlens=crossing, max_seqlen=8)  # any cu_seqlens, when no promise is made
    with pytest.raises(ValueError, match="takes no attention_mask"):
        encode(ids, torch.ones_like(ids), cu_seqlens=crossing, max_seqlen=8)
    with pytest.raises(ValueError, match="pass cu_seqlens with them"):
        encode(ids[None], max_seqlen=8)


def _model_and_batch(backend="torch"):
    from bertfuse import bert

    torch.manual_seed(0)
    model = bert.BertForPreTraining(bert.BertConfig.preset("tiny", vocab_size=1000, backend=backend,
                                                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    rng = random.Random(2)
    insts = [instance(n, rng, nsp) for n, nsp in ((40, 0), (9, 1), (31, 1))]
    shapes = PackedShapes.for_rows(rows=2, max_seqlen=48, per_row=2, mlm_probability=0.15)
    batch = DictPacker(DictMasker(SPECIAL, seed=3), shapes)([[insts[0]], [insts[1], insts[2]]], keys=[1, 2, 3])
    return model, batch


def _with(batch, **changes):
    out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    for key, (index, value) in changes.items():
        out[key][index] = value
    return out


@pytest.mark.parametrize("change, message", [
    (dict(mlm_positions=(0, -1)), "1 mlm_positions outside the sequences"),
    (dict(mlm_positions=(0, 96)), "1 mlm_positions outside the sequences"),     # == T: was a raw IndexError
    (dict(mlm_positions=(0, 44)), "1 mlm_positions in filler"),                  # row 0's filler tail
    (dict(mlm_labels=(0, 1000)), "1 mlm_labels outside [0, 1000)"),
    (dict(next_sentence_label=(5, 1)), "1 next_sentence_label(s) on an empty sequence"),
    (dict(next_sentence_label=(0, 5)), "1 next_sentence_label(s) outside {0, 1, -100}"),
    (dict(cu_seqlens=(-1, 4000)), "cu_seqlens ends at 4000, past the 96 tokens"),
])
def test_packed_validation_covers_the_label_side(change, message):
    """Each of these changed the loss (or raised a raw IndexError) under validate=True; now each is named. On the
    CPU the check is free, so it runs without validate too."""
    model, batch = _model_and_batch()
    bad = _with(batch, **change)
    for validate in (True, False):
        with pytest.raises(ValueError, match="packed batch: .*" + message.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("{", r"\{")):
            model(**bad, validate=validate)


def test_an_mlm_only_model_takes_a_packed_batch_with_empty_sequences():
    """A packed layout's empty sequences are its unused slots: without next-sentence labels (an MLM-only batch)
    they are no mistake, and the masked-LM-only model's loss on the batch is the pre-training model's MLM loss."""
    from bertfuse import bert

    model, batch = _model_and_batch()
    assert (batch["cu_seqlens"].diff() == 0).any()
    mlm = bert.BertForMaskedLM(model.config)
    mlm.load_state_dict(model.state_dict(), strict=False)
    mlm_only = {k: v for k, v in batch.items() if k != "next_sentence_label"}
    torch.testing.assert_close(mlm(**mlm_only, validate=True).loss, model(**batch).mlm_loss)
    with pytest.raises(ValueError, match="1 mlm_positions outside the sequences"):
        mlm(**_with(mlm_only, mlm_positions=(0, 96)), validate=True)


def test_a_duplicated_mlm_position_is_refused():
    model, batch = _model_and_batch()
    used = (batch["mlm_labels"] != -100).nonzero().squeeze(1)
    bad = _with(batch, mlm_positions=(used[1], batch["mlm_positions"][used[0]]),
                mlm_labels=(used[1], batch["mlm_labels"][used[0]]))
    with pytest.raises(ValueError, match="1 mlm_positions given twice"):
        model(**bad)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unchecked_slots_outside_the_tokens_or_vocabulary_count_for_nothing_on_both_backends(backend, monkeypatch):
    """Where values go unchecked (a GPU batch without validate; here the CPU's free check switched off), a slot
    whose position or label is out of range is ignored alike on both backends: never a read out of bounds, an
    error inside a kernel, or a different loss."""
    from bertfuse.bert.model import modeling, padding

    model, batch = _model_and_batch(backend)
    reference = model(**batch)
    used = (batch["mlm_labels"] != -100).nonzero().squeeze(1)
    dropped = _with(batch, mlm_labels=(used[:2], -100))
    monkeypatch.setattr(modeling, "checks_are_free", lambda t: False)
    monkeypatch.setattr(padding, "checks_are_free", lambda t: False)
    expected = model(**dropped)
    for change in (dict(mlm_positions=(used[:2], torch.tensor([-7, 10**6]))),
                   dict(mlm_labels=(used[:2], torch.tensor([1000, -3])))):
        out = model(**_with(batch, **change))
        torch.testing.assert_close(out.mlm_loss, expected.mlm_loss)
        assert int(out.mlm_count) == int(expected.mlm_count) == int(reference.mlm_count) - 2


def test_packed_max_seqlen_may_be_a_numpy_integer_or_a_zero_d_tensor():
    import numpy as np

    model, batch = _model_and_batch()
    ref = model(**batch).loss
    for form in (np.int64(48), torch.tensor(48), torch.tensor([48])):
        torch.testing.assert_close(model(**{**batch, "max_seqlen": form}).loss, ref)
    with pytest.raises(ValueError, match="packed max_seqlen must be an integer, got float 48.0"):
        model(**{**batch, "max_seqlen": 48.0})


def test_collator_and_pack_check_their_inputs():
    rng = random.Random(0)
    collate = DictPacker(DictMasker(SPECIAL, seed=0), PackedShapes.for_rows(2, 48, 2, 0.15))
    good = instance(20, rng, 1)
    cases = [
        (([[good, good]], [1]), "2 instances but 1 masking keys"),
        (([[{**good, "next_sentence_label": 5}]], [1]), "instance 0 of row 0 has next_sentence_label 5, not 0 or 1"),
        (([[{**good, "input_ids": good["input_ids"][:-1] + [1000]}]], [1]), "has ids outside [0, 1000)"),
        (([[good], [{"input_ids": [], "token_type_ids": [], "next_sentence_label": 0}]], [1, 2]),
         "instance 0 of row 1 has no tokens"),
    ]
    for (rows, keys), message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
            collate(rows, keys)
    with pytest.raises(ValueError, match=r"instance 0 of the batch has next_sentence_label 5"):
        DictMasker(SPECIAL)([{**good, "next_sentence_label": 5}])
    with pytest.raises(ValueError, match="pack: max_seqs must be at least 1, got 0"):
        pack([3, 4], budget=10, max_seqs=0)
    with pytest.raises(ValueError, match=r"pack: instance 1 has a negative length \(-4 tokens\)"):
        pack([3, -4], budget=10, max_seqs=2)


@pytest.mark.parametrize("whole_word", [False, True])
def test_an_instance_is_masked_the_same_padded_and_packed(whole_word):
    """One masking algorithm: with the same key an instance gets the same labels and ids in a padded batch
    (DictMasker) as in a packed one (DictPacker), as training and evaluation of either layout rely on."""
    rng = random.Random(4)
    masker = DictMasker(SPECIAL, whole_word=whole_word, continuation_ids=range(500, 700), seed=9)
    insts = [instance(n, rng, 1) for n in (40, 9, 31, 20)]
    keys = [(2, 5), (2, 6), (2, 7), (2, 8)]
    padded = masker(insts, keys=keys)
    packed = DictPacker(masker, PackedShapes.for_rows(rows=2, max_seqlen=64, per_row=2, mlm_probability=0.15))(
        [insts[:2], insts[2:]], keys=keys)
    starts = packed.cu_seqlens.tolist()
    for i, x in enumerate(insts):
        n, s = len(x["input_ids"]), [0, 40, 64, 95][i]
        assert starts[[0, 1, 3, 4][i]] == s
        assert torch.equal(packed.input_ids[s:s + n], padded["input_ids"][i, :n])
        labels = padded["labels"][i, :n]
        used = packed.mlm_labels != -100
        at = (packed.mlm_positions[used] >= s) & (packed.mlm_positions[used] < s + n)
        assert torch.equal(packed.mlm_positions[used][at] - s, (labels != -100).nonzero().squeeze(1))
        assert torch.equal(packed.mlm_labels[used][at], labels[labels != -100])
    with pytest.raises(ValueError, match="packed batches need exact-count masking"):
        DictPacker(DictMasker(SPECIAL, exact=False), PackedShapes.for_rows(2, 64, 2, 0.15))


def test_one_per_row_is_a_padded_batch_in_the_packed_layout():
    from batch_utils import one_per_row

    rng = random.Random(5)
    masker = DictMasker(SPECIAL, seed=2)
    insts = [instance(n, rng, n % 2) for n in (13, 30, 4)]
    b = one_per_row(masker, insts, [(0, 1), (0, 2), (0, 3)])
    padded = masker(insts, keys=[(0, 1), (0, 2), (0, 3)])  # the same masks, padded to 32 as well
    assert b.max_seqlen == 32 and b.slots == 3 * 32 and b.lengths == [13, 30, 4] and b.row_aligned
    assert b.cu_seqlens.tolist() == [0, 13, 32, 62, 64, 68, 96]  # each row: its instance, then its filler
    for r, n in enumerate((13, 30, 4)):
        assert torch.equal(b.input_ids[32 * r:32 * r + n], padded["input_ids"][r, :n])
    assert b.labelled == int((padded["labels"] != -100).sum())
    assert b.next_sentence_label.tolist() == [1, -100, 0, -100, 0, -100]
    with pytest.raises(ValueError, match="no instances"):
        one_per_row(masker, [], [])

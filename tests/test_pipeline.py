"""bert.data.pipeline: shard-streamed epochs, the same under any ranks x accumulation steps, resumable, parallel."""
import numpy as np
import pytest
import torch

import bertfuse.bert.data.pipeline as pipeline
from bertfuse.bert.data.corpus import TokenisedCorpus
from bertfuse.bert.data.masking import SpecialIds
from batch_utils import DictMasker, materialize
from bertfuse.bert.data.instances import span_lengths
from bertfuse.bert.data.packing import PackedShapes
from bertfuse.bert.data.pipeline import Layout, Planner, StepCollator, StepSampler, shard_starts, step_work

SPECIAL = SpecialIds(cls=2, sep=3, mask=4, pad=0, vocab_size=30_000, special=(0, 1, 2, 3, 4))


def corpus(n_docs=60, seed=0) -> TokenisedCorpus:
    """Documents of 5-30 sentences of 3-25 tokens; every token names its document and sentence."""
    rng = np.random.default_rng(seed)
    return TokenisedCorpus.from_documents(
        [[[100 + (d * 37 + s) % 29_000] * int(rng.integers(3, 26)) for s in range(int(rng.integers(5, 31)))]
         for d in range(n_docs)])


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of a few thousand tokens, so that a test corpus has several."""
    monkeypatch.setattr(pipeline, "MIN_SHARD_TOKENS", 3000)
    monkeypatch.setattr(pipeline, "STEPS_PER_SHARD", 1)


def planner(parts, packed=True, seed=5, c=None) -> Planner:
    c = c or corpus()
    shapes = PackedShapes.for_rows(4, 64, 3, 0.15) if packed else None
    return Planner(c, np.random.default_rng(1).permutation(len(c)), Layout(64, parts, shapes, batch_size=8), seed)


def batches(p: Planner, epoch, rank, accum, first=0, processes=0, workers=0):
    masker = DictMasker(SPECIAL, seed=3)
    loader = torch.utils.data.DataLoader(StepCollator(p.corpus, masker, p.layout), batch_size=None,
                                         sampler=StepSampler(p, epoch, rank, accum, first, processes),
                                         num_workers=workers, collate_fn=lambda x: x)
    return [[dict(b.items()) for b in step] for step in loader]


def same(a, b) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(
        all(torch.equal(u[k], v[k]) if isinstance(u[k], torch.Tensor) else u[k] == v[k] for k in u)
        for u, v in zip(x, y)) for x, y in zip(a, b))


def test_shards_are_consecutive_documents_of_at_least_the_size():
    tokens = np.array([5, 1, 7, 3, 3, 9, 2, 1])
    starts = shard_starts(tokens, 8)
    assert starts.tolist() == [0, 3, 8]  # 13 tokens; then 15 + the rest (3): too small for a shard of its own
    assert shard_starts(tokens, 5).tolist() == [0, 1, 3, 5, 8]  # 5, 8, 6, then 9 + the rest (3, below 5)
    assert shard_starts(tokens, 100).tolist() == [0, 8] and shard_starts(np.zeros(0, int), 8).tolist() == [0]


def test_a_shard_plan_is_every_row_within_the_layout(small_shards):
    p = planner(parts=2)
    assert p.shards > 3
    plan = p.plan(epoch=0, shard=1)
    lengths = span_lengths(plan.spans)
    assert plan.rows.shape == (plan.steps * 2 * 4, 3) and plan.steps >= 1
    used = plan.rows[plan.rows >= 0]
    assert len(used) == len(set(used.tolist()))  # an instance at most once
    assert all(lengths[row[row >= 0]].sum() <= 64 for row in plan.rows)
    left_out = len(plan.spans) - len(used)  # only what does not fill a last step
    assert left_out <= 2 * 4 * 3 and lengths[used].sum() / (len(plan.rows) * 64) > 0.9
    assert np.array_equal(p.plan(0, 1).rows, plan.rows) and not np.array_equal(p.plan(1, 1).rows, plan.rows)
    assert sorted(p.order(0).tolist()) == list(range(p.shards)) and not np.array_equal(p.order(0), p.order(1))


@pytest.mark.parametrize("packed", [True, False])
def test_a_step_is_the_same_under_any_ranks_x_accumulation_steps(small_shards, packed):
    """2 ranks x 1 accumulation step and 1 rank x 2 give each micro-batch of every step the same tokens, masks
    and layout (the union over ranks of one is the other), epoch after epoch."""
    p = planner(parts=2, packed=packed)
    for epoch in (0, 1):
        one = batches(p, epoch, rank=0, accum=2)
        ranks = [batches(p, epoch, rank=r, accum=1) for r in (0, 1)]
        assert len(one) > 3 and all(len(r) == len(one) for r in ranks)
        assert same(one, [[ranks[0][t][0], ranks[1][t][0]] for t in range(len(one))])
    assert not same(batches(p, 0, 0, 2), batches(p, 1, 0, 2))


def test_resuming_at_any_step_continues_exactly_and_workers_change_nothing(small_shards):
    p = planner(parts=1)
    whole = batches(p, epoch=2, rank=0, accum=1)
    for first in (1, 5, len(whole) - 1):
        assert same(batches(p, 2, 0, 1, first=first), whole[first:])
    assert same(batches(p, 2, 0, 1, processes=1, workers=2), whole)  # planned and collated elsewhere
    assert same(batches(p, 2, 0, 1, first=3, processes=2), whole[3:])


def test_collated_batches_hold_the_planned_instances(small_shards):
    p = planner(parts=1)
    plan = next(p.plans(0))
    (work,) = step_work(plan, 0, 0, p.layout, rank=0, accum=1)
    (b,) = StepCollator(p.corpus, DictMasker(SPECIAL, seed=3), p.layout)[[work]]
    instances = materialize(p.corpus, work.spans, SPECIAL.cls, SPECIAL.sep)
    assert b.lengths == [len(x["input_ids"]) for x in instances]
    starts = b.cu_seqlens.tolist()
    real = [s for s, label in zip(starts, b.next_sentence_label.tolist()) if label != -100]
    for s, x in zip(real, instances):
        n = len(x["input_ids"])
        labelled = {int(q) - s: int(v) for q, v in zip(b.mlm_positions, b.mlm_labels) if v != -100 and s <= q < s + n}
        restored = b.input_ids[s:s + n].clone()
        for q, v in labelled.items():
            restored[q] = v
        assert restored.tolist() == x["input_ids"] and b.token_type_ids[s:s + n].tolist() == x["token_type_ids"]
    assert (work.keys[:, :2] == [0, plan.shard]).all()


def _children() -> set[int]:
    import os

    pid = os.getpid()
    return {int(c) for t in os.listdir(f"/proc/{pid}/task")
            for c in open(f"/proc/{pid}/task/{t}/children").read().split()}


def _gone(pids, seconds=10.0) -> bool:
    import os
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split(") ")[1][0] != "Z"]
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_closing_the_loader_with_planners_blocked_mid_send_returns_within_a_bound():
    """What hung finished runs: shard plans of ~250 KB (more than a pipe holds) being written by planning
    processes when the loader closes after the last step. Closing returns, and no planner or worker is left."""
    import time

    from bertfuse.bert.data.pipeline import EpochStream

    n_tokens = 4 << 20  # four shards of the minimum size
    tokens = np.random.default_rng(0).integers(5, 29_000, n_tokens).astype(np.uint16)
    sentences = np.arange(0, n_tokens + 1, 16, dtype=np.int64)
    big = TokenisedCorpus(tokens, sentences, np.arange(0, len(sentences), 8, dtype=np.int64))
    layout = Layout(128, 1, PackedShapes.for_rows(8, 128, 3, 0.15))
    p = Planner(big, np.arange(len(big)), layout, 0)
    assert p.shards == 4
    before = _children()
    items = iter(EpochStream(p, DictMasker(SPECIAL, seed=0), 0, 0, 1, processes=3).loader(0, 1, False))
    next(items)
    time.sleep(2.0)  # the planners of the later shards are done and blocked writing their plans
    started = _children() - before
    assert len(started) == 4  # three planners, one collating worker
    t0 = time.monotonic()
    del items
    assert time.monotonic() - t0 < 20 and _gone(started)


def chosen_budget(lengths, specials: int, p: float) -> int:
    """What exact masking chooses in instances of these lengths (no special token inside them)."""
    return int(sum(max(1, np.round(p * (n - specials))) for n in lengths))


@pytest.mark.parametrize("nsp", [True, False])
@pytest.mark.parametrize("p", [0.3, 0.4])
def test_the_chosen_share_stays_exact_at_30_and_40_percent(small_shards, nsp, p):
    """MosaicBERT's masking rates: every micro-batch labels exactly what each instance chooses (max(1,
    round(p x candidates))): the micro-batch's label bound R never drops a choice."""
    c = corpus()
    shapes = PackedShapes.for_rows(4, 64, 3, p)
    plan = Planner(c, np.arange(len(c)), Layout(64, 1, shapes, 8, nsp), seed=2)
    collator = StepCollator(c, DictMasker(SPECIAL, mlm_probability=p, seed=3), plan.layout)
    checked = 0
    for shard in range(plan.shards):
        for step in range(plan.plan(0, shard).steps):
            batch = collator[step_work(plan.plan(0, shard), step, 0, plan.layout, 0, 1)][0]
            assert batch.labelled == chosen_budget(batch.lengths, 3 if nsp else 2, p) <= shapes.labels
            checked += 1
    assert checked > 10


def test_an_mlm_only_layout_gives_batches_without_nsp_that_bert_for_masked_lm_takes(small_shards):
    from bertfuse import bert

    c = corpus()
    p = Planner(c, np.arange(len(c)), Layout(64, 2, PackedShapes.for_rows(4, 64, 3, 0.15), 8, nsp=False), seed=5)
    step = batches(p, 0, 0, 2)[0]
    assert all("next_sentence_label" not in b for b in step)
    b = StepCollator(c, DictMasker(SPECIAL, seed=3), p.layout)[step_work(p.plan(0, int(p.order(0)[0])), 0, 0,
                                                                          p.layout, 0, 1)][0]
    assert b.next_sentence_label is None and set(b) == set(step[0])
    lengths = b.lengths
    assert len(lengths) == int(b.instance.sum()) and sum(lengths) > 0.9 * b.slots  # filler tails are not instances
    assert all(n <= 64 for n in lengths) and (b.input_ids[b.cu_seqlens[:-1][b.instance].long()] == SPECIAL.cls).all()
    model = bert.BertForMaskedLM(bert.BertConfig.tiny(vocab_size=30_000, max_position_embeddings=64, backend="torch"))
    out = model(**b, validate=True)
    assert out.mlm_count == b.labelled and torch.isfinite(out.loss)
    mlm_and_nsp = Planner(c, p.doc_ids, Layout(64, 2, p.layout.shapes, 8), seed=5)
    assert "next_sentence_label" in batches(mlm_and_nsp, 0, 0, 2)[0][0]

"""The pre-training input pipeline: tokenised corpus -> shards -> NSP spans -> rows -> micro-batches on the device.

Nothing here grows with the corpus but its three memory-mapped arrays (bert.data.corpus) and the training documents'
ids, and nothing waits for a pass over the whole corpus:

- **Shards.** The training documents (in the order of the run's "split" stream) are cut into shards of
  consecutive documents of at least `shard_tokens` tokens: at least 64 global steps' worth, so that what a shard
  leaves over (below) is little. An epoch visits the shards in an order of its own (the "order" stream, keyed
  by the epoch).
- **Planning** a shard (`Planner.plan`, a pure function of the shard, the epoch and the seed) draws its NSP spans
  (bert.data.instances; a random B may come from any training document; the "nsp" stream keyed by epoch and shard)
  or, MLM-only, cuts its documents into segments,
  packs them into rows (bert.data.packing.pack, linear time) or, without packing, buckets them into padded batches by
  length, shuffles (the "order" stream keyed by epoch and shard), and cuts the rows into global steps of
  P = ranks x accumulation steps micro-batches. The rows that do not fill a last step are left out (on average
  half a step per shard: at most 1/64 of the data at the default shard size). `--num-proc` background
  processes (at least one) plan shards ahead of training, in order (bert.common.workers.ordered_map), so the training
  process never stops to plan.
- **Collation** of a step's micro-batches (`StepCollator`) runs in the DataLoader's workers: the sampler (this
  process) hands each worker its rank's share of one step as spans, the worker gathers their tokens from the
  memory-mapped array, masks the whole micro-batch at once (Masker.mask_flat) and lays it out packed
  (PackingCollator.collate) or one instance per row; pinned, then copied to the device without blocking.

A step is micro-batches t P ... t P + P - 1 of its shard, rank r taking r A ... r A + A - 1, and an instance is
masked by (epoch, shard, its index in the shard), so the batches of a step are the same under any ranks x
accumulation steps with the same product, and a run resumed at any step continues exactly (the planner
re-plans the shards before it: time, not state).
"""
from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from bertfuse.bert.common import seeds
from bertfuse.bert.common.workers import ordered_map, worker_init
from bertfuse.bert.data.corpus import TokenisedCorpus
from bertfuse.bert.data.instances import SPAN, draw_spans, gather, iter_instances, span_lengths
from bertfuse.bert.data.masking import Masker
from bertfuse.bert.data.packing import FlatInstances, PackedShapes, PackingCollator, bucket_rows, epoch_rows, one_per_row, pack

MIN_SHARD_TOKENS = 1 << 20


STEPS_PER_SHARD = 64


@dataclass(frozen=True)
class Layout:
    """How an epoch's instances become steps. packed: `shapes` (rows of max_seqlen, `shapes.rows` a
    micro-batch); else length-bucketed global batches of `batch_size` instances, one per row. `parts` = ranks x
    accumulation steps micro-batches a step. `nsp`: the instances are NSP pairs (MLM + NSP), else single segments
    of contiguous text (MLM-only; bert.data.instances)."""
    max_seqlen: int
    parts: int
    shapes: PackedShapes | None = None
    batch_size: int = 0
    nsp: bool = True

    @property
    def rows_per_micro(self) -> int:
        return self.shapes.rows if self.shapes else self.batch_size // self.parts

    @property
    def step_tokens(self) -> int:
        return self.parts * self.rows_per_micro * self.max_seqlen


class ShardPlan(NamedTuple):
    shard: int            # the shard's id: its place among the shards of the corpus
    spans: np.ndarray     # SPAN [instances]
    rows: np.ndarray      # int64 [steps x parts x rows_per_micro, instances per row]: span indices, -1 after
    steps: int            # global steps the shard fills


def shard_starts(doc_tokens: np.ndarray, shard_tokens: int) -> np.ndarray:
    """Where each shard starts in the document list, then its end: consecutive documents until a shard has at
    least `shard_tokens` tokens; a smaller rest joins the last shard."""
    ends = np.cumsum(doc_tokens)
    starts, total = [0], int(ends[-1]) if len(ends) else 0
    while True:
        done = int(ends[starts[-1] - 1]) if starts[-1] else 0
        cut = int(np.searchsorted(ends, done + shard_tokens)) + 1
        if cut >= len(ends) or total - int(ends[cut - 1]) < shard_tokens:  # a rest too small joins this shard
            break
        starts.append(cut)
    return np.array(starts + [len(ends)] if len(ends) else [0])


@dataclass
class Planner:
    """Plans the shards of the training documents `doc_ids` of `corpus` (see the module docstring)."""
    corpus: TokenisedCorpus
    doc_ids: np.ndarray
    layout: Layout
    seed: int

    def __post_init__(self):
        shard_tokens = max(MIN_SHARD_TOKENS, STEPS_PER_SHARD * self.layout.step_tokens)
        self.starts = shard_starts(self.corpus.document_tokens(self.doc_ids), shard_tokens)

    @property
    def shards(self) -> int:
        return len(self.starts) - 1

    def order(self, epoch: int) -> np.ndarray:
        return seeds.rng(self.seed, "order", epoch).permutation(self.shards)

    def plan(self, epoch: int, shard: int) -> ShardPlan:
        seed = seeds.integer(self.seed, "nsp", epoch, shard)
        spans = draw_spans(self.corpus, self.doc_ids, self.layout.max_seqlen, seed, int(self.starts[shard]),
                           int(self.starts[shard + 1]), self.layout.nsp)
        rng = seeds.rng(self.seed, "order", epoch, shard)  # (the key epoch alone orders the shards)
        lengths = span_lengths(spans)
        if self.layout.shapes:
            rows = epoch_rows(lengths, self.layout.max_seqlen, self.layout.shapes.per_row, rng)
        else:
            rows = bucket_rows(lengths, self.layout.batch_size, rng)
        per_step = self.layout.parts * self.layout.rows_per_micro
        steps = len(rows) // per_step
        return ShardPlan(shard, spans, rows[:steps * per_step], steps)

    def plans(self, epoch: int, processes: int = 0) -> Iterator[ShardPlan]:
        """The epoch's shard plans in order: `processes` background processes planning ahead (each handed this
        planner once, when it starts, not with every shard), or 0: planned here, when asked."""
        tasks = ((epoch, int(s)) for s in self.order(epoch))
        if processes <= 0:
            return (self.plan(*task) for task in tasks)
        return ordered_map(_plan_in_worker, tasks, processes, _set_planner, (self,), name="planning")


_PLANNER: Planner | None = None


def _set_planner(planner: Planner) -> None:
    global _PLANNER
    _PLANNER = planner


def _plan_in_worker(task) -> ShardPlan:
    return _PLANNER.plan(*task)


class MicroBatchWork(NamedTuple):
    spans: np.ndarray     # SPAN [instances], row after row
    per_row: np.ndarray   # int64 [rows]: instances in each row
    keys: np.ndarray      # int64 [instances, k]: masking keys, in training (epoch, shard, index in the shard)


def micro_batch_work(spans: np.ndarray, block: np.ndarray, *key_prefix: int) -> MicroBatchWork:
    """The micro-batch of rows `block` (int64 [rows, instances per row]: indices into `spans`, -1 after), each
    instance keyed (*key_prefix, its index)."""
    index = block[block >= 0]  # row after row
    keys = np.stack([np.full(len(index), k) for k in key_prefix] + [index], axis=1)
    return MicroBatchWork(spans[index], (block >= 0).sum(axis=1), keys)


def step_work(plan: ShardPlan, step: int, epoch: int, layout: Layout, rank: int, accum: int) -> list[MicroBatchWork]:
    """Rank `rank`'s micro-batches of global step `step` of a shard: what a worker collates."""
    out, rows_per = [], layout.rows_per_micro
    for a in range(accum):
        m = step * layout.parts + rank * accum + a
        out.append(micro_batch_work(plan.spans, plan.rows[m * rows_per:(m + 1) * rows_per], epoch, plan.shard))
    return out


class StepSampler:
    """What the DataLoader hands its workers, in order: each step's work for this rank (step_work), from the
    `first`-th step of the epoch on (the steps before it are planned again, not collated)."""

    def __init__(self, planner: Planner, epoch: int, rank: int, accum: int, first: int = 0, processes: int = 1):
        """`processes`: background planning processes (0: plan in this process)."""
        self.planner, self.epoch, self.rank, self.accum = planner, epoch, rank, accum
        self.first, self.processes = first, processes

    def __iter__(self):
        skip = self.first
        for plan in self.planner.plans(self.epoch, self.processes):
            for t in range(min(skip, plan.steps), plan.steps):
                yield step_work(plan, t, self.epoch, self.planner.layout, self.rank, self.accum)
            skip = max(0, skip - plan.steps)


class StepCollator(torch.utils.data.Dataset):
    """Collates a step's work (a list of MicroBatchWork) into bert.data.batch.PackedBatch micro-batches, masked by
    the run's `stream` (bert.common.seeds; evaluation collates its held-out instances here too, by its own)."""

    def __init__(self, corpus: TokenisedCorpus, masker: Masker, layout: Layout, stream: str = "masking"):
        self.corpus, self.masker, self.layout, self.stream = corpus, masker, layout, stream
        self.packer = PackingCollator(masker, layout.shapes, layout.nsp) if layout.shapes else None

    def __getitem__(self, work: list[MicroBatchWork]):
        return [self.collate(w) for w in work]

    def collate(self, w: MicroBatchWork):
        special = self.masker.special
        ids, types = gather(self.corpus, w.spans, special.cls, special.sep)
        flat = FlatInstances(ids, types, span_lengths(w.spans), w.spans["label"].astype(np.int64))
        if self.packer:
            return self.packer.collate(flat, w.per_row, w.keys.astype(np.uint64), self.stream)
        return one_per_row(self.masker, flat, w.keys.astype(np.uint64), self.stream, nsp=self.layout.nsp)


def held_out_batches(corpus: TokenisedCorpus, doc_ids: np.ndarray, max_seqlen: int, seed: int, masker: Masker,
                     shapes: PackedShapes | None, batch_size: int, batches: int, nsp: bool = True) -> Iterator:
    """Evaluation's micro-batches: the held-out documents' first `batches` x `batch_size` instances (NSP pairs of
    the run's "eval_nsp" stream, or with nsp False single segments) collated as training collates them
    (StepCollator), one per row in batches of `batch_size`, or packed into micro-batches of the run's fixed
    `shapes`. Each instance is masked by the "eval_masking" stream keyed by its index: the same at every
    evaluation, and the same either way."""
    draws = iter_instances(corpus, doc_ids, max_seqlen, seeds.integer(seed, "eval_nsp"), nsp=nsp)
    spans = np.array(list(itertools.islice(draws, batches * batch_size)), dtype=SPAN)
    layout = Layout(max_seqlen, 1, shapes, batch_size, nsp)
    collator = StepCollator(corpus, masker, layout, "eval_masking")
    rows = (np.arange(len(spans))[:, None] if shapes is None  # a row per instance
            else pack(span_lengths(spans), shapes.max_seqlen, shapes.per_row))
    for first in range(0, len(rows), layout.rows_per_micro):
        yield collator.collate(micro_batch_work(spans, rows[first:first + layout.rows_per_micro]))


def as_is(item):
    """The loaders' collate function: a step's micro-batches pass as built (the default one would turn typed
    batches, bert.data.batch.PackedBatch, into plain dicts)."""
    return item


def step_loader(dataset, sampler, num_workers: int, pin_memory: bool) -> torch.utils.data.DataLoader:
    """A DataLoader of whole steps, the one kind a trainer reads: `dataset[item]` for each item of `sampler`, as
    built, pinned when asked. Its workers are forked, whatever the default start method (spawn inside a spawned
    process; forkserver from Python 3.14): they start at once, sharing the parent's imported modules and mapped
    corpus. Its own generator: the loader never draws from the global RNG, which dropout uses."""
    context = "fork" if num_workers and "fork" in multiprocessing.get_all_start_methods() else None
    return torch.utils.data.DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=num_workers,
                                       collate_fn=as_is, pin_memory=pin_memory, generator=torch.Generator(),
                                       multiprocessing_context=context, worker_init_fn=worker_init)


class StepList(torch.utils.data.Dataset):
    """An epoch whose steps are known up front: a subclass's item i is global step i's micro-batches (its
    __len__ and __getitem__), read from step `first` on through `step_loader`, as EpochStream is."""

    def loader(self, first: int, num_workers: int, pin_memory: bool) -> torch.utils.data.DataLoader:
        return step_loader(self, range(first, len(self)), num_workers, pin_memory)


class EpochStream:
    """An epoch of pre-training steps for this rank, as the trainer reads it (`loader`)."""

    def __init__(self, planner: Planner, masker: Masker, epoch: int, rank: int, accum: int, processes: int = 1):
        self.planner, self.masker, self.epoch, self.rank, self.accum = planner, masker, epoch, rank, accum
        self.processes = processes

    def loader(self, first: int, num_workers: int, pin_memory: bool) -> torch.utils.data.DataLoader:
        sampler = StepSampler(self.planner, self.epoch, self.rank, self.accum, first, self.processes)
        return step_loader(StepCollator(self.planner.corpus, self.masker, self.planner.layout), sampler, num_workers,
                           pin_memory)

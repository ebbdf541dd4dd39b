"""BERT pre-training: `bert-pretrain` / `python -m bertfuse.bert.pretrain`.

Two objectives: the paper's masked LM + next-sentence prediction on sentence pairs (`--objective mlm+nsp`, the
default), or masked LM alone on documents cut into contiguous segments, as RoBERTa and MosaicBERT train
(`--objective mlm`, BertForMaskedLM). A run starts from random weights or from the weights of another run or a
published checkpoint (`--init-from`: a recipe's second phase, continued pre-training; bert.train.start), decays
its learning rate polynomially after the warm-up (`--lr-decay-power`), and may stop at a held-out MLM accuracy
(`--target-mlm-accuracy`), reporting the time, steps, sequences and tokens it took in OUTPUT_DIR/summary.json.

One process on a CPU or GPU, or several GPUs and nodes through torchrun (DistributedDataParallel; NCCL on GPU,
gloo on CPU). Instances are packed into micro-batches of fixed shapes (bert.data.packing; `--no-packing` lays
length-bucketed batches out one instance per padded row instead: the same batch type, shapes that vary), which
`--compile` compiles once and `--cuda-graphs` captures. Every rank
trains on its own micro-batches of each global step, and the losses are normalised by the number of labelled
tokens and sequences in the whole global step, so N ranks compute exactly what one process accumulating N
micro-batches would. Checkpoints hold the model (save_pretrained), optimizer, scheduler, RNG states
and data position; `--resume` continues so that later losses equal those of an uninterrupted run. The data
path, corpus -> memory-mapped tokens -> shards of NSP spans -> packed rows -> micro-batches collated by the
DataLoader's workers, is bert.data.pipeline's: nothing waits for a pass over the whole corpus.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from bertfuse.bert.common import seeds
from bertfuse.bert.common.commands import add_debug_flag, add_flags, check_flags, check_source, entry, flag, resumed, run
from bertfuse.bert.common.errors import stop_signals
from bertfuse.bert.common.workers import default_num_workers, ordered_map
from bertfuse.bert.data.batch import PackedBatch
from bertfuse.bert.data.corpus import TokenisedCorpus, source_digest, tokenize_corpus
from bertfuse.bert.data.instances import nsp_skew
from bertfuse.bert.data.masking import Masker, SpecialIds
from bertfuse.bert.data.packing import PackedShapes
from bertfuse.bert.data.pipeline import EpochStream, Layout, Planner, held_out_batches
from bertfuse.bert.data.text import iter_documents
from bertfuse.bert.data.tokenizer import load_tokenizer, save_tokenizer, tokenizer_digest, train_tokenizer
from bertfuse.bert.model.config import BertConfig
from bertfuse.bert.model.modeling import BertForMaskedLM, BertForPreTraining, BertForPreTrainingOutput
from bertfuse.bert.train.distributed import Dist, setup_device
from bertfuse.bert.train.loop import Job, Trainer
from bertfuse.bert.train.rundir import output_dir_lock, prepare_output_dir
from bertfuse.bert.train.settings import Settings
from bertfuse.bert.train.start import (
    ARCHITECTURE,
    StartingPoint,
    check_start,
    check_tokenizer,
    describe,
    load_start,
    starting_point,
)

PRESETS = ("tiny", "mini", "base", "large")
DEFAULT_CONFIG = "mini"
OBJECTIVES = ("mlm+nsp", "mlm")


# This command's options. `resumed`: a setting that makes a run what it is, which --resume compares with the
# checkpoint's, with the trainer's own (bert.train.settings; the others only say how it runs: workers, logging
# cadence, caching). The tokenizer is compared by content (data_identity), not by where it was read from or how it
# was made: the same vocabulary moved elsewhere, or the saved OUTPUT_DIR/tokenizer of a --train-tokenizer run,
# continues the run.
OPTIONS = (
    flag("--config", default=None, resumed=True,
         help="model size: tiny | mini | base | large, or a config.json path (default: mini, or with --init-from the "
              "architecture of its weights, which a --config given must match); vocab_size is taken from the "
              "tokenizer"),
    flag("--init-from", default=None, resumed=True, metavar="PATH",
         help="start from these weights, with a fresh optimizer, schedule and step count: a run directory (its "
              "final model, or its latest checkpoint), one of its checkpoints, or a Hugging Face BERT directory. "
              "The tokenizer defaults to the one saved with them; heads they lack start fresh"),
    flag("--objective", choices=OBJECTIVES, default="mlm+nsp", resumed=True,
         help="mlm+nsp: masked LM and next-sentence prediction on sentence pairs, the paper's (default); mlm: "
              "masked LM alone on documents cut into contiguous segments, no NSP head (RoBERTa, MosaicBERT)"),
    flag("--data", required=True, resumed=True,
         help="corpus: text file(s) (path, directory or glob; documents separated by blank lines, WikiText "
              "'= Title =' lines understood), a .jsonl file with a 'text' field, or a Hugging Face dataset streamed "
              "by name as hf:NAME[:CONFIG], e.g. hf:wikimedia/wikipedia:20231101.en"),
    flag("--tokenizer", group="tokenizer", help="an HF directory (tokenizer.json or vocab.txt) or a vocab.txt file"),
    flag("--train-tokenizer", type=int, metavar="VOCAB_SIZE", group="tokenizer", check="positive",
         help="train a WordPiece vocabulary of this size on the corpus (saved under OUTPUT_DIR/tokenizer)"),
    # Read once into the run's structures, where it is `max_seqlen` (PackedShapes, Layout, PretrainData) as it is
    # for the batch, the model and the kernels; args.max_seq_len stays the flag's name, the key saved runs compare.
    flag("--max-seq-len", type=int, default=128, check="positive", resumed=True,
         help="tokens per instance, specials included (default 128)"),
    flag("--batch-size", type=int, default=32, check="positive", resumed=True,
         help="sequences per optimizer step, over all ranks and accumulation steps (default 32)"),
    # packing into fixed shapes, and what fixed shapes allow: one compilation, CUDA graphs
    flag("--packing", action=argparse.BooleanOptionalAction, default=True, resumed=True,
         help="pack instances end to end into micro-batches of a fixed token budget, every shape fixed and almost "
              "no padding (default on; --no-packing puts length-bucketed batches one instance per padded row "
              "instead)"),
    flag("--tokens-per-batch", type=int, default=None, check="positive", resumed=True,
         help="with packing: the token budget of a micro-batch (one rank, one accumulation step), a multiple of "
              "--max-seq-len (rows of that length); default: its share of --batch-size times --max-seq-len"),
    flag("--instances-per-row", type=int, default=None, check="positive", resumed=True,
         help="with packing: the most instances a row of --max-seq-len tokens holds (default 3)"),
    flag("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
         help="torch.compile the model (backend default inductor); with packing it compiles once"),
    flag("--cuda-graphs", action="store_true",
         help="capture each training step (forward, backward, clipping, fused AdamW) in one CUDA graph and replay "
              "it; needs packing, one GPU and bf16/fp32, else runs without, with a warning"),
    flag("--steps", type=int, default=1000, check="positive", resumed=True, help="optimizer steps (default 1000)"),
    flag("--backend", choices=["auto", "torch", "triton"], default="auto",
         help="hot-op implementation (default auto: triton on CUDA)"),
    flag("--mlm-probability", type=float, default=0.15, resumed=True, help="share of tokens chosen (default 0.15)"),
    flag("--whole-word-masking", action="store_true", resumed=True, help="choose whole words, not single pieces"),
    flag("--eval-fraction", type=float, default=0.05, check="fraction", resumed=True,
         help="documents held out for evaluation (default 0.05)"),
    flag("--eval-batches", type=int, default=20, check="positive", help="batches per evaluation (default 20)"),
    flag("--target-mlm-accuracy", type=float, default=None, metavar="A",
         help="stop once the held-out MLM accuracy, evaluated every --eval-every steps, reaches A (NVIDIA's and "
              "MLPerf's BERT target: 0.720); the log row and OUTPUT_DIR/summary.json record the training seconds, "
              "steps, sequences and tokens it took"),
    flag("--num-proc", type=int, default=1, check="positive",
         help="processes that tokenise the corpus (rank 0, once; cached; 1: in this process, its tokenizer using "
              "every core) and that plan each epoch's shards ahead of training in the background (every rank; at "
              "least one) (default 1)"),
    flag("--num-workers", type=int, default=None, check="non_negative",
         help="DataLoader workers collating micro-batches (default: this rank's share of the CPUs less one, at most "
              "8; 0 collates in the training process)"),
    flag("--cache-dir", default=None, help="where the tokenised corpus is cached (default OUTPUT_DIR/cache)"),
    flag("--max-documents", type=int, default=None, check="positive", resumed=True,
         help="read at most this many documents"),
)
RUN_SETTINGS = resumed(OPTIONS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert-pretrain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, OPTIONS)
    Settings.add_arguments(p, output_dir="runs/pretrain", lr=1e-4, warmup=0.01, log_every=1, save_every=500,
                           keep_checkpoints=3, eval_every=200)
    add_debug_flag(p)
    return p


def validate_args(args) -> StartingPoint | None:
    """Everything that can be checked before any work (tokenising a corpus can take hours); returns the weights
    --init-from names (their config read and checked against --config and --max-seq-len). A run without it and
    without --config gets the default preset here (so a saved run's settings read as they always have)."""
    Settings.check_arguments(args)
    check_flags(args, OPTIONS)
    if not 0 < args.mlm_probability <= 1:
        raise ValueError(f"--mlm-probability must be in (0, 1], got {args.mlm_probability}")
    if args.target_mlm_accuracy is not None:
        if not 0 < args.target_mlm_accuracy <= 1:
            raise ValueError(f"--target-mlm-accuracy must be in (0, 1], got {args.target_mlm_accuracy}")
        if not args.eval_every or not args.eval_fraction:
            raise ValueError("--target-mlm-accuracy is checked at evaluations: give --eval-every N (> 0) and a "
                             "held-out share, --eval-fraction (> 0)")
    if args.max_seq_len < 8:
        raise ValueError(f"--max-seq-len must be at least 8 ([CLS] A [SEP] B [SEP] needs room), got "
                         f"{args.max_seq_len}")
    check_static_shape_options(args)
    if args.packing and args.tokens_per_batch is not None and args.tokens_per_batch % args.max_seq_len:
        raise ValueError(f"--tokens-per-batch {args.tokens_per_batch} must be a multiple of --max-seq-len "
                         f"{args.max_seq_len} (packed micro-batches are rows of that length)")
    if args.config is not None and args.config not in PRESETS and not os.path.isfile(args.config):
        raise ValueError(f"--config {args.config!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    check_source("--data", args.data, hub_prefix="hf:")
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise FileNotFoundError(f"--tokenizer {args.tokenizer}: no such file or directory")
    if not args.init_from:
        args.config = args.config or DEFAULT_CONFIG
        return None
    if args.train_tokenizer:
        raise ValueError("--train-tokenizer makes a new vocabulary, which the --init-from weights were not trained "
                         "with; give their tokenizer (the default) or --tokenizer")
    start = starting_point(args.init_from, args.backend)
    given = config_from_flag(args.config, start.config.vocab_size, args.backend) if args.config else None
    check_start(start, given, args.config, args.max_seq_len)
    return start


def check_batch(args, d: Dist) -> None:
    """A global batch splits into equal micro-batches over the ranks and accumulation steps (checked as soon as
    the rank count is known, before any tokenising)."""
    if args.batch_size % (d.world * args.grad_accum):
        raise ValueError(f"--batch-size {args.batch_size} must divide evenly over {d.world} rank(s) x "
                         f"{args.grad_accum} accumulation step(s)")


def check_static_shape_options(args) -> None:
    """Packing's options only with packing (never silently ignored; so --instances-per-row defaults to None and
    is set to 3 here when packing), a --compile backend torch knows, checked before any tokenising."""
    if not args.packing:
        given = [flag for flag, value in (("--tokens-per-batch", args.tokens_per_batch),
                                          ("--instances-per-row", args.instances_per_row)) if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} to packed "
                             "batches; drop --no-packing or the option")
    elif args.instances_per_row is None:
        args.instances_per_row = 3
    if args.compile:
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if args.compile not in known:
            raise ValueError(f"--compile {args.compile}: not a torch.compile backend (known: {', '.join(known)})")


def run_settings(args) -> dict:
    return {k: getattr(args, k) for k in RUN_SETTINGS}


# ---- data ----------------------------------------------------------------------------------------
@dataclass
class PretrainData:
    """The tokenised corpus (memory-mapped, bert.data.corpus) and its documents split into training and held-out ids
    (the run's "split" stream): all the pipeline (bert.data.pipeline) plans from."""
    corpus: TokenisedCorpus
    train_ids: np.ndarray
    eval_ids: np.ndarray
    special: SpecialIds
    max_seqlen: int
    seed: int
    nsp: bool = True      # the objective: MLM + NSP on pairs, or MLM alone on contiguous segments


def cache_dir(args) -> str:
    return args.cache_dir or os.path.join(args.output_dir, "cache")


def data_identity(args, tokenizer) -> dict:
    """What identifies the run's data beyond its paths, for --resume to compare: the corpus's content and the
    tokenizer's (a corpus edited, or another vocabulary put at the same --tokenizer path, is refused by name)."""
    return {"data_sha256": source_digest(args.data, cache_dir(args)), "tokenizer_sha256": tokenizer_digest(tokenizer)}


def load_corpus(args, tokenizer, special: SpecialIds, d: Dist) -> PretrainData:
    """Tokenised by rank 0 (with --num-proc processes) into the cache, then memory-mapped by every rank."""
    cache = cache_dir(args)
    docs = d.main_first(lambda: tokenize_corpus(args.data, tokenizer, cache_dir=cache, num_proc=args.num_proc,
                                                max_documents=args.max_documents))
    order = seeds.rng(args.seed, "split").permutation(len(docs))
    n_eval = int(len(docs) * args.eval_fraction) if len(docs) > 1 else 0
    if args.eval_every and args.eval_fraction > 0 and len(docs) > 1:
        n_eval = max(1, n_eval)
    nsp = args.objective == "mlm+nsp"
    if len(docs) - n_eval < 1 + nsp:
        raise ValueError(f"the corpus at {args.data} has {len(docs) - n_eval} training document(s); "
                         + ("next-sentence prediction needs at least 2" if nsp else "training needs at least 1"))
    skew = nsp_skew(docs, order[n_eval:]) if nsp else None
    if skew and d.main:
        warnings.warn(f"{args.data}: {skew}")
    return PretrainData(docs, order[n_eval:], order[:n_eval], special, args.max_seq_len, args.seed, nsp)


# ---- training ------------------------------------------------------------------------------------
def resolve_tokenizer(args, d: Dist, start: StartingPoint | None):
    """--tokenizer, or the one saved with the --init-from weights (either checked against them), or one trained
    into OUTPUT_DIR/tokenizer by --train-tokenizer."""
    if args.tokenizer or start is not None:
        if not args.tokenizer and start.tokenizer is None:
            raise ValueError(f"--init-from {args.init_from}: no tokenizer saved with the weights; give --tokenizer "
                             "(the vocabulary they were trained with)")
        tokenizer = load_tokenizer(args.tokenizer or start.tokenizer)
        if start is not None:
            check_tokenizer(start, tokenizer, args.tokenizer)
        return tokenizer
    if not args.train_tokenizer:
        raise ValueError("give --tokenizer (an HF directory or vocab.txt) or --train-tokenizer VOCAB_SIZE")
    path = os.path.join(args.output_dir, "tokenizer")
    if d.main and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        # In a process of its own: the trainer runs in Rust and would not return to Python (to a signal's
        # handler) until done, which at Wikipedia's size takes minutes; a worker is stopped at once.
        list(ordered_map(_train_tokenizer, [(args.data, args.train_tokenizer, path)], processes=1,
                         name="tokenizer-training"))
    if d.world > 1:
        dist.barrier()
    return load_tokenizer(path)


def _train_tokenizer(task) -> None:
    data, vocab_size, path = task
    train_tokenizer((" ".join(doc) for doc in iter_documents(data)), vocab_size=vocab_size, output_dir=path)


def config_from_flag(config: str, vocab_size: int, backend: str) -> BertConfig:
    """--config's model: a preset or a config.json, with the tokenizer's vocabulary size."""
    if config in PRESETS:
        return BertConfig.preset(config, vocab_size=vocab_size, backend=backend)
    return BertConfig.from_json_file(config, vocab_size=vocab_size, backend=backend)


def build_config(args, vocab_size: int, start: StartingPoint | None) -> BertConfig:
    """The model's config: the --init-from weights' (checked against the run's in validate_args and
    resolve_tokenizer), or --config's."""
    if start is not None:
        return start.config
    cfg = config_from_flag(args.config, vocab_size, args.backend)
    if args.max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-seq-len {args.max_seq_len} is longer than the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    return cfg


def mlm_sums(out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(MLM loss, correct predictions, labelled tokens) of a model output: BertForPreTraining's or, MLM-only,
    BertForMaskedLM's."""
    loss = out.mlm_loss if isinstance(out, BertForPreTrainingOutput) else out.loss
    return loss, out.mlm_correct, out.mlm_count


def evaluate(model, batches, device) -> dict:
    """MLM loss, accuracy and perplexity over `batches` (bert.data.pipeline.held_out_batches)."""
    model.eval()
    loss_sum, hits, count = 0.0, 0, 0
    with torch.no_grad():
        for batch in batches:
            loss, correct, n = mlm_sums(model(**batch.to(device)))
            loss_sum += float(loss) * int(n)
            hits += int(correct)
            count += int(n)
    model.train()
    if not count:
        return {}
    loss = loss_sum / count
    return {"eval_mlm_loss": loss, "eval_mlm_acc": hits / count, "eval_perplexity": math.exp(min(loss, 50.0))}


class PretrainJob(Job):
    """MLM + NSP on NSP instances drawn per epoch and shard (or MLM alone on contiguous segments: data.nsp False),
    packed into micro-batches of fixed `shapes`, or (shapes None) length-bucketed into global batches laid out one
    instance per row; either way a micro-batch is a bert.data.batch.PackedBatch, streamed by bert.data.pipeline
    (see bert.train.loop.Job). `about`: what summary.json says of the run beyond the trainer's totals."""
    name = "pre-training"

    def __init__(self, model, data: PretrainData, masker: Masker, tokenizer, device, *, batch_size: int,
                 grad_accum: int, eval_batches: int, shapes: PackedShapes | None = None, num_proc: int = 1,
                 about: dict | None = None):
        self.model, self.data, self.masker, self.tokenizer = model, data, masker, tokenizer
        self.device, self.shapes, self.num_proc = device, shapes, num_proc
        self.batch_size, self.grad_accum, self.eval_batches = batch_size, grad_accum, eval_batches
        self.about = about or {}
        self._planner: Planner | None = None

    def planner(self, d: Dist, accum: int) -> Planner:
        if self._planner is None:
            layout = Layout(self.data.max_seqlen, d.world * accum, self.shapes, self.batch_size, self.data.nsp)
            self._planner = Planner(self.data.corpus, self.data.train_ids, layout, self.data.seed)
        return self._planner

    def epoch_steps(self, epoch, steps_before, d, accum):
        return EpochStream(self.planner(d, accum), self.masker, epoch, d.rank, accum, self.num_proc)

    @property
    def static_shapes(self) -> bool:
        return self.shapes is not None

    def counts(self, batch: PackedBatch):
        mlm = {"mlm": float(batch.labelled)}
        return {**mlm, "nsp": float((batch.next_sentence_label != -100).sum())} if self.data.nsp else mlm

    def sizes(self, batch: PackedBatch):
        lengths = batch.lengths  # the instances': not the rows' filler tails or unused slots
        return float(sum(lengths)), float(len(lengths)), float(batch.slots)

    def loss_terms(self, out, batch):
        loss, _, count = mlm_sums(out)
        if not self.data.nsp:
            return {"mlm": loss * count}
        nsp_count = (batch["next_sentence_label"] != -100).sum()
        return {"mlm": loss * count, "nsp": out.nsp_loss * nsp_count}

    def stats(self, out, batch):
        hits = {"mlm_hits": mlm_sums(out)[1]}
        if not self.data.nsp:
            return hits
        return {**hits, "nsp_hits": (out.seq_relationship_logits.argmax(-1) == batch["next_sentence_label"]).sum()}

    def log_fields(self, sums, counts):
        heads = ("mlm", "nsp") if self.data.nsp else ("mlm",)
        n = {h: max(counts[h], 1.0) for h in heads}
        return {**{f"{h}_loss": sums[h] / n[h] for h in heads}, **{f"{h}_acc": sums[f"{h}_hits"] / n[h] for h in heads}}

    def no_full_step(self):
        layout = self._planner.layout
        unit = (f"{layout.rows_per_micro} row(s) of {layout.max_seqlen} tokens" if layout.shapes else
                f"{layout.batch_size} sequences")
        return (f"the corpus's {len(self.data.train_ids)} training documents do not fill one step of {unit} per "
                f"micro-batch x {self.grad_accum} accumulation step(s) x the ranks; lower --tokens-per-batch (or "
                "--batch-size), or give more data")

    def evaluate(self, model):
        if not len(self.data.eval_ids):
            return {}
        d = self.data
        batches = held_out_batches(d.corpus, d.eval_ids, d.max_seqlen, d.seed, self.masker, self.shapes,
                                   self.batch_size, self.eval_batches, d.nsp)
        return evaluate(model, batches, self.device)

    def summary(self):
        return self.about

    def announce(self):
        """The first log row of a run started --init-from names the weights and what started fresh."""
        start = self.about.get("init_from")
        return {"init_from": start} if start else {}


def packed_shapes(args, d: Dist) -> PackedShapes | None:
    """The run's packed micro-batch shapes: by default as many rows as a padded micro-batch has sequences."""
    if not args.packing:
        return None
    rows = args.tokens_per_batch // args.max_seq_len if args.tokens_per_batch else \
        args.batch_size // (d.world * args.grad_accum)
    return PackedShapes.for_rows(rows, args.max_seq_len, args.instances_per_row, args.mlm_probability)


def settings(args, identity: dict | None = None) -> Settings:
    """The trainer's settings; `identity` (data_identity) joins what --resume compares."""
    workers = default_num_workers() if args.num_workers is None else args.num_workers
    target = ("eval_mlm_acc", args.target_mlm_accuracy) if args.target_mlm_accuracy is not None else None
    return Settings.from_arguments(args, args.steps, {**run_settings(args), **(identity or {})},
                                   num_workers=workers, adam_eps=1e-6, compile=args.compile,
                                   cuda_graphs=args.cuda_graphs, target=target)


class TrainResult(NamedTuple):
    metrics: dict                 # the last logged step (plus evaluation, when it ran)
    model: torch.nn.Module        # the trained model (unwrapped from DDP): BertForPreTraining, MLM-only BertForMaskedLM


def train(args) -> TrainResult:
    """Run pre-training with parsed CLI arguments. Used by the CLI and by tests."""
    with stop_signals() as stop, contextlib.ExitStack() as held:
        # Until training starts a signal ends the run at once: a corpus cache is written to a temporary name
        # and renamed, so nothing half-built is kept (and nothing needs saving yet).
        with stop.interruptible("while preparing the run (tokenising the corpus, building the model); "
                                "nothing needed saving yet"):
            start = validate_args(args)
            device, d = setup_device(args.dist_timeout)
            check_batch(args, d)
            held.enter_context(output_dir_lock(args.output_dir, d))
            trainer = _prepare(args, start, device, d)
        return TrainResult(trainer.fit(), trainer.model)


def _prepare(args, start: StartingPoint | None, device, d: Dist) -> Trainer:
    # A tokenizer that is read (not trained into OUTPUT_DIR) is checked before the output directory is touched: a
    # vocabulary the --init-from weights were not trained with stops the run here.
    tokenizer = None if args.train_tokenizer else resolve_tokenizer(args, d, start)
    if d.main:
        prepare_output_dir(args.output_dir, args.resume, args.overwrite)
    d.barrier()
    torch.manual_seed(args.seed)
    tokenizer = tokenizer or resolve_tokenizer(args, d, start)
    cfg = build_config(args, tokenizer.get_vocab_size(), start)
    special = SpecialIds.from_tokenizer(tokenizer)
    if d.main:  # where --resume finds it; PretrainJob.save also puts it next to every saved config.json
        save_tokenizer(tokenizer, os.path.join(args.output_dir, "tokenizer"))
    data = load_corpus(args, tokenizer, special, d)
    continuation = [i for t, i in tokenizer.get_vocab().items() if t.startswith("##")]
    collator = Masker(special, args.mlm_probability, whole_word=args.whole_word_masking,
                      continuation_ids=continuation, seed=args.seed)
    model, about = build_model(args, cfg, start, d)
    job = PretrainJob(model, data, collator, tokenizer, device, batch_size=args.batch_size,
                      grad_accum=args.grad_accum, eval_batches=args.eval_batches,
                      shapes=packed_shapes(args, d), num_proc=args.num_proc, about=about)
    return Trainer(job, settings(args, data_identity(args, tokenizer)), device, d)


def build_model(args, cfg: BertConfig, start: StartingPoint | None, d: Dist) -> tuple[torch.nn.Module, dict]:
    """The objective's model, with the --init-from weights loaded (not when resuming: the checkpoint's load
    then), and what summary.json says of it."""
    model = (BertForPreTraining if args.objective == "mlm+nsp" else BertForMaskedLM)(cfg)
    about = {"objective": args.objective, "max_seq_len": args.max_seq_len, "mlm_probability": args.mlm_probability,
             "batch_size": args.batch_size, "architecture": {k: getattr(cfg, k) for k in ARCHITECTURE},
             "init_from": None}
    if start is not None:
        about["init_from"] = {"path": start.path}
        if not args.resume:
            info = load_start(model, start)
            about["init_from"].update(initialised_fresh=info.missing_keys, left_out=info.unexpected_keys)
            if d.main:
                print(describe(start, info), flush=True)
    return model, about


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def body():
        try:
            last = train(args).metrics
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if last:
            print(json.dumps(last))
        return 0

    return run("bert-pretrain", body, args.debug)


def cli() -> None:
    """The console script: main() in a process that exits at once on a signal outside the run."""
    entry("bert-pretrain", main)


if __name__ == "__main__":
    cli()

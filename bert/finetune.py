"""Fine-tuning: `bert-finetune TASK` / `python -m bertfuse.bert.finetune`, one task of bert.tasks.task.TASKS (listed below,
from each task class's own description).

--train/--eval take local files or a Hugging Face dataset name (glue/sst2, conll2003, squad). --model is a
save_pretrained directory (ours or any HF BERT); a pre-training checkpoint gets a new head, and the log says which
keys were new and which were dropped.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os

import torch
import torch.distributed as dist

from bertfuse.bert.common import commands, seeds
from bertfuse.bert.common.commands import add_debug_flag, add_flags, check_flags, check_source, flag, resumed
from bertfuse.bert.common.errors import stop_signals
from bertfuse.bert.common.files import atomic_write_text, read_json_object
from bertfuse.bert.data.batch import pad_batch
from bertfuse.bert.data.pipeline import StepList
from bertfuse.bert.data.tokenizer import load_tokenizer, tokenizer_digest
from bertfuse.bert.tasks.readers import Features
from bertfuse.bert.tasks.task import TASKS, Task
from bertfuse.bert.train.distributed import micro_batch, setup_device
from bertfuse.bert.train.loop import Job, Trainer
from bertfuse.bert.train.rundir import output_dir_lock, prepare_output_dir, saved_run_settings
from bertfuse.bert.train.settings import Settings

logger = logging.getLogger("bert")


# This command's options. `resumed`: a setting that makes a fine-tuning run what it is, which --resume compares with
# the checkpoint's, with the trainer's own (bert.train.settings).
OPTIONS = (
    flag("task", choices=list(TASKS), resumed=True, help="the task"),
    flag("--model", required=True, resumed=True, help="a save_pretrained directory (ours or a Hugging Face BERT)"),
    flag("--tokenizer", help="tokenizer directory or vocab.txt (default: the --model directory)"),
    flag("--train", resumed=True, help="training data: a file or a Hugging Face dataset name"),
    flag("--eval", help="evaluation data: a file or a Hugging Face dataset name"),
    flag("--epochs", type=float, default=2.0, check="positive", resumed=True,
         help="passes over the training data (default 2)"),
    flag("--max-steps", type=int, default=None, check="positive", resumed=True,
         help="stop after this many optimizer steps"),
    flag("--batch-size", type=int, default=32, check="positive", resumed=True,
         help="examples per optimizer step, over all ranks and accumulation steps (default 32)"),
    flag("--eval-batch-size", type=int, default=64, check="positive", help="evaluation batch size (default 64)"),
    flag("--max-seq-len", type=int, default=None, check="positive", resumed=True,
         help="tokens per input, specials included (default 384 for qa, 128 for the others; with --resume the "
              "saved run's)"),
    flag("--doc-stride", type=int, default=None, check="non_negative", resumed=True,
         help="qa: tokens shared by adjacent windows (default 128, with --resume the saved run's; 0: windows that "
              "do not overlap)"),
    flag("--max-answer-len", type=int, default=30, check="positive", help="qa: longest answer in tokens (default 30)"),
    flag("--n-best", type=int, default=20, check="positive", help="qa: start/end candidates per window (default 20)"),
    flag("--max-train-examples", type=int, check="positive", resumed=True,
         help="use only the first N training examples"),
    flag("--max-eval-examples", type=int, check="positive", help="evaluate only the first N examples"),
    flag("--backend", choices=["auto", "torch", "triton"], default="auto", help="hot-op implementation"),
    flag("--allow-vocab-mismatch", action="store_true",
         help="fine-tune although the tokenizer is not the checkpoint's (another vocabulary, or another size than "
              "its embedding table): a warning instead of an error. A tokenizer with ids past the embedding table "
              "is refused either way"),
)
RUN_SETTINGS = resumed(OPTIONS)


def build_parser() -> argparse.ArgumentParser:
    tasks = "".join(f"\n{name}: {' '.join(task.__doc__.split())}" for name, task in TASKS.items())
    p = argparse.ArgumentParser(prog="bert-finetune", description=__doc__ + tasks,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, OPTIONS)
    Settings.add_arguments(p, output_dir="runs/finetune", lr=3e-5, warmup=0.1, log_every=10, save_every=0,
                           keep_checkpoints=2, eval_every=0)
    add_debug_flag(p)
    return p


def validate_args(args) -> None:
    """Everything that can be checked before loading a model or reading data."""
    Settings.check_arguments(args)
    fill_defaults(args)
    check_flags(args, OPTIONS)
    if not args.train and not args.eval:
        raise ValueError("give --train and/or --eval data")
    TASKS[args.task].check_arguments(args)
    config_path = os.path.join(args.model, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"--model {args.model}: no config.json there (expected a save_pretrained directory)")
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise FileNotFoundError(f"--tokenizer {args.tokenizer}: no such file or directory")
    check_source("--train", args.train)
    check_source("--eval", args.eval)
    positions = read_json_object(config_path).get("max_position_embeddings")
    if isinstance(positions, int) and args.max_seq_len > positions:
        raise ValueError(f"--max-seq-len {args.max_seq_len} is longer than the model's max_position_embeddings "
                         f"({positions}, {config_path}); use {positions} or less")


def fill_defaults(args) -> None:
    """The task's defaults for the options left unset (Task.defaults: 384 tokens for qa); a resumed run takes its
    saved settings instead, so a run saved under other defaults continues as it started."""
    saved = saved_run_settings(args.output_dir, args.resume) if args.resume else {}
    for name, default in TASKS[args.task].defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, saved.get(name, default))


class FinetuneJob(Job):
    """A task's training features, reshuffled each epoch (the run's "shuffle" stream keyed by epoch, bert.common.seeds,
    so a resume continues the same order), in global batches split over ranks and accumulation steps (see
    bert.train.loop.Job)."""

    def __init__(self, task: Task, model, rows: list[dict], tokenizer, *, batch_size: int, seed: int,
                 evaluate=None):
        self.task, self.model, self.rows, self.tokenizer = task, model, rows, tokenizer
        self.batch_size, self.seed = batch_size, seed
        self.name = f"fine-tuning ({task.name})"
        self._evaluate = evaluate

    def epoch_steps(self, epoch, steps_before, d, accum):
        order = torch.randperm(len(self.rows), generator=seeds.generator(self.seed, "shuffle", epoch))
        size = self.batch_size
        batches = [order[i:i + size].tolist() for i in range(0, len(order), size)]
        if batches and len(batches[-1]) < d.world * accum:  # too few rows left to give every micro-batch one
            batches.pop()
        return _Steps(self.rows, batches, d, accum)

    def counts(self, batch):  # the CPU batch
        return {"task": float(self.task.count(batch))}

    def loss_terms(self, out, batch):  # the device batch: the count stays on the device
        return {"task": out.loss * self.task.count(batch)}

    def stats(self, out, batch):
        return {"hits": self.task.hits(out, batch)}

    def log_fields(self, sums, counts):
        n = max(counts["task"], 1.0)
        return {"loss": sums["task"] / n, "acc": sums["hits"] / n}

    def evaluate(self, model):
        return self._evaluate(model) if self._evaluate else {}


class _Steps(StepList):
    """Item i: this rank's padded micro-batches of global step i."""

    def __init__(self, rows, batches, d, accum):
        self.rows, self.batches, self.d, self.accum = rows, batches, d, accum

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return [pad_batch([self.rows[j] for j in micro_batch(self.batches[i], self.d.rank, self.d.world, a,
                                                              self.accum)]) for a in range(self.accum)]


@torch.no_grad()
def predict(task: Task, model, data, features: Features, device, id2label, batch_size: int):
    """(metrics, predictions) of `model` on every feature row, in batches."""
    model.eval()
    outputs = []
    for i in range(0, len(features.rows), batch_size):
        batch = pad_batch(features.rows[i:i + batch_size])
        for key in ("labels", "start_positions", "end_positions"):
            batch.pop(key, None)
        outputs.append(model(**{k: v.to(device) for k, v in batch.items()}))
    model.train()
    return task.predict(outputs, data, features, id2label)


def settings(args, total_steps: int, data: dict) -> Settings:
    """The trainer's settings; `data` (the training examples' fingerprint, the label set) joins what --resume
    compares, so a changed file or label set behind the same --train is named, not loaded into the wrong head."""
    return Settings.from_arguments(args, total_steps, {**{k: getattr(args, k) for k in RUN_SETTINGS}, **data},
                                   adam_eps=1e-8)


def data_identity(train_data: list, id2label) -> dict:
    """What identifies the training data beyond its path: a hash of the examples read, and the label set."""
    text = json.dumps([dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x for x in train_data],
                      sort_keys=True, default=str)
    return {"train_examples_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "train_labels": [id2label[i] for i in sorted(id2label)] if id2label else None}


def load(args, device, d):
    """(task, tokenizer, train data, eval data, id2label, model)."""
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    task = TASKS[args.task](tokenizer, args.max_seq_len, doc_stride=args.doc_stride, n_best=args.n_best,
                            max_answer_len=args.max_answer_len)

    def read(source, split, limit):
        data = task.read(source, split)
        if not data:
            raise ValueError(f"{source}: no {'training' if split == 'train' else 'evaluation'} examples")
        return data[:limit] if limit else data

    train_data = read(args.train, "train", args.max_train_examples) if args.train else []
    eval_data = read(args.eval, "eval", args.max_eval_examples) if args.eval else []
    model_config = read_json_object(os.path.join(args.model, "config.json"))
    id2label = task.labels_from(train_data or eval_data, model_config)
    overrides = {"backend": args.backend, **({"id2label": id2label} if id2label is not None else {})}
    model = d.main_first(lambda: task.model_cls.from_pretrained(args.model, **overrides))
    check_vocabulary(args, tokenizer, model.bert.embeddings.word_embeddings.num_embeddings)
    return task, tokenizer, train_data, eval_data, id2label, model.to(device)


def check_vocabulary(args, tokenizer, rows: int) -> None:
    """The tokenizer must be the checkpoint's: one whose ids pass its embedding table is refused (they would
    index past it); one of another size, or another vocabulary than the tokenizer saved beside the checkpoint,
    trains embeddings on the wrong words, so it is refused unless --allow-vocab-mismatch (then warned)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    source = args.tokenizer or args.model
    if size > rows:
        raise ValueError(f"the tokenizer ({source}) has {size} tokens, but the checkpoint's embedding table "
                         f"({args.model}) has {rows} rows: ids from {rows} on have no embedding; use the "
                         "checkpoint's own tokenizer")
    problem = f"the tokenizer ({source}) has {size} tokens for the checkpoint's {rows} embedding rows" \
        if size != rows else None
    own = os.path.join(args.model, "tokenizer.json")
    if problem is None and args.tokenizer and os.path.isfile(own) and \
            tokenizer_digest(load_tokenizer(args.model)) != tokenizer_digest(tokenizer):
        problem = f"the tokenizer {args.tokenizer} is not the one saved with the checkpoint ({own})"
    if problem and not args.allow_vocab_mismatch:
        raise ValueError(f"{problem}: not the vocabulary it was trained with; use the checkpoint's own tokenizer, "
                         "or pass --allow-vocab-mismatch to fine-tune anyway")
    if problem:
        logger.warning("warning: %s; fine-tuning anyway (--allow-vocab-mismatch)", problem)


def loss_history(log_path: str) -> dict:
    """The training loss of the first and last log windows (log.jsonl), for a quick look at learning."""
    with open(log_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"train_loss_first": rows[0]["loss"], "train_loss_last": rows[-1]["loss"]} if rows else {}


def _start(args, held: contextlib.ExitStack):
    """The checks, the device and process group, and the output directory's lock (held until `held` closes)."""
    validate_args(args)
    device, d = setup_device(args.dist_timeout)
    if args.train and args.batch_size < d.world * args.grad_accum:  # (setup_device is cheap: still before any work)
        ranks = f" x {d.world} ranks" if d.world > 1 else ""
        raise ValueError(f"--batch-size {args.batch_size} is smaller than --grad-accum {args.grad_accum}{ranks}: "
                         "every micro-batch needs at least one example")
    held.enter_context(output_dir_lock(args.output_dir, d))
    return device, d


PREPARING = "while preparing the run (reading the data, loading the model); nothing needed saving yet"


def run(args) -> dict:
    """Fine-tune and/or evaluate; returns the metrics. Used by the CLI and by tests. The output directory is
    locked for the run; an evaluation-only run writes its metrics and predictions there, never a model."""
    with stop_signals() as stop, contextlib.ExitStack() as held:
        with stop.interruptible(PREPARING):
            device, d = _start(args, held)
            torch.manual_seed(args.seed)
            task, tokenizer, train_data, eval_data, id2label, model = load(args, device, d)
            label2id = {v: k for k, v in id2label.items()} if id2label else None
            eval_features = task.features(eval_data, label2id, train=False) if eval_data else None

        def evaluate(m):
            scores, _ = predict(task, m, eval_data, eval_features, device, id2label, args.eval_batch_size)
            return {f"eval_{k}": v for k, v in scores.items()}

        metrics = {}
        if train_data:
            with stop.interruptible(PREPARING):
                if d.main:
                    prepare_output_dir(args.output_dir, args.resume, args.overwrite)
                d.barrier()
                rows = task.features(train_data, label2id, train=True).rows
                total = args.max_steps or max(1, int(math.ceil(len(rows) / args.batch_size) * args.epochs))
                job = FinetuneJob(task, model, rows, tokenizer, batch_size=args.batch_size, seed=args.seed,
                                  evaluate=evaluate if eval_data else None)
                identity = {**data_identity(train_data, id2label), "tokenizer_sha256": tokenizer_digest(tokenizer)}
                trainer = Trainer(job, settings(args, total, identity), device, d)
            trainer.fit()
            model = trainer.model
            metrics.update(train_steps=trainer.state["step"], **loss_history(trainer.log_path))
        if eval_data and d.main and not stop.raised:  # (a run stopped by a signal is not evaluated)
            with stop.interruptible("while evaluating; no metrics or predictions were written"):
                scores, predictions = predict(task, model, eval_data, eval_features, device, id2label,
                                              args.eval_batch_size)
            print("evaluation: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()
                                             if isinstance(v, (int, float))), flush=True)
            metrics.update({f"eval_{k}": v for k, v in scores.items()}, eval_examples=len(eval_data))
            task.write_predictions(eval_data, predictions, os.path.join(args.output_dir, task.prediction_file))
        if d.main:
            write_metrics(os.path.join(args.output_dir, "metrics.json"), metrics, merge=not train_data)
        d.barrier()
    return metrics


def write_metrics(path: str, metrics: dict, merge: bool) -> None:
    """metrics.json, atomically; an evaluation-only run adds its scores to the file a training run left there."""
    old = {}
    if merge and os.path.isfile(path):
        with contextlib.suppress(ValueError, OSError):
            old = read_json_object(path)

    atomic_write_text(path, json.dumps({**old, **metrics}, indent=2))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)

    def body():
        try:
            metrics = run(args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        print(json.dumps(metrics, indent=2))
        return 0

    return commands.run("bert-finetune", body, args.debug)


def cli() -> None:
    """The console script: main() in a process that exits at once on a signal outside the run."""
    commands.entry("bert-finetune", main)


if __name__ == "__main__":
    cli()

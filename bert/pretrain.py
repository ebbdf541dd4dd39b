"""BERT pre-training (MLM + NSP): `bert-pretrain` / `python -m bert.pretrain`.

One process on a CPU or GPU, or several GPUs and nodes through torchrun (DistributedDataParallel; NCCL on GPU,
gloo on CPU). Every rank trains on its own slice of each global batch, and the losses are normalised by the
number of labelled tokens and sequences in the whole global batch, so N ranks compute exactly what one process
with the same global batch would. Checkpoints hold the model (save_pretrained), optimizer, scheduler, RNG states
and data position; `--resume` continues so that later losses equal those of an uninterrupted run.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .config import BertConfig
from .data import BucketBatchSampler, DocumentView, MLMCollator, SpecialIds, iter_documents, iter_instances, \
    micro_batch, tokenize_corpus
from .model import BertForPreTraining
from .optim import linear_schedule, param_groups
from .checkpoint import atomic_write
from .cli import add_debug_flag, check_numbers, check_source, run
from .tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

PRESETS = ("tiny", "mini", "base", "large")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert-pretrain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="mini", help="model size: tiny | mini | base | large, or a config.json path "
                                                    "(default: mini); vocab_size is taken from the tokenizer")
    p.add_argument("--data", required=True,
                   help="corpus: text file(s) (path, directory or glob; documents separated by blank lines, "
                        "WikiText '= Title =' lines understood), a .jsonl file with a 'text' field, or a Hugging "
                        "Face dataset streamed by name as hf:NAME[:CONFIG], e.g. hf:wikimedia/wikipedia:20231101.en")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="an HF directory (tokenizer.json or vocab.txt) or a vocab.txt file")
    tok.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                     help="train a WordPiece vocabulary of this size on the corpus (saved under OUTPUT_DIR/tokenizer)")
    p.add_argument("--max-seq-len", type=int, default=128, help="tokens per instance, specials included (default 128)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sequences per optimizer step, over all ranks and accumulation steps (default 32)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    p.add_argument("--warmup", type=float, default=0.01,
                   help="warm-up: a fraction of --steps if < 1, else a number of steps (default 0.01)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay, not on biases and "
                                                                     "LayerNorm (default 0.01)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping; 0 turns it off (default 1)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: bf16 autocast on GPU, fp32 on CPU; fp16 uses a gradient scaler (default auto)")
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto",
                   help="hot-op implementation (default auto: triton on CUDA)")
    p.add_argument("--mlm-probability", type=float, default=0.15, help="share of tokens chosen (default 0.15)")
    p.add_argument("--whole-word-masking", action="store_true", help="choose whole words, not single pieces")
    p.add_argument("--output-dir", default="runs/pretrain", help="checkpoints, logs and the final model "
                                                                 "(default runs/pretrain)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from a checkpoint directory, or from the latest one in OUTPUT_DIR if no path")
    p.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps (default 500)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="keep the last K checkpoints (default 3)")
    p.add_argument("--eval-every", type=int, default=200, help="evaluate every N steps; 0 turns it off (default 200)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="documents held out for evaluation "
                                                                     "(default 0.05)")
    p.add_argument("--eval-batches", type=int, default=20, help="batches per evaluation (default 20)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--num-proc", type=int, default=1, help="processes for tokenisation (default 1)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers for collation (default 0)")
    p.add_argument("--cache-dir", default=None, help="where the tokenised corpus is cached "
                                                     "(default OUTPUT_DIR/cache)")
    p.add_argument("--max-documents", type=int, default=None, help="read at most this many documents")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run in an OUTPUT_DIR that already holds one (its log and checkpoints are "
                        "deleted)")
    p.add_argument("--allow-config-changes", action="store_true",
                   help="with --resume: continue although settings differ from the saved run's (listed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_debug_flag(p)
    return p


# Settings that make a run what it is: --resume compares them with the checkpoint's (the others only say how
# it runs: workers, logging cadence, caching).
RUN_SETTINGS = ("config", "data", "tokenizer", "train_tokenizer", "max_seq_len", "batch_size", "grad_accum", "steps",
                "lr", "warmup", "weight_decay", "max_grad_norm", "precision", "mlm_probability",
                "whole_word_masking", "eval_fraction", "seed", "max_documents")


def validate_args(args) -> None:
    """Everything that can be checked before any work (tokenising a corpus can take hours)."""
    check_numbers(args, positive=("max_seq_len", "batch_size", "grad_accum", "steps", "lr", "keep_checkpoints",
                                  "eval_batches", "num_proc", "train_tokenizer", "max_documents"),
                  non_negative=("warmup", "weight_decay", "max_grad_norm", "save_every", "eval_every",
                                "num_workers"),
                  fractions=("eval_fraction",))
    if not 0 < args.mlm_probability <= 1:
        raise ValueError(f"--mlm-probability must be in (0, 1], got {args.mlm_probability}")
    if args.max_seq_len < 8:
        raise ValueError(f"--max-seq-len must be at least 8 ([CLS] A [SEP] B [SEP] needs room), got "
                         f"{args.max_seq_len}")
    if args.config not in PRESETS and not os.path.isfile(args.config):
        raise ValueError(f"--config {args.config!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    check_source("--data", args.data, hub_prefix="hf:")
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise FileNotFoundError(f"--tokenizer {args.tokenizer}: no such file or directory")
    if args.resume and args.resume != "latest" and not os.path.isdir(args.resume):
        raise FileNotFoundError(f"--resume {args.resume}: no such checkpoint directory")


def run_settings(args) -> dict:
    return {k: getattr(args, k) for k in RUN_SETTINGS}


def prepare_output_dir(args) -> None:
    """A fresh run refuses an OUTPUT_DIR that holds another run (its log, checkpoints or model), unless
    --overwrite, which deletes the old log and checkpoints so a later --resume cannot pick them up."""
    os.makedirs(args.output_dir, exist_ok=True)
    if args.resume:
        return
    old = [n for n in ("log.jsonl", "checkpoints", "model.safetensors") if os.path.exists(os.path.join(args.output_dir, n))]
    if old and not args.overwrite:
        raise ValueError(f"{args.output_dir} already holds a run ({', '.join(old)}); pass --resume to continue it "
                         "or --overwrite to start a new one there")
    for name in ("log.jsonl", "checkpoints", "tensorboard", "tokenizer"):
        path = os.path.join(args.output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def check_resumed_settings(saved: dict | None, args) -> None:
    """Refuse to continue a run under other settings than it was started with, listing every difference."""
    if saved is None:
        return
    changed = {k: (saved.get(k), v) for k, v in run_settings(args).items() if k in saved and saved[k] != v}
    if changed and not args.allow_config_changes:
        listed = "; ".join(f"--{k.replace('_', '-')} was {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ValueError(f"--resume: the settings differ from the saved run's: {listed}. Use the saved settings, "
                         "or pass --allow-config-changes to continue anyway")


def truncate_log(path: str, step: int) -> None:
    """Drop the log rows written after the checkpoint a run resumes from (they will be written again)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(rows)

    atomic_write(path, write)


# ---- distributed helpers -------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def main_first(self, fn):
        """fn() on rank 0 first, which fills a cache on disk, then on the other ranks, which read it from there
        instead of racing rank 0 to write it."""
        if self.main:
            out = fn()
        if self.world > 1:
            dist.barrier()
        if not self.main:
            out = fn()
        return out

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t


def setup_distributed(device_type: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


# ---- data ----------------------------------------------------------------------------------------
class StepData(torch.utils.data.Dataset):
    """Item i: this rank's collated micro-batches of global step i of the epoch."""

    def __init__(self, instances, batches, collator, d: Dist, accum: int, epoch: int, steps_before: int):
        self.instances, self.batches, self.collator = instances, batches, collator
        self.d, self.accum, self.epoch, self.steps_before = d, accum, epoch, steps_before

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        out, global_batch = [], self.batches[i]
        size = len(global_batch)
        for a in range(self.accum):
            idx = micro_batch(global_batch, self.d.rank, self.d.world, a, self.accum)
            offset = (self.d.rank * self.accum + a) * len(idx)
            keys = [(self.steps_before + i) * size + offset + k for k in range(len(idx))]
            out.append(self.collator([self.instances[int(j)] for j in idx], keys=keys))
        return out


@dataclass
class Corpus:
    """Tokenised documents held in Arrow (memory-mapped) and, per epoch, the NSP instances drawn from them,
    written once to the cache by rank 0 and read by every rank: nothing corpus-sized lives in Python lists."""
    train_docs: DocumentView
    eval_docs: DocumentView
    special: SpecialIds
    max_seq_len: int
    seed: int
    cache_dir: str
    d: Dist
    _cache: dict = field(default_factory=dict)

    def instances(self, epoch: int):
        """NSP pairs are drawn anew each epoch (deterministically), so each epoch sees fresh pairings."""
        if epoch not in self._cache:
            import datasets

            self._cache.clear()
            seed = self.seed * 7919 + epoch
            key = f"{self.train_docs.dataset._fingerprint}-{self.max_seq_len}-{seed}-{self.special.cls}"

            def rows():
                for x in iter_instances(self.train_docs, self.max_seq_len, self.special, seed=seed):
                    yield dict(x, length=len(x["input_ids"]))

            self._cache[epoch] = self.d.main_first(lambda: datasets.Dataset.from_generator(
                rows, cache_dir=self.cache_dir, fingerprint=f"nsp-{key}"))
        return self._cache[epoch]


def load_corpus(args, tokenizer, special: SpecialIds, d: Dist) -> Corpus:
    cache = args.cache_dir or os.path.join(args.output_dir, "cache")

    docs = d.main_first(lambda: tokenize_corpus(args.data, tokenizer, cache_dir=cache, num_proc=args.num_proc,
                                                max_documents=args.max_documents))
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(args.seed)).tolist()
    n_eval = int(len(docs) * args.eval_fraction) if len(docs) > 1 else 0
    if args.eval_every and args.eval_fraction > 0 and len(docs) > 1:
        n_eval = max(1, n_eval)
    eval_docs, train_docs = docs.select(order[:n_eval]), docs.select(order[n_eval:])
    if len(train_docs) < 2:
        raise ValueError(f"the corpus at {args.data} has {len(train_docs)} training document(s); "
                         "next-sentence prediction needs at least 2")
    return Corpus(DocumentView(train_docs), DocumentView(eval_docs), special, args.max_seq_len, args.seed, cache, d)


# ---- checkpoints ---------------------------------------------------------------------------------
def checkpoint_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def latest_checkpoint(output_dir: str) -> str | None:
    root = checkpoint_dir(output_dir)
    if not os.path.isdir(root):
        return None
    names = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    return os.path.join(root, names[-1]) if names else None


def save_checkpoint(output_dir, model, optimizer, scheduler, scaler, state: dict, keep: int,
                    settings: dict | None = None) -> str:
    """Write into a temporary directory, then rename it: a checkpoint is either complete or absent."""
    root = checkpoint_dir(output_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{state['step']:08d}")
    tmp = os.path.join(root, f".tmp-step-{state['step']:08d}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "run_settings": json.dumps(settings), **state}, os.path.join(tmp, "training_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    names = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    for old in names[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


# ---- training ------------------------------------------------------------------------------------
class _StopFlag:
    def __init__(self):
        self.raised = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.raised = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def resolve_tokenizer(args, d: Dist):
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if not args.train_tokenizer:
        raise ValueError("give --tokenizer (an HF directory or vocab.txt) or --train-tokenizer VOCAB_SIZE")
    path = os.path.join(args.output_dir, "tokenizer")
    if d.main and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        texts = (" ".join(doc) for doc in iter_documents(args.data))
        train_tokenizer(texts, vocab_size=args.train_tokenizer, output_dir=path)
    if d.world > 1:
        dist.barrier()
    return load_tokenizer(path)


def build_config(args, vocab_size: int) -> BertConfig:
    if args.config in PRESETS:
        cfg = BertConfig.preset(args.config, vocab_size=vocab_size, backend=args.backend)
    else:
        cfg = BertConfig.from_json_file(args.config, vocab_size=vocab_size, backend=args.backend)
    if args.max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-seq-len {args.max_seq_len} is longer than the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    return cfg


def evaluate(model, corpus: Corpus, collator, batch_size: int, batches: int, device, amp) -> dict:
    """MLM loss, accuracy and perplexity on held-out documents, masked the same way every time."""
    if not corpus.eval_docs:
        return {}
    instances = list(itertools.islice(
        iter_instances(corpus.eval_docs, corpus.max_seq_len, corpus.special, seed=corpus.seed + 1),
        batches * batch_size))
    model.eval()
    loss_sum, hits, count = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, min(len(instances), batches * batch_size), batch_size):
            rows = instances[start:start + batch_size]
            batch = collator(rows, keys=[-(start + k + 1) for k in range(len(rows))])
            batch = {k: v.to(device) for k, v in batch.items()}
            with amp():
                out = model(**batch)
            n = int(out.mlm_count)
            loss_sum += float(out.mlm_loss) * n
            hits += int(out.mlm_correct)
            count += n
    model.train()
    if not count:
        return {}
    loss = loss_sum / count
    return {"eval_mlm_loss": loss, "eval_mlm_acc": hits / count, "eval_perplexity": math.exp(min(loss, 50.0))}


class TrainResult(NamedTuple):
    metrics: dict                 # the last logged step (plus evaluation, when it ran)
    model: BertForPreTraining     # the trained model (unwrapped from DDP)


def train(args) -> TrainResult:
    """Run pre-training with parsed CLI arguments. Used by the CLI and by tests."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    validate_args(args)
    d = setup_distributed(device.type)
    if d.main:
        prepare_output_dir(args)
    if d.world > 1:
        dist.barrier()
    torch.manual_seed(args.seed)

    tokenizer = resolve_tokenizer(args, d)
    special = SpecialIds.from_tokenizer(tokenizer)
    cfg = build_config(args, tokenizer.get_vocab_size())
    if d.main:  # next to config.json too, so OUTPUT_DIR is a complete model for bert-finetune --model
        for where in (os.path.join(args.output_dir, "tokenizer"), args.output_dir):
            save_tokenizer(tokenizer, where)
    corpus = load_corpus(args, tokenizer, special, d)
    continuation = [i for t, i in tokenizer.get_vocab().items() if t.startswith("##")]
    collator = MLMCollator(special, args.mlm_probability, whole_word=args.whole_word_masking,
                           continuation_ids=continuation, seed=args.seed)
    if args.batch_size % (d.world * args.grad_accum):
        raise ValueError(f"--batch-size {args.batch_size} must divide evenly over {d.world} rank(s) x "
                         f"{args.grad_accum} accumulation step(s)")

    model = BertForPreTraining(cfg).to(device)
    precision = args.precision if args.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def amp():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.999), eps=1e-6,
                                  **({"fused": True} if device.type == "cuda" else {}))
    warmup = int(args.warmup * args.steps) if args.warmup < 1 else int(args.warmup)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(warmup, args.steps))
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "steps_before_epoch": 0}

    resume = latest_checkpoint(args.output_dir) if args.resume == "latest" else args.resume
    if args.resume and not resume:
        raise FileNotFoundError(f"--resume: no checkpoint in {checkpoint_dir(args.output_dir)}")
    if resume:
        from .checkpoint import read_state_dict

        model.load_hf_state_dict(read_state_dict(resume))
        saved = torch.load(os.path.join(resume, "training_state.pt"), map_location="cpu", weights_only=True)
        check_resumed_settings(json.loads(saved.get("run_settings") or "null"), args)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        if scaler is not None and saved.get("scaler"):
            scaler.load_state_dict(saved["scaler"])
        torch.set_rng_state(saved["rng_cpu"])
        if device.type == "cuda" and saved["rng_cuda"]:
            torch.cuda.set_rng_state_all(saved["rng_cuda"])
        state = {k: saved[k] for k in state}
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                    else None) if d.world > 1 else model
    model.train()

    log_path = os.path.join(args.output_dir, "log.jsonl")
    if d.main:
        truncate_log(log_path, state["step"])
    writer = None
    if d.main:
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(os.path.join(args.output_dir, "tensorboard"))
        except ImportError:
            pass
    progress = None
    if d.main and not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=args.steps, initial=state["step"], desc="pre-training", dynamic_ncols=True)

    last: dict = {}
    with _StopFlag() as stop, open(log_path, "a", encoding="utf-8") if d.main else open(os.devnull, "w") as log:
        while state["step"] < args.steps:
            instances = corpus.instances(state["epoch"])
            sampler = BucketBatchSampler(np.asarray(instances["length"]), args.batch_size,
                                         seed=args.seed * 31 + state["epoch"])
            batches = sampler.epoch_batches(state["epoch"])
            if not batches:
                raise ValueError("the corpus yields no full batch; lower --batch-size")
            data = StepData(instances, batches, collator, d, args.grad_accum, state["epoch"],
                            state["steps_before_epoch"])
            loader = torch.utils.data.DataLoader(
                torch.utils.data.Subset(data, range(state["batch_in_epoch"], len(data))), batch_size=None,
                num_workers=args.num_workers, generator=torch.Generator())  # keeps the global RNG (dropout) untouched
            for micro_batches in loader:
                t0 = time.perf_counter()
                # Global counts first: the loss of every micro-batch is normalised by the whole step's totals.
                counts = torch.tensor([[float((b["labels"] != -100).sum()), float(len(b["labels"]))]
                                       for b in micro_batches]).sum(0)
                counts = d.all_sum(counts.to(device)).tolist()
                n_labelled, n_seqs = max(counts[0], 1.0), counts[1]
                stats = torch.zeros(7, device=device)
                for a, batch in enumerate(micro_batches):
                    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                    sync = a == len(micro_batches) - 1 or d.world == 1
                    ctx = ddp.no_sync() if not sync and d.world > 1 else contextlib.nullcontext()
                    with ctx:
                        with amp():
                            out = ddp(**batch)
                        mlm_sum = out.mlm_loss * out.mlm_count
                        nsp_sum = out.nsp_loss * len(batch["next_sentence_label"])
                        loss = (mlm_sum / n_labelled + nsp_sum / n_seqs) * d.world
                        (scaler.scale(loss) if scaler else loss).backward()
                    nsp_hits = (out.seq_relationship_logits.argmax(-1) == batch["next_sentence_label"]).sum()
                    stats += torch.stack([mlm_sum.detach().float(), nsp_sum.detach().float(),
                                          out.mlm_correct.float(), nsp_hits.float(),
                                          batch["attention_mask"].sum().float(), out.mlm_count.float(),
                                          torch.tensor(float(stop.raised), device=device)])
                if scaler:
                    scaler.unscale_(optimizer)
                if args.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state["step"] += 1
                state["batch_in_epoch"] += 1
                mlm_sum, nsp_sum, mlm_hits, nsp_hits, tokens, _, stopping = d.all_sum(stats).tolist()
                elapsed = time.perf_counter() - t0
                last = {"step": state["step"], "mlm_loss": mlm_sum / n_labelled, "nsp_loss": nsp_sum / n_seqs,
                        "mlm_acc": mlm_hits / n_labelled, "nsp_acc": nsp_hits / n_seqs, "lr": lr,
                        "tokens_per_s": tokens / elapsed, "seqs_per_s": n_seqs / elapsed}
                if stopping:
                    last["stopped"] = True
                if args.eval_every and state["step"] % args.eval_every == 0 and d.main:
                    scores = evaluate(model, corpus, collator, max(1, args.batch_size // d.world),
                                      args.eval_batches, device, amp)
                    last.update(scores)
                    if scores:
                        say(progress, f"step {state['step']}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()))
                if d.main:
                    log.write(json.dumps(last) + "\n")
                    log.flush()
                    if writer:
                        for k, v in last.items():
                            if k != "step":
                                writer.add_scalar(k, v, state["step"])
                    if progress:
                        progress.update(1)
                        progress.set_postfix(mlm=f"{last['mlm_loss']:.3f}", nsp=f"{last['nsp_loss']:.3f}",
                                             acc=f"{last['mlm_acc']:.3f}")
                done = state["step"] >= args.steps
                if stopping or done or (args.save_every and state["step"] % args.save_every == 0):
                    if d.main:
                        save_checkpoint(args.output_dir, model, optimizer, scheduler, scaler, state,
                                        args.keep_checkpoints, run_settings(args))
                    if d.world > 1:
                        dist.barrier()
                if stopping:
                    if d.main:
                        say(progress, f"stopped by signal at step {state['step']}; checkpoint saved")
                    break
                if done:
                    break
            if last.get("stopped") or state["step"] >= args.steps:
                break
            state["steps_before_epoch"] += len(batches)
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
    if progress:
        progress.close()
    if writer:
        writer.close()
    if d.main and not last.get("stopped"):
        model.save_pretrained(args.output_dir)
        print(f"saved to {args.output_dir}", flush=True)
    if d.world > 1:
        dist.barrier()
    return TrainResult(last, model)


def say(progress, message: str) -> None:
    """A console line that does not break the progress bar (and shows without one)."""
    if progress:
        progress.write(message)
    else:
        print(message, flush=True)


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


if __name__ == "__main__":
    raise SystemExit(main())

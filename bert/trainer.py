"""The training loop shared by pre-training and fine-tuning: `Trainer(job, settings).fit()`.

The trainer owns everything the two have in common: the device and torchrun/DDP set-up, mixed precision
(bf16 autocast, or fp16 with a gradient scaler), gradient accumulation and clipping, AdamW (fused on CUDA; no
decay on biases and LayerNorm) with linear warm-up and decay, evaluation cadence, atomic checkpoints with exact
resume (model, optimizer, scheduler, scaler, RNG states, data position; a changed setting is refused unless
allowed; log rows after the checkpoint are dropped), SIGTERM/SIGINT (checkpoint, then stop), and logging
(console, OUTPUT_DIR/log.jsonl, TensorBoard when installed, tqdm) with real tokens/s and sequences/s.

A job supplies the rest (see `Job`): its model, its data as global steps of rank-local micro-batches, the loss
terms of a micro-batch, its log fields and its evaluation. Losses are normalised over the whole global batch
(every micro-batch on every rank): each term is a sum over its items divided by the global count of items, so
N ranks and K accumulation steps compute exactly what one process with the whole batch would. Nothing is read
back from the device inside a step: step statistics are summed on the device and read every `log_every` steps.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .checkpoint import atomic_write
from .optim import adamw, linear_schedule, param_groups, set_lr_types


# ---- distributed -------------------------------------------------------------------------------
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
        self.barrier()
        if not self.main:
            out = fn()
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t


def setup_device() -> tuple[torch.device, Dist]:
    """The device (this rank's GPU, or the CPU) and the process group under torchrun (NCCL on GPU, gloo on CPU)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return device, Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


# ---- what a job supplies -----------------------------------------------------------------------
class Job:
    """The task-specific half of training. Subclasses set `model` and `name` and implement the methods."""
    name = "training"
    model: torch.nn.Module

    def epoch_steps(self, epoch: int, steps_before: int, d: Dist, accum: int):
        """A sequence (len, getitem) whose item i is the list of this rank's `accum` micro-batches (dicts of CPU
        tensors) of global step i of `epoch`; steps_before = global steps of the earlier epochs."""
        raise NotImplementedError

    def counts(self, batch: dict) -> dict[str, float]:
        """Per loss term, how many items of this micro-batch it averages over (from the CPU batch)."""
        raise NotImplementedError

    def loss_terms(self, out, batch: dict) -> dict[str, torch.Tensor]:
        """Per loss term, the sum of its items' losses in this micro-batch (a device scalar)."""
        raise NotImplementedError

    def stats(self, out, batch: dict) -> dict[str, torch.Tensor]:
        """Device scalars to sum over a log window (hits for accuracies...)."""
        return {}

    def sizes(self, batch: dict) -> tuple[float, float, float]:
        """(real tokens, sequences, token slots computed) of a CPU micro-batch: tokens/s, sequences/s and the
        packing efficiency (real tokens / slots) of the log. A padded batch's slots are its whole shape."""
        mask = batch["attention_mask"]
        return float(mask.sum()), float(mask.shape[0]), float(mask.numel())

    @property
    def static_shapes(self) -> bool:
        """Whether every micro-batch has the same shapes (packed batches): what CUDA graphs need."""
        return False

    def log_fields(self, sums: dict[str, float], counts: dict[str, float]) -> dict:
        """The log row's task fields from a window's summed loss terms, stats and counts."""
        return {f"{k}_loss": sums[k] / max(counts[k], 1.0) for k in counts}

    def evaluate(self, model) -> dict:
        return {}

    def save(self, model, path: str) -> None:
        save_model(model, getattr(self, "tokenizer", None), path)


def save_model(model, tokenizer, path: str) -> None:
    """A complete model directory: save_pretrained, and the tokenizer next to config.json when there is one."""
    model.save_pretrained(path)
    if tokenizer is not None:
        from .tokenizer import save_tokenizer

        save_tokenizer(tokenizer, path)


@dataclass
class Settings:
    output_dir: str
    steps: int
    lr: float
    warmup: float = 0.0                # a fraction of steps if < 1, else a number of steps
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    precision: str = "auto"            # auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16
    grad_accum: int = 1
    save_every: int = 0
    keep_checkpoints: int = 3
    eval_every: int = 0
    log_every: int = 1
    num_workers: int = 0
    seed: int = 0
    resume: str | None = None          # a checkpoint directory, or "latest"
    allow_config_changes: bool = False
    progress: bool = True
    adam_eps: float = 1e-6
    compile: str | None = None         # a torch.compile backend ("inductor", "aot_eager"...), or None
    cuda_graphs: bool = False          # capture each step in a CUDA graph (static shapes, one GPU)
    run_settings: dict = field(default_factory=dict)   # what --resume compares with the checkpoint's


# ---- checkpoints -------------------------------------------------------------------------------
def checkpoint_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def latest_checkpoint(output_dir: str) -> str | None:
    root = checkpoint_dir(output_dir)
    names = sorted(n for n in os.listdir(root) if n.startswith("step-")) if os.path.isdir(root) else []
    return os.path.join(root, names[-1]) if names else None


def check_resumed_settings(saved: dict | None, current: dict, allow: bool) -> None:
    """Refuse to continue a run under other settings than it was started with, listing every difference."""
    if saved is None:
        return
    changed = {k: (saved.get(k), v) for k, v in current.items() if k in saved and saved[k] != v}
    if changed and not allow:
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


class _StopFlag:
    """SIGTERM / SIGINT set a flag that the loop reads between steps (checkpoint, then stop)."""

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


def prepare_output_dir(output_dir: str, resume, overwrite: bool) -> None:
    """A fresh run refuses an output directory that holds another run (its log, checkpoints or model), unless
    `overwrite`, which deletes the old log and checkpoints so that a later --resume cannot pick them up."""
    os.makedirs(output_dir, exist_ok=True)
    if resume:
        return
    old = [n for n in ("log.jsonl", "checkpoints", "model.safetensors") if os.path.exists(os.path.join(output_dir, n))]
    if old and not overwrite:
        raise ValueError(f"{output_dir} already holds a run ({', '.join(old)}); pass --resume to continue it "
                         "or --overwrite to start a new one there")
    for name in ("log.jsonl", "checkpoints", "tensorboard", "tokenizer"):
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def slice_bounds(n: int, parts: int, j: int) -> tuple[int, int]:
    """[start, end) of part j when n rows are cut into `parts` slices whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    start = j * base + min(j, extra)
    return start, start + base + (j < extra)


def micro_batch(global_batch, rank: int, world_size: int, accum_step: int, accum_steps: int):
    """This rank's rows for one accumulation step of a global batch: the batch is cut into world x accum slices
    (equal when they divide it), rank r takes slices r*accum ... r*accum + accum - 1."""
    start, end = slice_bounds(len(global_batch), world_size * accum_steps, rank * accum_steps + accum_step)
    return global_batch[start:end]


# ---- the loop ----------------------------------------------------------------------------------
class _Window:
    """Sums of a log window: loss terms and stats on the device (read once, at the log step), item counts,
    tokens and sequences from the CPU batches."""

    def __init__(self):
        self.device_sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, float] = {}
        self.tokens = self.seqs = self.slots = 0.0
        self.start = time.perf_counter()

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for k, v in values.items():
            v = v.detach().float()
            self.device_sums[k] = self.device_sums[k] + v if k in self.device_sums else v

    def add_sizes(self, tokens: float, seqs: float, slots: float) -> None:
        self.tokens, self.seqs, self.slots = self.tokens + tokens, self.seqs + seqs, self.slots + slots

    def read(self, d: Dist, device) -> tuple[dict, dict, tuple[float, float, float]]:
        """(summed device values, counts, (tokens, sequences, slots)), over every rank."""
        names = sorted(self.device_sums)
        local = torch.stack([self.device_sums[k] for k in names]) if names else torch.zeros(0, device=device)
        cpu = torch.tensor([*self.counts.values(), self.tokens, self.seqs, self.slots], dtype=torch.float64)
        if d.world > 1:  # counts, tokens and sequences of every rank
            cpu = d.all_sum(cpu.to(device)).cpu()
            local = d.all_sum(local)
        sums = dict(zip(names, local.tolist()))
        *counts, tokens, seqs, slots = cpu.tolist()
        return sums, dict(zip(self.counts, counts)), (tokens, seqs, slots)


class Trainer:
    """Runs a Job under Settings on `device` (see the module docstring)."""

    def __init__(self, job: Job, settings: Settings, device: torch.device, d: Dist):
        self.job, self.s, self.device, self.d = job, settings, device, d
        self.model = job.model.to(device)
        precision = settings.precision if settings.precision != "auto" else \
            ("bf16" if device.type == "cuda" else "fp32")
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        graphs = settings.cuda_graphs and self._graphs_possible()
        self.optimizer = adamw(param_groups(self.model, settings.weight_decay), settings.lr, device,
                               capturable=graphs, betas=(0.9, 0.999), eps=settings.adam_eps)
        warmup = int(settings.warmup * settings.steps) if settings.warmup < 1 else int(settings.warmup)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, linear_schedule(warmup, settings.steps))
        self.state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "steps_before_epoch": 0}
        self._resume()
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None) if d.world > 1 else self.model
        # What a step calls: the model (DDP-wrapped on several ranks), compiled when asked. Packed batches have
        # one shape, so one compilation serves the whole run.
        self.forward = torch.compile(self.ddp, backend=settings.compile, dynamic=False if job.static_shapes else None) \
            if settings.compile else self.ddp
        self.graphed = None
        if graphs:
            from .static import GraphedStep

            self.graphed = GraphedStep(self._train_step, self.model, self.optimizer)
        self.log_path = os.path.join(settings.output_dir, "log.jsonl")

    def _graphs_possible(self) -> bool:
        """CUDA graphs need static shapes, one CUDA device and no gradient scaler (its step reads the device);
        otherwise the run goes on without them, after one warning saying why."""
        reason = ("there is no CUDA device" if self.device.type != "cuda" else
                  "the batches change shape (use --packing)" if not self.job.static_shapes else
                  "several ranks (DDP's all-reduce is not captured here)" if self.d.world > 1 else
                  "fp16's gradient scaler reads the device every step (use bf16)" if self.scaler else None)
        if reason:
            warnings.warn(f"--cuda-graphs: running without CUDA graphs: {reason}", stacklevel=3)
        return reason is None

    def amp(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    # -- checkpoints --
    def _resume(self) -> None:
        s = self.s
        path = latest_checkpoint(s.output_dir) if s.resume == "latest" else s.resume
        if s.resume and not path:
            raise FileNotFoundError(f"--resume: no checkpoint in {checkpoint_dir(s.output_dir)}")
        if not path:
            return
        from .checkpoint import read_state_dict

        saved = torch.load(os.path.join(path, "training_state.pt"), map_location="cpu", weights_only=True)
        check_resumed_settings(json.loads(saved.get("run_settings") or "null"), s.run_settings,
                               s.allow_config_changes)
        self.model.load_hf_state_dict(read_state_dict(path))
        self.optimizer.load_state_dict(saved["optimizer"])
        set_lr_types(self.optimizer, self.device)
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None and saved.get("scaler"):
            self.scaler.load_state_dict(saved["scaler"])
        torch.set_rng_state(saved["rng_cpu"])
        if self.device.type == "cuda" and saved["rng_cuda"]:
            torch.cuda.set_rng_state_all(saved["rng_cuda"])
        self.state = {k: saved[k] for k in self.state}

    def save_checkpoint(self) -> str:
        """Written into a temporary directory, then renamed: a checkpoint is either complete or absent."""
        root = checkpoint_dir(self.s.output_dir)
        os.makedirs(root, exist_ok=True)
        final = os.path.join(root, f"step-{self.state['step']:08d}")
        tmp = os.path.join(root, f".tmp-step-{self.state['step']:08d}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.job.save(self.model, tmp)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                    "rng_cpu": torch.get_rng_state(),
                    "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                    "run_settings": json.dumps(self.s.run_settings), **self.state},
                   os.path.join(tmp, "training_state.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        names = sorted(n for n in os.listdir(root) if n.startswith("step-"))
        for old in names[:-self.s.keep_checkpoints] if self.s.keep_checkpoints > 0 else []:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        return final

    # -- the loop --
    def fit(self) -> dict:
        """Train until settings.steps (or a signal); returns the last log row (with evaluation, when it ran)."""
        s, d = self.s, self.d
        if d.main:
            truncate_log(self.log_path, self.state["step"])
        writer, progress = self._sinks()
        last: dict = {}
        window = _Window()
        self.model.train()
        with _StopFlag() as stop, open(self.log_path if d.main else os.devnull, "a", encoding="utf-8") as log:
            while self.state["step"] < s.steps and not last.get("stopped"):
                steps, loader = self._loader()
                for micro_batches in loader:
                    lr = self._step(micro_batches, window)
                    stopping = self._stopping(stop)
                    row = self._end_of_step(window, lr, stopping, log, writer, progress)
                    if row is not None:
                        last, window = row, _Window()
                    if stopping or self.state["step"] >= s.steps:
                        break
                else:
                    self.state["steps_before_epoch"] += len(steps)
                    self.state["epoch"] += 1
                    self.state["batch_in_epoch"] = 0
        if progress:
            progress.close()
        if writer:
            writer.close()
        if d.main and not last.get("stopped"):
            self.job.save(self.model, s.output_dir)
            say(progress, f"saved to {s.output_dir}")
        d.barrier()
        return last

    def _sinks(self):
        writer = progress = None
        if self.d.main:
            try:
                from torch.utils.tensorboard import SummaryWriter

                writer = SummaryWriter(os.path.join(self.s.output_dir, "tensorboard"))
            except ImportError:
                pass
            if self.s.progress:
                from tqdm.auto import tqdm

                progress = tqdm(total=self.s.steps, initial=self.state["step"], desc=self.job.name,
                                dynamic_ncols=True)
        return writer, progress

    def _loader(self):
        steps = self.job.epoch_steps(self.state["epoch"], self.state["steps_before_epoch"], self.d, self.s.grad_accum)
        if len(steps) == 0:
            raise ValueError("the data yields no full batch; lower the batch size")
        subset = torch.utils.data.Subset(steps, range(self.state["batch_in_epoch"], len(steps)))
        # Its own generator: the loader never draws from the global RNG, which dropout uses.
        return steps, torch.utils.data.DataLoader(subset, batch_size=None, num_workers=self.s.num_workers,
                                                  generator=torch.Generator(),
                                                  pin_memory=self.device.type == "cuda")

    def _denominators(self, micro_batches) -> tuple[dict, dict]:
        """(this rank's item counts per loss term, the global counts the sums are divided by). One process: plain
        floats, no device traffic; several: one all-reduce."""
        counts = [self.job.counts(b) for b in micro_batches]
        local = {n: float(sum(c[n] for c in counts)) for n in counts[0]}
        if self.d.world == 1:
            return local, {n: max(v, 1.0) for n, v in local.items()}
        total = self.d.all_sum(torch.tensor(list(local.values()), dtype=torch.float32, device=self.device))
        return local, dict(zip(local, total.clamp_min(1.0).unbind()))

    def _step(self, micro_batches, window: _Window) -> float:
        local, denominators = self._denominators(micro_batches)
        for batch in micro_batches:
            window.add_sizes(*self.job.sizes(batch))
        batches = [{k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items()} for batch in micro_batches]
        logged = (self.graphed or self._train_step)(batches, denominators)
        for values in logged:
            window.add(values)
        for n, v in local.items():
            window.counts[n] = window.counts.get(n, 0.0) + v
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.state["step"] += 1
        self.state["batch_in_epoch"] += 1
        return lr

    def _train_step(self, batches: list[dict], denominators: dict) -> list[dict[str, torch.Tensor]]:
        """Forward and backward of every micro-batch (device tensors), then the optimizer step; returns each
        micro-batch's loss terms and stats (device scalars). Nothing here reads the device, so that it can be
        captured as a CUDA graph (bert.static.GraphedStep) when the batches are packed."""
        logged = []
        for a, batch in enumerate(batches):
            sync = a == len(batches) - 1 or self.d.world == 1
            with self.ddp.no_sync() if not sync else contextlib.nullcontext():
                with self.amp():
                    out = self.forward(**batch)
                terms = self.job.loss_terms(out, batch)
                loss = sum(terms[n] / denominators[n] for n in denominators) * self.d.world
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            logged.append({**terms, **self.job.stats(out, batch)})
        self._optimizer_step()
        return logged

    def _optimizer_step(self) -> None:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.s.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _stopping(self, stop: _StopFlag) -> bool:
        if self.d.world == 1:
            return stop.raised
        flag = self.d.all_sum(torch.tensor([float(stop.raised)], device=self.device))
        return bool(flag.item())  # every rank stops at the same step

    def _end_of_step(self, window, lr, stopping, log, writer, progress) -> dict | None:
        """Log (every log_every steps, at evaluations, the last step and a stop), evaluate, checkpoint."""
        s, step = self.s, self.state["step"]
        done = step >= s.steps
        evaluating = bool(s.eval_every) and step % s.eval_every == 0
        row = None
        if stopping or done or evaluating or step % s.log_every == 0:
            sums, counts, (tokens, seqs, slots) = window.read(self.d, self.device)
            elapsed = max(time.perf_counter() - window.start, 1e-9)
            row = {"step": step, **self.job.log_fields(sums, counts), "lr": lr, "tokens_per_s": tokens / elapsed,
                   "seqs_per_s": seqs / elapsed, "packing_efficiency": tokens / max(slots, 1.0)}
            if stopping:
                row["stopped"] = True
            if evaluating and self.d.main:
                with self.amp():
                    scores = self.job.evaluate(self.model)
                row.update(scores)
                if scores:
                    say(progress, f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()))
            if self.d.main:
                self._write(row, log, writer, progress)
        if stopping or done or (s.save_every and step % s.save_every == 0):
            if self.d.main:
                self.save_checkpoint()
            self.d.barrier()
        if stopping and self.d.main:
            say(progress, f"stopped by signal at step {step}; checkpoint saved")
        return row

    def _write(self, row, log, writer, progress) -> None:
        log.write(json.dumps(row) + "\n")
        log.flush()
        if writer:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    writer.add_scalar(k, v, row["step"])
        if progress:
            progress.update(row["step"] - progress.n)
            progress.set_postfix({k: f"{v:.3f}" for k, v in row.items() if k.endswith(("loss", "acc"))})


def say(progress, message: str) -> None:
    """A console line that does not break the progress bar (and shows without one)."""
    if progress:
        progress.write(message)
    else:
        print(message, flush=True)

"""The loop shared by pre-training and fine-tuning: `Trainer(job, settings, device, dist).fit()`, and `Job`, what
each supplies.

The trainer owns everything the two have in common: the device and torchrun/DDP set-up, mixed precision
(bf16 autocast, or fp16 with a gradient scaler), gradient accumulation and clipping, the optimizer (AdamW, fused
on CUDA, or LAMB, whose kernels pre-normalise the gradients by their norm instead of a clip; no decay on biases
and LayerNorm) with linear warm-up and polynomial (by default linear) decay, evaluation cadence and
a target score that ends the run (time to target, as MLPerf scores training), atomic checkpoints with exact
resume (model, optimizer, scheduler, scaler, RNG states, data position; a changed setting is refused unless
allowed; log rows after the checkpoint are dropped), SIGTERM/SIGINT (checkpoint, then stop), and logging
(console, OUTPUT_DIR/log.jsonl, TensorBoard when installed, tqdm) with real tokens/s and sequences/s, and the
tokens, sequences and seconds of training so far (carried over a resume); OUTPUT_DIR/summary.json at the end.

Nothing non-finite is trained on or saved: a step whose loss or gradient norm is not finite never changes the
weights (the fused AdamW on CUDA and LAMB skip it on the device, as a gradient scaler's step does; the CPU's AdamW
reads the flag, which costs no device sync there), the flags are read with the log window, and more than
`max_nonfinite_steps` such steps in a row stop the run with `NonFiniteError` naming the step. Every window is read
before a checkpoint (log windows restart at checkpoints, so a resumed run logs what an uninterrupted one does), and
no weights that are not finite are ever written. `output_dir_lock` keeps a second job out of a run's directory.

A job supplies the rest (see `Job`): its model, its data as global steps of rank-local micro-batches, the loss
terms of a micro-batch, its log fields and its evaluation. Losses are normalised over the whole global batch
(every micro-batch on every rank): each term is a sum over its items divided by the global count of items, so
N ranks and K accumulation steps compute exactly what one process with the whole batch would. Nothing is read
back from the device inside a step: step statistics are summed on the device and read every `log_every` steps.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import time
import warnings

import torch

from bertfuse.bert.common.errors import ExpectedError, StopRun, StopSignals, first_line, stop_signals
from bertfuse.bert.common.files import atomic_write_text
from bertfuse.bert.train.distributed import Dist
from bertfuse.bert.train.health import HEALTH, NonFiniteError, Window, grad_norm, say, worker_deaths
from bertfuse.bert.train.optim import adamw, lamb, param_groups, set_lr_types, warmup_decay_schedule
from bertfuse.bert.train.rundir import (
    check_resumed_settings,
    checkpoint_dir,
    checkpoint_path,
    latest_checkpoint,
    resume_path,
    run_settings_of,
    save_model,
    truncate_log,
)
from bertfuse.bert.train.settings import Settings


# ---- what a job supplies -----------------------------------------------------------------------
class Job:
    """The task-specific half of training. Subclasses set `model` and `name` and implement the methods."""
    name = "training"
    model: torch.nn.Module

    def epoch_steps(self, epoch: int, steps_before: int, d: Dist, accum: int):
        """This epoch's steps: an object whose loader(first, num_workers, pin_memory) iterates, from step `first`
        of `epoch` on, the list of this rank's `accum` micro-batches (CPU tensors) of each global step
        (bert.data.pipeline.step_loader builds such loaders); steps_before = global steps of the earlier epochs."""
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

    def summary(self) -> dict:
        """The job's fields of OUTPUT_DIR/summary.json (what it trained: objective, starting weights...)."""
        return {}

    def announce(self) -> dict:
        """Fields for the first log row of a run that starts at step 0 (where its weights came from...)."""
        return {}

    def no_full_step(self) -> str:
        """The error when an epoch's data fills no global step: what to change."""
        return "the data yields no full batch; lower the batch size"

    def save(self, model, path: str) -> None:
        save_model(model, getattr(self, "tokenizer", None), path)


def json_safe(value):
    """`value` with every float that is not finite (a skipped step's loss) as None: JSON has no NaN or infinity."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def warmup_steps(warmup: float, steps: int) -> int:
    """Warm-up steps from a fraction of `steps` (rounded up, as transformers does) or a number of steps."""
    return math.ceil(warmup * steps) if warmup < 1 else int(warmup)


def amp_precision(requested: str, device: torch.device) -> str:
    """The precision a run trains in: `requested`, or for "auto" bf16 autocast on a GPU with bfloat16 tensor
    cores (sm_80 and newer, AMD's MI200/MI300), fp16 with a gradient scaler on one without (sm_75: T4, RTX 20xx),
    fp32 on the CPU. bf16 asked of a GPU without it is one clear error naming the GPU and what to use."""
    if device.type != "cuda":
        return "fp32" if requested == "auto" else requested
    props = torch.cuda.get_device_properties(device)
    bf16 = torch.version.hip is not None or props.major >= 8
    if requested == "auto":
        return "bf16" if bf16 else "fp16"
    if requested == "bf16" and not bf16:
        raise ExpectedError(f"--precision bf16: the {props.name} (sm_{props.major}{props.minor}) has no bfloat16 "
                            "tensor cores (sm_80+ and AMD MI200/MI300 have them); use --precision fp16 (autocast "
                            "with a gradient scaler) or fp32")
    return requested


class Trainer:
    """Runs a Job under Settings on `device` (see the module docstring)."""

    def __init__(self, job: Job, settings: Settings, device: torch.device, d: Dist):
        self.job, self.s, self.device, self.d = job, settings, device, d
        self.model = job.model.to(device)
        precision = amp_precision(settings.precision, device)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.capturable = settings.cuda_graphs and self._graphs_possible()
        groups = param_groups(self.model, settings.weight_decay)
        if settings.optimizer == "lamb":  # its step pre-normalises the gradients by their norm (max_grad_norm)
            self.optimizer = lamb(groups, settings.lr, device, self.capturable, betas=(0.9, 0.999),
                                  eps=settings.adam_eps, max_grad_norm=settings.max_grad_norm)
        else:
            self.optimizer = adamw(groups, settings.lr, device, capturable=self.capturable, betas=(0.9, 0.999),
                                   eps=settings.adam_eps)
        warmup = warmup_steps(settings.warmup, settings.steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_decay_schedule(warmup, settings.steps, settings.lr_decay_power))
        # The position, and the totals a time-to-target is reported in (training seconds: the loop's wall time,
        # evaluation included, summed over the runs a resume continues; tokens and sequences: real ones, all ranks).
        self.state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "steps_before_epoch": 0, "train_seconds": 0.0,
                      "tokens_seen": 0.0, "sequences_seen": 0.0}
        self.reached: dict | None = None  # the log row at which the target score was reached
        self._resume()
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None) if d.world > 1 else self.model
        # What a step calls: the model (DDP-wrapped on several ranks), compiled when asked. Packed batches have
        # one shape, so one compilation serves the whole run.
        self.forward = torch.compile(self.ddp, backend=settings.compile, dynamic=False if job.static_shapes else None) \
            if settings.compile else self.ddp
        self.graphed = None
        if self.capturable:
            from bertfuse.bert.train.static import GraphedStep

            self.graphed = GraphedStep(self._train_step, self.model, self.optimizer)
        self.log_path = os.path.join(settings.output_dir, "log.jsonl")
        self._starving_said = False  # the data-wait warning (_data_wait), given once a run
        self.stop: StopSignals | None = None  # the run's SIGTERM / SIGINT, while fit runs

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
        path = resume_path(s.output_dir, s.resume)
        if s.resume and not path:
            raise FileNotFoundError(f"--resume: no checkpoint in {checkpoint_dir(s.output_dir)}")
        if not path:
            return
        from bertfuse.bert.model.checkpoint import read_state_dict

        saved = torch.load(os.path.join(path, "training_state.pt"), map_location="cpu", weights_only=True)
        check_resumed_settings(run_settings_of(saved), s.run_settings,
                               s.allow_config_changes)
        self.model.load_hf_state_dict(read_state_dict(path))
        self.optimizer.load_state_dict(saved["optimizer"])
        set_lr_types(self.optimizer, self.device, self.capturable)
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None and saved.get("scaler"):
            self.scaler.load_state_dict(saved["scaler"])
        torch.set_rng_state(saved["rng_cpu"])
        if self.device.type == "cuda" and saved["rng_cuda"]:
            torch.cuda.set_rng_state_all(saved["rng_cuda"])
        self.state = {k: saved.get(k, default) for k, default in self.state.items()}  # (totals: newer than some)

    def save_checkpoint(self) -> str:
        """Written into a temporary directory, then renamed: a checkpoint is either complete or absent. A failed
        write (a full disk...) removes the temporary directory and raises one OSError naming the disk; the
        earlier checkpoints are untouched."""
        root = checkpoint_dir(self.s.output_dir)
        os.makedirs(root, exist_ok=True)
        final = checkpoint_path(self.s.output_dir, self.state["step"])
        for name in os.listdir(root):  # left by a killed run (the output-dir lock says no one else writes here)
            if name.startswith(".tmp-step-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        tmp = os.path.join(root, f".tmp-step-{self.state['step']:08d}")
        self._check_weights()
        try:
            self._write_checkpoint(tmp)
        except (OSError, RuntimeError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(root).free
            raise OSError(errno.ENOSPC if getattr(e, "errno", None) == errno.ENOSPC else errno.EIO,
                          f"step {self.state['step']}: the checkpoint could not be written to {root} "
                          f"({first_line(e)}); that disk has {free / 2**20:.0f} MiB free. Earlier checkpoints are "
                          "intact; free some space and --resume") from e
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        names = sorted(n for n in os.listdir(root) if n.startswith("step-"))
        for old in names[:-self.s.keep_checkpoints] if self.s.keep_checkpoints > 0 else []:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        return final

    def _write_checkpoint(self, tmp: str) -> None:
        self.job.save(self.model, tmp)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                    "rng_cpu": torch.get_rng_state(),
                    "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                    "run_settings": json.dumps(self.s.run_settings), **self.state},
                   os.path.join(tmp, "training_state.pt"))

    # -- the loop --
    def fit(self) -> dict:
        """Train until settings.steps (or a signal); returns the last log row (with evaluation, when it ran)."""
        s, d = self.s, self.d
        if d.main:
            truncate_log(self.log_path, self.state["step"])
        writer, progress = self._sinks()
        self._first_row = self.job.announce() if self.state["step"] == 0 else {}
        self.model.train()
        try:
            with stop_signals() as self.stop, open(self.log_path if d.main else os.devnull, "a", encoding="utf-8") \
                    as log, worker_deaths(self.state):
                last = self._loop(log, writer, progress)
        finally:
            if progress:
                progress.close()
            if writer:
                writer.close()
        if not last.get("stopped") and last.get("steps") and not self.applied_steps:
            raise NonFiniteError(f"step {self.state['step']}: no step of this run had a finite loss and gradient "
                                 "norm (every one was skipped), so the weights are those it started with; nothing was "
                                 "saved. Lower --lr, or check the data")
        if d.main and not last.get("stopped"):
            self._check_weights()
            self.job.save(self.model, s.output_dir)
            say(progress, f"saved to {s.output_dir}")
        if d.main:
            atomic_write_text(os.path.join(s.output_dir, "summary.json"),
                              json.dumps(json_safe(self.summary(last)), indent=2) + "\n")
        d.barrier()
        return last

    def summary(self, last: dict) -> dict:
        """OUTPUT_DIR/summary.json: what the run trained on and for how long, its last log row, the job's own
        fields (Job.summary), and with a target whether and when it was reached: the step, training seconds,
        sequences and tokens it took."""
        st = self.state
        out = {"steps": st["step"], "train_seconds": st["train_seconds"], "sequences": st["sequences_seen"],
               "tokens": st["tokens_seen"], "stopped": bool(last.get("stopped")), "optimizer": self.s.optimizer,
               **self.job.summary()}
        if self.s.target:
            metric, value = self.s.target
            hit = self.reached
            out["target"] = {"metric": metric, "value": value, "reached": hit is not None,
                             **({"step": hit["step"], "score": hit[metric], "train_seconds": hit["train_seconds"],
                                 "sequences": hit["sequences_seen"], "tokens": hit["tokens_seen"]} if hit else {})}
        return {**out, "last": last}

    def _loop(self, log, writer, progress) -> dict:
        last: dict = {}
        window = Window(self.state["step"] + 1)
        self.nonfinite_run, self.applied_steps, self.lr = 0, 0, self.scheduler.get_last_lr()[0]
        self._clock = (time.perf_counter(), self.state["train_seconds"])  # (started, seconds before: a resume's)
        while self.state["step"] < self.s.steps and not last.get("stopped") and not self.reached:
            first, items, started = self.state["batch_in_epoch"], iter(self._loader()), False
            while True:
                t0 = time.perf_counter()
                try:  # one process: a signal while the pipeline prepares the next batch stops the run at once
                    with self.stop.interruptible("while waiting for a batch", self.d.world == 1):
                        micro_batches = next(items, None)
                except StopRun:
                    last = self._stop_between_steps(window, log, writer, progress)
                    break
                if micro_batches is None:  # the epoch is over
                    if first == 0 and self.state["batch_in_epoch"] == 0:
                        raise ValueError(self.job.no_full_step())
                    self.state["steps_before_epoch"] = self.state["step"]
                    self.state["epoch"] += 1
                    self.state["batch_in_epoch"] = 0
                    break
                window.waited(time.perf_counter() - t0, started)
                started = True
                self.lr = self._step(micro_batches, window)
                stopping = self._stopping()
                row = self._end_of_step(window, self.lr, stopping, log, writer, progress)
                if row is not None:
                    last, window = row, Window(self.state["step"] + 1)
                if row is not None and row.get("stopped") or self.state["step"] >= self.s.steps or self.reached:
                    break
            items = None  # the loader's workers and the planners are shut down here, not at some later collection
        return last

    def _stop_between_steps(self, window, log, writer, progress) -> dict:
        """A signal stopped the run between steps: the steps since the last log row are logged and the position
        after the last one checkpointed (none when no step has run)."""
        if window.health:
            return self._end_of_step(window, self.lr, True, log, writer, progress)
        step = self.state["step"]
        if step == 0:
            say(progress, "stopped by signal before the first step; nothing to save")
            return {"step": 0, "stopped": True}
        if self.d.main and not os.path.isdir(checkpoint_path(self.s.output_dir, step)):
            self.save_checkpoint()
        say(progress, f"stopped by signal at step {step}; checkpoint saved")
        return {"step": step, "stopped": True}

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
        """This epoch's steps from the current one on: pinned when training on a GPU (copied without blocking)."""
        steps = self.job.epoch_steps(self.state["epoch"], self.state["steps_before_epoch"], self.d, self.s.grad_accum)
        pin, first = self.device.type == "cuda", self.state["batch_in_epoch"]
        return steps.loader(first, self.s.num_workers, pin)

    def _denominators(self, micro_batches) -> tuple[dict, dict]:
        """(this rank's item counts per loss term, the global counts the sums are divided by). One process: plain
        floats, no device traffic; several: one all-reduce."""
        counts = [self.job.counts(b) for b in micro_batches]
        local = {n: float(sum(c[n] for c in counts)) for n in counts[0]}
        if self.d.world == 1:
            return local, {n: max(v, 1.0) for n, v in local.items()}
        total = self.d.all_sum(torch.tensor(list(local.values()), dtype=torch.float32, device=self.device))
        return local, dict(zip(local, total.clamp_min(1.0).unbind()))

    def _step(self, micro_batches, window: Window) -> float:
        local, denominators = self._denominators(micro_batches)
        for batch in micro_batches:
            window.add_sizes(*self.job.sizes(batch))
        batches = [{k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items()} for batch in micro_batches]
        logged = (self.graphed or self._train_step)(batches, denominators)
        window.health.append(logged[-1].pop(HEALTH))
        for values in logged:
            window.add(values)
        for n, v in local.items():
            window.counts[n] = window.counts.get(n, 0.0) + v
        lr = self._lr()
        self.scheduler.step()
        self.state["step"] += 1
        self.state["batch_in_epoch"] += 1
        return lr

    def _lr(self) -> float:
        """The first group's learning rate at this step, from the schedule: a float even where the optimizer reads
        a device tensor (a captured step's), which would cost a sync to read."""
        s = self.scheduler
        return s.base_lrs[0] * s.lr_lambdas[0](s.last_epoch)

    def _train_step(self, batches: list[dict], denominators: dict) -> list[dict[str, torch.Tensor]]:
        """Forward and backward of every micro-batch (device tensors), then the optimizer step; returns each
        micro-batch's loss terms and stats (device scalars), the last with the step's health (HEALTH). Nothing
        here reads the device, so that it can be captured as a CUDA graph (bert.train.static.GraphedStep) when the
        batches are packed."""
        logged, step_loss = [], 0.0
        for a, batch in enumerate(batches):
            sync = a == len(batches) - 1 or self.d.world == 1
            with self.ddp.no_sync() if not sync else contextlib.nullcontext():
                with self.amp():
                    out = self.forward(**batch)
                terms = self.job.loss_terms(out, batch)
                loss = sum(terms[n] / denominators[n] for n in denominators) * self.d.world
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            step_loss = step_loss + loss.detach().float() / self.d.world
            logged.append({**terms, **self.job.stats(out, batch)})
        logged[-1][HEALTH] = self._optimizer_step(step_loss)
        return logged

    def _optimizer_step(self, loss: torch.Tensor) -> torch.Tensor:
        """Clip and step, unless the loss or the gradient norm is not finite: then the weights and the optimizer's
        state stay as they were. Returns [non-finite, loss, gradient norm] (device, float32). With fp16's scaler,
        non-finite gradients are its business (it skips the step and lowers the scale); only the loss counts."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.s.optimizer == "lamb" and not self.scaler:
            return self._lamb_step(loss)
        norm = grad_norm(self.model.parameters(), 0.0 if self.s.optimizer == "lamb" else self.s.max_grad_norm)
        bad = ~torch.isfinite(loss) if self.scaler else ~(torch.isfinite(loss) & torch.isfinite(norm))
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self.optimizer.defaults.get("fused"):
            self.optimizer.found_inf = bad.float()  # read by the fused kernel: the step is skipped on the device
            self.optimizer.step()
        elif not bad.item():  # the CPU's AdamW: a read costs nothing (it reads its step count anyway)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([bad.float(), loss.float(), norm.float()])

    def _lamb_step(self, loss: torch.Tensor) -> torch.Tensor:
        """LAMB takes the gradients as they are: its kernels compute their global norm (logged, and its
        pre-normalisation by max_grad_norm), skip a step where it is not finite, and skip one whose loss is not
        (found_inf), all on the device."""
        bad_loss = ~torch.isfinite(loss)
        self.optimizer.found_inf = bad_loss.float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        norm = self.optimizer.grad_norm
        return torch.stack([(bad_loss | ~torch.isfinite(norm)).float(), loss.float(), norm.float()])

    def _stopping(self) -> bool:
        if self.d.world == 1:
            return self.stop.raised
        flag = self.d.all_sum(torch.tensor([float(self.stop.raised)], device=self.device))
        return bool(flag.item())  # every rank stops at the same step

    def _end_of_step(self, window, lr, stopping, log, writer, progress) -> dict | None:
        """Log (every log_every steps, at evaluations and checkpoints, the last step and a stop), check the window's
        steps were finite, evaluate (a signal during evaluation, in one process, abandons it and stops), checkpoint."""
        s, step = self.s, self.state["step"]
        done = step >= s.steps
        evaluating = bool(s.eval_every) and step % s.eval_every == 0
        saving = stopping or done or bool(s.save_every and step % s.save_every == 0)
        if not (saving or evaluating or step % s.log_every == 0):
            return None
        v = window.read(self.d, self.device)
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        tokens, seqs, slots = v.sizes
        row = {"step": step, "steps": len(v.health), **self.job.log_fields(v.sums, v.counts), "lr": lr,
               "tokens_per_s": tokens / elapsed, "seqs_per_s": seqs / elapsed,
               "packing_efficiency": tokens / max(slots, 1.0),
               "grad_norm": sum(h[2] for h in v.health) / max(len(v.health), 1),
               "nonfinite_steps": sum(h[0] > 0 for h in v.health), **self._data_wait(window, elapsed, progress)}
        failure = self._check_health(v.health, window.first_step)
        if evaluating and self.d.main and not failure and not stopping:
            scores, stopping = self._evaluate(progress)
            row.update(scores)
        row.update(self._totals(tokens, seqs))
        if evaluating and self.s.target and not failure and self._target_reached(row, progress):
            saving = True
        if stopping:
            row["stopped"] = True
            saving = True
        if self.d.main:
            self._write(row, log, writer, progress)
        if failure:
            raise NonFiniteError(failure)
        if saving:
            if self.d.main:
                self.save_checkpoint()
            self.d.barrier()
        if stopping and self.d.main:
            say(progress, f"stopped by signal at step {step}; checkpoint saved")
        return row

    def _totals(self, tokens: float, seqs: float) -> dict:
        """The run's totals after this row's window (global: the window's sizes are summed over the ranks)."""
        started, before = self._clock
        st = self.state
        st["tokens_seen"] += tokens
        st["sequences_seen"] += seqs
        st["train_seconds"] = before + time.perf_counter() - started
        return {k: st[k] for k in ("tokens_seen", "sequences_seen", "train_seconds")}

    def _target_reached(self, row: dict, progress) -> bool:
        """Whether the evaluation of this row reached the target score (rank 0 evaluates and tells the others):
        then the row records it and the run ends after this step's checkpoint."""
        metric, value = self.s.target
        hit = float(self.d.main and row.get(metric, -math.inf) >= value)
        if self.d.world > 1:
            hit = float(self.d.all_sum(torch.tensor([hit], device=self.device)).item())
        if not hit:
            return False
        row["target_reached"] = True
        self.reached = row
        if self.d.main:
            say(progress, f"step {row['step']}: {metric} {row[metric]:.4g} reached the target {value} after "
                          f"{row['train_seconds']:.1f} s of training, {row['sequences_seen']:.0f} sequences, "
                          f"{row['tokens_seen']:.0f} tokens")
        return True

    def _evaluate(self, progress) -> tuple[dict, bool]:
        """(the job's scores, whether a signal came): in one process a signal abandons the evaluation at once."""
        try:
            with self.stop.interruptible("while evaluating", self.d.world == 1), self.amp():
                scores = self.job.evaluate(self.model)
        except StopRun:
            self.model.train()
            return {}, True
        if scores:
            say(progress, f"step {self.state['step']}: " + ", ".join(f"{k} {x:.4g}" for k, x in scores.items()))
        return scores, False

    def _data_wait(self, window: Window, elapsed: float, progress) -> dict:
        """data_wait_ms: the mean time a step of the window waited for its batch (on rank 0); data_start_s: the
        wait for an epoch's first batch, when the window has one. Once per run, a warning when the waits are
        more than 5% of the time: the input pipeline, not the device, then sets the pace."""
        fields = {"data_wait_ms": 1000 * window.data_wait / max(window.waits, 1)}
        if window.data_start:
            fields["data_start_s"] = window.data_start
        share = window.data_wait / max(elapsed - window.data_start, 1e-9)
        if share > 0.05 and self.d.main and not self._starving_said:
            self._starving_said = True
            say(progress, f"warning: steps waited {share:.0%} of their time for data (data_wait_ms "
                          f"{fields['data_wait_ms']:.1f}); raise --num-workers (now {self.s.num_workers}) or "
                          "--num-proc")
        return fields

    def _check_health(self, health: list[list[float]], first_step: int) -> str | None:
        """Count the window's non-finite steps in a row (carried over windows); the error message once there are
        more than max_nonfinite_steps in a row."""
        for i, (bad, loss, norm) in enumerate(health):
            self.nonfinite_run = self.nonfinite_run + 1 if bad > 0 else 0
            self.applied_steps += bad <= 0
            if self.nonfinite_run > self.s.max_nonfinite_steps:
                latest = latest_checkpoint(self.s.output_dir)
                in_a_row = f" ({self.nonfinite_run} in a row)" if self.nonfinite_run > 1 else ""
                return (f"step {first_step + i}: the loss ({loss:.4g}) or the gradient norm ({norm:.4g}) is not "
                        f"finite{in_a_row}; training stopped. The step changed no weight and nothing was saved "
                        f"after it; the last checkpoint is {latest or 'none'}. {self._nonfinite_advice()}")
        return None

    def _nonfinite_advice(self) -> str:
        """What may help. Before this run has applied any step the weights are the ones it started from (at
        warm-up's learning rate 0, too), so a lower --lr cannot help: the forward pass itself is not finite."""
        if self.applied_steps:
            return "Lower --lr, or let up to N such steps in a row be skipped with --max-nonfinite-steps N"
        cause = ("the forward pass overflows float16 (its largest value is 65,504): train with --precision bf16 "
                 "or fp32" if self.scaler is not None else
                 "check the data and the weights it started from (a non-finite value in the checkpoint or input)")
        return f"No step of this run changed a weight yet, so a lower --lr cannot help: {cause}"

    def _check_weights(self) -> None:
        """The last guard before anything is written: every parameter finite (one reduction, one read)."""
        bad = [n for n, p in self.model.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise NonFiniteError(f"step {self.state['step']}: {len(bad)} parameter tensor(s) hold values that are "
                                 f"not finite ({bad[0]}...); nothing saved")

    def _write(self, row, log, writer, progress) -> None:
        row.update(self._first_row)
        self._first_row = {}
        log.write(json.dumps(json_safe(row)) + "\n")
        log.flush()
        if writer:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    writer.add_scalar(k, v, row["step"])
        if progress:
            progress.update(row["step"] - progress.n)
            progress.set_postfix({k: f"{v:.3f}" for k, v in row.items() if k.endswith(("loss", "acc"))})

"""A run's directory: one job at a time (`output_dir_lock`), checkpoints written atomically and kept to the last K,
the latest found for --resume and its settings compared with the run's, the log cut back to the checkpoint a run
resumes from, and the final model saved with its tokenizer.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time

from bertfuse.bert.common.errors import ExpectedError
from bertfuse.bert.common.files import atomic_write_text
from bertfuse.bert.common.workers import parent_only, release
from bertfuse.bert.train.distributed import Dist


def save_model(model, tokenizer, path: str) -> None:
    """A complete model directory: save_pretrained, and the tokenizer next to config.json when there is one."""
    model.save_pretrained(path)
    if tokenizer is not None:
        from bertfuse.bert.data.tokenizer import save_tokenizer

        save_tokenizer(tokenizer, path)


# ---- checkpoints -------------------------------------------------------------------------------
def checkpoint_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(output_dir), f"step-{step:08d}")


def latest_checkpoint(output_dir: str) -> str | None:
    root = checkpoint_dir(output_dir)
    names = sorted(n for n in os.listdir(root) if n.startswith("step-")) if os.path.isdir(root) else []
    return os.path.join(root, names[-1]) if names else None


def resume_path(output_dir: str, resume: str | None) -> str | None:
    """The checkpoint --resume names: "latest" is OUTPUT_DIR's latest (None if it has none), else the path given."""
    return latest_checkpoint(output_dir) if resume == "latest" else resume


def run_settings_of(saved: dict) -> dict | None:
    """The settings a checkpoint's training state was saved with (None for a state that has none)."""
    return json.loads(saved.get("run_settings") or "null")


def saved_run_settings(output_dir: str, resume: str) -> dict:
    """The settings a run's checkpoint was saved with ({} when there is none yet): what --resume ("latest", or a
    checkpoint's path) compares, read before any work (memory-mapped: the optimizer's state is not read)."""
    path = resume_path(output_dir, resume)
    state = os.path.join(path, "training_state.pt") if path else ""
    if not os.path.isfile(state):
        return {}
    import torch

    return run_settings_of(torch.load(state, map_location="cpu", weights_only=True, mmap=True)) or {}


# Run settings that are digests of content: what a changed one means, in words.
DIGESTS = {"data_sha256": "the content of the --data corpus", "tokenizer_sha256": "the tokenizer",
           "train_examples_sha256": "the training examples"}


def check_resumed_settings(saved: dict | None, current: dict, allow: bool) -> None:
    """Refuse to continue a run under other settings than it was started with, listing every difference."""
    if saved is None:
        return
    changed = {k: (saved.get(k), v) for k, v in current.items() if k in saved and saved[k] != v}
    if changed and not allow:
        listed = "; ".join(f"{DIGESTS[k]} changed (sha256 {str(a)[:12]}, now {str(b)[:12]})" if k in DIGESTS else
                           f"--{k.replace('_', '-')} was {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ValueError(f"--resume: the settings differ from the saved run's: {listed}. Use the saved settings, "
                         "or pass --allow-config-changes to continue anyway")


def truncate_log(path: str, step: int) -> None:
    """Drop the log rows written after the checkpoint a run resumes from (they will be written again). A last
    row cut short (the run was killed while writing it) is dropped too; a damaged row before it is an error
    naming its line."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines):  # torn by a kill mid-write
                break
            raise ValueError(f"{path}:{i}: not a JSON log row; repair or remove that line, then --resume") from None
        if isinstance(row, dict) and row.get("step", 0) <= step:
            rows.append(line if line.endswith("\n") else line + "\n")
    atomic_write_text(path, "".join(rows))


class OutputDirBusy(ExpectedError):
    """Another job holds the output directory."""


@contextlib.contextmanager
def output_dir_lock(output_dir: str, d: "Dist | None" = None):
    """Hold OUTPUT_DIR/.lock for the length of a job, so that a second job started on the same directory is
    refused at once instead of interleaving its log and checkpoints with the first's. An flock, which the kernel
    drops when its process dies: a killed job leaves no stale lock. Rank 0 alone takes it under torchrun."""
    if d is not None and not d.main:
        yield
        return
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, ".lock")
    fd = parent_only(os.open(path, os.O_RDWR | os.O_CREAT, 0o666))  # (closed in forked workers)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise OutputDirBusy(f"{output_dir} is in use by another job ({holder}); wait for it to finish or "
                                "choose another --output-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  .encode(), 0)
        yield
    finally:
        release(fd)
        os.close(fd)  # releases the flock


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

"""What a run watches between log rows: the window of step statistics summed on the device (read every
`log_every` steps, no per-step host sync), steps whose loss or gradient norm is not finite (`NonFiniteError`
once too many come in a row), and DataLoader workers that died (`DataWorkerDied`).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from bertfuse.bert.common.errors import ExpectedError, first_line
from bertfuse.bert.train.distributed import Dist


class NonFiniteError(ExpectedError):
    """Training produced a loss or gradient norm that is not finite (more often in a row than allowed)."""


class DataWorkerDied(ExpectedError):
    """A DataLoader worker process died (killed by the OOM killer, or by hand)."""


@contextlib.contextmanager
def worker_deaths(state: dict):
    """A dead DataLoader worker as one clear error: torch reports it as a RuntimeError from its SIGCHLD handler,
    wherever the training process is (in the backward, waiting for a batch...)."""
    try:
        yield
    except RuntimeError as e:
        if "DataLoader worker" not in str(e):
            raise
        # Its traceback holds the loop's frames and with them the loader, whose workers stay registered with
        # torch's SIGCHLD handler until it is freed: any later child's exit would raise this again, anywhere.
        e.with_traceback(None)
        raise DataWorkerDied(f"after step {state['step']}: {first_line(e)} If the machine ran out of memory, give "
                             "the run more memory or fewer --num-workers; --resume continues from the last "
                             "checkpoint") from None


# ---- the loop ----------------------------------------------------------------------------------
class Window:
    """Sums of a log window: loss terms and stats on the device (read once, at the log step), item counts,
    tokens and sequences from the CPU batches, and each step's health [non-finite flag, loss, gradient norm]."""

    def __init__(self, first_step: int = 1):
        self.device_sums: dict[str, torch.Tensor] = {}
        self.health: list[torch.Tensor] = []
        self.counts: dict[str, float] = {}
        self.tokens = self.seqs = self.slots = 0.0
        self.first_step = first_step
        self.start = time.perf_counter()
        self.data_wait = self.data_start = 0.0  # waiting for batches; the wait for an epoch's first, apart
        self.waits = 0

    def waited(self, seconds: float, started: bool) -> None:
        """A step waited `seconds` for its batch: the pipeline's start-up if the loader had not `started`."""
        if started:
            self.data_wait, self.waits = self.data_wait + seconds, self.waits + 1
        else:
            self.data_start += seconds

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for k, v in values.items():
            v = v.detach().float()
            self.device_sums[k] = self.device_sums[k] + v if k in self.device_sums else v

    def add_sizes(self, tokens: float, seqs: float, slots: float) -> None:
        self.tokens, self.seqs, self.slots = self.tokens + tokens, self.seqs + seqs, self.slots + slots

    def read(self, d: Dist, device) -> "WindowValues":
        """The window's values over every rank, in one read from the device."""
        names = sorted(self.device_sums)
        local = torch.stack([self.device_sums[k] for k in names]) if names else torch.zeros(0, device=device)
        health = torch.stack(self.health) if self.health else torch.zeros((0, 3), device=device)
        cpu = torch.tensor([*self.counts.values(), self.tokens, self.seqs, self.slots], dtype=torch.float64)
        if d.world > 1:  # counts, tokens and sequences of every rank
            cpu = d.all_sum(cpu.to(device)).cpu()
            local, health = d.all_sum(local), d.all_sum(health.float()) / d.world  # (a flag > 0: some rank)
        values = torch.cat([local.float(), health.float().flatten()]).tolist()
        *counts, tokens, seqs, slots = cpu.tolist()
        health_rows = [values[len(names) + 3 * i:len(names) + 3 * i + 3] for i in range(len(self.health))]
        return WindowValues(dict(zip(names, values[:len(names)])), dict(zip(self.counts, counts)),
                            (tokens, seqs, slots), health_rows)


@dataclass
class WindowValues:
    sums: dict[str, float]
    counts: dict[str, float]
    sizes: tuple[float, float, float]      # real tokens, sequences, token slots
    health: list[list[float]]              # per step: [non-finite (> 0), loss, gradient norm]


HEALTH = "_health"  # the key of a step's [non-finite, loss, gradient norm] in what _train_step returns


def grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """The gradients' total 2-norm (a device scalar), clipping them to max_norm when it is positive."""
    params = [p for p in parameters if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if not params:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params]))


def say(progress, message: str) -> None:
    """A console line that does not break the progress bar (and shows without one)."""
    if progress:
        progress.write(message)
    else:
        print(message, flush=True)

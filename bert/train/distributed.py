"""The device and the process group: one process on a CPU or GPU, or torchrun (DDP; NCCL on GPU, gloo on CPU), and
a global batch split into per-rank, per-accumulation-step micro-batches so that a step's data does not depend on
how many processes share it.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bertfuse.bert.common.errors import ExpectedError, first_line


# ---- distributed -------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    timeout_minutes: float = 0.0   # of the process group's collectives (--dist-timeout)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def main_first(self, fn):
        """fn() on rank 0 first, which fills a cache on disk, then on the other ranks, which read it from there
        instead of racing rank 0 to write it."""
        if self.main:
            out = fn()
        try:
            self.barrier()
        except RuntimeError as e:  # the process group's timeout (DistBackendError), or rank 0 failed meanwhile
            raise RankTimeout(f"rank {self.rank} waited for rank 0 and gave up ({first_line(e)}); if rank 0 was "
                              f"still at work (tokenising a large corpus), raise --dist-timeout (now "
                              f"{self.timeout_minutes:g} minutes)") from None
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


DIST_TIMEOUT_MINUTES = 120.0


def setup_device(timeout_minutes: float = DIST_TIMEOUT_MINUTES) -> tuple[torch.device, Dist]:
    """The device (this rank's GPU, or the CPU) and the process group under torchrun (NCCL on GPU, gloo on CPU).
    Collectives wait up to `timeout_minutes` for the slowest rank (`--dist-timeout`): long enough for rank 0 to
    tokenise a large corpus while the others wait, where NCCL's default of 10 minutes is not."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return device, Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return device, Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                        timeout_minutes)


class RankTimeout(ExpectedError):
    """A rank waited longer than the process group's timeout for another."""


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

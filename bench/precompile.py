"""Compile the kernels a benchmark run needs, in parallel worker processes, before anything is timed.

Triton compiles a kernel variant the first time it is launched with a new specialisation, on one CPU core,
and keeps the result in its on-disk cache (~/.triton/cache), shared by every process. Each worker here runs one
piece of the coming run once, untimed: one kernel suite (this project's implementations only), or one
end-to-end variant for one warm-up step. The timed run that follows, in the parent and in its fresh
per-variant processes, then loads compiled kernels instead of compiling them one after another. On a 16-core
GPU machine this turns minutes of serial compilation into the time of the slowest piece.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time
import traceback

import torch


def _warm_suite(name: str, quick: bool, device: str) -> str:
    from bertfuse.bench.ops import record

    from . import kernel_suite

    kernel_suite.WARM_ONLY = True
    kernel_suite.rows(record(name), {"copy_GBps": 1.0, "matmul_TFLOPs": 1.0}, quick, torch.device(device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return name


def _warm_variant(variant: str, spec: dict) -> str:
    from .e2e import run_variant

    row = run_variant(variant, dict(spec, warmup=1, steps=0))
    if row.get("status") != "warm":
        raise RuntimeError(row.get("status"))
    return f"{variant} {spec['config']} s{spec['seq_len']}"


def jobs(suites: list[str], variants: list[str], specs: list[dict], quick: bool, device: str) -> list[tuple]:
    """(function, *args) per piece: the kernel suites (kernel record names), then each triton-backed end-to-end
    variant per spec."""
    out = [(_warm_suite, name, quick, device) for name in suites]
    triton = ("ours-triton", "hf-fused", "ours-packed", "ours-mlm", "ours-mlm-packed")
    out += [(_warm_variant, v, s) for v in variants if v in triton for s in specs]
    return out


def run(pieces: list[tuple], workers: int | None = None, log=print) -> list[str]:
    """Runs the pieces in spawned processes; returns the errors (a failed piece only costs its own warm-up)."""
    if not pieces:
        return []
    workers = workers or min(len(pieces), os.cpu_count() or 1)
    t0 = time.monotonic()
    errors = []
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(fn, *args): (fn.__name__, args[0]) for fn, *args in pieces}
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except Exception as e:  # reported, not fatal: the timed run compiles what is missing
                name = " ".join(map(str, futures[future]))
                errors.append(f"{name}: {type(e).__name__}: {e}")
                log(f"  precompile {name} failed:\n{traceback.format_exc(limit=2)}")
    log(f"Precompiled {len(pieces) - len(errors)}/{len(pieces)} pieces in {time.monotonic() - t0:.0f} s "
        f"with {workers} worker(s)\n")
    return errors

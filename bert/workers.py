"""Ordered, bounded parallel map over worker processes: what tokenising and the pre-training planner share.

`multiprocessing.Pool.imap` reads its whole input ahead of the workers, which for a corpus the size of Wikipedia
means holding it all in memory. `ordered_map` keeps at most `ahead` tasks per process in flight, yields results
in input order, and with 0 processes runs in this one (no pool, nothing to pickle).
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_num_workers() -> int:
    """DataLoader workers for one rank: its share of the CPUs (LOCAL_WORLD_SIZE ranks on this machine) less one
    for the training process itself, at most 8 (beyond which collation has never been the bottleneck)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(0, min(8, available_cpus() // ranks - 1))


def ordered_map(fn: Callable, items: Iterable, processes: int = 1, initializer: Callable | None = None,
                initargs: tuple = (), ahead: int = 2) -> Iterator:
    """fn(item) for each item, in order, computed by `processes` forked workers (each set up by
    initializer(*initargs)), with at most `ahead` x processes items read ahead of the consumer; `processes` 0:
    in this process, when asked. Closing the returned generator (or dropping it, or the interpreter exiting)
    stops the workers."""
    if processes <= 0:
        if initializer is not None:
            initializer(*initargs)
        return map(fn, items)
    results = _pooled(fn, items, processes, initializer, initargs, ahead)
    _OPEN.add(results)
    return results


def _pooled(fn, items, processes, initializer, initargs, ahead) -> Iterator:
    # fork: the workers inherit the imported modules (no second import of torch) and touch no CUDA.
    with multiprocessing.get_context("fork").Pool(processes, initializer, initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= ahead * processes:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# Pools still open at exit (a loader left mid-epoch) are closed while the interpreter is whole: a generator
# finalised during its teardown finds multiprocessing's module globals gone and fails noisily.
_OPEN: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    for results in list(_OPEN):
        results.close()

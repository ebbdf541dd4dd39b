"""Ordered, bounded parallel map over worker processes: what tokenising and the pre-training planner share.

`multiprocessing.Pool.imap` reads its whole input ahead of the workers, which for a corpus the size of Wikipedia
means holding it all in memory, and a Pool waits forever for the task of a worker that was killed (the OOM
killer) and, on close, for a worker blocked writing a result nobody reads. `ordered_map` runs its own workers:

- task i goes to worker i mod P and its result comes back on that worker's own pipe, so results are read in input
  order with at most `ahead` tasks per worker in flight; a sender thread writes the tasks, so that the consumer
  never blocks on a worker's full pipe while that worker blocks on its own;
- the consumer waits on the result pipe and the worker's exit at once: a worker that dies raises `WorkerDied`
  (one line: which work, which process, which signal) instead of a hang, and an error inside `fn` is raised in
  the consumer;
- workers leave SIGINT to the consumer and take SIGTERM's default action (not the handler of a trainer they
  were forked from), and die with their parent (PR_SET_PDEATHSIG on Linux; elsewhere at the parent's EOF);
- closing (the generator closed, dropped or left unfinished at exit) terminates the workers, waits at most
  `CLOSE_TIMEOUT` seconds, then kills what is left: it returns whatever the workers were doing.

With 0 processes `fn` runs in this process (no workers, nothing pickled).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator

from bertfuse.bert.common.errors import ExpectedError

CLOSE_TIMEOUT = 5.0  # seconds a worker is given to exit on SIGTERM before it is killed


_STOPS = {signal.SIGTERM, signal.SIGINT}


class WorkerDied(ExpectedError):
    """A worker process ended before returning its task's result."""


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


def _libc():
    """The C library, loaded here in the parent (a dlopen in a child forked from a threaded process could wait on
    a loader lock held by a thread that does not exist there); None where prctl is not Linux's."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "prctl") else None
    except OSError:
        return None


_LIBC = _libc()


# Descriptors a forked worker must not keep open: an output directory's flock is held while any copy of its
# descriptor lives, so a worker outliving its run would keep the next run out.
_PARENT_ONLY_FDS: set[int] = set()


def parent_only(fd: int) -> int:
    """Register `fd` to be closed in every worker forked from now on (until `release`); returns it."""
    _PARENT_ONLY_FDS.add(fd)
    return fd


def release(fd: int) -> None:
    _PARENT_ONLY_FDS.discard(fd)


def detach_worker(parent_pid: int | None = None) -> None:
    """In a forked worker: SIGINT ignored (Ctrl-C reaches the whole process group; the parent decides), SIGTERM
    back to its default (end now: what the parent's close sends), death with the parent, and the parent's
    locks' descriptors closed (parent_only). Also the DataLoader's worker_init_fn."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd in list(_PARENT_ONLY_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)  # (not LOCK_UN: the lock belongs to the parent's descriptor, which keeps it)
    _PARENT_ONLY_FDS.clear()
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def worker_init(_worker_id: int) -> None:
    """A DataLoader worker_init_fn: detach_worker for the training process's collating workers."""
    detach_worker(os.getppid())


def ordered_map(fn: Callable, items: Iterable, processes: int = 1, initializer: Callable | None = None,
                initargs: tuple = (), ahead: int = 2, name: str = "worker") -> Iterator:
    """fn(item) for each item, in order, computed by `processes` forked workers (each set up by
    initializer(*initargs)), with at most `ahead` x processes items read ahead of the consumer; `processes` 0:
    in this process, when asked. `name` says what the workers do, in errors ("a planning process ... died").
    Closing the returned generator (or dropping it, or the interpreter exiting) stops the workers."""
    if processes <= 0:
        if initializer is not None:
            initializer(*initargs)
        return map(fn, items)
    results = _pooled(fn, items, processes, initializer, initargs, ahead, name)
    _OPEN.add(results)
    return results


def _pooled(fn, items, processes, initializer, initargs, ahead, name) -> Iterator:
    pool = _Workers(fn, processes, initializer, initargs, name)
    try:
        sent = received = 0
        for item in items:
            pool.send(sent % processes, item)
            sent += 1
            if sent - received >= ahead * processes:
                yield pool.receive(received % processes)
                received += 1
        while received < sent:
            yield pool.receive(received % processes)
            received += 1
    finally:
        pool.close()


def _serve(fn, initializer, initargs, tasks, results, parent_pid) -> None:
    """A worker's life: set up, then (task -> result) until the parent closes the task pipe or goes away."""
    detach_worker(parent_pid)
    failed = None
    try:
        try:
            if initializer is not None:
                initializer(*initargs)
        except Exception as e:  # noqa: BLE001 - the answer to every task, raised in the consumer
            failed = e
        while True:
            try:
                item = tasks.recv()
            except EOFError:  # the parent closed the pipe, or died
                return
            try:
                reply = (False, failed) if failed is not None else (True, fn(item))
            except Exception as e:  # noqa: BLE001 - raised again in the consumer
                reply = (False, e)
            try:
                results.send(reply)
            except (BrokenPipeError, EOFError, OSError):
                return
            except Exception as e:  # noqa: BLE001 - a result or error that does not pickle
                results.send((False, RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        os._exit(0)  # no atexit handlers or finalisers inherited from the parent


class _Workers:
    """`processes` forked workers, each with a task pipe (written by one sender thread) and a result pipe."""

    def __init__(self, fn, processes, initializer, initargs, name):
        # fork: the workers inherit the imported modules (no second import of torch) and touch no CUDA.
        ctx = multiprocessing.get_context("fork")
        self.name, self.procs, self.tasks, self.results = name, [], [], []
        for _ in range(processes):
            task_r, task_w = ctx.Pipe(duplex=False)
            result_r, result_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_serve, args=(fn, initializer, initargs, task_r, result_w, os.getpid()),
                               daemon=True, name=f"{name}-{len(self.procs)}")
            proc.start()
            task_r.close()  # the worker's ends: its death is then EOF / EPIPE here
            result_w.close()
            self.procs.append(proc)
            self.tasks.append(task_w)
            self.results.append(result_r)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send_loop, daemon=True, name=f"{name}-sender")
        self.sender.start()

    def _send_loop(self) -> None:
        while True:
            job = self.outbox.get()
            if job is None:
                return
            worker, item = job
            try:
                self.tasks[worker].send(item)
            except (BrokenPipeError, EOFError, OSError):  # that worker is gone; receive() reports it
                pass

    def send(self, worker: int, item) -> None:
        self.outbox.put((worker, item))

    def receive(self, worker: int):
        """The next result of `worker`, in the order its tasks were sent; WorkerDied if it ends first."""
        conn, proc = self.results[worker], self.procs[worker]
        while True:
            ready = multiprocessing.connection.wait([conn, proc.sentinel])
            if conn in ready:
                try:
                    ok, value = conn.recv()
                except (EOFError, OSError):
                    break
                if ok:
                    return value
                raise value
            if proc.sentinel in ready:
                break
        proc.join(CLOSE_TIMEOUT)
        raise WorkerDied(f"a {self.name} process (pid {proc.pid}) {_how_it_ended(proc.exitcode)} before returning "
                         "its work; if the machine ran out of memory, give the run more memory or fewer processes "
                         "(--num-proc), then run it again")

    def close(self) -> None:
        """Terminate every worker (whatever it is doing), wait up to CLOSE_TIMEOUT, kill what is left; SIGTERM and
        SIGINT wait until it is done (a handler raising half-way would leave workers behind)."""
        main = threading.current_thread() is threading.main_thread()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS) if main else None
        try:
            self._close()
        finally:
            if held is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def _close(self) -> None:
        self.outbox.put(None)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + CLOSE_TIMEOUT
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.sender.join(CLOSE_TIMEOUT)  # its pipes' readers are gone: a blocked send has failed
        for conn in self.tasks + self.results:
            conn.close()


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# Pools still open at exit (a loader left mid-epoch) are closed while the interpreter is whole: a generator
# finalised during its teardown finds multiprocessing's module globals gone and fails noisily.
_OPEN: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    for results in list(_OPEN):
        results.close()

"""bert.common.workers: an ordered parallel map that never reads its input far ahead; the default worker count."""
import os

from bertfuse.bert.common.workers import available_cpus, default_num_workers, ordered_map


def _square_and_pid(x):
    return x * x, os.getpid()


def test_results_come_in_input_order_from_several_processes():
    out = list(ordered_map(_square_and_pid, range(40), processes=2))
    assert [v for v, _ in out] == [x * x for x in range(40)]
    assert len({pid for _, pid in out}) >= 1 and all(pid != os.getpid() for _, pid in out)
    assert [v for v, _ in ordered_map(_square_and_pid, range(5), processes=1)] == [0, 1, 4, 9, 16]
    here = list(ordered_map(_square_and_pid, range(5), processes=0))  # 0: in this process
    assert [v for v, _ in here] == [0, 1, 4, 9, 16] and {pid for _, pid in here} == {os.getpid()}


def test_the_input_is_read_at_most_a_few_tasks_ahead():
    """A corpus-sized input must not be pulled into memory: `ahead` tasks per process at most."""
    read = []

    def items():
        for i in range(1000):
            read.append(i)
            yield i

    results = ordered_map(_square_and_pid, items(), processes=2, ahead=2)
    assert next(results)[0] == 0 and len(read) <= 2 * 2 + 1
    results.close()  # the pool is shut down with the generator


def test_default_workers_share_the_cpus_between_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = default_num_workers()
    assert alone == max(0, min(8, available_cpus() - 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(available_cpus()))
    assert default_num_workers() == 0  # a CPU per rank: collation stays in the training process


# ---- faults: every one ends within a bound (pytest-timeout fails a test that would hang) ---------------------
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from bertfuse.bert.common.workers import CLOSE_TIMEOUT, WorkerDied  # noqa: E402


def _big(x):
    return x, b"x" * (8 << 20)  # far more than a pipe holds: the worker blocks mid-send until it is read


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _pid_then_big(x):
    return os.getpid(), _big(x)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_close_with_workers_blocked_mid_send_returns_within_a_bound():
    """What hung a finished pre-training run: the consumer stops reading while workers are writing results.
    Under a parent's SIGTERM handler that only sets a flag (a trainer's), as the forked workers inherit it."""
    old = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        results = ordered_map(_pid_then_big, range(100), processes=3, ahead=2)
        first_pid, _ = next(results)
        time.sleep(0.5)  # the others are now blocked writing 8 MB each
        t0 = time.monotonic()
        results.close()
        assert time.monotonic() - t0 < CLOSE_TIMEOUT + 5
        assert not _alive(first_pid)
    finally:
        signal.signal(signal.SIGTERM, old)


def _kill_self_at(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does
    return x


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_killed_worker_is_a_one_line_error_not_a_hang():
    with pytest.raises(WorkerDied, match=r"a planning process \(pid \d+\) was killed by SIGKILL before returning"):
        list(ordered_map(_kill_self_at, range(20), processes=2, name="planning"))


def _fail_at(x):
    if x == 2:
        raise ValueError(f"bad item {x}")
    return x


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_error_in_a_worker_is_raised_in_the_consumer():
    with pytest.raises(ValueError, match="bad item 2"):
        list(ordered_map(_fail_at, range(10), processes=2))


ORPHAN_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
from bertfuse.bert.common.workers import ordered_map
def work(x):
    time.sleep(600)
pids = ordered_map(lambda _: os.getpid(), range(2), processes=2)
print(" ".join(str(p) for p in pids), flush=True)
sleepy = ordered_map(work, range(4), processes=2)
next(sleepy)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_workers_die_with_a_killed_parent():
    """SIGKILL of the consumer (no finaliser runs): its workers exit too, none lives on as an orphan."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT.format(root=root)], stdout=subprocess.PIPE,
                            text=True)
    proc.stdout.readline()  # the first pool is done; the second's workers now sleep
    time.sleep(1.0)
    children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    assert len(children) == 2
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in children)

"""bert.workers: an ordered parallel map that never reads its input far ahead; the default worker count."""
import os

from bert.workers import available_cpus, default_num_workers, ordered_map


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

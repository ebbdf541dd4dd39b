"""bert.common: what SIGTERM and SIGINT do to a run (StopSignals), and the one line a command prints for them."""
import os
import signal
import time

import pytest

from bertfuse.bert.common import commands
from bertfuse.bert.common.errors import Interrupted, StopRun, StopSignals, stop_signals


def test_the_first_signal_sets_a_flag_and_raises_only_where_the_run_may_stop_at_once():
    with StopSignals() as stop:
        assert stop_signals() is stop  # shared by whatever runs inside (a trainer inside a command)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.raised and stop.signum == signal.SIGTERM  # between steps: only the flag
        with pytest.raises(StopRun) as e, stop.interruptible("while testing"):
            pass  # entering after the signal came raises at once
        assert e.value.where == "while testing"
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)  # a second signal: at once, anywhere
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and stop_signals() is not stop


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_signal_inside_an_interruptible_stage_raises_there():
    with StopSignals() as stop, pytest.raises(StopRun):
        with stop.interruptible("while waiting"):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(300):  # a long wait, which the handler ends
                time.sleep(0.1)


@pytest.mark.parametrize("error, status, line", [
    (StopRun(signal.SIGTERM, "while preparing the run; nothing needed saving yet"), 143,
     "prog: stopped by SIGTERM while preparing the run; nothing needed saving yet"),
    (Interrupted(signal.SIGINT), 130, "prog: stopped at once by a second SIGINT"),
    (KeyboardInterrupt(), 130, "prog: interrupted"),
])
def test_a_stopped_run_prints_one_line_and_its_exit_status(capsys, error, status, line):
    def body():
        raise error

    assert commands.run("prog", body) == status
    err = capsys.readouterr().err
    assert err.strip() == line and "Traceback" not in err


def test_a_run_that_saved_and_stopped_exits_with_128_plus_the_signal(capsys):
    """The trainer checkpoints after a signal and returns: the command's status still says it was stopped."""
    def body():
        with stop_signals():
            os.kill(os.getpid(), signal.SIGINT)  # between steps: only the flag; the body saves and returns
        return 0

    assert commands.run("prog", body) == 130
    assert commands.run("prog", lambda: 0) == 0  # the next run starts unstopped
    assert commands.run("prog", lambda: 3) == 3


FINALISING = """
import atexit, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from bertfuse.bert.common import commands
from bertfuse.bert.common.errors import stop_signals

class Slow:
    def __del__(self):  # a finaliser (a loader's workers closing): a signal here must not be swallowed
        print("closing", flush=True)
        time.sleep(30)

def body():
    with stop_signals():
        os.kill(os.getpid(), signal.SIGTERM)  # the first: a flag
        if sys.argv[2] == "del":
            slow = Slow()
            del slow
    if sys.argv[2] == "atexit":
        atexit.register(lambda: (print("closing", flush=True), time.sleep(30)))
    return 0

commands.entry("prog", lambda: commands.run("prog", body))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["del", "atexit"])
def test_a_second_signal_in_a_finaliser_or_at_exit_is_one_line_and_the_same_status(where, tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", FINALISING, root, where], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "closing"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "prog: stopped at once by a second SIGINT"
    assert "Traceback" not in err and "Exception ignored" not in err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_signal_before_the_run_starts_is_one_line_and_stops_a_shell_chain(tmp_path):
    """`bert-pretrain ... && next`: Ctrl-C stops the chain (130), also while the arguments are still read."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ("import os, signal, sys, time\nsys.path.insert(0, sys.argv[1])\nfrom bertfuse.bert.common import commands\n"
              "def main():\n    print('parsing', flush=True)\n    time.sleep(30)\n    return 0\n"
              "commands.entry('prog', main)\n")
    marker = tmp_path / "next-ran"
    proc = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "$0" "$1" && touch "{marker}"', script, root],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "parsing"
    child = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid]
    os.kill(child[0], signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "prog: stopped by SIGINT" and not marker.exists()


def _parent(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_options_declared_once_give_the_parser_the_checks_and_what_resume_compares():
    import argparse

    flags = (commands.flag("--rows", type=int, default=4, check="positive", resumed=True, help="rows"),
             commands.flag("--share", type=float, default=0.5, check="fraction", help="a share"),
             commands.flag("--a", group="one", action="store_true"), commands.flag("--b", group="one"))
    p = argparse.ArgumentParser()
    commands.add_flags(p, flags)
    assert vars(p.parse_args([])) == {"rows": 4, "share": 0.5, "a": False, "b": None}
    with pytest.raises(SystemExit):
        p.parse_args(["--a", "--b", "x"])  # one group: mutually exclusive
    with pytest.raises(ValueError, match="--rows must be positive, got 0"):
        commands.check_flags(p.parse_args(["--rows", "0"]), flags)
    with pytest.raises(ValueError, match=r"--share must be in \[0, 1\), got 1.0"):
        commands.check_flags(p.parse_args(["--share", "1"]), flags)
    assert commands.resumed(flags) == ("rows",)
    with pytest.raises(ValueError, match="unknown check"):
        commands.flag("--x", check="even")


def test_each_command_compares_on_resume_what_makes_its_run():
    from bertfuse.bert import finetune, pretrain

    assert {"max_seq_len", "batch_size", "packing", "data"} <= set(pretrain.RUN_SETTINGS)
    assert not {"num_workers", "cache_dir", "backend"} & set(pretrain.RUN_SETTINGS)
    assert {"task", "model", "max_seq_len", "doc_stride"} <= set(finetune.RUN_SETTINGS)
    assert "eval_batch_size" not in finetune.RUN_SETTINGS

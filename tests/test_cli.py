"""bert.common: what SIGTERM and SIGINT do to a run (StopSignals), and the one line a command prints for them."""
import os
import signal
import time

import pytest

from bert.common import commands
from bert.common.errors import Interrupted, StopRun, StopSignals, stop_signals


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


@pytest.mark.timeout(60)
def test_a_signal_inside_an_interruptible_stage_raises_there():
    with StopSignals() as stop, pytest.raises(StopRun):
        with stop.interruptible("while waiting"):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(300):  # a long wait, which the handler ends
                time.sleep(0.1)


@pytest.mark.parametrize("error, status, line", [
    (StopRun(signal.SIGTERM, "while preparing the run; nothing needed saving yet"), 0,
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

"""How a run ends: the errors a command reports in one line (`ExpectedError`), and what SIGTERM and SIGINT do to a
run (`StopSignals`: the first stops it where it may stop at once, or asks the trainer to checkpoint and stop).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys


class ExpectedError(RuntimeError):
    """A failure a command line reports in one line: not a bug (a diverged run, a busy output directory...)."""


class StopRun(BaseException):
    """The first SIGTERM / SIGINT, raised where a run may stop at once (preparing its data, waiting for a batch,
    evaluating): nothing half-done is kept. `where` says where it stopped and what that left, for the one line a
    command prints. A BaseException, like KeyboardInterrupt, so that no `except
    Exception` swallows it."""

    def __init__(self, signum: int, where: str = ""):
        super().__init__(signum, where)
        self.signum, self.where = signum, where


class Interrupted(BaseException):
    """A second SIGTERM / SIGINT: the run ends at once, wherever it is (a checkpoint being written is left as a
    temporary directory, which the next save removes; the earlier checkpoints are intact)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """SIGTERM and SIGINT for the length of a run (re-entrant: a trainer inside a command shares the command's).
    The first signal sets `raised`, which the training loop reads between steps (checkpoint, then stop), and
    inside `interruptible()` raises StopRun at once; a second raises Interrupted, wherever the run is. Only the
    main thread can take signals; elsewhere this does nothing."""

    def __init__(self):
        self.raised, self.signum = False, None
        self._depth, self._old, self._where = 0, {}, None

    def __enter__(self) -> "StopSignals":
        global _ACTIVE
        if self._depth == 0:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(ValueError):  # not the main thread
                    self._old[sig] = signal.signal(sig, self._handle)
            _ACTIVE = self
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        self._depth -= 1
        if self._depth == 0:
            for sig, old in self._old.items():
                signal.signal(sig, old)
            self._old = {}
            _ACTIVE = None

    def _handle(self, signum, frame) -> None:
        global _STOPPED_BY
        if self.raised:
            if _COMMAND is not None:  # a command's process: now, whatever code the signal interrupted
                exit_now(signum)
            raise Interrupted(signum)
        self.raised, self.signum = True, signum
        _STOPPED_BY = _STOPPED_BY or signum
        if self._where is not None:
            raise StopRun(signum, self._where)

    @contextlib.contextmanager
    def interruptible(self, where: str, enabled: bool = True):
        """Within: the first signal raises StopRun(where) at once (also on entry, when it came before)."""
        if not enabled:
            yield
            return
        if self.raised:
            raise StopRun(self.signum, where)
        outer, self._where = self._where, where
        try:
            yield
        finally:
            self._where = outer


_ACTIVE: StopSignals | None = None
_STOPPED_BY: int | None = None   # the first signal of the current command's run (commands.run reads it)
_COMMAND: str | None = None      # the command this process is, once exit_at_once made it one


def stopped_by(reset: bool = False) -> int | None:
    """The signal that asked the current run to stop (None if none did); reset=True forgets it (a new run)."""
    global _STOPPED_BY
    signum = _STOPPED_BY
    if reset:
        _STOPPED_BY = None
    return signum


def exit_at_once(command: str) -> None:
    """Make this process the command `command`: outside a run's StopSignals (before it, and after it while
    workers close and finalisers run at exit) SIGTERM and SIGINT, and a second one inside, print one line and
    end the process at once with 128 + the signal's number, never a traceback. An exception raised from a signal
    handler could land in a finaliser, where Python prints it and carries on; exiting cannot."""
    global _COMMAND
    _COMMAND = command
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: exit_now(signum))


def exit_now(signum: int) -> None:
    """One line, then the process ends with 128 + signum (children die with it: bert.common.workers)."""
    again = "at once by a second " if _STOPPED_BY is not None else "by "
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.write(2, f"{_COMMAND or 'bert'}: stopped {again}{signal_name(signum)}\n".encode())
    os._exit(128 + signum)


def stop_signals() -> StopSignals:
    """The run's StopSignals when one is installed (enter it again to share it), else a new one."""
    return _ACTIVE or StopSignals()


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__

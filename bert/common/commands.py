"""What the command lines (bert-pretrain, bert-finetune, bert-bench) share: options declared once (`flag`: the
flag, its check and whether --resume compares it), argument checks made before any work, local paths that do not
exist caught at once (not sent to the Hugging Face Hub), and `run`, which prints expected errors and stops as one
line without a traceback (`--debug`, or BERTFUSE_DEBUG=1 in the environment, shows it).
"""
from __future__ import annotations

import glob
import os
import signal
import sys
from typing import NamedTuple

from bertfuse.bert.common.errors import ExpectedError, Interrupted, StopRun, exit_at_once, signal_name, stopped_by

DATA_EXTENSIONS = (".txt", ".tsv", ".csv", ".json", ".jsonl", ".conll", ".parquet", ".arrow", ".gz", ".bz2")


def looks_local(value: str) -> bool:
    """A path rather than a Hub dataset name: a file extension, a leading ./ ../ / or ~, or more than one
    separator ('glue/sst2' is a Hub name, 'data/glue/train.tsv' a path)."""
    return (value.lower().endswith(DATA_EXTENSIONS) or value.startswith((".", "/", "~", os.sep))
            or value.count("/") + (value.count(os.sep) if os.sep != "/" else 0) > 1)


def check_source(flag: str, value: str | None, hub_prefix: str | None = None) -> None:
    """A data source that looks local must exist (as a file, directory or glob) before any work starts."""
    if value is None or (hub_prefix and value.startswith(hub_prefix)):
        return
    if os.path.exists(value) or glob.glob(value):
        return
    if hub_prefix or looks_local(value):
        raise FileNotFoundError(f"{flag} {value}: no such file or directory")


def check_numbers(args, positive=(), non_negative=(), fractions=()) -> None:
    """Integer/float options that must be >= 1 (positive), >= 0, or in [0, 1)."""
    for name in positive:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in non_negative:
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {value}")
    for name in fractions:
        value = getattr(args, name)
        if value is not None and not 0 <= value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")


class Flag(NamedTuple):
    """One option of a command, declared once: argparse's names and keywords, the check made before any work
    ("positive", "non_negative" or "fraction": `check_numbers`), whether --resume compares it with the
    checkpoint's (`resumed`), and the mutually exclusive group it belongs to, if any."""
    names: tuple
    kwargs: dict
    check: str | None = None
    resumed: bool = False
    group: str | None = None

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.names[0].lstrip("-").replace("-", "_")


def flag(*names: str, check: str | None = None, resumed: bool = False, group: str | None = None, **kwargs) -> Flag:
    if check not in (None, "positive", "non_negative", "fraction"):
        raise ValueError(f"flag {names[0]}: unknown check {check!r}")
    return Flag(names, kwargs, check, resumed, group)


def add_flags(parser, flags) -> None:
    """Every flag on `parser` (or an argument group of it), in order; a group's flags mutually exclusive."""
    groups = {}
    for f in flags:
        if f.group and f.group not in groups:
            groups[f.group] = parser.add_mutually_exclusive_group()
        (groups[f.group] if f.group else parser).add_argument(*f.names, **f.kwargs)


def check_flags(args, flags) -> None:
    """The checks the flags declare (`check_numbers`)."""
    def named(check):
        return tuple(f.dest for f in flags if f.check == check)

    check_numbers(args, positive=named("positive"), non_negative=named("non_negative"), fractions=named("fraction"))


def resumed(flags) -> tuple[str, ...]:
    """The options --resume compares with the checkpoint's."""
    return tuple(f.dest for f in flags if f.resumed)


def add_debug_flag(parser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also BERTFUSE_DEBUG=1)")


def run(prog: str, body, debug: bool = False) -> int:
    """body() -> exit status. An expected error (bad arguments, missing or malformed files: ValueError, OSError,
    ExpectedError) prints `prog: error: message` and returns 2; anything else is a bug and keeps its traceback.
    A run stopped by SIGTERM or SIGINT returns 128 + its number (143, 130), as shells and launchers expect of a
    stopped process: after saving what it must (the trainer's checkpoint), or at once where nothing needed
    saving (StopRun, one line saying where); so does a second signal (Interrupted), or Ctrl-C where no
    StopSignals is installed."""
    stopped_by(reset=True)
    try:
        status = body()
    except StopRun as e:
        print(f"{prog}: stopped by {signal_name(e.signum)} {e.where}", file=sys.stderr)
        return 128 + e.signum
    except Interrupted as e:
        print(f"{prog}: stopped at once by a second {signal_name(e.signum)}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except (ValueError, OSError, ExpectedError) as e:
        if debug or os.environ.get("BERTFUSE_DEBUG") == "1":
            raise
        message = str(e) or type(e).__name__
        if isinstance(e, OSError) and e.filename and str(e.filename) not in message:
            message = f"{e.filename}: {e.strerror or message}"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    signum = stopped_by()
    return 128 + signum if signum and status == 0 else status


def entry(prog: str, main) -> None:
    """A command's process (its console script, `python -m`): main()'s status is the exit status, and a signal
    outside the run, or a second one, ends it at once with one line (bert.common.errors.exit_at_once)."""
    exit_at_once(prog)
    raise SystemExit(main())

"""The documentation's commands work from a clone of the repository alone: no path into a folder beside it, every
shell variable defined in the block that uses it, and every bert-pretrain, bert-finetune and bert-bench command
in a README's code blocks accepted by that command's own parser."""
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(ROOT.glob("*/README.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
ASSIGNED = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", re.M)


def _blocks(doc: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block."""
    return FENCE.findall(doc.read_text())


def _commands(text: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = (line.split(" #", 1)[0].strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _inline_code(doc: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", FENCE.sub("", doc.read_text()))


def test_the_docs_are_found():
    assert {d.relative_to(ROOT).as_posix() for d in DOCS} >= {"README.md", "bert/README.md", "bench/README.md",
                                                              "tests/README.md"}
    assert sum(len(_blocks(d)) for d in DOCS) > 5


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_no_command_reaches_outside_the_clone(doc):
    """A user's clone has nothing beside it: no code in the docs names a path up out of the repository."""
    code = [text for _, text in _blocks(doc)] + _inline_code(doc)
    outside = [c for c in code if re.search(r"(^|[\s=\"'(])\.\./", c)]
    assert not outside, outside


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_variable_a_command_uses_is_defined_where_it_is_used(doc):
    """A shell block assigns each variable before a line uses it; inline commands use none."""
    for lang, text in _blocks(doc):
        if lang not in ("bash", "sh", "shell"):
            continue
        defined = set()
        for line in _commands(text):
            used = set(VARIABLE.findall(line.split("=", 1)[1] if ASSIGNED.match(line) else line))
            assert used <= defined, f"{doc.name}: {line!r} uses {sorted(used - defined)} before it is defined"
            defined |= set(ASSIGNED.findall(line))
    used_inline = [c for c in _inline_code(doc) if VARIABLE.search(c) and " " in c]
    assert not used_inline, f"{doc.name}: inline commands using a variable: {used_inline}"


def _parser(program: str):
    """The argument parser of one of the project's commands, as a function of argv."""
    if program == "bert-pretrain":
        from bertfuse.bert import pretrain
        return pretrain.build_parser().parse_args
    if program == "bert-finetune":
        from bertfuse.bert import finetune
        return finetune.build_parser().parse_args
    from bertfuse.bench import cli
    return cli.parse_args


def _pipeline(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at &&, ||, |, ;), quotes respected."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands = [[]]
    for token in lexer:
        if token in ("&&", "||", "|", ";"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _project_commands() -> list[tuple[str, list[str]]]:
    """(doc, argv) of every bert-pretrain, bert-finetune and bert-bench command in a shell block, torchrun's
    `-m bertfuse.bert.pretrain` included; shell variables stand in as a placeholder path."""
    found = []
    for doc in DOCS:
        for lang, text in _blocks(doc):
            if lang not in ("bash", "sh", "shell"):
                continue
            for line in _commands(text):
                for argv in _pipeline(VARIABLE.sub("path/to/model", line)):
                    if "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["bertfuse.bert.pretrain"]:
                        argv = ["bert-pretrain", *argv[argv.index("-m") + 2:]]
                    argv = argv[next((i for i, a in enumerate(argv) if a.startswith("bert-")), len(argv)):]
                    if argv and argv[0] in ("bert-pretrain", "bert-finetune", "bert-bench"):
                        found.append((doc.relative_to(ROOT).as_posix(), argv))
    return found


def test_the_readme_commands_are_found():
    programs = {argv[0] for _, argv in _project_commands()}
    assert programs == {"bert-pretrain", "bert-finetune", "bert-bench"}


@pytest.mark.parametrize("doc, argv", _project_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_each_documented_command_is_accepted_by_its_parser(doc, argv):
    parse = _parser(argv[0])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse(argv[1:])
    except SystemExit as e:
        assert e.code == 0, f"{doc}: {' '.join(argv)}: {err.getvalue().strip().splitlines()[-1]}"

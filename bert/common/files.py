"""Files written so that a crash never leaves a torn one (a temporary name in the same directory, then a rename),
and JSON objects read with errors that name the file.
"""
from __future__ import annotations

import codecs
import json
import os
import tempfile

# Longest first: UTF-32LE's mark starts with UTF-16LE's.
_MARKS = ((codecs.BOM_UTF32_LE, "UTF-32LE"), (codecs.BOM_UTF32_BE, "UTF-32BE"), (codecs.BOM_UTF16_LE, "UTF-16LE"),
          (codecs.BOM_UTF16_BE, "UTF-16BE"))


def default_file_mode() -> int:
    """The permissions open() gives a new file under the current umask (mkstemp's are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: str, write) -> None:
    """Call write(tmp_path), then rename tmp_path to path; the temporary file is removed on failure. The file
    gets the permissions any other new file would."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, default_file_mode())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """`text` as the UTF-8 file `path`, atomically (atomic_write)."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def read_json_object(path) -> dict:
    """A JSON object from a file; an error naming the file when it is empty, not JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def other_encoding(head: bytes) -> str | None:
    """The encoding a text file's first bytes show it is in, where that is not UTF-8: a UTF-16 or UTF-32
    byte-order mark, or text with a NUL beside every other byte (UTF-16 without a mark); else None."""
    found = next((name for mark, name in _MARKS if head.startswith(mark)), None)
    if found or len(head) < 8:
        return found
    even, odd = head[0::2], head[1::2]
    if odd.count(0) >= 0.9 * len(odd) and not even.count(0):
        return "UTF-16LE"
    if even.count(0) >= 0.9 * len(even) and not odd.count(0):
        return "UTF-16BE"
    return None


def check_utf8(path: str) -> None:
    """A ValueError naming the file, its encoding and the command that converts it, for a text file in UTF-16 or
    UTF-32 (Windows tools write them), before any line of it is read as something else."""
    with open(path, "rb") as f:
        found = other_encoding(f.read(4096))
    if found:
        raise ValueError(f"{path}: {found} text, not UTF-8; convert it first, e.g. iconv -f {found} -t UTF-8 "
                         f"'{path}' > '{path}.utf8'")

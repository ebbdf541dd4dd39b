"""Files written so that a crash never leaves a torn one (a temporary name in the same directory, then a rename),
and JSON objects read with errors that name the file.
"""
from __future__ import annotations

import json
import os
import tempfile


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

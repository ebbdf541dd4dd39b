"""The records of the kernels' ops (bench/record.py), one module per op of `kernels`, named as that op's module.

Importing this package imports every module here (and so `kernels` and triton) and lists their `RECORD`s in
`RECORDS`, in module-name order: a new op's record file is picked up without editing this one. `records()` and
`record(name)` are how the tools read them.
"""
import importlib as _importlib
import pkgutil as _pkgutil

RECORDS = tuple(_importlib.import_module(f"{__name__}.{info.name}").RECORD
                for info in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name)
                if not info.name.startswith("_"))


def records() -> list:
    return list(RECORDS)


def record(name: str):
    """The record of op `name` ("attention", or a launch site's name such as "attention.fwd")."""
    op = name.split(".")[0]
    for r in RECORDS:
        if r.name == op:
            return r
    raise KeyError(f"no kernel record named {op!r} (have: {', '.join(r.name for r in RECORDS)})")

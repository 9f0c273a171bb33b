"""The files the tools write (tokenize, eval, train, demo): checked before the long work starts,
and named when a write fails.

    check_file_target(out, "--out")         a file can be created or replaced at `out`
    check_dir_target(out_dir, "--out-dir")  `out_dir` is, or can be made, a writable directory
    with writing(path): ...                 an OSError (full disk, quota, lost mount) or a
                                            safetensors write error inside names `path`

Each check raises ValueError naming the argument and the path, so `echo-tp` prints one line; a
write that fails later (the disk filled up during the run) raises OSError with the file name,
which the CLI prints in one line too (cli.main).
"""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from safetensors import SafetensorError


def _first_existing(p: Path) -> Path:
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def _writable_dir(d: Path) -> bool:
    return d.is_dir() and os.access(d, os.W_OK | os.X_OK)


def check_file_target(path: str | Path, what: str) -> None:
    """ValueError unless a file can be created (or replaced) at `path`."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {path} is a directory; name a file (in it, or elsewhere)")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise ValueError(f"{what} {path}: the file exists and cannot be written "
                             "(permissions); pick another path")
        return
    _check_parent(p, what, "cannot write there")


def check_dir_target(path: str | Path, what: str) -> None:
    """ValueError unless `path` is a writable directory or one can be created there."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{what} {path} is a file, not a directory; pick a directory "
                             "(it is created if missing)")
        if not _writable_dir(p):
            raise ValueError(f"{what} {path} is not a writable directory; pick another one")
        return
    _check_parent(p, what, "cannot create it")


def _check_parent(p: Path, what: str, verb: str) -> None:
    """ValueError unless the nearest existing folder above p is a writable directory."""
    parent = _first_existing(p)
    if not parent.is_dir():
        raise ValueError(f"{what} {p}: {verb} ({parent} is a file, not a directory); pick "
                         "another path")
    if not _writable_dir(parent):
        raise ValueError(f"{what} {p}: {verb} ({parent} is not a writable directory); pick "
                         "another path")


@contextlib.contextmanager
def writing(path: str | Path):
    """Re-raise an OSError without a file name, or a safetensors write error, as an OSError
    naming `path` (what a full disk gives: write() errors carry no name)."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno or errno.EIO, e.strerror or str(e), str(path)) from e
    except SafetensorError as e:
        raise OSError(errno.EIO, str(e), str(path)) from e

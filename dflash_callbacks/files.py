"""Writing files so that a reader never sees half of one, and telling when one was replaced."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write under a hidden temporary name in the same folder, fsync, rename into place; a
    failure (a full disk, a folder where the file goes, an interrupt) leaves no temporary."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, payload) -> None:
    atomic_write(path, (json.dumps(payload, indent=2) + "\n").encode())


def file_version(path: str | os.PathLike) -> tuple[int, int, int] | None:
    """(inode, mtime_ns, size) of a file, None when there is none: it changes whenever the
    file is rewritten, and an atomic write (a rename) always brings a new inode."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size

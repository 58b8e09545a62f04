"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write under a hidden temporary name in the same folder, fsync, rename into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str | os.PathLike, payload) -> None:
    atomic_write(path, (json.dumps(payload, indent=2) + "\n").encode())

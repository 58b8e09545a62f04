"""Progress as a terminal shows it and as a log keeps it: on a terminal (or in a notebook) tqdm's bars; with
stderr redirected, one plain line per item of the outer loop (`scoring X: 3/10 tasks, 12 s`) and no nested
bar, so a log holds no carriage returns or cursor moves. Progress goes to stderr, with the diagnostics."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm.auto import tqdm


def on_terminal() -> bool:
    return sys.stderr.isatty() or "ipykernel" in sys.modules


def progress(iterable: Iterable | None = None, *, desc: str, unit: str, total: int | None = None,
             nested: bool = False, enabled: bool = True) -> Any:
    """`iterable` with its progress shown: a tqdm bar on a terminal (a `nested` one is cleared when done), else
    a plain line per item (none for a `nested` loop); nothing when not `enabled`. Without `iterable`: an
    object to `update(n)` by hand, as a tqdm bar (plain lines are of the outer loops only)."""
    if enabled and on_terminal():
        return tqdm(iterable, desc=desc, unit=unit, total=total, leave=not nested)
    if not enabled or nested or iterable is None:
        return tqdm(iterable, total=total, disable=True)
    return PlainLines(iterable, desc, unit, total)


class PlainLines:
    """Iterates `items`, writing `DESC: i/N UNITs, S s` to stderr after each."""

    def __init__(self, items: Iterable, desc: str, unit: str, total: int | None = None):
        self.items, self.desc, self.unit = items, desc, unit
        self.total = total if total is not None else len(items) if hasattr(items, "__len__") else None

    def __iter__(self) -> Iterator:
        started = time.perf_counter()
        for done, item in enumerate(self.items, 1):
            yield item
            of = f"/{self.total}" if self.total is not None else ""
            print(f"{self.desc}: {done}{of} {self.unit}s, {time.perf_counter() - started:.0f} s", file=sys.stderr,
                  flush=True)

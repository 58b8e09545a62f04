"""The optional packages a tracker needs, each behind an extra of this package: one line that names the
extra when it is missing (`pip install 'dflash-callbacks[EXTRA]'`), never a traceback into the tracker."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """A tracker was asked for whose package is not installed; its message is the one line to show."""


def require(module: str, extra: str, tracker: str) -> ModuleType:
    """`module`, imported, or MissingExtra naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"the {tracker} tracker needs the '{extra}' extra: pip install 'dflash-callbacks[{extra}]' "
                           f"({type(e).__name__}: {e})") from None

"""Packages that name what they hold without importing it: `from dflash_callbacks.model import
TargetHead` imports torch, `import dflash_callbacks.model.attention` does not."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's `__getattr__`: each of `names` (name -> submodule, relative to `package`) imported on
    first use."""
    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__

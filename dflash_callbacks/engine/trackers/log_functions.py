"""`log=` of the plain-loop and transformers adapters: functions `fn(metrics, step)` that get every report's
numbers at the snapshot's step, as the host's loggers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..host import Logger


def log_functions(log: Callable | Sequence[Callable] | None) -> list[Callable[[dict, int], object]]:
    """`log=` of the plain-loop and transformers adapters, as a list (TypeError for anything else)."""
    functions = [] if log is None else [log] if callable(log) else list(log)
    if not all(callable(fn) for fn in functions):
        raise TypeError("log must be a function fn(metrics, step) or a list of them")
    return functions


def as_loggers(functions: list[Callable[[dict, int], object]]) -> list[Logger]:
    return [(getattr(fn, "__qualname__", type(fn).__name__), fn) for fn in functions]

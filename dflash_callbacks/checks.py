"""Argument checks shared by every public entry point, and the one table of dtypes.

Each check raises ValueError (TypeError where the kind of value is wrong) with a
message that names the argument, what it must be, and what it got. YAML and the CLIs
reach the same checks through the constructors, so a value is refused the same way
from Python, from a config file and from the command line.

No torch at import (the CLI's help and its refusals answer before torch loads): `DTYPES`
(name -> torch dtype) and the device checks import it when first used.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def __getattr__(name: str):
    if name == "DTYPES":  # name -> torch dtype, made on first use
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    for name in DTYPE_NAMES:
        if str(dtype) == f"torch.{name}":
            return name
    raise ValueError(f"unsupported dtype {dtype}; expected one of {list(DTYPE_NAMES)}")


def is_int(value: Any) -> bool:
    """A real integer: bool, float and str are not (a NumPy integer is one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def problems_of(*checks: Callable[[], object]) -> list[str]:
    """The message of each check (a function of no arguments) that raises ValueError, in order:
    for code that reports every problem at once, one line each."""
    problems = []
    for check in checks:
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    return problems


def check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> int | None:
    """`value` as an int if it is an integer >= minimum (a NumPy integer too), or None when optional;
    else ValueError."""
    if optional and value is None:
        return None
    if not is_int(value) or value < minimum:
        kind = f"None or an integer >= {minimum}" if optional else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {kind}; got {value!r}")
    return int(value)


def check_int_list(name: str, value: Any, minimum: int, maximum: int | None = None) -> list[int]:
    """A list (or tuple) of distinct integers >= minimum (and <= maximum when given); a string
    or a single number is refused."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of integers >= {minimum}, e.g. [4, 8]; got {value!r}")
    for item in value:
        if not is_int(item) or item < minimum:
            raise ValueError(f"{name} must be a list of integers >= {minimum}; got {item!r} in {list(value)!r}")
        if maximum is not None and item > maximum:
            raise ValueError(f"{name} must be at most {maximum}; got {item!r} in {list(value)!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{name} holds a value twice: {list(value)!r}")
    return list(value)


def check_str_list(name: str, value: Any, *, optional: bool = False) -> list[str] | None:
    """A list (or tuple) of strings; a bare string is refused (it is not a list of names)."""
    if optional and value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of names, e.g. ['fizzbuzz']; got {value!r}")
    return list(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false; got {value!r}")
    return value


def check_number(name: str, value: Any, *, above: float | None = None, optional: bool = False) -> float | None:
    """A finite real number (int or float, not bool), > above when given."""
    if optional and value is None:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (above is not None and value <= above):
        kind = "a finite number" + (f" > {above:g}" if above is not None else "")
        raise ValueError(f"{name} must be {'None or ' if optional else ''}{kind}; got {value!r}")
    return float(value)


def did_you_mean(value: Any, legal: Iterable[Any], show=repr) -> str:
    """`; did you mean X?` naming the one of `legal` closest to `value` (shown by `show`), or "" when none is
    close: the hint every refusal of a name from a closed set ends with."""
    if not isinstance(value, str):
        return ""
    names = {str(x): x for x in legal}
    close = difflib.get_close_matches(value, list(names), n=1)
    return f"; did you mean {show(names[close[0]])}?" if close else ""


def check_choice(name: str, value: Any, legal: Iterable[Any]) -> Any:
    legal = list(legal)
    if value not in legal:
        raise ValueError(f"{name} must be one of {legal}; got {value!r}{did_you_mean(value, legal)}")
    return value


def check_device(name: str, device: str) -> torch.device:
    """'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N' that exists on this machine.
    A CUDA device comes back with its index: 'auto' and 'cuda' mean cuda:0, never the calling
    thread's current device (which a training process sets, and a fresh thread does not have)."""
    import torch

    if not isinstance(device, str):
        raise ValueError(f"{name} must be a string such as 'auto', 'cpu', 'cuda' or 'cuda:1'; got {device!r}")
    if device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name} must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"{name}={device!r}, but CUDA is not available here (torch {torch.__version__} is "
                             f"{build}); use 'cpu' or 'auto'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", resolved.index or 0)
    elif resolved.type != "cpu":
        raise ValueError(f"{name}={device!r} is not supported; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return resolved

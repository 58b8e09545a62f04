"""Method and monitor names: one value type each, used wherever a name is read or written.

    vanilla          the longest prefix where the drafter's argmax is the label
    ddtree@N         DDTree with a node budget of N (N >= 1)
    top@K            every label among the top K (an upper bound, not a node budget)
    METHOD/AGGREGATE a monitor: the run-level mean of one aggregate (live or dense)

`Method.parse("ddtree@8")`, `str(method)`, `Monitor.parse("ddtree@8/live")`; reports and
logged keys use `str(method)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

AGGREGATES = ("dense", "live")
KINDS = ("vanilla", "ddtree", "top")
METHOD_FORMS = "vanilla, ddtree@N (node budget N >= 1) or top@K (width K >= 1)"


@dataclass(frozen=True)
class Method:
    kind: str  # one of KINDS
    n: int | None = None  # DDTree node budget or top@K width; None for vanilla

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"method kind must be one of {list(KINDS)}; got {self.kind!r}")
        if (self.kind == "vanilla") != (self.n is None):
            raise ValueError(f"{self.kind} takes {'no parameter' if self.kind == 'vanilla' else 'a parameter'}")
        if self.n is not None and (isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1):
            raise ValueError(f"{self.kind}@N needs an integer N >= 1; got {self.n!r}")

    @classmethod
    def parse(cls, text: object) -> Method:
        if isinstance(text, Method):
            return text
        if not isinstance(text, str):
            raise ValueError(f"a method is {METHOD_FORMS}; got {text!r}")
        kind, at, n = text.partition("@")
        if kind == "vanilla" and not at:
            return cls("vanilla")
        if kind in ("ddtree", "top") and at and n.isdigit() and not n.startswith("0"):
            return cls(kind, int(n))
        raise ValueError(f"a method is {METHOD_FORMS}; got {text!r}")

    def __str__(self) -> str:
        return self.kind if self.n is None else f"{self.kind}@{self.n}"


@dataclass(frozen=True)
class Monitor:
    method: Method
    aggregate: str = "live"

    def __post_init__(self) -> None:
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"an aggregate is one of {list(AGGREGATES)}; got {self.aggregate!r}")

    @classmethod
    def parse(cls, text: object) -> Monitor:
        if isinstance(text, Monitor):
            return text
        if not isinstance(text, str) or text.count("/") != 1:
            raise ValueError(f"a monitor is METHOD/AGGREGATE, e.g. 'ddtree@8/live', with METHOD {METHOD_FORMS} "
                             f"and AGGREGATE one of {list(AGGREGATES)}; got {text!r}")
        method, aggregate = text.split("/")
        return cls(Method.parse(method), aggregate)

    def __str__(self) -> str:
        return f"{self.method}/{self.aggregate}"


def scored_methods(ddtree_budgets: Iterable[int], topk: Iterable[int]) -> list[Method]:
    """The methods a scoring config computes, in report order: vanilla, DDTree budgets, top@k widths."""
    return [Method("vanilla")] + [Method("ddtree", n) for n in ddtree_budgets] + [Method("top", k) for k in topk]

"""Method and monitor names: one value type each, used wherever a name is read or written.

    vanilla          the longest prefix where the drafter's proposal is the label
    ddtree@N         DDTree with a node budget of N (N >= 1)
    top@K            every label among the top K (an upper bound, not a node budget)
    METHOD:bB        the method scored at block size B, when a run scores more than one
                     (`ScoringConfig.block_sizes`; without it: the run's block size)
    METHOD:RULE      the method scored under another attention rule (`ScoringConfig.attentions`,
                     `model.attention.RULES`; without it: the run's `attention`), after any :bB:
                     `vanilla:trained`, `ddtree@8:b8:vllm`
    METHOD/AGGREGATE a monitor: the run-level mean of one aggregate (`aggregates.AGGREGATES`)

A method carries every setting its number depends on that is not the run's own: `ddtree@8:b8` next
to `ddtree@8` (block 16) in one report is the same method served at `num_speculative_tokens` 7.
`Method.parse("ddtree@8:b8")`, `str(method)`, `Monitor.parse("ddtree@8:b8/live")`; reports, logged
keys and W&B use `str(method)`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..model.attention import RULES
from .aggregates import AGGREGATES

KINDS = ("vanilla", "ddtree", "top")
METHOD_FORMS = ("vanilla, ddtree@N (node budget N >= 1) or top@K (width K >= 1), optionally :bB (block size B >= 2), "
                f"then optionally :RULE (an attention rule: {', '.join(RULES)})")
_FORM = re.compile(r"^(vanilla|ddtree@([1-9][0-9]*)|top@([1-9][0-9]*))(?::b([1-9][0-9]*))?"
                   r"(?::(" + "|".join(map(re.escape, RULES)) + r"))?\Z")


@dataclass(frozen=True)
class Method:
    kind: str  # one of KINDS
    n: int | None = None  # DDTree node budget or top@K width; None for vanilla
    block: int | None = None  # the block size it is scored at; None: the run's
    attention: str | None = None  # the attention rule it is scored under (model.attention.RULES); None: the run's

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"method kind must be one of {list(KINDS)}; got {self.kind!r}")
        if (self.kind == "vanilla") != (self.n is None):
            raise ValueError(f"{self.kind} takes {'no parameter' if self.kind == 'vanilla' else 'a parameter'}")
        for name, value, low in (("N", self.n, 1), ("block size", self.block, 2)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{self.kind}: the {name} must be an integer >= {low}; got {value!r}")
        if self.attention is not None and self.attention not in RULES:
            raise ValueError(f"{self.kind}: the attention rule must be one of {list(RULES)}; got {self.attention!r}")

    @classmethod
    def parse(cls, text: object) -> Method:
        if isinstance(text, Method):
            return text
        found = _FORM.match(text) if isinstance(text, str) else None
        if found is None or (found.group(4) is not None and int(found.group(4)) < 2):
            raise ValueError(f"a method is {METHOD_FORMS}; got {text!r}")
        kind = found.group(1).split("@")[0]
        n = found.group(2) or found.group(3)
        return cls(kind, None if n is None else int(n), None if found.group(4) is None else int(found.group(4)),
                   found.group(5))

    def __str__(self) -> str:
        base = self.kind if self.n is None else f"{self.kind}@{self.n}"
        base = base if self.block is None else f"{base}:b{self.block}"
        return base if self.attention is None else f"{base}:{self.attention}"

    def at(self, block: int | None) -> Method:
        """This method at another block size (None: the run's), under its own attention rule."""
        return Method(self.kind, self.n, block, self.attention)

    def under(self, attention: str | None) -> Method:
        """This method under another attention rule (None: the run's), at its own block size."""
        return Method(self.kind, self.n, self.block, attention)


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


def scored_methods(ddtree_budgets: Iterable[int], topk: Iterable[int], block_sizes: Iterable[int] = (),
                   attentions: Iterable[str] = ()) -> list[Method]:
    """The methods a scoring config computes, in report order: vanilla, DDTree budgets, top@k widths at the
    run's block size, then the same at each other block size of `block_sizes`; all of them again under each
    other attention rule of `attentions`."""
    base = [Method("vanilla")] + [Method("ddtree", n) for n in ddtree_budgets] + [Method("top", k) for k in topk]
    blocks = base + [m.at(block) for block in block_sizes for m in base]
    return blocks + [m.under(rule) for rule in attentions for m in blocks]


def unscored_monitor(monitor: str | Monitor, methods: list[str], given: str, scoring: str | None = "scoring") -> str | None:
    """One line when `monitor`'s method is not one of `methods` (what the config named `scoring` scores; None: a
    run's reports, scored already), else None: the monitor as `given` names it, the methods scored, the setting
    that would score it, and the closest scored monitor."""
    from ..checks import did_you_mean

    monitor = Monitor.parse(monitor)
    method = monitor.method
    if str(method) in methods:
        return None
    base = Method(method.kind, method.n)
    if scoring is None:
        add = ""
    elif str(base) not in methods and method.kind != "vanilla":
        add = f", or add {method.n} to {scoring}.{'ddtree_budgets' if method.kind == 'ddtree' else 'topk'}"
    elif method.block is not None and str(base.at(method.block)) not in methods:
        add = f", or add {method.block} to {scoring}.block_sizes"
    else:
        add = f", or add {method.attention} to {scoring}.attentions"
    scored = [f"{m}/{monitor.aggregate}" for m in methods]
    return (f"{given}={str(monitor)!r}, but {scoring or 'the run'} scores only {methods}: monitor one of those{add}"
            f"{did_you_mean(str(monitor), scored)}")

"""EvalReport: the numbers of one scoring run, as JSON (its comparison table: `table.py`).

A report is read back strictly (`EvalReport.from_dict`): anything that is not the shape
below, holds a number that is not finite (anywhere, `extra` included) or a number outside
its legal range (tau 1 to the method's largest, `max_tau`, curve shares 0 to 1, counts and times >= 0, integers
within int64), or a task named `mean` (the run-level mean), is refused with ValueError
naming the task, method and field, so a damaged or foreign file is never logged as a score.
The per-anchor streaks a report keeps for its intervals (`streaks`, see
`aggregates.encode_streaks`) are checked against the numbers made from them: one per anchor,
each 0 to max_tau - 1, each aggregate following from them (`aggregates.Aggregate.check`: their mean tau
the `dense` value, the live schedule over them the `live_rounds`); and each interval lies within 1 to
max_tau, low end first. A confidence-cut report's `confidence_reach` (a share per depth 1 to max_tau - 1)
never rises with depth and is at each depth at least the `curve`'s share (a streak never passes its cut).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..cache.tasks import task_name_problem
from ..checks import is_int
from ..files import atomic_write
from ..cache.sampling import SAMPLING_KEYS, sampling_problems
from .aggregates import AGGREGATES, pooled_numbers, task_streaks
from .methods import Method, Monitor

TASK_FIELDS = ("dense", "live", "pooled", "curve", "live_rounds", "rounds", "anchors", "streaks", "expected",
               "visits", "confidence_reach")


SCORER_VERSION = 6
"""The version of the numbers' definitions as this library computes them, bumped when a fix
changes a report's numbers for the same inputs (2: a DDTree prefix whose score ties the
budget's threshold is resolved as Algorithm 1 does; before, a confident drafter's
`ddtree@N` streak could exceed N. 3: sliding layers attend inside the block as vLLM serves
them, causal unless the config says otherwise, where they were bidirectional; a pruned draft
vocabulary is scored over its own ids. 4: reports carry the per-anchor streaks and a 95% interval
for every mean, so a baseline cached without them is scored again. 5: the intervals: a run-level
interval whose between-task shrinkage is 0 is widened by t(T - 1) as every other, where it was
widened by t over the blocks (narrower); a task's live rounds are resampled in at least 3 blocks,
where one block could span them all (a live interval of zero width); a cache of fewer than 3
tasks carries the within-task interval as its mean's). 6: the live schedule runs to the end of each answer
(`max_rounds` None, where it stopped after 30 rounds); the aggregate `pooled` (vLLM's mean acceptance length);
each method's interval is resampled on its own numbers alone, where every method of a report was resampled
alike (one method's interval moved with what else was scored), and a paired one on the pair alone; a report of
before is read with `pooled` made from the streaks it keeps (`upgrade_tasks`). A report of another version stands on
another basis, and a cached baseline report of another version is scored again."""


@dataclass
class EvalReport:
    """Per task and method: {"dense", "live", "curve", "live_rounds", "anchors", "streaks"}, and
    "confidence_reach" when scored with `scoring.confidence_threshold`; tau units.

    JSON shape: {"step", "snapshot_id", "drafter", "cache": {"path", "fingerprint", "target"},
    "block_size", "tasks": {TASK: {METHOD: {...}}}, "mean": {METHOD: {"dense", "live"}}, ...}.
    `cache.target` is the fingerprint of the target head scored with (`head_fingerprint`;
    absent in reports written before it was recorded).
    `step` and `snapshot_id` name the snapshot scored (None for a drafter folder);
    `seconds` is the scorer's own time; `peak_memory` its peak accelerator memory in bytes
    (None on the CPU); `created` the Unix time scoring started; `scorer_version` the
    SCORER_VERSION that computed the numbers (None in reports written before it was
    recorded); `attention` each drafter layer's attention pattern inside the block, as
    scored (`model.attention`; None in reports written before it was recorded); `family` the drafter's
    family, how many tokens its block proposes at each block size scored and the family's settings
    ({"name", "proposals": {B: P}, "settings": {...} or null}: P = B - 1 for DFlash, B for DSpark's
    anchor-first blocks; None in reports written before it was recorded: DFlash's; no "settings" in reports
    written before they were), which bounds each method's tau to 1 .. P + 1 (`max_tau`); `intervals` the
    95% interval of every mean (`intervals.report_intervals`: {"confidence", "resamples", "seed",
    "mean": {METHOD: {AGG: [lo, hi]}}, "tasks": {TASK: {METHOD: {AGG: [lo, hi]}}}}; None in reports
    written before scorer version 4); `attention_patterns` each layer's pattern as its trainer trained it and
    as vLLM serves it (`model.attention`'s "trained" and "vllm": {"trained": [...], "vllm": [...]}), where
    those two and the scored one do not all agree (absent where they do); `cache.sampling` the settings a sampled cache's answers were drawn at (absent: a greedy
    cache); per task and method, `expected` the expected streaks where the draft is sampled at T > 0
    (`aggregates.encode_expected`; `streaks` then a seeded draw of the acceptance coins); `extra`
    anything else.
    """

    drafter: str
    cache: dict[str, str]
    block_size: int
    tasks: dict[str, dict[str, dict[str, Any]]]
    step: int | None = None
    snapshot_id: str | None = None
    drafter_block_size: int | None = None
    scoring: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    peak_memory: int | None = None
    created: float | None = None
    scorer_version: int | None = None
    attention: list[str] | None = None
    family: dict[str, Any] | None = None
    intervals: dict[str, Any] | None = None
    attention_patterns: dict[str, list[str]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def methods(self) -> list[str]:
        first = next(iter(self.tasks.values()), {})
        return list(first)

    @property
    def mean(self) -> dict[str, dict[str, float]]:
        """Run-level numbers: each task weighs the same, or as its aggregate weighs it (`pooled`: by its rounds);
        an aggregate some task does not hold (a report made by hand of dense and live alone) is left out."""
        def held(numbers: dict, aggregate) -> bool:
            return aggregate.name in numbers and (aggregate.weight is None or aggregate.weight in numbers)

        return {method: {name: aggregate.run_level([t[method] for t in self.tasks.values()])
                         for name, aggregate in AGGREGATES.items()
                         if all(held(t[method], aggregate) for t in self.tasks.values())} for method in self.methods}

    def block(self, method: str | Method) -> int:
        """The block size `method` was scored at (its `:bB`, else the report's)."""
        return Method.parse(method).block or self.block_size

    def max_tau(self, method: str | Method) -> int:
        """The largest tau of `method`: its block's proposals + 1 (DFlash: the block size)."""
        block = self.block(method)
        proposals = (self.family or {}).get("proposals", {}).get(str(block), block - 1)
        return proposals + 1

    def value(self, monitor: str | Monitor, task: str = "mean") -> float:
        """`"ddtree@8/live"` -> the mean (or one task's) value."""
        monitor = Monitor.parse(monitor)
        method = str(monitor.method)
        if method not in self.methods:
            raise KeyError(f"{monitor} is not in this report; it holds the methods {self.methods}")
        if task == "mean":
            return self.mean[method][monitor.aggregate]
        return self.tasks[task][method][monitor.aggregate]

    def interval(self, monitor: str | Monitor, task: str = "mean") -> tuple[float, float]:
        """`"ddtree@8/live"` -> the 95% interval (lo, hi) of the mean (or of one task's value)."""
        monitor = Monitor.parse(monitor)
        self.value(monitor, task)  # the same KeyError for a method the report does not hold
        if self.intervals is None:
            raise KeyError(f"the report of {self.drafter} carries no intervals (written before scorer version 4)")
        where = self.intervals["mean"] if task == "mean" else self.intervals["tasks"][task]
        lo, hi = where[str(monitor.method)][monitor.aggregate]
        return lo, hi

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["attention_patterns"] is None:  # said only where the patterns differ
            del out["attention_patterns"]
        out["mean"] = self.mean
        return out

    @property
    def sampling(self) -> dict[str, Any] | None:
        """The settings the cache's answers were sampled at (`cache.sampling`), None for a greedy cache."""
        return self.cache.get("sampling")

    @property
    def estimators(self) -> str | None:
        """On a sampled cache, how vanilla's numbers were estimated: "conditional" (the cache keeps the served
        support: each streak term's last factor is its expectation given the text before it, live the expected
        rounds over the acceptance coins) or "coin draws" (a cache of before, or max_rounds set: today's
        estimators, the integer streaks of an argmax draft, one seeded draw of a sampled draft's coins); None
        on a greedy cache."""
        if self.sampling is None:
            return None
        first = next(iter(self.tasks.values()), {})
        return "conditional" if any("visits" in n for n in first.values()) else "coin draws"

    def served(self) -> str:
        """One line saying what this report's numbers stand for: the attention rule, and the cache's settings."""
        rule = self.scoring.get("attention", "auto")
        sampling = self.sampling
        text = "greedy" if sampling is None else ", ".join(f"{k} {sampling[k]}" for k in SAMPLING_KEYS)
        line = f"attention {rule}, cache {text}"
        if sampling is not None:
            line += f", draft rule {self.scoring.get('draft_rule', 'greedy')}, coin seed {self.scoring.get('coin_seed', 0)}"
            line += f", estimators: {self.estimators}"
        if self.attention_patterns is not None:
            shown = {**self.attention_patterns, f"scored ({rule})": self.attention or []}
            line += ("; the drafter's patterns differ: " + "; ".join(
                f"{name} {_layers(layers)}" for name, layers in shown.items())
                + " (scoring.attentions scores the others beside it, METHOD:RULE)")
        cost = self.window_cost()
        return line if cost is None else f"{line}; {cost}"

    def window_cost(self, aggregate: str = "live") -> str | None:
        """Under attention vllm, where the target's model-level window reached layers that declare none and the
        config as written was scored beside it (`ScoringConfig.score_as_written`), what the window does to the
        first method's `aggregate`: the paired delta with its 95% interval (`intervals.method_comparison`) and
        both numbers; None otherwise."""
        method = next(iter(self.methods), None)
        written = f"{method}:vllm-as-written"
        if self.scoring.get("attention") != "vllm" or written not in self.methods or self.intervals is None:
            return None
        from .intervals import method_comparison

        delta = method_comparison(self, method, written, aggregate).delta
        return (f"the target's window on the layers without their own moves {method} {aggregate} by "
                f"{delta.show(sign=True)} ({self.value(f'{method}/{aggregate}'):.2f} served, "
                f"{self.value(f'{written}/{aggregate}'):.2f} as written: {written})")

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as JSON text; with `path`, also written there atomically."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            atomic_write(path, (text + "\n").encode())
        return text

    @classmethod
    def from_dict(cls, raw: Any) -> EvalReport:
        """A report from its JSON object; ValueError saying what is wrong for anything else."""
        if not isinstance(raw, dict):
            raise ValueError(f"not a report: a JSON object was expected, found {type(raw).__name__}")
        raw = dict(raw)
        raw.pop("mean", None)
        missing = [k for k in ("drafter", "cache", "block_size", "tasks") if k not in raw]
        if missing:
            raise ValueError(f"not a report: it has no {', '.join(repr(k) for k in missing)}")
        added = _upgrade(raw)
        _check_shape(raw, added)
        extra = {k: raw.pop(k) for k in list(raw) if k not in cls.__dataclass_fields__}
        report = cls(**raw)
        report.extra = {**report.extra, **extra}  # a new dict: the caller's `extra` is left as it was
        if added and report.intervals is not None:
            from .intervals import report_intervals

            found = report_intervals(report, report.intervals["resamples"], report.intervals["seed"], added)
            report.intervals = {**report.intervals, **{where: {
                task: {m: {**per[m], **found[where][task][m]} for m in per} for task, per in report.intervals[where].items()}
                if where == "tasks" else {m: {**per, **found[where][m]} for m, per in report.intervals[where].items()}
                for where in ("mean", "tasks")}}
        return report

    @classmethod
    def load(cls, path: str | Path) -> EvalReport:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no report at {path}")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a JSON report: {e}") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _upgrade(raw: dict) -> list[str]:
    """A report written before an aggregate was added (scorer version 5 and before: no `pooled`) gets it, in
    place in `raw` (its `tasks` copied, the caller's left as they were): from the streaks it keeps, as the
    scorer makes it, else from the live rounds it keeps (a report of before version 4 keeps no streaks).
    Returns the aggregates added, whose intervals `from_dict` then computes."""
    tasks = raw.get("tasks")
    numbers = [n for per in tasks.values() if isinstance(per, dict) for n in per.values() if isinstance(n, dict)] \
        if isinstance(tasks, dict) else []
    if not numbers or all("pooled" in n for n in numbers):
        return []
    raw["tasks"] = {task: {m: dict(n) for m, n in per.items()} for task, per in tasks.items()}
    for task, per in raw["tasks"].items():
        for method, n in per.items():
            if "pooled" in n:
                continue
            try:
                streaks = task_streaks(n, _max_tau(raw, method)) if "streaks" in n else None
            except (ValueError, KeyError, TypeError):
                return []  # the strict reader then says what is wrong with it
            if streaks is not None:
                n["pooled"], n["rounds"] = pooled_numbers(streaks)
            elif isinstance(n.get("live_rounds"), list) and n["live_rounds"]:
                n["pooled"], n["rounds"] = sum(n["live_rounds"]) / len(n["live_rounds"]), len(n["live_rounds"])
    return ["pooled"] if "streaks" in numbers[0] else []


def _layers(patterns: list[str]) -> str:
    """Each layer's pattern, "bidirectional x3" where every layer has the same."""
    return f"{patterns[0]} x{len(patterns)}" if patterns and len(set(patterns)) == 1 else ", ".join(patterns)


INT_MAX = 2**63 - 1
"""The largest integer a report holds (an int64): a mean of values up to it stays finite."""


def _bad(what: str) -> ValueError:
    return ValueError(f"not a report: {what}")


def _check_number(value: Any, name: str, low: float, high: float = INT_MAX, *, integer: bool = False,
                  optional: bool = False) -> None:
    """`value` is a finite number (an integer when `integer`) in [low, high], or null when optional."""
    if optional and value is None:
        return
    number = is_int(value) or (not integer and isinstance(value, float) and math.isfinite(value))
    if not number or not low <= value <= high:
        kind = "an integer" if integer else "a finite number"
        top = "2**63 - 1" if high == INT_MAX else high
        raise _bad(f"{name} is {value!r}, not {kind} from {low} to {top}" + (" or null" if optional else ""))


def _strict_json_problem(value: Any, where: str) -> str | None:
    """Where `value` holds what strict JSON can not hold (NaN, Inf, a non-string key, a Python object)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} is {value}, not a finite number"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r}, not a string"
            if (problem := _strict_json_problem(item, f"{where}.{key}" if where else key)) is not None:
                return problem
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if (problem := _strict_json_problem(item, f"{where}[{i}]")) is not None:
                return problem
    elif not isinstance(value, (str, int, float, type(None))):
        return f"{where} is a {type(value).__name__}, not a JSON value"
    return None


def _check_shape(raw: dict, added: list[str] = ()) -> None:
    if (problem := _strict_json_problem(raw, "")) is not None:
        raise _bad(problem)
    if not isinstance(raw["drafter"], str):
        raise _bad("'drafter' is not a string")
    cache = raw["cache"]
    if not isinstance(cache, dict) or not isinstance(cache.get("fingerprint"), str):
        raise _bad("'cache' is not an object with a 'fingerprint' string")
    if not all(isinstance(cache.get(k, ""), str) for k in ("path", "target")):
        raise _bad("'cache' holds a 'path' or 'target' that is not a string")
    _check_sampling(cache.get("sampling"))
    patterns = raw.get("attention_patterns")
    if patterns is not None and (not isinstance(patterns, dict) or not all(
            isinstance(v, list) and all(isinstance(a, str) for a in v) for v in patterns.values())):
        raise _bad(f"'attention_patterns' is {patterns!r}, not an object of rule -> one pattern per layer, or null")
    if raw.get("snapshot_id") is not None and not isinstance(raw["snapshot_id"], str):
        raise _bad(f"'snapshot_id' is {raw['snapshot_id']!r}, not a string or null")
    for key in ("scoring", "extra"):
        if not isinstance(raw.get(key, {}), dict):
            raise _bad(f"{key!r} is not an object")
    attention = raw.get("attention")
    if attention is not None and (not isinstance(attention, list) or not all(isinstance(a, str) for a in attention)):
        raise _bad(f"'attention' is {attention!r}, not a list of strings (one per drafter layer) or null")
    _check_number(raw["block_size"], "'block_size'", 2, integer=True)
    _check_family(raw.get("family"))
    _check_number(raw.get("drafter_block_size"), "'drafter_block_size'", 2, integer=True, optional=True)
    _check_number(raw.get("step"), "'step'", 0, integer=True, optional=True)
    _check_number(raw.get("peak_memory"), "'peak_memory'", 0, integer=True, optional=True)
    _check_number(raw.get("seconds"), "'seconds'", 0, optional=True)
    _check_number(raw.get("created"), "'created'", 0, optional=True)
    _check_number(raw.get("scorer_version"), "'scorer_version'", 1, integer=True, optional=True)
    tasks = raw["tasks"]
    if not isinstance(tasks, dict) or not tasks:
        raise _bad("'tasks' is not a non-empty object of task -> method -> numbers")
    methods = None
    for task, per_method in tasks.items():
        if (problem := task_name_problem(task)) is not None:
            raise _bad(problem)
        if not isinstance(per_method, dict) or not per_method:
            raise _bad(f"task {task!r} is not an object of method -> numbers")
        if methods is None:
            methods = list(per_method)
            for method in methods:
                try:
                    Method.parse(method)
                except ValueError as e:
                    raise _bad(f"task {task!r}: {e}") from None
        elif list(per_method) != methods:
            raise _bad(f"task {task!r} holds the methods {list(per_method)}, another task {methods}")
        for method, numbers in per_method.items():
            if not isinstance(numbers, dict):
                raise _bad(f"task {task!r}, {method}: not an object of {list(TASK_FIELDS)}")
            scoring = raw.get("scoring", {})  # max_rounds None: to the answer's end, no limit (absent: not known)
            _check_numbers(numbers, f"task {task!r}, {method}: ", _max_tau(raw, method),
                           math.inf if "max_rounds" in scoring and scoring["max_rounds"] is None else
                           scoring.get("max_rounds"), older=(raw.get("scorer_version") or 0) < SCORER_VERSION)
    if raw.get("intervals") is not None:
        bare = [f"{task}/{m}" for task, per_method in tasks.items() for m, numbers in per_method.items()
                if "streaks" not in numbers]
        if bare:
            raise _bad(f"'intervals' without the streaks they come from ({', '.join(bare[:3])} keep none)")
        _check_intervals(raw["intervals"], tasks, {m: _max_tau(raw, m) for m in methods}, added)


def _check_sampling(sampling: Any) -> None:
    """A sampled cache's settings (`cache.sampling.SAMPLING_KEYS`, a temperature > 0), or absent (greedy)."""
    if sampling is None:
        return
    if not isinstance(sampling, dict) or sorted(sampling) != sorted(SAMPLING_KEYS):
        raise _bad(f"'cache.sampling' is {sampling!r}, not an object of {list(SAMPLING_KEYS)}")
    problems = sampling_problems(*(sampling[k] for k in SAMPLING_KEYS)) or (
        ["temperature 0 is greedy: a greedy cache records no sampling"] if sampling["temperature"] == 0 else [])
    if problems:
        raise _bad("'cache.sampling': " + "; ".join(problems))


def _check_family(family: Any) -> None:
    """{"name": a family, "proposals": {block size: tokens proposed}, "settings": an object or null (absent in
    reports of before)} or null (a DFlash report of before)."""
    if family is None:
        return
    proposals = family.get("proposals") if isinstance(family, dict) else None
    if not isinstance(family, dict) or not isinstance(family.get("name"), str) or not isinstance(proposals, dict):
        raise _bad(f"'family' is {family!r}, not an object of 'name' and 'proposals' (block size -> tokens proposed)")
    if not isinstance(family.get("settings", {}), (dict, type(None))):
        raise _bad(f"'family.settings' is {family['settings']!r}, not an object of the family's settings or null")
    for block, count in proposals.items():
        if not block.isdigit() or not is_int(count) or not 1 <= count <= int(block):
            raise _bad(f"'family.proposals' says a block of {block} proposes {count!r} tokens (1 to the block size)")


def _max_tau(raw: dict, method: str) -> int:
    """`EvalReport.max_tau` of a report not yet read (its family checked): a method at a block the family
    does not describe has none."""
    block = Method.parse(method).block or raw["block_size"]
    family = raw.get("family")
    if family is None:
        return block
    if str(block) not in family["proposals"]:
        raise _bad(f"{method} is scored at block size {block}, which 'family.proposals' does not describe")
    return family["proposals"][str(block)] + 1


def _check_numbers(numbers: dict, where: str, max_tau: int, max_rounds: Any = None, older: bool = False) -> None:
    """One task's numbers of one method (DESIGN.md, "Aggregates per task"): tau = streak + 1 is 1 to
    `max_tau` at every anchor, so each aggregate and each live round are too; the acceptance curve holds
    shares (0 to 1) for depths 1 to max_tau - 1; and the streaks, where kept, are the ones these numbers were
    made from (each aggregate's `check`). A report `older` than this scorer that keeps neither streaks nor live
    rounds to make `pooled` from (`_upgrade`) holds none."""
    for agg in AGGREGATES:
        if older and agg == "pooled" and agg not in numbers:
            continue
        _check_number(numbers.get(agg), f"{where}{agg!r}", 1, max_tau)
    curve = numbers.get("curve", [])
    if not isinstance(curve, list) or len(curve) > max_tau - 1:
        raise _bad(f"{where}'curve' must be a list of at most {max_tau - 1} shares (depths 1 to {max_tau - 1})")
    for depth, share in enumerate(curve, 1):
        _check_number(share, f"{where}'curve' at depth {depth}", 0, 1)
    rounds = numbers.get("live_rounds", [])
    if not isinstance(rounds, list) or ("live_rounds" in numbers and not rounds):
        raise _bad(f"{where}'live_rounds' must be a non-empty list of taus")
    for i, tau in enumerate(rounds):
        _check_number(tau, f"{where}'live_rounds'[{i}]", 1, max_tau, integer=True)
    _check_number(numbers.get("rounds"), f"{where}'rounds'", 1, optional=older and "pooled" not in numbers)
    _check_number(numbers.get("anchors"), f"{where}'anchors'", 1, integer=True, optional=True)
    if "confidence_reach" in numbers:
        _check_reach(numbers["confidence_reach"], curve, where, max_tau)
    if "streaks" not in numbers:
        if "expected" in numbers or "visits" in numbers:
            raise _bad(f"{where}'expected' or 'visits' without the 'streaks' of the coins drawn")
        return
    if "visits" in numbers and "expected" not in numbers:
        raise _bad(f"{where}'visits' without the 'expected' streaks")
    try:
        streaks = task_streaks(numbers, max_tau)
    except ValueError as e:
        raise _bad(f"{where}{e}") from None
    if numbers.get("anchors") != len(streaks.drawn):
        raise _bad(f"{where}'streaks' holds {len(streaks.drawn)} anchors; 'anchors' says {numbers.get('anchors')}")
    for aggregate in AGGREGATES.values():
        problem = aggregate.check(numbers, streaks, max_rounds if is_int(max_rounds) or max_rounds == math.inf else None)
        if problem is not None:
            raise _bad(f"{where}{problem}")


def _check_reach(reach: Any, curve: list, where: str, max_tau: int) -> None:
    """`confidence_reach`: a share (0 to 1) per depth 1 to max_tau - 1, never rising with depth, and at each depth
    at least the acceptance curve's (a streak never passes its anchor's cut)."""
    if not isinstance(reach, list) or len(reach) != max_tau - 1:
        raise _bad(f"{where}'confidence_reach' must be a list of {max_tau - 1} shares (depths 1 to {max_tau - 1})")
    for depth, share in enumerate(reach, 1):
        _check_number(share, f"{where}'confidence_reach' at depth {depth}", 0, 1)
        if depth > 1 and share > reach[depth - 2]:
            raise _bad(f"{where}'confidence_reach' rises from {reach[depth - 2]!r} to {share!r} at depth {depth}: "
                       "a cut that reaches a depth reaches every depth before it")
        if depth <= len(curve) and curve[depth - 1] > share:
            raise _bad(f"{where}'curve' at depth {depth} is {curve[depth - 1]!r}, above 'confidence_reach' there "
                       f"({share!r}): a streak never passes its anchor's confidence cut")


def _check_intervals(intervals: Any, tasks: dict, max_taus: dict[str, int], added: list[str] = ()) -> None:
    """`intervals` is {"confidence", "resamples", "seed", "mean", "tasks"} over the report's own tasks and
    methods (`max_taus`: method -> its largest tau), each interval [lo, hi] with 1 <= lo <= hi <= max_tau; the
    aggregates `added` to a report of before (`_upgrade`) have none yet."""
    methods = list(max_taus)
    if not isinstance(intervals, dict) or set(intervals) != {"confidence", "resamples", "seed", "mean", "tasks"}:
        raise _bad("'intervals' is not an object of 'confidence', 'resamples', 'seed', 'mean' and 'tasks'")
    _check_number(intervals["confidence"], "'intervals.confidence'", 0, 1)
    _check_number(intervals["resamples"], "'intervals.resamples'", 1, integer=True)
    _check_number(intervals["seed"], "'intervals.seed'", 0, integer=True)
    where_all = {"mean": intervals["mean"]}
    if not isinstance(intervals["tasks"], dict) or sorted(intervals["tasks"]) != sorted(tasks):
        raise _bad(f"'intervals.tasks' does not hold the report's tasks {sorted(tasks)}")
    where_all.update({f"tasks.{task}": per_method for task, per_method in intervals["tasks"].items()})
    for where, per_method in where_all.items():
        if not isinstance(per_method, dict) or sorted(per_method) != sorted(methods):
            raise _bad(f"'intervals.{where}' does not hold the report's methods {methods}")
        for method, per_agg in per_method.items():
            if not isinstance(per_agg, dict) or sorted(per_agg) != sorted(set(AGGREGATES) - set(added)):
                raise _bad(f"'intervals.{where}.{method}' is not an object of {list(AGGREGATES)}")
            for agg, pair in per_agg.items():
                name = f"'intervals.{where}.{method}.{agg}'"
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _bad(f"{name} is not a pair [lo, hi]")
                for end, value in zip(("lo", "hi"), pair):
                    _check_number(value, f"{name} {end}", 1, max_taus[method])
                if pair[0] > pair[1]:
                    raise _bad(f"{name} is {pair}: its low end is above its high end")


@dataclass
class Results:
    """What a results.jsonl holds: reports and error lines in file order, and the lines
    that are neither (each as "line N: why")."""

    reports: list[EvalReport] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def parse_record(raw: Any) -> EvalReport | dict:
    """One results.jsonl object: an EvalReport with a step, or an error line {"step", "error", ...}."""
    if isinstance(raw, dict) and "error" in raw:
        if not isinstance(raw["error"], str) or isinstance(raw.get("step"), bool) or not isinstance(raw.get("step"), int):
            raise ValueError("an error line needs an integer 'step' and an 'error' string")
        return raw
    report = EvalReport.from_dict(raw)
    if report.step is None:
        raise ValueError("a report in results.jsonl needs a 'step'")
    return report


def read_results(path: str | Path) -> Results:
    """Every line of a results.jsonl; a torn or foreign line is skipped and named, never fatal."""
    results = Results()
    path = Path(path)
    if not path.is_file():
        return results
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            record = parse_record(json.loads(line))
        except (ValueError, TypeError, RecursionError) as e:
            results.skipped.append(f"line {number}: {e}")
            continue
        (results.reports if isinstance(record, EvalReport) else results.errors).append(record)
    return results


def family_title(report: EvalReport) -> str:
    """How people write the family of the report's drafter ("DFlash 2"); DFlash for a report of before families."""
    from ..model.families import FAMILIES  # the registry alone: no torch

    name = (report.family or {}).get("name", "dflash")
    return FAMILIES[name].title if name in FAMILIES else name

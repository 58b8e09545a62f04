"""Predicted speed-up: what a report's tau buys on a device whose costs were measured (`scoring.costs.Costs`).

One speculative round at context length L drafts a block, verifies n tokens in one target forward and does
its bookkeeping; in that time plain decoding makes T_round / T_target(1, L) tokens. So a method whose rounds
accept tau tokens on average is predicted to decode

    speed-up = tau x T_target(1, L) / (T_draft(B) + T_target(n, L) + overhead)

times as fast as plain decoding, with n the tokens verified: the block's proposals + 1 for a chain
(`vanilla`: the block size for DFlash), the tree's nodes + 1 for `ddtree@N` (N + 1), and k per depth for
`top@k` (k x proposals + 1: the tree holding the top k at every depth of the path, an upper bound as top@k
itself is). The cost factor T_target(1, L) / T_round is a constant of the method and the device, so the
speed-up's 95% interval is tau's times it, and ours against the baseline's is the paired tau ratio times the
ratio of the two cost factors (1 where the two drafters have the same shape; `Costs.baseline_draft` otherwise).

L is each task's mean context over its scored rounds (`task_contexts`, from the cache's manifest), or, without
a cache, the middle length the costs were measured at; the run-level value is the run-level tau times the cost
factor at the tasks' mean context. What it does not model: batching beyond the profiled batch size, the
engine's scheduling, and how the KV cache's length grows inside a task beyond its mean.

Keys (the engine logs them beside the tau keys; `speedup_metrics`):
    PREFIX/speedup/METHOD/AGG/TASK              ours (TASK a task or `mean`)
    PREFIX/speedup/baseline/METHOD/AGG/TASK     the baseline's, on the same costs
    PREFIX/speedup/ratio/METHOD/AGG/TASK        ours / the baseline's, paired
    .../mean_lo, .../mean_hi                    the 95% interval of each run-level one
"""

from __future__ import annotations

import functools
import statistics
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .costs import Costs, CostsError
from .intervals import MIN_TASKS, Comparison, Estimate, _resampled, paired_comparison
from .methods import Method
from .report import EvalReport


@dataclass(frozen=True)
class Shape:
    """What one round of a method does: the block size drafted, the tokens verified, a tree or a chain."""

    block: int
    verified: int
    tree: bool


def method_shape(report: EvalReport, method: str | Method) -> Shape:
    method = Method.parse(method)
    return shape_of(method, report.block(method), report.max_tau(method) - 1)


def shape_of(method: str | Method, block: int, proposals: int) -> Shape:
    """The round of `method` at block size `block` whose drafter proposes `proposals` tokens per block."""
    method = Method.parse(method)
    if method.kind == "vanilla":
        return Shape(block, proposals + 1, False)
    if method.kind == "ddtree":
        return Shape(block, method.n + 1, True)
    return Shape(block, method.n * proposals + 1, True)


def round_seconds(costs: Costs, shape: Shape, context: float, baseline: bool = False) -> float:
    """T_draft(B) + T_target(n, L) + overhead: one round of `shape` at context length `context`."""
    return (costs.draft_round(shape.block, baseline) + costs.target_forward(shape.verified, context)
            + costs.round_overhead(shape.block, shape.verified, shape.tree))


def cost_factor(costs: Costs, report: EvalReport, method: str | Method, context: float, baseline: bool = False) -> float:
    """T_target(1, L) / T_round: the plain-decoding tokens one round's time buys; speed-up = tau x this."""
    return costs.target_forward(1, context) / round_seconds(costs, method_shape(report, method), context, baseline)


def task_contexts(cache: str | object, report: EvalReport) -> dict[str, float]:
    """Each task's mean context length over its scored rounds: its prompt and half the completion scored (the
    report's `window`, else the whole completion), from the cache folder's manifest."""
    return dict(_task_contexts(str(cache), tuple(report.tasks), report.scoring.get("window")))


@functools.lru_cache(maxsize=16)
def _task_contexts(cache: str, tasks: tuple[str, ...], window: int | None) -> dict[str, float]:
    from ..cache.format import read_manifest

    entries = {t["name"]: t for t in read_manifest(cache)["tasks"]}
    out = {}
    for task in tasks:
        if task not in entries:
            raise CostsError(f"the cache holds no task {task!r} of the report: give the cache it was scored on")
        prompt, total = entries[task]["prompt_len"], entries[task]["num_tokens"]
        completion = total - prompt if window is None else min(window, total - prompt)
        out[task] = prompt + completion / 2
    return out


def _contexts(costs: Costs, report: EvalReport, contexts: Mapping[str, float] | float | None) -> dict[str, float]:
    """Per task and "mean": the context length its speed-up is predicted at."""
    if contexts is None:
        contexts = float(statistics.median_low(costs.contexts))
    if isinstance(contexts, (int, float)):
        per = {task: float(contexts) for task in report.tasks}
    else:
        missing = [t for t in report.tasks if t not in contexts]
        if missing:
            raise CostsError(f"no context length for the tasks {missing}")
        per = {task: float(contexts[task]) for task in report.tasks}
    return {**per, "mean": sum(per.values()) / len(per)}


@dataclass(frozen=True)
class SpeedUp:
    """The predicted speed-up of one method, aggregate and task ("mean": the run level): ours, the baseline's
    and the paired ratio, each with its 95% interval (None: no baseline, or a report without intervals)."""

    ours: Estimate
    baseline: Estimate | None = None
    ratio: Estimate | None = None


def _scaled(value: float, interval: tuple[float, float] | None, factor: float) -> Estimate:
    lo, hi = interval if interval is not None else (value, value)
    return Estimate(value * factor, lo * factor, hi * factor)


def speedup_values(report: EvalReport, baseline: EvalReport | None, costs: Costs,
                   contexts: Mapping[str, float] | float | None = None,
                   comparisons: dict[str, dict[str, Comparison]] | None = None) -> dict[tuple[str, str, str], SpeedUp]:
    """{(METHOD, AGG, TASK): SpeedUp} for every method and aggregate of `report` and every task and "mean".
    `contexts`: each task's context length (`task_contexts`), one for all, or None (the middle one measured);
    `comparisons`: the paired comparison with the baseline, where already made (else made here)."""
    from .aggregates import AGGREGATES

    where = _contexts(costs, report, contexts)
    paired = baseline is not None and baseline.intervals is not None and report.intervals is not None
    if paired and comparisons is None:
        comparisons = paired_comparison(report, baseline)
    out = {}
    for method in report.methods:
        ours_factor = {task: cost_factor(costs, report, method, L) for task, L in where.items()}
        theirs = baseline is not None and method in baseline.methods
        base_factor = {task: cost_factor(costs, baseline, method, L, baseline=True) for task, L in where.items()} \
            if theirs else {}
        for aggregate in AGGREGATES:
            monitor = f"{method}/{aggregate}"
            for task in where:
                interval = report.interval(monitor, task) if report.intervals is not None else None
                ours = _scaled(report.value(monitor, task), interval, ours_factor[task])
                base = ratio = None
                if theirs:
                    base_interval = baseline.interval(monitor, task) if baseline.intervals is not None else None
                    base = _scaled(baseline.value(monitor, task), base_interval, base_factor[task])
                    if paired:
                        r = comparisons[monitor][task].ratio
                        scale = ours_factor[task] / base_factor[task]
                        ratio = Estimate(r.value * scale, r.lo * scale, r.hi * scale)
                    else:
                        ratio = Estimate(*(ours.value / base.value,) * 3)
                out[(method, aggregate, task)] = SpeedUp(ours, base, ratio)
    return out


def speedup_metrics(prefix: str, values: dict[tuple[str, str, str], SpeedUp]) -> dict[str, float]:
    """The logged keys (the module's doc) of `speedup_values`: every task's value and the run level's interval."""
    out = {}
    for (method, aggregate, task), found in values.items():
        for kind, estimate in (("speedup", found.ours), ("speedup/baseline", found.baseline),
                               ("speedup/ratio", found.ratio)):
            if estimate is None:
                continue
            key = f"{prefix}/{kind}/{method}/{aggregate}/{task}"
            out[key] = estimate.value
            if task == "mean":
                out[f"{key}_lo"], out[f"{key}_hi"] = estimate.lo, estimate.hi
    return out


# ---------------------------------------------------------------------- the fastest configuration
SERVABLE_KINDS = ("vanilla", "ddtree")
"""The methods the fastest is chosen among: top@k is an upper bound, not a configuration an engine serves."""


@dataclass(frozen=True)
class Fastest:
    """The fastest method and the runner-up (None: a single candidate), and the fastest's speed-up over the
    runner-up's, paired on the same anchors (None where they were scored on other anchors)."""

    method: str
    speedup: Estimate
    runner_up: str | None = None
    runner_up_speedup: Estimate | None = None
    over_runner_up: Estimate | None = None
    tasks: int = 0

    @property
    def verdict(self) -> str:
        """"distinguishable" (the ratio's interval above 1) or "not distinguishable"; "too few tasks to tell" under
        MIN_TASKS tasks, "no paired interval to tell" for a report without intervals or two methods scored on other
        anchors."""
        if self.runner_up is None:
            return "the only one scored"
        if self.tasks < MIN_TASKS or self.over_runner_up is None:
            return "too few tasks to tell" if self.tasks < MIN_TASKS else "no paired interval to tell"
        return "distinguishable" if self.over_runner_up.lo > 1 else "not distinguishable"


def _named(report: EvalReport, method: str) -> str:
    """The method with its block size always said: `ddtree@8:b16`."""
    m = Method.parse(method)
    return str(m.at(report.block(m)))


def fastest(report: EvalReport, costs: Costs, aggregate: str = "live",
            contexts: Mapping[str, float] | float | None = None,
            values: dict[tuple[str, str, str], SpeedUp] | None = None) -> Fastest:
    """Over the servable methods (vanilla and DDTree, every block size and attention rule scored), the one with
    the highest predicted run-level speed-up, and whether it is distinguishable from the runner-up: the ratio of
    their speed-ups, resampled on the same anchors and tasks, has a 95% interval above 1."""
    values = values if values is not None else speedup_values(report, None, costs, contexts)
    candidates = sorted((m for m in report.methods if Method.parse(m).kind in SERVABLE_KINDS),
                        key=lambda m: -values[(m, aggregate, "mean")].ours.value)
    if not candidates:
        raise CostsError(f"the report scores no method an engine serves (vanilla or ddtree@N): {report.methods}")
    best = candidates[0]
    first = values[(best, aggregate, "mean")].ours
    if len(candidates) == 1:
        return Fastest(_named(report, best), first, tasks=len(report.tasks))
    second = candidates[1]
    other = values[(second, aggregate, "mean")].ours
    over = None
    if report.intervals is not None:
        where = _contexts(costs, report, contexts)["mean"]
        scale = cost_factor(costs, report, best, where) / cost_factor(costs, report, second, where)
        over = _paired_ratio(report, best, second, aggregate, scale)
    return Fastest(_named(report, best), first, _named(report, second), other, over, len(report.tasks))


def _paired_ratio(report: EvalReport, first: str, second: str, aggregate: str, scale: float) -> Estimate | None:
    """first's run-level mean over second's, times `scale`, with the interval of the two resampled alike (the
    same tasks and stretches of text; `intervals.Resampled`); None when a task scored them on other anchors."""
    tasks = list(report.tasks)
    if any(report.tasks[t][first].get("anchors") != report.tasks[t][second].get("anchors") for t in tasks):
        return None
    resampled = _resampled([(report, first), (report, second)], tasks, 0, 1000)[aggregate]
    mean = resampled.means.mean(axis=1)
    gradients = np.array([[1 / mean[1], -mean[0] / mean[1] ** 2]])
    top = float(max(report.max_tau(first), report.max_tau(second)))
    found = resampled.run_level(lambda means: (means[0] / means[1])[None], gradients, np.array([[1 / top, top]]))[0]
    return Estimate(found.value * scale, found.lo * scale, found.hi * scale)


def fastest_line(report: EvalReport, costs: Costs, aggregate: str = "live",
                 contexts: Mapping[str, float] | float | None = None,
                 values: dict[tuple[str, str, str], SpeedUp] | None = None) -> str:
    """"fastest: ddtree@6:b8, 2.41× [2.30, 2.52] (ddtree@8:b8 2.38×; 1.01 [0.99, 1.03] of it, not
    distinguishable)": the fastest servable method's predicted speed-up and its interval, against the runner-up."""
    found = fastest(report, costs, aggregate, contexts, values)
    s = found.speedup
    line = f"fastest: {found.method}, {s.value:.2f}× [{s.lo:.2f}, {s.hi:.2f}]"
    if found.runner_up is None:
        return line + " (the only servable method scored)"
    ratio = "" if found.over_runner_up is None else (
        f"; {found.over_runner_up.value:.2f} [{found.over_runner_up.lo:.2f}, {found.over_runner_up.hi:.2f}] of it")
    return line + f" ({found.runner_up} {found.runner_up_speedup.value:.2f}×{ratio}, {found.verdict})"


def speedup_table(report: EvalReport, baseline: EvalReport | None, costs: Costs, aggregate: str = "live",
                  contexts: Mapping[str, float] | float | None = None,
                  values: dict[tuple[str, str, str], SpeedUp] | None = None) -> str:
    """The run-level predicted speed-up of every method, ours (and the baseline's, and the paired ratio), one
    row each, then the fastest line."""
    values = values if values is not None else speedup_values(report, baseline, costs, contexts)
    where = _contexts(costs, report, contexts)["mean"]
    head = (f"predicted speed-up ({aggregate}) on {costs.device}, {costs.dtype}, batch {costs.batch_size}, "
            f"at context {where:.0f}:")
    rows = [head]
    width = max(len(m) for m in report.methods)
    for method in report.methods:
        found = values[(method, aggregate, "mean")]
        row = f"  {method:<{width}}  {found.ours.value:.2f}× [{found.ours.lo:.2f}, {found.ours.hi:.2f}]"
        if found.baseline is not None:
            b, r = found.baseline, found.ratio
            row += f" | baseline {b.value:.2f}× [{b.lo:.2f}, {b.hi:.2f}] | ratio {r.value:.2f} [{r.lo:.2f}, {r.hi:.2f}]"
        rows.append(row)
    rows.append(fastest_line(report, costs, aggregate, contexts, values))
    return "\n".join(rows)


# ---------------------------------------------------------------------- the costs a config names
def target_shape(target: str | object) -> dict[str, int]:
    """{"hidden_size", "vocab_size", "num_layers"} of a target folder, from its config.json (no torch); a key
    the file does not hold (a target folder of only the head's tensors) is left out, and so not checked."""
    import json

    raw = json.loads((Path(target) / "config.json").read_text())
    raw = raw.get("text_config", raw)
    said = {"hidden_size": "hidden_size", "vocab_size": "vocab_size", "num_layers": "num_hidden_layers"}
    return {ours: raw[theirs] for ours, theirs in said.items() if theirs in raw}  # what the file says


def drafter_shape(config) -> dict:
    """{"family", "hidden_size", "num_layers"} of a drafter config (`model.DrafterConfig`)."""
    return {"family": config.family, "hidden_size": config.hidden_size, "num_layers": config.num_hidden_layers}


def drafter_folder_shape(folder: str | object) -> dict | None:
    """`drafter_shape` of a drafter folder, from its config.json without torch (the family from the registry);
    None where the file does not say it plainly (a layout whose shape is nested, a config no family claims)."""
    import json

    from ..model.families import identify

    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
        return {"family": identify(raw).name, "hidden_size": raw["hidden_size"],
                "num_layers": raw["num_hidden_layers"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def config_costs(scoring, target: str | object | None = None, drafter_config=None,
                 device_type: str | None = None, drafter_shape_given: dict | None = None) -> tuple[Costs, list[str]]:
    """(the costs `scoring.costs` names, the mismatches let through by `scoring.force_costs`): CostsError when the
    file is not a costs file, or, unless forced, in one line naming what it was measured on that differs from the
    scoring's device kind (`device_type`, default the config's device), dtype, the `target` folder's shape or the
    drafter's (`drafter_config`, or its `drafter_shape_given`; each checked where given)."""
    from .costs import check_costs_fit

    costs = Costs.load(scoring.costs)
    if device_type is None and scoring.device != "auto":
        device_type = scoring.device.split(":")[0]
    used = {"device_type": device_type, "dtype": scoring.dtype,
            "target": None if target is None else target_shape(target),
            "drafter": drafter_shape(drafter_config) if drafter_config is not None else drafter_shape_given}
    return costs, check_costs_fit(costs, scoring.force_costs, **used)


# ---------------------------------------------------------------------- a run's reports (the engine's)
def coverage_problems(costs: Costs, shapes: Mapping[str, Shape]) -> list[str]:
    """One line naming each scored method whose round the costs do not hold (a verify forward of more tokens
    than measured, a block size not profiled, a tree's overhead not measured), [] when they hold every one:
    `shapes` is {METHOD: Shape}."""
    lines = []
    for method, shape in shapes.items():
        try:
            round_seconds(costs, shape, float(costs.contexts[0]))
        except CostsError as e:
            lines.append(f"{method}: {e}")
    return ["the costs do not hold every scored round: " + "; ".join(lines)] if lines else []


@functools.lru_cache(maxsize=8)
def _costs_file(path: str, stamp: int | None) -> Costs:
    return Costs.load(path)


def report_costs(report: EvalReport) -> Costs | None:
    """The costs the report's scoring names (`scoring.costs`; None: no costs), read once per file (again
    when the file is rewritten)."""
    path = report.scoring.get("costs")
    if not path:
        return None
    try:
        stamp = Path(path).stat().st_mtime_ns
    except OSError:
        stamp = None
    return _costs_file(str(path), stamp)


def report_contexts(report: EvalReport) -> dict[str, float] | None:
    """`task_contexts` of the cache the report was scored on, read once per cache; None where that folder is
    not here (a report scored on another host): the costs' middle length."""
    cache = report.cache.get("path")
    if not cache or not Path(cache).is_dir():
        return None
    return task_contexts(cache, report)


def report_speedups(report: EvalReport, baseline: EvalReport | None,
                    versus: dict | None) -> dict[tuple[str, str, str], SpeedUp] | None:
    """`speedup_values` of a report on the costs its scoring names (None: it names none), each task at its mean
    context in its cache; `versus`, the paired comparison with the baseline the runner made already, is never
    made here: without it, a baseline both of whose reports hold intervals (scored on other anchors) is left
    out. None too where the costs do not hold a scored method's round (preflight refuses that; the fastest
    line says it), or a costs file gone since the run started."""
    try:
        costs = report_costs(report)
        if costs is None:
            return None
        paired = baseline is not None and baseline.intervals is not None and report.intervals is not None
        if paired and versus is None:
            baseline = None
        return speedup_values(report, baseline, costs, report_contexts(report), comparisons=versus)
    except (CostsError, KeyError):
        return None


def speedup_record(values: dict[tuple[str, str, str], SpeedUp], verdicts: Mapping[str, str] | None = None,
                   digits: int | None = 6) -> dict:
    """The run-level speed-ups as results.jsonl keeps them beside `versus_baseline`:
    {METHOD/AGG: {"ours": [value, lo, hi], "baseline": [...], "ratio": [...], "verdict": ...}} (the baseline's
    and the ratio only with a baseline; the verdict, the tau comparison's, where one was made)."""
    out = {}
    for (method, aggregate, task), found in values.items():
        if task != "mean":
            continue
        monitor = f"{method}/{aggregate}"
        entry = {}
        for kind, e in (("ours", found.ours), ("baseline", found.baseline), ("ratio", found.ratio)):
            if e is not None:
                entry[kind] = [x if digits is None else round(x, digits) for x in (e.value, e.lo, e.hi)]
        if verdicts and monitor in verdicts:
            entry["verdict"] = verdicts[monitor]
        out[monitor] = entry
    return out


_FASTEST: OrderedDict[tuple, str] = OrderedDict()  # the latest reports' fastest lines (a bootstrap each)


def report_fastest_line(report: EvalReport, aggregate: str = "live") -> str | None:
    """`fastest_line` of a report on the costs its scoring names (None: none named), made once per report:
    the runner makes it off the training thread (`results_line.prepare`), the summary line reads it back.
    A line saying why where the costs do not hold a method's round."""
    if not report.scoring.get("costs"):
        return None
    key = (report.snapshot_id, report.step, report.created, report.scoring.get("costs"), aggregate)
    if key not in _FASTEST:
        try:
            _FASTEST[key] = fastest_line(report, report_costs(report), aggregate, report_contexts(report))
        except CostsError as e:  # also a costs file gone since the run started
            _FASTEST[key] = f"fastest: not predicted: {e}"
        while len(_FASTEST) > 32:
            _FASTEST.popitem(last=False)
    return _FASTEST[key]

"""The predicted speed-up against the measured one, on one machine in one run (`benchmarks/bench_speedup.py`).

A drafter is scored on a cache (every method at each block size; the live schedule over the whole completion),
the device is profiled (`timing.profile_costs`, at the cache's context lengths) before each pass (their mean is
the costs: a busy machine weighs on the profile and the decoding alike), and in each pass every cached prompt is
decoded, timed, with plain greedy decoding and with each method at each block size (`decode`); per method, the
measured speed-up is the mean over tasks of plain seconds / speculative seconds (each a median over `passes`),
as the report's mean is over tasks, and the predicted one is `scoring.speed.speedup_values`' run-level value.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..cache.extract import load_target, stop_token_ids
from ..model import TargetHead
from ..scoring.config import ScoringConfig
from ..scoring.methods import Method
from ..scoring.scorer import score_drafter
from ..scoring.speed import speedup_values, task_contexts
from ..scoring.costs import Costs
from .decode import plain_decode, speculative_decode
from .rounds import Speculator
from .timing import CLOCKS, profile_costs


@dataclass(frozen=True)
class Checked:
    """One method at one block size: tau (the report's live mean, and the decoder's), the predicted speed-up with
    its interval, and the measured one."""

    method: str
    tau_report: float
    tau_decoded: float
    predicted: float
    predicted_lo: float
    predicted_hi: float
    measured: float

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.measured / self.predicted


def mean_costs(profiles: Sequence[Costs]) -> Costs:
    """The mean of profiles of the same pieces: each time the mean of theirs."""
    first = profiles[0]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    over = lambda get: mean([get(p) for p in profiles])  # noqa: E731
    overhead = {"chain": {b: over(lambda p, b=b: p.overhead["chain"][b]) for b in first.overhead["chain"]},
                "tree": {b: {n: over(lambda p, b=b, n=n: p.overhead["tree"][b][n]) for n in per}
                         for b, per in first.overhead["tree"].items()}}
    return replace(first, verify={L: [over(lambda p, L=L, i=i: p.verify[L][i]) for i in range(len(ts))]
                                  for L, ts in first.verify.items()},
                   draft={b: over(lambda p, b=b: p.draft[b]) for b in first.draft}, overhead=overhead,
                   extra={**first.extra, "profiles": len(profiles)})


def context_lengths(cache, tasks: Sequence[str], points: int = 3) -> list[int]:
    """`points` lengths spanning the contexts the tasks' rounds see: the shortest prompt to the longest text."""
    lo = min(cache.entry(t)["prompt_len"] for t in tasks)
    hi = max(cache.entry(t)["num_tokens"] for t in tasks)
    return sorted({round(lo + (hi - lo) * i / max(points - 1, 1)) for i in range(points)})


def check_speedups(target, drafter, cache, *, ddtree_budgets: Sequence[int] = (4, 8), block_sizes: Sequence[int] = (8, 4),
                   tasks: Sequence[str] | None = None, passes: int = 3, repeats: int = 10, clock: str = "wall"):
    """(the rows, the costs, the report) of `drafter` (a DFlash drafter, on the CPU in float32) with the target
    folder `target` on `cache` (a HiddenStateCache of that target's greedy answers), methods vanilla and
    ddtree@N for N in `ddtree_budgets`, at each block size of `block_sizes` (the first the report's own), every
    second counted by `clock` (`timing.CLOCKS`: "wall", or "cpu", this thread's CPU time)."""
    now = CLOCKS[clock]
    names = list(tasks or cache.task_names)
    config = ScoringConfig(ddtree_budgets=list(ddtree_budgets), block_size=block_sizes[0],
                           block_sizes=list(block_sizes[1:]), max_rounds=100_000, device="cpu", tasks=names)
    report = score_drafter(drafter, cache, TargetHead.from_pretrained(target), config)
    model, tokenizer = load_target(target, dtype=torch.float32)
    eos, _ = stop_token_ids(model, tokenizer)
    spec = Speculator(model, drafter)
    profiles = []
    configs = [(m, Method.parse(m).block or block_sizes[0], Method.parse(m).n) for m in report.methods]
    seconds = {(t, m): [] for t in names for m in ["plain", *report.methods]}
    taus = {}
    for _ in range(passes):  # a profile before each pass: what else the machine does weighs on both alike
        profiles.append(profile_costs(model, drafter, block_sizes=block_sizes, ddtree_budgets=ddtree_budgets,
                                      contexts=context_lengths(cache, names), repeats=repeats, clock=clock))
        for t in names:
            task = cache.task(t)
            prompt, limit = task.input_ids[: task.prompt_len].tolist(), task.num_tokens
            plain = plain_decode(spec, prompt, limit, eos, now)
            seconds[(t, "plain")].append(plain.seconds)
            for method, block, budget in configs:
                found = speculative_decode(spec, prompt, limit, eos, block, budget, now)
                if found.tokens != plain.tokens:
                    raise AssertionError(f"{method} decoded another text than plain greedy decoding on {t}")
                seconds[(t, method)].append(found.seconds)
                taus[(t, method)] = sum(found.taus) / len(found.taus)
    costs = mean_costs(profiles)
    predicted = speedup_values(report, None, costs, task_contexts(cache.path, report))
    rows = []
    for method in report.methods:
        speedups = [statistics.median(seconds[(t, "plain")]) / statistics.median(seconds[(t, method)]) for t in names]
        p = predicted[(method, "live", "mean")].ours
        rows.append(Checked(str(Method.parse(method).at(report.block(method))), report.value(f"{method}/live"),
                            statistics.mean(taus[(t, method)] for t in names), p.value, p.lo, p.hi,
                            statistics.mean(speedups)))
    return rows, costs, report

"""What a report's numbers depend on besides the drafter's weights, and the one check that
a report stands where a run stands.

A run's reports, its baseline and every report taken for it (from a watcher, from a
killed run's folder, from a saved JSON) share one basis: the cache (its fingerprint),
the target's head (its fingerprint, when both name one), the block size, the tasks, the
scoring fields that change numbers (window, max_rounds, dtype, the attention rule the
drafters were scored under, and the confidence threshold a block was cut by), the settings a sampled
cache's answers were drawn at with the draft rule and the acceptance coins' seed (`sampling`; None for
a greedy cache, where neither changes a number), and the library's definitions (`SCORER_VERSION`); and
each carries every method the run scores. A report on another basis is an error for that report, never
a number; a resume on another basis starts a new run folder.

The drafters themselves may differ (a DFlash baseline against a DFlash 2 drafter in training: each is
scored as its family drafts, on the same anchors); `drafter_difference` says how, in one note.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .config import ScoringConfig
from .report import SCORER_VERSION, EvalReport, family_title

LABELS = {"cache": "cache", "target": "target head", "block_size": "block size", "tasks": "tasks",
          "window": "window", "max_rounds": "max_rounds", "dtype": "dtype", "attention": "attention rule",
          "confidence_threshold": "confidence threshold", "sampling": "served sampling", "scorer": "scorer version"}


def served_sampling(sampling: dict | None, draft_rule: str = "greedy", coin_seed: int = 0,
                    estimators: str = "coin draws") -> str | None:
    """What a report's numbers stand for at T > 0, as one line: the cache's sampling settings, the draft rule,
    the coins' seed and the estimators (`EvalReport.estimators`); None for a greedy cache (`sampling` None)."""
    if sampling is None:
        return None
    return (f"temperature {sampling['temperature']:g}, top_p {sampling['top_p']:g}, top_k {sampling['top_k']}, "
            f"draft rule {draft_rule}, coin seed {coin_seed}, estimators {estimators}")


def run_estimators(config: ScoringConfig, cache) -> str:
    """The estimators `config` scores a sampled `cache` with, as `EvalReport.estimators` names them: conditional
    where every task scored keeps the served support (`scorer.conditional_scoring`), else coin draws."""
    kept = all("support" in cache.entry(name) for name in (config.tasks or cache.task_names))
    return "conditional" if kept and config.estimators == "conditional" and config.max_rounds is None else "coin draws"


@dataclass(frozen=True)
class Basis:
    cache: str | None  # the cache's fingerprint
    target: str | None  # the target head's fingerprint (None: not recorded)
    block_size: int | None  # None: not known yet (`watch`, before it has seen a drafter)
    tasks: tuple[str, ...]  # sorted
    window: int | None
    max_rounds: int | None
    dtype: str | None
    methods: tuple[str, ...]
    scorer: int | None = SCORER_VERSION  # the library's definitions (None: a report from before it was recorded)
    attention: str | None = "auto"  # ScoringConfig.attention (None: a report from before it was recorded)
    confidence_threshold: float | None = None  # ScoringConfig.confidence_threshold (None: the full block)
    sampling: str | None = None  # `served_sampling` (None: a greedy cache)

    @classmethod
    def of_run(cls, config: ScoringConfig, cache, block_size: int | None, target: str | None = None,
               target_window: int | None = None) -> Basis:
        """A run's basis: `config` scoring `cache` (a HiddenStateCache) at `block_size`, for the target of head
        fingerprint `target` and model-level window `target_window` (`ScoringConfig.methods_on`)."""
        sampling = None if cache.sampling is None else cache.sampling.to_dict()
        return cls(cache.fingerprint, target, block_size, tuple(sorted(config.tasks or cache.task_names)),
                   config.window, config.max_rounds, config.dtype, tuple(config.methods_on(target_window)),
                   attention=config.attention,
                   confidence_threshold=config.confidence_threshold,
                   sampling=served_sampling(sampling, config.draft_rule, config.coin_seed,
                                            run_estimators(config, cache) if sampling is not None else "coin draws"))

    @classmethod
    def of_report(cls, report: EvalReport) -> Basis:
        s = report.scoring
        return cls(report.cache.get("fingerprint"), report.cache.get("target"), report.block_size,
                   tuple(sorted(report.tasks)), s.get("window"), s.get("max_rounds"), s.get("dtype"),
                   tuple(report.methods), report.scorer_version, s.get("attention"), s.get("confidence_threshold"),
                   served_sampling(report.sampling, s.get("draft_rule", "greedy"), s.get("coin_seed", 0),
                                   report.estimators or "coin draws"))

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, raw: dict) -> Basis:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**{"scorer": None, "attention": None, **fields})  # recorded before these were: unknown

    def differences(self, other: Basis) -> list[str]:
        """Each field where `other` differs, as "name: other's value (this: ours)"; a target
        recorded on one side only is not a difference, nor is any block size when ours is not
        known yet (None), nor are methods `other` has beyond ours."""
        out = []
        for name, label in LABELS.items():
            ours, theirs = getattr(self, name), getattr(other, name)
            if (name == "target" and (ours is None or theirs is None)) or (name == "block_size" and ours is None):
                continue
            if ours != theirs:
                out.append(f"{label} {_show(name, theirs)} (this run: {_show(name, ours)})")
        missing = [m for m in self.methods if m not in other.methods]
        if missing:
            out.append(f"no {', '.join(missing)} (this run scores {', '.join(self.methods)})")
        return out

    def mismatches(self, report: EvalReport, what: str) -> list[str]:
        """Why `report` can not stand beside this run's numbers (empty: it can), naming `what`."""
        return [f"{what} was scored with {d}" for d in self.differences(Basis.of_report(report))]


def drafter_difference(ours: EvalReport, theirs: EvalReport, other: str = "the baseline") -> str | None:
    """One note of how the two reports' drafters differ, None when they do not: their families (or, of one
    family, the settings that differ: `EvalReport.family`), and how their layers attend inside the block when
    their kinds of layer differ (two architectures, or reports of before it was recorded; not the number of
    layers). Each is scored as it is served, on the same anchors, so the numbers compare; the note says what
    is compared. `other` names the second report ("the baseline")."""
    clauses = []
    title, their_title = family_title(ours), family_title(theirs)
    settings, their_settings = (ours.family or {}).get("settings"), (theirs.family or {}).get("settings")
    if title != their_title:
        clauses.append(f"are of two families (ours: {title}; {other}: {their_title})")
    elif settings is not None and their_settings is not None and settings != their_settings:
        differ = sorted(k for k in {*settings, *their_settings} if settings.get(k) != their_settings.get(k))
        show = lambda values: ", ".join(f"{k} {values.get(k)}" for k in differ)  # noqa: E731
        clauses.append(f"are {title} drafters of other settings (ours: {show(settings)}; {other}: "
                       f"{show(their_settings)})")
    kinds = lambda a: None if a is None else sorted(set(a))  # noqa: E731
    if kinds(ours.attention) != kinds(theirs.attention):
        show = lambda a: "unrecorded" if a is None else "; ".join(kinds(a))  # noqa: E731
        clauses.append(f"attend differently inside the block (ours: {show(ours.attention)}; {other}: "
                       f"{show(theirs.attention)})")
    if not clauses:
        return None
    return (f"the drafters {' and '.join(clauses)}: each is scored as it is served, but they are not one "
            "architecture")


def _show(name: str, value) -> str:
    if name == "scorer" and value is None:
        return "unrecorded (a report from before versions were recorded)"
    if name == "sampling" and value is None:
        return "none (a greedy cache)"
    return ", ".join(value) if isinstance(value, tuple) else str(value)

"""The evaluator: everything needed to turn drafter weights into an EvalReport.

It lives wherever scoring runs (a thread of the training process, a spawned worker,
`dflash-callbacks watch` on another host) and is built from plain arguments, so each of
those can build its own. The baseline is scored once per (baseline weights, cache,
scoring config) and its report kept in `baseline_cache_dir`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache.format import HiddenStateCache
from ..model import DFlashDrafter, DrafterConfig, TargetHead, load_drafter
from ..model.io import safetensors_files
from ..scoring.config import ScoringConfig
from ..scoring.report import EvalReport
from ..scoring.scorer import score_drafter


def default_baseline_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "dflash_callbacks" / "baselines"


def weights_fingerprint(folder: str | os.PathLike) -> str:
    """sha256 over config.json and every weight file of a drafter folder (full contents)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for file in [folder / "config.json", *safetensors_files(folder)]:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def non_finite_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]


class NonFiniteWeightsError(ValueError):
    """The snapshot holds NaN or Inf weights: nothing to score."""


@dataclass
class EvaluatorSpec:
    """Plain arguments an Evaluator is built from (picklable, for a spawned worker)."""

    cache: str
    target: str
    baseline: str | None
    scoring: dict
    baseline_cache_dir: str | None = None


class Evaluator:
    def __init__(self, spec: EvaluatorSpec):
        self.spec = spec
        self.config = ScoringConfig(**spec.scoring)
        self.cache = HiddenStateCache(spec.cache)
        self.head = TargetHead.from_pretrained(spec.target)
        self._baseline: EvalReport | None = None

    def score_state(self, config: DrafterConfig, state: dict[str, torch.Tensor], step: int, name: str) -> EvalReport:
        bad = non_finite_tensors(state)
        if bad:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise NonFiniteWeightsError(f"snapshot at step {step} holds NaN or Inf weights in {shown}; not scored")
        drafter = DFlashDrafter.from_state_dict(config, state)
        return self.score_drafter(drafter, step, name)

    def score_folder(self, folder: str | os.PathLike, step: int | None = None) -> EvalReport:
        drafter = load_drafter(folder)
        bad = non_finite_tensors(drafter.state_dict())
        if bad:
            raise NonFiniteWeightsError(f"{folder} holds NaN or Inf weights in {', '.join(bad[:5])}; not scored")
        return self.score_drafter(drafter, step, str(folder))

    def score_drafter(self, drafter: DFlashDrafter, step: int | None, name: str) -> EvalReport:
        report = score_drafter(drafter, self.cache, self.head, self.config, step=step, name=name)
        bad = [m for m, v in report.mean.items() if not all(math.isfinite(x) for x in v.values())]
        if bad:
            raise ValueError(f"scoring step {step} gave non-finite numbers for {bad}")
        return report

    def baseline(self) -> EvalReport | None:
        """The baseline's report: from a saved report JSON, from the on-disk cache of
        earlier runs, or scored now (and cached)."""
        if self._baseline is not None or self.spec.baseline is None:
            return self._baseline
        source = Path(self.spec.baseline)
        if source.is_file():
            report = EvalReport.load(source)
        else:
            key = {
                "weights": weights_fingerprint(source),
                "cache": self.cache.fingerprint,
                "scoring": self.config.fingerprint_fields(),
            }
            digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
            cache_dir = Path(self.spec.baseline_cache_dir or default_baseline_cache_dir())
            cached = cache_dir / f"baseline-{digest}.json"
            if cached.is_file():
                report = EvalReport.load(cached)
            else:
                report = self.score_folder(source)
                report.extra["baseline_key"] = key
                cache_dir.mkdir(parents=True, exist_ok=True)
                report.to_json(cached)
        problems = comparable_to_cache(report, self)
        if problems:
            raise ValueError(f"baseline {source} can not be compared: " + "; ".join(problems))
        self._baseline = report
        return report


def comparable_to_cache(report: EvalReport, evaluator: Evaluator) -> list[str]:
    """A saved baseline report must come from the same cache and block size we score."""
    problems = []
    if report.cache.get("fingerprint") != evaluator.cache.fingerprint:
        problems.append(
            f"it was scored on cache {report.cache.get('fingerprint')}, this run scores {evaluator.cache.fingerprint}"
        )
    block = evaluator.config.block_size
    if block is not None and report.block_size != block:
        problems.append(f"it was scored at block size {report.block_size}, this run scores {block}")
    return problems


__all__ = ["Evaluator", "EvaluatorSpec", "NonFiniteWeightsError", "weights_fingerprint"]

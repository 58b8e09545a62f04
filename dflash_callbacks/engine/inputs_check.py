"""Before training, every rank: the drafter, cache, target, scoring config, device, baseline and stops fit
together (`check_inputs`: every problem at once, or PreflightError), and what the run then stands on
(`Checked`). No state of the engine's is written here: the engine keeps what this returns."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..model import DrafterConfig
from ..scoring.basis import Basis
from ..scoring.service import PreflightError, ServiceSpec, preflight
from ..settings import EvalSettings
from .host import Host
from .stop import StopPolicy


@dataclass(frozen=True)
class Checked:
    """What a checked run stands on: its settings (the device pinned), the scoring service's spec, the basis
    of every report, the drafter's config and tensor shapes, and (block -> the most tau there, the run's
    block) for the stops' thresholds."""

    settings: EvalSettings
    spec: ServiceSpec
    basis: Basis
    config: DrafterConfig
    shapes: dict[str, tuple[int, ...]]
    most_tau: tuple[Callable[[int], int], int]


def check_inputs(settings: EvalSettings, names: Mapping[str, str], policies: list[StopPolicy], host: Host,
                 drafter: nn.Module | None, config: DrafterConfig, max_steps: int | None,
                 shapes: Mapping[str, tuple[int, ...]] | None) -> Checked:
    """Every input checked (see the module doc); without a live drafter (a watcher of checkpoints), `shapes`
    gives its tensors' shapes. `names`: the adapter's own spelling of a setting, for messages."""
    settings = _pin_device(settings, drafter)
    spec = ServiceSpec(str(settings.cache), str(settings.target),
                       None if settings.baseline is None else str(settings.baseline), settings.scoring,
                       None if settings.baseline_cache_dir is None else str(settings.baseline_cache_dir))
    shapes = {k: tuple(v) for k, v in (shapes or {k: v.shape for k, v in drafter.state_dict().items()}).items()}
    reach = (functools.partial(most_tau, drafter), settings.scoring.block_size or config.block_size)
    unreachable = [line for p in policies if (line := p.unreachable(*reach))]
    unreachable += costs_problems(settings, drafter, config, reach, host)
    try:
        basis = preflight(spec, config, shapes, warn=host.warn)
    except PreflightError as e:  # every problem at once
        raise PreflightError("\n  ".join([str(e), *unreachable])) from None
    if unreachable:
        raise PreflightError("the scoring inputs do not fit together:\n  " + "\n  ".join(unreachable))
    every, cadence = settings.every_n_steps, names.get("every_n_steps", "every_n_steps")
    if max_steps is not None and 0 < max_steps < every:
        host.warn(f"{settings.name}: {cadence}={every} is more than max_steps={max_steps}: no snapshot is taken "
                  "while training" + (", only the last step's at the end" if settings.wait_on_end else "")
                  + f"; set {cadence}= to a cadence that fits the run")
    return Checked(settings, spec, basis, config, shapes, reach)


def costs_problems(settings: EvalSettings, drafter: nn.Module | None, config: DrafterConfig,
                   reach: tuple[Callable[[int], int], int], host: Host) -> list[str]:
    """With scoring.costs, one line when the file is not a costs file, was measured on another device kind,
    dtype, target shape or drafter shape (`speed.config_costs`; with scoring.force_costs a warning instead),
    or does not hold the round of a scored method (a verify forward of more tokens, a block size not
    profiled); [] without costs."""
    scoring = settings.scoring
    if scoring.costs is None:
        return []
    from pathlib import Path

    from ..scoring.costs import CostsError
    from ..scoring.methods import Method
    from ..scoring.speed import config_costs, coverage_problems, shape_of

    try:
        device_type = scoring.resolved_device().type
    except (ValueError, RuntimeError):
        device_type = None  # preflight says why
    target = settings.target if (Path(settings.target) / "config.json").is_file() else None
    try:
        costs, forced = config_costs(scoring, target, config, device_type)
    except (CostsError, OSError, KeyError, ValueError) as e:
        return [f"scoring.costs {scoring.costs}: {e}"]
    if forced:
        host.warn(f"{settings.name}: scoring.costs {scoring.costs} does not fit, used anyway (scoring.force_costs): "
                  f"{'; '.join(forced)}")
    draft_rows = getattr(drafter, "draft_rows", None)
    shapes = {}
    for name in scoring.methods:
        block = Method.parse(name).block or reach[1]
        proposals = len(draft_rows(block)) if callable(draft_rows) else block - 1
        shapes[name] = shape_of(name, block, proposals)
    return [f"scoring.costs {scoring.costs}: {line}" for line in coverage_problems(costs, shapes)]


def most_tau(drafter: nn.Module | None, block_size: int) -> int:
    """The most tau any report can hold at `block_size`: the drafter's proposals per block + 1
    (`draft_rows`; without a live drafter, at most the block size's)."""
    draft_rows = getattr(drafter, "draft_rows", None)
    proposals = len(draft_rows(block_size)) if callable(draft_rows) else block_size
    return proposals + 1


def _pin_device(settings: EvalSettings, drafter: nn.Module | None) -> EvalSettings:
    """The thread runner scores on a definite CUDA device (its thread would otherwise take device 0): the
    drafter's, or this process's current one."""
    scoring = settings.scoring
    if settings.runner != "thread" or scoring.device not in ("auto", "cuda") or not torch.cuda.is_available():
        return settings
    devices = {p.device for p in drafter.parameters() if p.device.type == "cuda"} if drafter is not None else set()
    index = next(iter(devices)).index if len(devices) == 1 else torch.cuda.current_device()
    return dataclasses.replace(settings, scoring=dataclasses.replace(scoring, device=f"cuda:{index}"), device=None)


"""DrafterEvaluator: the evaluation engine in a plain PyTorch training loop (one process, DDP or
FSDP2), with no framework:

    evaluator = DrafterEvaluator(cache=..., target=..., baseline=..., every_n_steps=500,
                                 stop=TrailingBaselineStop(monitor="ddtree@8/live"), dirpath="runs/eval")
    evaluator.attach(drafter, optimizer)   # every check before the first step; raises listing every problem
    for step, batch in enumerate(loader, start=1):
        ...
        optimizer.step()
        if evaluator.step(step):              # True on every rank once the stop has decided
            break
    evaluator.close()                          # the last step's report, then the run folder is released

`attach` registers a pre-hook on the optimizer: a snapshot's copy (on CUDA, a pinned copy on a side
stream) has landed before the optimizer writes the weights, so a report holds the weights of the step
it names. A write that bypasses the optimizer (an EMA swap, `load_state_dict`, a clamp of `p.data`)
calls `evaluator.sync()` first. Under `torch.distributed` every rank calls `attach`, `step` and
`close` (the FSDP2 gather and the news from rank 0 are collectives); rank 0 scores.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .checks import is_int
from .engine.drafters import check_drafter_config, drafter_config_of, refuse_collective_wrappers, unwrap
from .engine.evaluator import EngineView, EvalEngine, Host, log_functions, stop_policies
from .engine.publish import Logger, WandbRows
from .engine.stop import StopPolicy
from .model import DrafterConfig
from .scoring.config import ScoringConfig
from .scoring.service import PreflightError


class LoopHost(Host):
    """A plain loop as the engine's host: ranks from torch.distributed (one process when it is not
    initialised), loggers the user gave, the active W&B run."""

    def __init__(self, evaluator: DrafterEvaluator):
        self.evaluator = evaluator
        self.distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if self.distributed else 0
        self.world_size = torch.distributed.get_world_size() if self.distributed else 1
        self._rows: dict[int, WandbRows] = {}

    def broadcast(self, obj: Any) -> Any:
        device = None
        if torch.distributed.get_backend() == "nccl":  # its objects travel through the rank's own device
            device = torch.device("cuda", torch.cuda.current_device())
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, device=device)
        return box[0]

    def loggers(self) -> list[Logger]:
        return [(getattr(fn, "__qualname__", type(fn).__name__), fn) for fn in self.evaluator.log]

    def wandb_runs(self) -> list[tuple[str, Any, Callable[[dict, int], object]]]:
        run = self.evaluator.wandb
        if run is None:  # the active run, if the script has started one (wandb is never imported here)
            module = sys.modules.get("wandb")
            run = getattr(module, "run", None) if module is not None else None
        if run is None or run is False:
            return []
        rows = self._rows.setdefault(id(run), WandbRows(run))
        return [("wandb", run, rows.log)]

    def set_metrics(self, metrics: dict[str, float]) -> None:
        self.evaluator.metrics = metrics

    def horizon(self) -> int | None:
        return self.evaluator.max_steps

    def ending(self) -> str | None:
        max_steps, step = self.evaluator.max_steps, self.evaluator.last_step
        if max_steps is not None and step is not None and step >= max_steps:
            return f"max_steps={max_steps} reached"
        return None


class DrafterEvaluator(EngineView):
    """Snapshot the drafter every `every_n_steps` steps of a plain loop and score it in the background.

    Args:
        cache: hidden-state cache folder (`dflash-callbacks extract`).
        target: the target's folder; only `embed_tokens` and `lm_head` are read.
        baseline: a published drafter folder (scored once, cached) or a saved report JSON.
        every_n_steps: snapshot cadence in optimizer steps (>= 1).
        stop: a TrailingBaselineStop (or any `StopPolicy`), or a list of them: `step()` returns True once
            one decides to stop.
        dirpath: the folder that holds the runs, one subfolder per run (default: ./<name>).
        drafter_config: a DrafterConfig or config.json path, when the drafter has none at `.config`.
        scoring, runner, device, busy, max_pending, keep_last, on_error, wait_on_end, baseline_cache_dir,
        wait_timeout, name, verbose, sync_every_n_steps: as DrafterEvalCallback's.
        max_steps: the loop's last step, when known: the stop's projection horizon, and a report of
            that step (or later) never stops training (it ends anyway).
        log: a function `fn(metrics, step)`, or a list of them, that gets every report's numbers at the
            snapshot's step (TensorBoard: `lambda m, s: [writer.add_scalar(k, v, s) for k, v in m.items()]`).
        wandb: a W&B run to log to; None: the active `wandb.run` when there is one; False: never.

    Attributes (every rank): `metrics` (the latest means, NaN before the first report), `history`,
    `errors`, `should_stop`, `stop_reason`; on rank 0 also `reports`, `baseline_report`, `run`.
    """

    def __init__(
        self,
        cache: str | os.PathLike,
        target: str | os.PathLike,
        baseline: str | os.PathLike | None = None,
        every_n_steps: int = 500,
        stop: StopPolicy | Sequence[StopPolicy] | None = None,
        dirpath: str | os.PathLike | None = None,
        drafter_config: DrafterConfig | str | os.PathLike | None = None,
        scoring: ScoringConfig | Mapping | None = None,
        runner: str = "thread",
        device: str | None = None,
        busy: str = "skip",
        max_pending: int = 1,
        keep_last: int = 2,
        on_error: str = "warn",
        wait_on_end: bool = True,
        baseline_cache_dir: str | os.PathLike | None = None,
        wait_timeout: float = 3600.0,
        name: str = "dflash",
        verbose: bool = True,
        sync_every_n_steps: int = 1,
        max_steps: int | None = None,
        log: Callable[[dict, int], object] | Sequence[Callable[[dict, int], object]] | None = None,
        wandb: Any = None,
    ):
        self.engine = EvalEngine(cache, target, baseline, every_n_steps, scoring, runner, device, busy, max_pending,
                                 keep_last, on_error, wait_on_end, dirpath, baseline_cache_dir, wait_timeout, name,
                                 verbose, sync_every_n_steps)
        for policy in stop_policies(stop):
            self.engine.add_stop(policy)  # its monitor must be scored: checked now
        self.drafter_config = check_drafter_config(drafter_config)
        if max_steps is not None and not (is_int(max_steps) and max_steps >= 1):
            raise ValueError(f"max_steps must be an integer >= 1 or None; got {max_steps!r}")
        self.max_steps = max_steps
        self.log = log_functions(log)
        self.wandb = wandb
        self.metrics: dict[str, float] = {}
        self.last_step: int | None = None
        self._drafter: nn.Module | None = None
        self._hooks: list = []
        self._restored: dict | None = None
        self._updates = 0  # optimizer steps seen by the post-hook
        self._updates_at_last_step = 0
        self._closed = False

    # ------------------------------------------------------------------ before training
    def attach(self, drafter: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        """Every rank, before the first step: check everything (the drafter, its optimizer, the cache,
        the target, the baseline, the scoring config, the device) and hook the optimizer. Raises
        PreflightError listing every problem."""
        if self._drafter is not None:
            raise RuntimeError("DrafterEvaluator.attach() was called already: one evaluator follows one drafter")
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or [])
        problems = []
        if not isinstance(drafter, nn.Module):
            raise TypeError(f"attach(drafter, optimizer): the drafter must be an nn.Module; got {type(drafter).__name__}")
        module = unwrap(drafter)
        refuse_collective_wrappers(module, drafter, "attach(drafter, optimizer)")
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            problems.append("attach(drafter, optimizer): the optimizer must be a torch.optim.Optimizer (or a list of "
                            "them) that steps the drafter's parameters")
        else:
            problems += _ownership_problems(module, optimizers)
        config = drafter_config_of(module, self.drafter_config, "DrafterEvaluator", drafter="drafter")
        try:
            self.engine.check(LoopHost(self), module, config, self.max_steps)
        except PreflightError as e:
            problems += str(e).splitlines()[1:]
        if problems:
            raise PreflightError("the scoring inputs do not fit together:\n  " + "\n  ".join(p.strip() for p in problems))
        self._drafter = module
        for opt in optimizers:
            self._hooks.append(opt.register_step_pre_hook(lambda *args: self.engine.copy_landed()))
            self._hooks.append(opt.register_step_post_hook(lambda *args: self._count_update()))

    def _count_update(self) -> None:
        self._updates += 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resume, before the first `step()`: the run folder of the saved run is reopened, its history
        rebuilt from results.jsonl, and the stops go on with their counts."""
        if self.last_step is not None:
            raise RuntimeError("load_state_dict() must come before the first step()")
        self._restored = dict(state_dict)
        for policy, state in zip(self.engine.stops.policies, state_dict.get("stops", [])):
            policy.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Primitives only, the same on every rank: put it in your own checkpoint."""
        return {"engine": self.engine.state_dict(), "stops": [p.state_dict() for p in self.engine.stops.policies]}

    # ------------------------------------------------------------------ training
    def step(self, step: int) -> bool:
        """Every rank, after `optimizer.step()` of training step `step` (steps go forward; a repeated
        step, under gradient accumulation, only publishes). Returns True on every rank once the stop
        has decided to stop."""
        if self._drafter is None:
            raise RuntimeError("call DrafterEvaluator.attach(drafter, optimizer) before step()")
        if self._closed:
            raise RuntimeError("step() after close(): this evaluator's run is over")
        if not is_int(step) or step < 0:
            raise ValueError(f"step() takes the training step, an integer >= 0; got {step!r}")
        if self.last_step is not None and step < self.last_step:
            raise ValueError(f"step() got step {step} after step {self.last_step}: steps go forward (a resume "
                             "restores the evaluator with load_state_dict and goes on from its step)")
        if self.last_step is None:
            if self._restored is not None:
                self.engine.load_state_dict(self._restored.get("engine", self._restored))
            self.engine.start(LoopHost(self), self._drafter)
        elif step != self.last_step and self._updates == self._updates_at_last_step:
            warnings.warn(f"DrafterEvaluator.step({step}): the optimizer has not stepped since step({self.last_step}); "
                          "call step() after optimizer.step(), or its snapshot holds the weights of the step before",
                          UserWarning, stacklevel=2)
        self._updates_at_last_step = self._updates
        self.last_step = step
        self.engine.on_step(step, 0, self._drafter)
        return self.engine.should_stop

    def sync(self) -> None:
        """Wait for a snapshot's copy to land: call it before writing the weights other than through the
        optimizer (an EMA swap, load_state_dict, clamping p.data)."""
        self.engine.copy_landed()

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Every rank, after the last step: its snapshot (with wait_on_end), then on rank 0 the pending
        reports within wait_timeout, and the run folder is released. Idempotent."""
        self._end(failed=None)

    def _end(self, failed: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.last_step is None:  # never started: no run folder
            return
        try:
            if failed is None:
                self.engine.finish(self.last_step, 0, self._drafter)
        finally:
            if failed is not None:
                self.engine.close(False, f"the loop stopped on {type(failed).__name__}", publish=False)
            elif self.engine.wait_on_end:
                self.engine.close(True, f"wait_timeout={self.engine.wait_timeout:g} s ran out at the end of training")
            else:
                self.engine.close(False, "wait_on_end=False: close() returned without waiting for it")

    def __enter__(self) -> DrafterEvaluator:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """A loop that raises keeps what is on disk for a resume (nothing more is logged)."""
        self._end(failed=error)


def _ownership_problems(drafter: nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[str]:
    """The drafter's trainable parameters that no optimizer steps (their snapshot copy would never be
    waited for before an update)."""
    owned = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    missing = [name for name, p in drafter.named_parameters() if p.requires_grad and id(p) not in owned]
    if not missing:
        return []
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return [f"attach(drafter, optimizer): the optimizer does not step {len(missing)} of the drafter's trainable "
            f"parameters ({shown}): pass the optimizer (or the list of optimizers) that trains the drafter"]


__all__ = ["DrafterEvaluator", "LoopHost"]

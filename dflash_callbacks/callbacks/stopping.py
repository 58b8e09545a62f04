r"""
TrailingBaselineStop
^^^^^^^^^^^^^^^^^^^^

Stop training when the drafter keeps trailing the baseline drafter with no prospect of catching up.

The decision is the engine's `StopPolicy` (`dflash_callbacks.engine.stop`); this class adds what a
Lightning Trainer needs. At ``setup`` it links to the ``DrafterEvalCallback`` in ``trainer.callbacks`` (the
one named by ``eval_callback``, or the only one), checks that the monitored method is one that callback
scores, and follows its reports. The callback's engine hands it every report (on rank 0, on the training
thread), and brings its stop to every rank. On a resume the history is rebuilt from the run's
results.jsonl, so reports that arrived after the checkpoint still count.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from typing_extensions import Unpack, override

from ..engine.stop import StopPolicy
from ..settings import StopFields, StopSettings
from .eval_callback import DrafterEvalCallback, eval_callbacks


class TrailingBaselineStop(StopPolicy, Callback):
    __doc__ = StopPolicy.__doc__.replace(
        "\n\n    Attributes:",
        "\n        eval_callback: the ``name`` of the DrafterEvalCallback to follow; ``None``: the only one in\n"
        "            ``trainer.callbacks``.\n\n    Attributes:", 1)

    def __init__(self, settings: StopSettings | str | None = None, *, eval_callback: str | None = None,
                 **fields: Unpack[StopFields]) -> None:
        StopPolicy.__init__(self, settings, **fields)
        Callback.__init__(self)
        if eval_callback is not None and not isinstance(eval_callback, str):
            raise ValueError(f"`eval_callback` must be the name of a DrafterEvalCallback or None; got {eval_callback!r}")
        self.eval_callback = eval_callback
        self.source: DrafterEvalCallback | None = None


    @property
    @override
    def state_key(self) -> str:
        source = self.source.name if self.source is not None else self.eval_callback
        return self._generate_state_key(monitor=self.monitor, eval_callback=source)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Link to the report source and check the monitor against what it scores, before training."""
        if stage != "fit":
            return
        if self.source is not None:
            self.source.engine.remove_stop(self)
        self.reset()  # nothing of an earlier fit with this callback: its reason, its count
        self.source = find_source(trainer.callbacks, self.eval_callback)
        self.source.engine.add_stop(self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.source is not None:
            self.source.engine.remove_stop(self)

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of an earlier version keyed this state by the monitor alone: read that key when
        this one is absent."""
        states = checkpoint.get("callbacks", {})
        old = self._generate_state_key(monitor=self.monitor)
        if self.state_key not in states and old in states:
            self.load_state_dict(states[old])


def find_source(callbacks, name: str | None) -> DrafterEvalCallback:
    """The DrafterEvalCallback TrailingBaselineStop follows: the one called `name`, or the only one."""
    sources = eval_callbacks(callbacks)
    names = [cb.name for cb in sources]
    if name is not None:
        sources = [cb for cb in sources if cb.name == name]
        if not sources:
            raise ValueError(f"TrailingBaselineStop(eval_callback={name!r}): no DrafterEvalCallback of that name in "
                             f"trainer.callbacks; found {names}")
    if not sources:
        raise ValueError("TrailingBaselineStop needs a DrafterEvalCallback in trainer.callbacks (it stops on its reports)")
    if len(sources) > 1:
        raise ValueError(f"trainer.callbacks holds several DrafterEvalCallbacks {names}; name the one to follow with "
                         f"TrailingBaselineStop(eval_callback=...)")
    return sources[0]

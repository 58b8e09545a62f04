"""The evaluation engine: preflight, run folder, snapshots, runners, publishing, the stop decision.
No Lightning and no transformers Trainer here: the adapters (`dflash_callbacks.callbacks`,
`dflash_callbacks.loop`, `dflash_callbacks.hf`, `dflash_callbacks.watch`) import the frameworks
they adapt."""

from ..lazy import exports

__getattr__ = exports(__name__, {"EvalEngine": ".eval_engine", "Host": ".host", "StopPolicy": ".stop"})
__all__ = ["EvalEngine", "Host", "StopPolicy"]

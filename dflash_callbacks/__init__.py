"""Score a DFlash drafter against a baseline while it trains: Lightning callbacks, a plain
PyTorch loop object, a transformers TrainerCallback, and a watcher of checkpoint folders,
over one evaluation engine (`dflash_callbacks.engine`)."""

from importlib import import_module

from .engine.stop import StopPolicy  # TrailingBaselineStop's rule without Lightning (plain loops, transformers)
from .model import DFlashDrafter, DrafterConfig, TargetHead, load_drafter, save_drafter
from .scoring import EvalReport, ScoringConfig, score_drafter

_ADAPTERS = {  # imported on first use: the engine and the plain loop never load Lightning or the Trainer
    "DrafterEarlyStopping": ".callbacks", "DrafterEvalCallback": ".callbacks", "TrailingBaselineStop": ".callbacks",
    "DrafterEvaluator": ".loop", "DrafterEvalTrainerCallback": ".hf",
}


def __getattr__(name: str):
    if name in _ADAPTERS:
        return getattr(import_module(_ADAPTERS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DFlashDrafter", "DrafterConfig", "DrafterEarlyStopping", "DrafterEvalCallback", "DrafterEvalTrainerCallback",
    "DrafterEvaluator", "EvalReport", "ScoringConfig", "StopPolicy", "TargetHead", "TrailingBaselineStop", "load_drafter",
    "save_drafter", "score_drafter",
]
__version__ = "0.1.0"

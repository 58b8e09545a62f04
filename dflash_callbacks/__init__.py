"""Score a DFlash-family drafter against a baseline while it trains: Lightning callbacks, a plain
PyTorch loop object, a transformers TrainerCallback, and a watcher of checkpoint folders, over one
evaluation engine (`dflash_callbacks.engine`). Names are imported on first use: the engine and the
plain loop never load Lightning or the Trainer, and the CLI's help loads no torch."""

from .lazy import exports

__all__ = [
    "DFlashDrafter", "DrafterConfig", "DrafterEarlyStopping", "DrafterEvalCallback", "DrafterEvalTrainerCallback",
    "DrafterEvaluator", "EvalReport", "EvalSettings", "MlflowTracker", "ScoringConfig", "StopPolicy", "StopSettings",
    "TargetHead", "TensorBoardTracker", "Tracker", "TrailingBaselineStop", "build_drafter", "load_drafter", "save_drafter", "score_drafter",
]
__getattr__ = exports(__name__, {
    "StopPolicy": ".engine.stop", "EvalSettings": ".settings", "StopSettings": ".settings",
    "DFlashDrafter": ".model.drafter", "build_drafter": ".model.drafter", "DrafterConfig": ".model.config",
    "TargetHead": ".model.target_head", "load_drafter": ".model.io", "save_drafter": ".model.io",
    "EvalReport": ".scoring.report", "ScoringConfig": ".scoring.config", "score_drafter": ".scoring.scorer",
    "DrafterEarlyStopping": ".callbacks", "DrafterEvalCallback": ".callbacks", "TrailingBaselineStop": ".callbacks",
    "DrafterEvaluator": ".loop", "DrafterEvalTrainerCallback": ".hf",
    "Tracker": ".engine.trackers.base", "TensorBoardTracker": ".engine.trackers.tensorboard",
    "MlflowTracker": ".engine.trackers.mlflow",
})
__version__ = "0.1.0"

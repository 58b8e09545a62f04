"""Lightning callbacks that score a DFlash drafter against a baseline while it trains."""

from .callbacks import DrafterEvalCallback, TrailingBaselineStop
from .model import DFlashDrafter, DrafterConfig, TargetHead, load_drafter, save_drafter
from .scoring import EvalReport, ScoringConfig, score_drafter

__all__ = [
    "DFlashDrafter", "DrafterConfig", "DrafterEvalCallback", "EvalReport", "ScoringConfig", "TargetHead",
    "TrailingBaselineStop", "load_drafter", "save_drafter", "score_drafter",
]
__version__ = "0.1.0"

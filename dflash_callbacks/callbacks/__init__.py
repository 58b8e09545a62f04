"""The Lightning adapters of the evaluation engine."""

from .early_stopping import DrafterEarlyStopping
from .eval_callback import DrafterEvalCallback
from .stopping import TrailingBaselineStop

__all__ = ["DrafterEarlyStopping", "DrafterEvalCallback", "TrailingBaselineStop"]

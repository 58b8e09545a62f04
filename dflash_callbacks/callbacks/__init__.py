from .eval_callback import DrafterEvalCallback
from .stopping import TrailingBaselineStop

__all__ = ["DrafterEvalCallback", "TrailingBaselineStop"]

"""The Lightning adapters of the evaluation engine."""

from ..lazy import exports

__all__ = ["DrafterEarlyStopping", "DrafterEvalCallback", "TrailingBaselineStop"]
__getattr__ = exports(__name__, {"DrafterEarlyStopping": ".early_stopping", "DrafterEvalCallback": ".eval_callback",
                                 "TrailingBaselineStop": ".stopping"})

from .eval_callback import DrafterEvalCallback

__all__ = ["DrafterEvalCallback"]

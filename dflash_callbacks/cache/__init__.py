"""The hidden-state cache: its format, its extraction, the sampling settings of its answers, the task sets."""

from ..lazy import exports

__all__ = ["CacheError", "CacheMismatchError", "HiddenStateCache", "Sampling", "load_tasks"]
__getattr__ = exports(__name__, {"CacheError": ".format", "CacheMismatchError": ".format",
                                 "HiddenStateCache": ".format", "Sampling": ".sampling", "load_tasks": ".tasks"})

"""The hidden-state cache: its format, its extraction, the task sets."""

from ..lazy import exports

__all__ = ["CacheError", "CacheMismatchError", "HiddenStateCache", "load_tasks"]
__getattr__ = exports(__name__, {"CacheError": ".format", "CacheMismatchError": ".format",
                                 "HiddenStateCache": ".format", "load_tasks": ".tasks"})

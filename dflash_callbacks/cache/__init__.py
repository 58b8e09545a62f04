from .format import CacheError, CacheMismatchError, HiddenStateCache
from .tasks import load_tasks

__all__ = ["CacheError", "CacheMismatchError", "HiddenStateCache", "load_tasks"]

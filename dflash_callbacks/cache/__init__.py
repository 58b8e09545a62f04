from .format import CacheError, CacheMismatchError, HiddenStateCache
from .sampling import Sampling
from .tasks import load_tasks

__all__ = ["CacheError", "CacheMismatchError", "HiddenStateCache", "Sampling", "load_tasks"]

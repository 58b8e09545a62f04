from .ddtree import ddtree_streaks_from_top
from .head_stats import HeadStats, head_stats

__all__ = ["HeadStats", "ddtree_streaks_from_top", "head_stats"]

"""Scoring: the methods, the scorer, the aggregates and their intervals, the report."""

from ..lazy import exports

__all__ = [
    "EvalReport", "ScoringConfig", "acceptance_curve", "comparison_table", "dense_tau", "live_rounds",
    "live_tau", "score_drafter", "score_task",
]
__getattr__ = exports(__name__, {
    "acceptance_curve": ".aggregates", "dense_tau": ".aggregates", "live_rounds": ".aggregates",
    "live_tau": ".aggregates", "ScoringConfig": ".config", "EvalReport": ".report", "comparison_table": ".table",
    "score_drafter": ".scorer", "score_task": ".scorer",
})

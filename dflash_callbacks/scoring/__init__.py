from .aggregates import acceptance_curve, dense_tau, live_rounds, live_tau
from .config import ScoringConfig
from .report import EvalReport, comparison_table
from .scorer import score_drafter, score_task

__all__ = [
    "EvalReport", "ScoringConfig", "acceptance_curve", "comparison_table", "dense_tau", "live_rounds",
    "live_tau", "score_drafter", "score_task",
]

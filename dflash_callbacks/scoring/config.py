"""What a scoring run computes and how. Plain fields, so OmegaConf can hold it."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch

from ..checks import (
    DTYPES, check_bool, check_choice, check_device, check_int, check_int_list, check_number, check_str_list, problems_of,
)
from ..kernels.head_stats import BACKENDS
from ..model.attention import RULES as ATTENTION_RULES
from .methods import scored_methods

MAX_DDTREE_BUDGET = 1024


def check_tasks(tasks: object) -> None:
    check_str_list("tasks", tasks, optional=True)
    if tasks is not None and not tasks:
        raise ValueError("tasks must be None (every task of the cache) or a non-empty list of task names")


def check_device_name(device: object) -> None:
    """The form of `device`; whether it exists here is checked before scoring starts."""
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r} "
                         "(whether it exists here is checked before scoring starts)")


@dataclass
class ScoringConfig:
    ddtree_budgets: list[int] = field(default_factory=lambda: [4, 8])  # DDTree node budgets N
    topk: list[int] = field(default_factory=list)  # top@k widths (an upper bound, not a budget)
    window: int | None = None  # score anchors in the first `window` tokens of each completion
    block_size: int | None = None  # default: the drafter's
    max_rounds: int = 30  # rounds of the live schedule
    tasks: list[str] | None = None  # default: every task of the cache
    anchors_per_forward: int = 64  # blocks decoded side by side in one drafter forward
    vocab_chunk: int | None = None  # vocabulary tile of the LM-head statistics
    backend: str = "auto"  # LM-head statistics: auto | torch | triton | reference
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "float32"  # float32 | bfloat16 | float16
    max_memory_gib: float | None = None  # the scorer's memory budget: chunks are sized to fit it
    release_memory: bool = False  # give the scorer's accelerator memory back after each report
    attention: str = "auto"  # the attention pattern inside a block: auto (as vLLM serves it) or a rule of model.attention

    def __post_init__(self) -> None:
        """Every bad field at once, one line each (the CLIs print one `error:` line per line)."""
        problems = problems_of(
            lambda: check_int_list("ddtree_budgets", self.ddtree_budgets, 1, MAX_DDTREE_BUDGET),
            lambda: check_int_list("topk", self.topk, 1),
            lambda: check_int("window", self.window, 1, optional=True),
            lambda: check_int("block_size", self.block_size, 2, optional=True),
            lambda: check_int("max_rounds", self.max_rounds, 1),
            lambda: check_tasks(self.tasks),
            lambda: check_int("anchors_per_forward", self.anchors_per_forward, 1),
            lambda: check_int("vocab_chunk", self.vocab_chunk, 1, optional=True),
            lambda: check_choice("backend", self.backend, BACKENDS),
            lambda: check_device_name(self.device),
            lambda: check_choice("dtype", self.dtype, DTYPES),
            lambda: check_number("max_memory_gib", self.max_memory_gib, above=0, optional=True),
            lambda: check_bool("release_memory", self.release_memory),
            lambda: check_choice("attention", self.attention, tuple(ATTENTION_RULES)),
        )
        if problems:
            raise ValueError("\n".join(problems))
        self.ddtree_budgets, self.topk = list(self.ddtree_budgets), list(self.topk)
        self.tasks = None if self.tasks is None else list(self.tasks)

    @property
    def methods(self) -> list[str]:
        """The names of the methods scored, in report order (`scored_methods` gives the values)."""
        return [str(m) for m in scored_methods(self.ddtree_budgets, self.topk)]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolved_device(self) -> torch.device:
        return check_device("scoring.device", self.device)

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint_fields(self) -> dict:
        """The fields that change the numbers (not where or how fast they are computed)."""
        keep = ("ddtree_budgets", "topk", "window", "block_size", "max_rounds", "tasks", "dtype", "attention")
        return {k: v for k, v in self.to_dict().items() if k in keep}

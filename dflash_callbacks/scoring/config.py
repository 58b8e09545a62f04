"""What a scoring run computes and how. Plain fields, so OmegaConf can hold it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("auto", "torch", "triton", "reference")


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

    def __post_init__(self) -> None:
        self.ddtree_budgets = [int(n) for n in self.ddtree_budgets]
        self.topk = [int(k) for k in self.topk]
        for n in self.ddtree_budgets:
            if not 1 <= n <= 1024:
                raise ValueError(f"ddtree_budgets must be integers in [1, 1024]; got {n}")
        for k in self.topk:
            if k < 1:
                raise ValueError(f"topk widths must be integers >= 1; got {k}")
        if len(set(self.ddtree_budgets)) != len(self.ddtree_budgets) or len(set(self.topk)) != len(self.topk):
            raise ValueError(f"duplicate budgets or widths: ddtree_budgets={self.ddtree_budgets}, topk={self.topk}")
        for name in ("window", "block_size"):
            value = getattr(self, name)
            if value is not None and value < (2 if name == "block_size" else 1):
                raise ValueError(f"{name} must be None or an integer >= {2 if name == 'block_size' else 1}; got {value}")
        for name in ("max_rounds", "anchors_per_forward"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {getattr(self, name)}")
        if self.vocab_chunk is not None and self.vocab_chunk < 1:
            raise ValueError(f"vocab_chunk must be None or an integer >= 1; got {self.vocab_chunk}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}; got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}; got {self.dtype!r}")
        if self.device != "auto":
            torch.device(self.device)  # raises on a malformed device string

    @property
    def methods(self) -> list[str]:
        return ["vanilla"] + [f"ddtree@{n}" for n in self.ddtree_budgets] + [f"top@{k}" for k in self.topk]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint_fields(self) -> dict:
        """The fields that change the numbers (not where or how fast they are computed)."""
        keep = ("ddtree_budgets", "topk", "window", "block_size", "max_rounds", "tasks", "dtype")
        return {k: v for k, v in self.to_dict().items() if k in keep}

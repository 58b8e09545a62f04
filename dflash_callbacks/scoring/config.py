"""What a scoring run computes and how: `ScoringConfig`, frozen, every field with its help. Plain
fields, so OmegaConf holds it, and no torch at import (the CLI's flags are made from it)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..checks import (
    DTYPE_NAMES, check_bool, check_choice, check_device, check_int, check_int_list, check_number, check_str_list,
    did_you_mean, problems_of,
)
from ..kernels.types import BACKENDS
from ..model.attention import RULES as ATTENTION_RULES
from .methods import scored_methods

MAX_DDTREE_BUDGET = 1024
DRAFT_RULES = ("greedy", "probabilistic")
"""vLLM's `speculative_config.draft_sample_method` values (docs/numbers.md, "tau at temperature T")."""
ESTIMATORS = ("conditional", "coins")
"""How vanilla is estimated on a sampled cache: `conditional` where the cache keeps the served support (each
streak term's last factor its expectation given the text before it, live the expected rounds), else as
`coins` (the integer streaks of an argmax draft, one seeded draw of a sampled draft's coins)."""


def check_tasks(tasks: object) -> None:
    check_str_list("tasks", tasks, optional=True)
    if tasks is not None and not tasks:
        raise ValueError("tasks must be None (every task of the cache) or a non-empty list of task names")


def _bad(message: str):
    raise ValueError(message)


def block_size_problems(config: ScoringConfig, trained: int, *, run_block: bool = True) -> list[str]:
    """What stops `config` from scoring a drafter trained at block `trained` at its block sizes, told without
    torch: a block size above it (its slots past the trained block never learnt to draft), and, with
    `run_block`, block_sizes holding `trained` where it is the run's block (block_size unset; an explicit one
    the config refuses itself)."""
    problems = [f"block size {b} is above the drafter's trained block size {trained}: the slots past it never "
                f"learnt to draft; score at most block size {trained} (scoring.block_size / block_sizes)"
                for b in [config.block_size, *config.block_sizes] if b is not None and b > trained]
    if run_block and config.block_size is None:
        problems += run_block_problems(config.block_sizes, trained,
                                       "the drafter's block size, as scoring.block_size is unset")
    return problems


def run_block_problems(block_sizes: list[int], block: int | None, whose: str = "scoring.block_size") -> list[str]:
    """`block_sizes` holding `block`, the block every method is scored at already (`whose`: where that block
    comes from, scoring.block_size or the drafter's block size): one line, the same from every entry point."""
    if block is None or not isinstance(block_sizes, (list, tuple)) or block not in block_sizes:
        return []
    return [f"block_sizes holds {block}, but {block} is already the run's block ({whose}): every method is scored at "
            f"it already; leave {block} out of block_sizes (its methods are the ones without :b{block})"]


def check_probability(name: str, value: object) -> None:
    """None, or a number strictly between 0 and 1."""
    try:
        number = check_number(name, value, optional=True)
    except ValueError:
        number = -1.0
    if number is not None and not 0 < number < 1:
        raise ValueError(f"{name} must be None or a number between 0 and 1 (exclusive); got {value!r}")


def check_device_name(device: object) -> None:
    """The form of `device`; whether it exists here is checked before scoring starts."""
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r} "
                         "(whether it exists here is checked before scoring starts)")


def _field(default: Any = dataclasses.MISSING, *, help: str, factory: Any = dataclasses.MISSING,
           numbers: bool = False, aliases: tuple[str, ...] = ()) -> Any:
    """A field, its help and other names (as `settings.setting`); `numbers`: it changes the numbers (not only
    where or how fast they are computed)."""
    return field(default=default, default_factory=factory,
                 metadata={"help": help, "numbers": numbers, "aliases": aliases, "flag": True})


@dataclass(frozen=True)
class ScoringConfig:
    ddtree_budgets: list[int] = _field(factory=lambda: [4, 8], numbers=True, aliases=("budgets",),
                                       help="DDTree node budgets N")
    topk: list[int] = _field(factory=list, numbers=True, help="top@k widths (an upper bound, not a node budget)")
    ddtree_sweep: int | None = _field(None, help="also every DDTree budget from 1 to N (added to ddtree_budgets): "
                                                  "the closed form reads every budget from one pass, and the "
                                                  "fastest configuration is then chosen over all of them")
    window: int | None = _field(None, numbers=True, help="score the anchors in the first N tokens of each completion "
                                                         "(None: all)")
    block_size: int | None = _field(None, numbers=True, help="the block size scored (None: the drafter's)")
    block_sizes: list[int] = _field(factory=list, numbers=True,
                                    help="other block sizes to score every method at, each a method of its own "
                                         "(METHOD:bB), e.g. the block vLLM serves: num_speculative_tokens + 1 for "
                                         "DFlash, num_speculative_tokens for DSpark (sample_from_anchor)")
    max_rounds: int | None = _field(None, numbers=True, help="rounds of the live schedule (None: to the end of each "
                                    "answer, as a served request runs)")
    tasks: list[str] | None = _field(None, numbers=True, help="the tasks scored (None: every task of the cache)")
    anchors_per_forward: int = _field(64, help="blocks decoded side by side in one drafter forward")
    vocab_chunk: int | None = _field(None, help="vocabulary tile of the LM-head statistics' torch path (None: 8192)")
    backend: str = _field("auto", help=f"LM-head statistics: {' | '.join(BACKENDS)}")
    device: str = _field("auto", help="auto | cpu | cuda | cuda:N (auto: cuda when available, else cpu)")
    dtype: str = _field("float32", numbers=True, help=" | ".join(DTYPE_NAMES))
    max_memory_gib: float | None = _field(None, help="the scorer's memory budget in GiB: chunks are sized to fit it")
    release_memory: bool = _field(False, help="give the scorer's accelerator memory back after each report")
    attention: str = _field("auto", numbers=True, help="the attention pattern inside a block: auto (vLLM's rule for "
                                                       "the published layout), vllm, sglang, trained, or another "
                                                       "rule (docs/numbers.md)")
    attentions: list[str] = _field(factory=list, numbers=True,
                                   help="other attention rules to score every method under, each a method of its own "
                                        "(METHOD:RULE), e.g. trained beside vllm: the cost of serving another pattern")
    score_as_written: bool = _field(True, numbers=True,
                                    help="under attention vllm, where the target's model-level window reaches drafter "
                                         "layers that declare none, also score every method as the config is written "
                                         "(METHOD:vllm-as-written), so the report says what the window costs; false: "
                                         "the served rule alone (half the scoring time on such a target)")
    served_temperature: float | None = _field(None, help="the temperature the requests are served at (None: the "
                                                          "cache's, 0 for a greedy cache); a cache sampled at another "
                                                          "is refused")
    served_top_p: float | None = _field(None, help="the requests' top-p (None: the cache's); a cache sampled at another "
                                                   "is refused")
    served_top_k: int | None = _field(None, help="the requests' top-k (None: the cache's, 0: off); a cache sampled at "
                                                 "another is refused")
    draft_rule: str = _field("greedy", numbers=True,
                             help="the draft rule at T > 0, as vLLM's draft_sample_method: greedy (the argmax; "
                                  "DFlash 2 samples its selector walk whatever this says) or probabilistic (DFlash "
                                  "samples softmax(logits / T))")
    served_engine_settings: list[str] = _field(
        factory=list, help="the serving engine's settings, as KEY=VALUE (e.g. rejection_sample_method=block, "
                           "speculative_accept_threshold_single=0.9): where one makes the engine accept otherwise than "
                           "exact speculative sampling, the scores are not its tau and a warning says so")
    estimators: str = _field("conditional", numbers=True,
                             help="on a sampled cache: conditional (where the cache keeps the served support and "
                                  "max_rounds is unset: expectations given the text, no coin) or coins (the estimators "
                                  "of before: integer streaks, a seeded draw of the coins)")
    coin_seed: int = _field(0, numbers=True, help="the seed of the acceptance coins the live schedule draws where the "
                                                  "draft is sampled at T > 0 (the report records it)")
    confidence_threshold: float | None = _field(None, numbers=True,
                                                help="a drafter with a confidence head (DSpark): score the draft cut "
                                                     "before the first slot whose confidence is below this (0 to 1, "
                                                     "as DeepSpec's evaluation); None: the full block")
    costs: str | None = _field(None, help="a costs file of the serving device (`dflash-callbacks profile`, or the "
                                          "engine's step times in its format): predict each method's speed-up and "
                                          "the fastest configuration (None: tau only)")
    force_costs: bool = _field(False, help="use a costs file measured on another device, dtype or target or drafter "
                                           "shape (refused otherwise, naming the mismatch)")

    def __post_init__(self) -> None:
        """Every bad field at once, one line each (the CLIs print one `error:` line per line)."""
        problems = problems_of(
            lambda: check_int_list("ddtree_budgets", self.ddtree_budgets, 1, MAX_DDTREE_BUDGET),
            lambda: check_int("ddtree_sweep", self.ddtree_sweep, 1, optional=True) is None
            or self.ddtree_sweep <= MAX_DDTREE_BUDGET or _bad(
                f"ddtree_sweep must be at most {MAX_DDTREE_BUDGET}; got {self.ddtree_sweep!r}"),
            lambda: check_int_list("topk", self.topk, 1),
            lambda: check_int("window", self.window, 1, optional=True),
            lambda: check_int("block_size", self.block_size, 2, optional=True),
            lambda: check_int_list("block_sizes", self.block_sizes, 2),
            lambda: [_bad(line) for line in run_block_problems(self.block_sizes, self.block_size)],
            lambda: check_int("max_rounds", self.max_rounds, 1, optional=True),
            lambda: check_tasks(self.tasks),
            lambda: check_int("anchors_per_forward", self.anchors_per_forward, 1),
            lambda: check_int("vocab_chunk", self.vocab_chunk, 1, optional=True),
            lambda: check_choice("backend", self.backend, BACKENDS),
            lambda: check_device_name(self.device),
            lambda: check_choice("dtype", self.dtype, DTYPE_NAMES),
            lambda: check_number("max_memory_gib", self.max_memory_gib, above=0, optional=True),
            lambda: check_bool("release_memory", self.release_memory),
            lambda: check_choice("attention", self.attention, tuple(ATTENTION_RULES)),
            lambda: check_str_list("attentions", self.attentions),
            lambda: [check_choice("attentions", rule, tuple(ATTENTION_RULES)) for rule in self.attentions],
            lambda: len(set(self.attentions)) == len(self.attentions) or _bad(
                f"attentions holds a rule twice: {self.attentions}"),
            lambda: self.attention not in self.attentions or _bad(
                f"attentions holds attention {self.attention!r}, which every method is scored under already"),
            lambda: check_bool("score_as_written", self.score_as_written),
            lambda: check_number("served_temperature", self.served_temperature, optional=True) is None
            or self.served_temperature >= 0 or _bad(
                f"served_temperature must be >= 0 (0: greedy); got {self.served_temperature!r}: give the temperature "
                "the requests are served at"),
            lambda: check_number("served_top_p", self.served_top_p, optional=True) is None or 0 < self.served_top_p <= 1
            or _bad(f"served_top_p must be in (0, 1] (1: off); got {self.served_top_p!r}: give the top-p the requests "
                    "are served at"),
            lambda: check_int("served_top_k", self.served_top_k, 0, optional=True),
            lambda: check_choice("draft_rule", self.draft_rule, DRAFT_RULES),
            lambda: check_choice("estimators", self.estimators, ESTIMATORS),
            lambda: check_str_list("served_engine_settings", self.served_engine_settings),
            lambda: [_bad(f"served_engine_settings holds {entry!r}: give each setting as KEY=VALUE, e.g. "
                          "rejection_sample_method=block") for entry in self.served_engine_settings
                     if "=" not in entry or not entry.split("=", 1)[0].strip()],
            lambda: check_int("coin_seed", self.coin_seed, 0),
            lambda: check_probability("confidence_threshold", self.confidence_threshold),
            lambda: self.costs is None or (isinstance(self.costs, str) and self.costs) or _bad(
                f"costs must be None or the path of a costs file (`dflash-callbacks profile --out PATH`); got "
                f"{self.costs!r}"),
            lambda: check_bool("force_costs", self.force_costs),
        )
        if problems:
            raise ValueError("\n".join(problems))
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen: copied once, here)
        sweep = [] if self.ddtree_sweep is None else range(1, self.ddtree_sweep + 1)
        put("ddtree_budgets", sorted({int(n) for n in [*self.ddtree_budgets, *sweep]}) if sweep
            else [int(n) for n in self.ddtree_budgets])
        put("topk", [int(k) for k in self.topk])
        put("block_sizes", [int(b) for b in self.block_sizes])
        put("attentions", list(self.attentions))
        put("served_engine_settings", list(self.served_engine_settings))
        put("tasks", None if self.tasks is None else list(self.tasks))
        if self.confidence_threshold is not None:
            put("confidence_threshold", float(self.confidence_threshold))

    @property
    def methods(self) -> list[str]:
        """The names of the methods scored, in report order (`scored_methods` gives the values), on a target
        without a model-level window (`methods_on` for one)."""
        return self.methods_on(None)

    def rules(self, target_window: int | None) -> list[str | None]:
        """The attention rules every method is scored under, on a target whose model-level window is
        `target_window` (`model.attention.vllm_model_window`): the run's (None), `attentions`, and under "vllm"
        with `score_as_written` on a target with one, "vllm-as-written" (the config as written, beside what
        the engine serves: the window's cost, `EvalReport.window_cost`)."""
        extra = (["vllm-as-written"] if self.attention == "vllm" and self.score_as_written and target_window
                 is not None and "vllm-as-written" not in self.attentions else [])
        return [None, *self.attentions, *extra]

    def methods_on(self, target_window: int | None) -> list[str]:
        """The names of the methods scored on a target whose model-level window is `target_window`."""
        rules = [rule for rule in self.rules(target_window) if rule is not None]
        return [str(m) for m in scored_methods(self.ddtree_budgets, self.topk, self.block_sizes, rules)]

    @property
    def torch_dtype(self):
        from ..checks import DTYPES

        return DTYPES[self.dtype]

    def resolved_device(self):
        return check_device("scoring.device", self.device)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> ScoringConfig:
        """A config from its fields (what `to_dict` wrote); an unknown field is refused naming the fields."""
        legal = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(raw) - set(legal))
        if unknown:
            raise ValueError("\n".join(f"scoring has no field {name!r}" + (did_you_mean(name, legal)
                                                                             or f"; the fields are {legal}")
                                       for name in unknown))
        return cls(**raw)

    def fingerprint_fields(self) -> dict:
        """The fields that change the numbers (not where or how fast they are computed)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["numbers"]}

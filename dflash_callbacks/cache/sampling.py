"""The sampling settings a request is served at, and the distribution they give.

`Sampling` is what a sampled cache records (manifest `"sampling"`) and what the live loop
(`tests/support/served_live.py`) decodes at: temperature (0: greedy), top-p (1: off), top-k (0: off), and,
for a cache, the answers drawn per prompt and the seed they are drawn from.

`served_logprobs` is the target's served distribution, in the order vLLM applies it: the
logits divided by the temperature, then top-k, then top-p on what top-k kept
(vllm/v1/sample/sampler.py `Sampler.sample`: "Apply temperature", then "Apply top_k and/or
top_p"; vllm/v1/sample/ops/topk_topp_sampler.py `apply_top_k_top_p_pytorch`: the top-k mask
first, then the top-p mask over the softmax of the top-k-masked logits; the verifier's
`compute_probs` in vllm/v1/sample/rejection_sampler.py the same). Top-k keeps every logit
>= the k-th largest (ties included); top-p keeps a token when the probability of the tokens
ranked above it is below p (at least the top one), as vLLM's ascending cumulative sum
`<= 1 - p` drops the rest.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..checks import is_int

if TYPE_CHECKING:  # torch is imported where it is used: the settings and their checks load without it
    import torch

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "samples", "seed")
SUPPORT_SIZE = 64
"""The most tokens of the served distribution a sampled cache keeps per position (`served_support`): the
nucleus of top-p sampling is small; the mass past the bound is recorded (`support_dropped`)."""


def sampling_problems(temperature: Any, top_p: Any, top_k: Any, samples: Any, seed: Any) -> list[str]:
    """One line per bad setting, each naming the fix (empty: the settings are usable)."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    problems = []
    if not number(temperature) or temperature < 0:
        problems.append(f"temperature must be a number >= 0 (0: greedy); got {temperature!r}")
    if not number(top_p) or not 0 < top_p <= 1:
        problems.append(f"top_p must be a number in (0, 1] (1: off); got {top_p!r}")
    if not is_int(top_k) or top_k < 0:
        problems.append(f"top_k must be an integer >= 0 (0: off); got {top_k!r}")
    if not is_int(samples) or samples < 1:
        problems.append(f"samples (answers per prompt) must be an integer >= 1; got {samples!r}")
    if not is_int(seed) or seed < 0:
        problems.append(f"seed must be an integer >= 0; got {seed!r}")
    if not problems and temperature == 0 and (top_p != 1 or top_k != 0 or samples != 1):
        problems.append(f"top_p={top_p}, top_k={top_k}, samples={samples} apply to sampled answers only: give a "
                        "temperature > 0, or leave them at 1, 0 and 1 for a greedy cache")
    return problems


@dataclass(frozen=True)
class Sampling:
    """Served sampling settings (checked on construction: every bad field at once, one line each)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    samples: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        problems = sampling_problems(self.temperature, self.top_p, self.top_k, self.samples, self.seed)
        if problems:
            raise ValueError("\n".join(problems))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)

    def answer_names(self, task: str) -> list[str]:
        """The cache's task names of one prompt's answers: the prompt's own name for one
        answer, else `name.s0`, `name.s1`, ... (zero-padded to sort in order)."""
        if self.samples == 1:
            return [task]
        width = len(str(self.samples - 1))
        return [f"{task}.s{i:0{width}d}" for i in range(self.samples)]

    def generator(self, task: str, sample: int) -> torch.Generator:
        """The CPU generator one answer is drawn with, seeded from (seed, task, sample): an
        answer does not depend on which others are drawn, so a resumed extraction draws the same."""
        import torch

        digest = hashlib.sha256(f"{self.seed}\0{task}\0{sample}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def served_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probabilities [..., V] (float32) of the served distribution of `logits` [..., V]:
    temperature, then top-k, then top-p (see the module docstring); -inf off the kept set.
    Temperature 0 is greedy: log-probability 0 at the argmax (the lowest id among ties), -inf elsewhere."""
    import torch

    logits = logits.float()
    if sampling.greedy:
        best = logits.argmax(dim=-1, keepdim=True)
        return torch.full_like(logits, -math.inf).scatter_(-1, best, 0.0)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p < 1:
        probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
        above = probs.cumsum(dim=-1) - probs  # the mass of the tokens ranked above each
        drop = above >= sampling.top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)
    return logits.log_softmax(dim=-1)


def served_support(served: torch.Tensor, size: int = SUPPORT_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The served distribution's support from its log-probabilities `served` [..., V] (`served_logprobs`): its
    `size` most probable tokens, (ids int32 [..., size], -1 past the support; probs float32 [..., size], 0 there;
    dropped float32 [...], the mass of the tokens past the bound, 0 where the support fits)."""
    import torch

    k = min(size, served.shape[-1])
    logp, ids = served.float().sort(dim=-1, descending=True, stable=True)  # descending, ties to the lower id
    logp, ids = logp[..., :k], ids[..., :k]
    probs = logp.exp()
    inside = probs > 0
    ids = torch.where(inside, ids, -1).to(torch.int32)
    probs = torch.where(inside, probs, 0.0)
    if k < size:
        pad = (*probs.shape[:-1], size - k)
        ids, probs = torch.cat([ids, ids.new_full(pad, -1)], -1), torch.cat([probs, probs.new_zeros(pad)], -1)
    dropped = (1 - probs.double().sum(-1)).clamp(min=0).float()
    return ids, probs, dropped

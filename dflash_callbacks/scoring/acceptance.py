"""tau as a request is served at a temperature: the settings a report is scored at, and the acceptance of a
sampled draft (docs/numbers.md, "tau at temperature T").

A sampled cache (`cache.sampling`) holds answers the target drew at the served settings and, for each
token, its served log-probability log p. Where the drafter proposes its argmax (vLLM's default draft
rule for DFlash, DSpark and Domino) its streaks on that text are the served acceptance, integers, and
nothing here changes them. Where it samples its proposal from q (DFlash 2's selector walk at T > 0;
DFlash under the "probabilistic" draft rule), standard speculative sampling accepts a slot whose emitted
token is the cached one with probability

    c_j = P(accepted | emitted x_j) = min(q_j(x_j), p_j(x_j)) / p_j(x_j) = min(1, q_j / p_j),

q_j the proposal's probability of the cached token given the true tokens before it (up to the first
rejection the walk's own proposals are those tokens). Given the text, the slots of a round are coins
with these chances, so the expected streak at an anchor is sum_k prod_{j<=k} c_j (what `dense` averages)
and the live schedule runs along one draw of the coins (`coins`: a generator this module seeds from the
coin seed, the task and the slot, never the global one; the same draw for every drafter, so a paired
comparison shares it). Text drawn from p and coins drawn given it have the law of the served rounds, so
the draw is one realisation of the served process and the live interval, made from its rounds as from
any other cache's, holds its Monte-Carlo error.

On a sampled cache that keeps the served support (`cache.sampling.served_support`) the conditional estimators
replace those for every draft rule (`slot_chances`, `conditional_streaks`): each streak term's last factor is its
expectation given the text before it, alpha = sum_x min(p(x), q(x)) (p(d) for an argmax draft d), and the live
schedule takes each anchor with its chance over the coins (`expected_visits`) instead of one draw.

`served_problems` refuses, one line each naming the fix, settings the cache was not sampled at and a draft
rule a family is not served with; `engine_settings_warning` names declared engine settings under which none of
this is exact; `ServedDraft` is what the scorer reads.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from .config import ScoringConfig

SAMPLED_FAMILIES = {"dflash2": "always", "dflash": "probabilistic"}
"""Families whose proposal is a draw at T > 0: DFlash 2 whatever the draft rule (vLLM allocates its draft
logits unconditionally), DFlash under the probabilistic draft rule (softmax(logits / T), temperature only)."""
PROBABILISTIC_REFUSED = {
    "dspark": "vLLM's probabilistic DSpark draft (q cut to its top dspark_draft_topk tokens where "
              "dspark_draft_topk is set) is not scored by this library",
    "domino": "no serving engine samples a Domino draft (vLLM does not serve Domino; its branch proposes the argmax)",
}


INEXACT_ENGINE_SETTINGS = {
    "rejection_sample_method": (lambda v: v.strip().lower() == "block",
                                "vLLM's block verification accepts a prefix as a whole, not token by token"),
    "speculative_accept_threshold_single": (lambda v: float(v) < 1,
                                            "SGLang accepts a draft token below the target's probability"),
    "speculative_accept_threshold_acc": (lambda v: float(v) < 1,
                                         "SGLang accepts a draft token below the target's probability"),
}
"""Engine settings under which the engine's acceptance is not exact speculative sampling (docs/numbers.md, "tau at
temperature T"): the setting's name -> (whether a value is one, what it changes)."""


def engine_settings_warning(settings: list[str]) -> str | None:
    """One line naming each of the declared engine `settings` (KEY=VALUE, `scoring.served_engine_settings`) under
    which the estimators are not exact (`INEXACT_ENGINE_SETTINGS`), None where there is none."""
    found = []
    for entry in settings:
        key, value = (part.strip() for part in entry.split("=", 1))
        rule = INEXACT_ENGINE_SETTINGS.get(key)
        try:
            inexact = rule is not None and rule[0](value)
        except ValueError:
            inexact = True  # not a number: it can not be told exact
        if inexact:
            found.append(f"{key}={value} ({rule[1]})")
    if not found:
        return None
    return ("the estimators are exact for token-by-token speculative sampling; the engine is served with "
            + "; ".join(found) + ": its tau is not these scores'")


def served_problems(config: ScoringConfig, sampling: Any, family: str | None, cache_path: str = "the cache") -> list[str]:
    """Why `config` can not score a cache sampled at `sampling` (a `cache.sampling.Sampling`, None: greedy) for a
    drafter of `family` (None: not known yet): scoring settings the cache was not sampled at, a draft rule the
    family is not served with at T > 0. One line each, naming the fix."""
    cache = {"temperature": 0.0, "top_p": 1.0, "top_k": 0} if sampling is None else {
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
    asked = {name: getattr(config, f"served_{name}") for name in cache if getattr(config, f"served_{name}") is not None}
    differ = {name: value for name, value in asked.items() if value != cache[name]}
    problems = draft_rule_problems(config, sampling, family)
    if differ:
        kind = "holds greedy answers" if sampling is None else "was sampled at " + ", ".join(
            f"{k} {v:g}" for k, v in cache.items())
        wanted = ", ".join(f"{k} {v:g}" for k, v in differ.items())
        flags = " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in {**cache, **asked}.items()
                         if v != {"temperature": 0.0, "top_p": 1.0, "top_k": 0}[k])
        problems.append(f"{cache_path} {kind}, but scoring asks for {wanted}: a cache's streaks are tau at its own "
                        f"settings only; extract a cache at yours (dflash-callbacks extract {flags or '(greedy)'}) or "
                        f"leave scoring.served_{', scoring.served_'.join(differ)} unset")
    return problems


def draft_rule_problems(config: ScoringConfig, sampling: Any, family: str | None) -> list[str]:
    """Why a drafter of `family` can not be scored under `config.draft_rule` at a sampled cache's temperature."""
    if family in PROBABILISTIC_REFUSED and config.draft_rule == "probabilistic" and sampling is not None:
        return [f"scoring.draft_rule 'probabilistic' can not be scored for a {family} drafter: "
                f"{PROBABILISTIC_REFUSED[family]}; score draft_rule 'greedy' (vLLM's default)"]
    return []


@dataclass(frozen=True)
class ServedDraft:
    """How a drafter's proposals are drawn as the cache's requests are served: `temperature` the cache's (0: a
    greedy cache), `sampled` whether the proposal is a draw from q (`SAMPLED_FAMILIES`), `coin_seed` the seed of
    the acceptance coins the live schedule draws."""

    family: str
    temperature: float
    sampled: bool
    coin_seed: int = 0

    @classmethod
    def of(cls, config: ScoringConfig, sampling: Any, family: str) -> ServedDraft:
        temperature = 0.0 if sampling is None else sampling.temperature
        rule = SAMPLED_FAMILIES.get(family)
        sampled = temperature > 0 and (rule == "always" or rule == config.draft_rule)
        return cls(family, temperature, sampled, config.coin_seed)

    @property
    def head_temperature(self) -> float | None:
        """The temperature the LM-head statistics must carry (`Drafter.slot_stats(temperature=)`): DFlash's
        probabilistic draft reads softmax(z / T) of the label; None where no tempered statistic is read."""
        return self.temperature if self.sampled and self.family != "dflash2" else None

    def label_logq(self, stats) -> torch.Tensor:
        """[M] log q of each row's label at the served temperature, given the true token before it (-inf: a label
        the proposal can not draw): DFlash 2, the selector's softmax(score / T) over the K candidates (0 off
        them); DFlash, the tempered head statistics' label log-prob."""
        import torch

        if self.family == "dflash2":
            logq = (stats.candidate_scores / self.temperature).log_softmax(-1)
            found = stats.label_index >= 0
            return torch.where(found, logq.gather(1, stats.label_index.clamp(min=0)[:, None])[:, 0], float("-inf"))
        return stats.tempered_label_logprob

    def acceptance(self, stats, target_logprob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """float64 [n, P] c = min(1, q / p) of each slot of n blocks: `target_logprob` [n, P] log p of the label
        (the cache's), `valid` [n, P]; 0 where the label is past the text (or not draftable)."""
        import torch

        logq = self.label_logq(stats).view(valid.shape).double()
        accept = (logq - target_logprob.double()).clamp(max=0).exp()
        return torch.where(valid, accept, 0.0)


def coins(seed: int, task: str, anchors: int, slots: int) -> np.ndarray:
    """float64 [anchors, slots] uniforms in [0, 1): slot j's coin at the i-th scored anchor of `task`, from a
    generator seeded with (seed, task, j) alone: the same for every drafter, method and block size, and a
    window that scores fewer anchors takes the first of them."""
    key = zlib.crc32(task.encode())
    return np.stack([np.random.default_rng([seed, key, j]).random(anchors) for j in range(slots)], axis=1) \
        if slots else np.zeros((anchors, 0))


@dataclass(frozen=True)
class Expected:
    """One task's sampled-draft method: `drawn` int64 [n] the streak of one draw of the coins, `expected`
    float64 [n] the expected streak, `reach` float64 [n, P] the chance of reaching each depth."""

    drawn: np.ndarray
    expected: np.ndarray
    reach: np.ndarray


def expected_streaks(accept: np.ndarray, uniforms: np.ndarray) -> Expected:
    """From c [n, P] (`ServedDraft.acceptance`) and coins [n, P]: the streak of the draw (a slot accepted where
    its coin is below c, the streak the run of accepted slots), the expected streak sum_k prod_{j<=k} c_j, and
    prod_{j<=d} c_j for each depth d."""
    reach = np.cumprod(accept, axis=1)
    drawn = np.cumprod(uniforms < accept, axis=1).sum(axis=1).astype(np.int64)
    return Expected(drawn, reach.sum(axis=1), reach)



def slot_chances(served: ServedDraft, stats, features: torch.Tensor, weight: torch.Tensor, vocab_ids: torch.Tensor | None,
                 target_logprob: torch.Tensor, support: tuple[torch.Tensor, torch.Tensor],
                 inside: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (c [n, P], alpha [n, P]) of each slot of n blocks on a cache that keeps the served support
    (`support`: ids and probs [n, P, S] of each label's position, target ids): c the chance the slot is accepted
    given its emitted token, the cached label (an argmax draft: 1 where the label is the draft, else 0; a
    sampled one min(1, q / p)), and alpha its chance given only the text before it, sum_x min(p(x), q(x)) over
    the served support (an argmax draft d: p(d)). 0 outside `inside` (past the text, past a confidence cut).
    `features` [n, P, H'] and `weight` the draft head's rows (`vocab_ids`: their target ids, None: all)."""
    import torch

    ids, probs = (t.to(inside.device) for t in support)
    n, depth, size = ids.shape
    rows = features.flatten(0, 1)
    if not served.sampled:
        from ..kernels.head_stats import head_topk

        draft = head_topk(rows, weight, 1).ids[:, 0]
        draft = (draft if vocab_ids is None else vocab_ids.to(draft.device)[draft]).view(n, depth, 1)
        alpha = (probs.double() * (ids.long() == draft)).sum(-1)
        accept = (stats.label_order.view(n, depth) == 0).double()
    else:
        accept = served.acceptance(stats, target_logprob, inside)
        if served.family == "dflash2":
            candidates = stats.candidate_ids if vocab_ids is None else vocab_ids.to(ids.device)[stats.candidate_ids]
            q = (stats.candidate_scores / served.temperature).softmax(-1).double().view(n, depth, -1)
            p = ((candidates.view(n, depth, -1, 1) == ids.long()[:, :, None, :]) * probs.double()[:, :, None, :]).sum(-1)
        else:  # softmax(z / T) at each support token the draft vocabulary holds
            index = ids.long().clamp(min=0) if vocab_ids is None else \
                torch.searchsorted(vocab_ids.to(ids.device), ids.long().clamp(min=0)).clamp(max=weight.shape[0] - 1)
            held = (ids >= 0) & (True if vocab_ids is None else vocab_ids.to(ids.device)[index] == ids.long())
            logits = torch.einsum("mh,msh->ms", rows.float(), weight[index.view(n * depth, size)].float())
            logq = logits.double() / served.temperature - stats.tempered_lse.double()[:, None]
            q = torch.where(held.view(n * depth, size), logq.exp(), 0.0).view(n, depth, size)
            p = probs.double()
        alpha = torch.minimum(p, q).sum(-1)
    return torch.where(inside, accept, 0.0), torch.where(inside, alpha, 0.0)


@dataclass(frozen=True)
class Conditional:
    """One task's method on a cache that keeps the served support: `expected` float64 [n] the expected streak
    at each anchor with each streak term's last factor replaced by its expectation given the text before it,
    sum_k prod_{j<k} c_j alpha_k; `reach` [n, P] the same per depth (the curve); `visits` [n] how often the live
    schedule takes each anchor in expectation over the acceptance coins (`expected_visits`)."""

    expected: np.ndarray
    reach: np.ndarray
    visits: np.ndarray


def conditional_streaks(accept: np.ndarray, alpha: np.ndarray) -> Conditional:
    """From c and alpha [n, P] (`slot_chances`)."""
    before = np.concatenate([np.ones((len(accept), 1)), np.cumprod(accept, axis=1)[:, :-1]], axis=1)
    reach = before * alpha
    return Conditional(reach.sum(axis=1), reach, expected_visits(accept))


def expected_visits(accept: np.ndarray) -> np.ndarray:
    """float64 [n]: the chance the live schedule, from the first anchor, takes each anchor as a round's anchor,
    its coins drawn with the chances c [n, P] (a dynamic programme over the anchors, O(n P)): anchor a moves the
    schedule to a + k + 1 with the chance that its streak is k, prod_{j<=k} c_j (1 - c_{k+1})."""
    n, depth = accept.shape
    survive = np.concatenate([np.ones((n, 1)), np.cumprod(accept, axis=1)], axis=1)  # P(streak >= k), k = 0..P
    streak = survive - np.concatenate([survive[:, 1:], np.zeros((n, 1))], axis=1)  # P(streak == k)
    visits = np.zeros(n + depth + 1)
    visits[0] = 1.0
    for a in range(n):
        if visits[a]:
            visits[a + 1 : a + depth + 2] += visits[a] * streak[a]
    return visits[:n].clip(0.0, 1.0)  # a chance: the sums' rounding can pass 1 by an ulp

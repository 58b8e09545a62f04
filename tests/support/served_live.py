"""Live speculative sampling with a DFlash or DFlash 2 drafter: what a served request does, round by round.

A round at anchor a (the last token so far, tok[a]): the drafter sees the target's hidden
states at its `target_layer_ids` for the context [0, a) and its block [tok[a], MASK x (B-1)]
at positions a..a+B-1 (as in `cache.extract` and the scorer), and proposes one token per slot:
its argmax ("argmax", vLLM's default `draft_sample_method="greedy"`; the verifier then treats
the draft as certain, q = one-hot) or a draw from its tempered distribution softmax(logits / T)
("sample", vLLM's "probabilistic": the temperature only, no top-k or top-p). A DFlash 2 drafter
proposes by its selector walk (`selector_walk`): slot j's K candidates scored given the token
proposed at j - 1 (the anchor for slot 0), the argmax ("argmax") or a draw from softmax(score / T)
over them ("sample": what vLLM serves at T > 0), q that softmax placed on the candidates' ids and 0
elsewhere. The target runs one forward over the text and the drafts and verifies them with
standard speculative sampling at the served settings (`cache.sampling.served_logprobs`): draft
d at slot j is accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection the
token is drawn from max(0, p_j - q_j) normalised; when every draft is accepted, a bonus token
from the next p. The round's tau is its accepted drafts + 1. Every coin comes from the one
torch.Generator the caller gives.

The text ends at EOS or after `max_new_tokens` completion tokens, and a round counts only the
drafts it keeps: those up to the first EOS and inside the length limit, as the scorer counts a
streak only over labels inside the cached text (its tau there is streak + 1 as well). So on a
cache whose answers the target sampled at the same settings, the scorer's `live` rounds
follow the same law as these rounds (argmax rule): the served tau, estimated offline.

Decoding runs on the CPU. The target keeps a KV cache of the text before the anchor: each
round forwards the block (the anchor and the drafts) and then drops the rejected positions.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transformers import DynamicCache

from dflash_callbacks.cache.extract import cache_argument, crop_cache, load_target, prompt_token_ids, resolve_tasks, stop_token_ids
from dflash_callbacks.cache.sampling import Sampling, served_logprobs
from dflash_callbacks.cache.tasks import Task
from dflash_callbacks.checks import check_choice
from dflash_callbacks.model import DFlashDrafter
from dflash_callbacks.scoring.intervals import CONFIDENCE, t_quantile

DRAFT_RULES = ("argmax", "sample")
LIVE_FAMILIES = ("dflash", "dflash2")
"""The families the loop proposes for: DFlash's slots read no predecessor, DFlash 2's walk reads its own."""


@dataclass
class LiveRun:
    """One request decoded live: its prompt's task, the text (prompt, then completion) and each round's tau."""

    task: str
    prompt_len: int
    tokens: list[int]
    taus: list[int]


def selector_walk(stats, vocab: int, temperature: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [P], q [P, vocab]) of a DFlash 2 block from its selector statistics (`slot_stats` of one block, whose
    `edge_scores` [P, K, K] score each slot's candidates given each candidate of the slot before, slot 0 given
    the anchor): from row 0, each slot takes the argmax (temperature 0; the lower index on ties) or a draw from
    softmax(score / T) of its row, and the next slot reads the row of what it took. q: one-hot, or that softmax
    on the candidates' ids."""
    ids, edges = stats.candidate_ids, stats.edge_scores
    drafts, q, row = [], torch.zeros(len(ids), vocab), 0
    for j in range(len(ids)):
        scores = edges[j, row].float()
        if temperature == 0:
            row = int(scores.argmax())
            q[j, ids[j, row]] = 1.0
        else:
            probs = (scores / temperature).softmax(-1)
            row = int(torch.multinomial(probs, 1, generator=generator))
            q[j, ids[j]] = probs
        drafts.append(int(ids[j, row]))
    return torch.tensor(drafts), q


def speculative_verify(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                       generator: torch.Generator) -> tuple[int, int]:
    """Standard speculative sampling of one block: `p` [B, V] the target's served distribution at
    the B-1 draft slots and then after the last one, `q` [B-1, V] the drafter's proposal at each
    slot, `drafts` [B-1]. Returns (accepted drafts, the token emitted after them): the draft at
    slot j is accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection the token
    comes from max(0, p_j - q_j) normalised; with all accepted, the bonus token from p[B-1]."""
    for j, d in enumerate(drafts.tolist()):
        if torch.rand((), generator=generator) * q[j, d] < p[j, d]:
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        if not residual.sum() > 0:  # p_j == q_j up to rounding: a rejection was a rounding error, draw from p
            residual = p[j]
        return j, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


@torch.no_grad()
def live_decode(
    model,
    drafter: DFlashDrafter,
    prompt: Sequence[int],
    sampling: Sampling,
    generator: torch.Generator,
    *,
    max_new_tokens: int,
    eos: Sequence[int],
    draft_rule: str = "argmax",
    task: str = "",
) -> LiveRun:
    """Decode one request from the token ids `prompt` with the target `model` (a transformers
    causal LM on the CPU) verifying `drafter`'s blocks (DFlash or DFlash 2) at the served `sampling` settings."""
    check_choice("draft_rule", draft_rule, DRAFT_RULES)
    check_choice("the live loop's drafter family", drafter.family, LIVE_FAMILIES)
    layer_ids = drafter.config.target_layer_ids
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    B, mask = drafter.block_size, drafter.mask_token_id
    tempered = Sampling(sampling.temperature)  # the drafter's proposal: its logits / T, nothing cut
    prompt, eos = [int(t) for t in prompt], {int(t) for t in eos}
    limit = len(prompt) + max_new_tokens
    kv, cache_arg = DynamicCache(), cache_argument(model)

    def target(new: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward the tokens `new` after those in the KV cache: the served distribution after
        each of the last `rows` of them [rows, V], and the drafter's features of each [len(new), F]."""
        out = model(input_ids=torch.tensor([new]), output_hidden_states=True, use_cache=True, **{cache_arg: kv})
        features = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        return served_logprobs(out.logits[0, -rows:], sampling).exp(), features

    p, features = target(prompt, 1)  # the cache and the features: [0, P)
    ids = prompt + [int(torch.multinomial(p[-1], 1, generator=generator))]
    taus: list[int] = []
    while len(ids) < limit and ids[-1] not in eos:
        a = len(ids) - 1
        context = drafter.encode_context(features[None, :a], torch.arange(a)[None])
        block = torch.tensor([[ids[a]] + [mask] * (B - 1)])
        hidden = drafter.decode_blocks(context, embed(block), torch.tensor([a]))[:, 1:]  # [1, B-1, H]
        if drafter.family == "dflash2":
            stats = drafter.slot_stats(hidden, lm_head.weight, torch.zeros(1, B - 1, dtype=torch.long),
                                       torch.tensor([[ids[a]] * (B - 1)]), 0)
            drafts, q = selector_walk(stats, lm_head.weight.shape[0], sampling.temperature if draft_rule == "sample" else 0,
                                      generator)
        elif draft_rule == "argmax":
            logits = lm_head(hidden[0])  # [B-1, V]
            drafts = logits.argmax(dim=-1)
            q = torch.nn.functional.one_hot(drafts, logits.shape[-1]).float()
        else:
            q = served_logprobs(lm_head(hidden[0]), tempered).exp()
            drafts = torch.multinomial(q, 1, generator=generator)[:, 0]
        p, block_features = target([ids[a], *drafts.tolist()], B)  # positions a .. a+B-1
        accepted, token = speculative_verify(p, q, drafts, generator)
        emitted = (drafts[:accepted].tolist() + [token])[: limit - len(ids)]
        ends = [i for i, t in enumerate(emitted) if t in eos]
        emitted = emitted[: ends[0] + 1] if ends else emitted
        taus.append(min(accepted, len(emitted)) + 1)
        ids += emitted
        # the next anchor is a + accepted + 1: keep the context [0, a + accepted] (the text's), drop the rest
        features = torch.cat([features, block_features[: accepted + 1]])
        crop_cache(kv, a + accepted + 1)
    return LiveRun(task, len(prompt), ids, taus)


def live_runs(
    target: str | os.PathLike,
    drafter: DFlashDrafter,
    tasks: str | os.PathLike | Sequence[Task],
    sampling: Sampling,
    *,
    runs_per_prompt: int,
    max_new_tokens: int,
    seed: int = 0,
    draft_rule: str = "argmax",
    chat_template: bool = True,
) -> list[LiveRun]:
    """`runs_per_prompt` live requests per prompt of `tasks` (prompts made as `extract` makes
    them), all coins from one torch.Generator seeded with `seed`; the target in float32 on the CPU."""
    model, tokenizer = load_target(target)
    eos, _ = stop_token_ids(model, tokenizer)
    drafter = drafter.to(device="cpu", dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    runs = []
    for task in resolve_tasks(tasks):
        prompt = prompt_token_ids(tokenizer, task.prompt, chat_template)
        for _ in range(runs_per_prompt):
            runs.append(live_decode(model, drafter, prompt, sampling, generator, max_new_tokens=max_new_tokens, eos=eos,
                                    draft_rule=draft_rule, task=task.name))
    return runs


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high): the mean of independent values and its Student-t interval."""
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 values, got {n}")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def live_tau(runs: Sequence[LiveRun]) -> tuple[float, float, float]:
    """(mean, low, high) of the runs' mean tau per round: the statistic of a report's `live` mean
    (the mean over tasks of each task's mean round), each run standing for one task. Runs
    without a round (the first token was EOS) have no tau, as the scorer has no anchor there."""
    return mean_interval([sum(r.taus) / len(r.taus) for r in runs if r.taus])

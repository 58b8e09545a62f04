"""Timed greedy decoding with the real target and a real KV cache: plain, and speculative with a block drafter
(a chain of its argmaxes, or a DDTree tree), from the pieces the profile times (`rounds`). What the predicted
speed-up (`scoring.speed`) is checked against: `benchmarks/bench_speedup.py`, `tests/unit/test_speedup_live.py`.

Both decoders time what follows the prompt's prefill (the same work for both: the target's forward over the
prompt, and the drafter's context keys and values of it), until the text holds `limit` tokens or ends at EOS.
A speculative round emits the accepted drafts and the target's bonus token, so on the same prompt both make the
same greedy text (`Decoded.tokens`), and the speed-up measured is the plain decoder's seconds over the
speculative one's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .rounds import Speculator, accept, chain, tree


@dataclass
class Decoded:
    """One decoded text: its tokens (prompt first), the tau of each round (1 per token for plain decoding), the
    seconds after the prefill, and those seconds split by phase (speculative: draft, verify, overhead)."""

    tokens: list[int]
    taus: list[int]
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)


def _prefill(spec: Speculator, prompt: Sequence[int]) -> tuple[DynamicCache, list[int], torch.Tensor]:
    kv = DynamicCache()
    n = len(prompt)
    nxt, features = spec.verify(kv, torch.tensor([list(prompt)], device=spec.device), list(range(n)),
                                list(range(-1, n - 1)))
    return kv, [*prompt, int(nxt[0, -1])], features


def _sync(spec: Speculator) -> None:
    if spec.device.type == "cuda":
        torch.cuda.synchronize(spec.device)


@torch.no_grad()
def plain_decode(spec: Speculator, prompt: Sequence[int], limit: int, eos: Sequence[int],
                 clock: Callable[[], float] = time.perf_counter) -> Decoded:
    """Greedy decoding, one target forward per token, until `limit` tokens or EOS (seconds by `clock`)."""
    kv, ids, _ = _prefill(spec, prompt)
    eos = set(eos)
    _sync(spec)
    start = clock()
    while len(ids) < limit and ids[-1] not in eos:
        nxt, _ = spec.verify(kv, torch.tensor([[ids[-1]]], device=spec.device), [0], [-1])
        ids.append(int(nxt[0, 0]))
    _sync(spec)
    return Decoded(ids, [1] * (len(ids) - len(prompt) - 1), clock() - start)


@torch.no_grad()
def speculative_decode(spec: Speculator, prompt: Sequence[int], limit: int, eos: Sequence[int], block: int,
                       budget: int | None = None, clock: Callable[[], float] = time.perf_counter) -> Decoded:
    """Greedy speculative decoding at block size `block`: each round drafts, verifies the chain of the drafter's
    argmaxes (`budget` None) or DDTree's tree of `budget` nodes in one target forward, and keeps the accepted
    drafts and the bonus token, until `limit` tokens or EOS."""
    kv, ids, features = _prefill(spec, prompt)
    context, _ = spec.draft(None, features, 0, torch.tensor([ids[-1]], device=spec.device),
                            torch.tensor([len(ids) - 1], device=spec.device), block)  # the prompt's context
    new, start_at, eos = features[:, :0], len(prompt), set(eos)
    taus, phases = [], {"draft": 0.0, "verify": 0.0, "overhead": 0.0}
    _sync(spec)
    start = clock()
    while len(ids) < limit and ids[-1] not in eos:
        a = len(ids) - 1
        t0 = clock()
        context, slots = spec.draft(context, new, start_at, torch.tensor([ids[a]], device=spec.device),
                                    torch.tensor([a], device=spec.device), block)
        logprobs = spec.logprobs(slots[0])
        _sync(spec)
        t1 = clock()
        proposal = chain(ids[a], logprobs) if budget is None else tree(ids[a], logprobs, budget)
        t2 = clock()
        nxt, verified = spec.verify(kv, torch.tensor([proposal.tokens], device=spec.device), proposal.depths,
                                    proposal.parents)
        _sync(spec)
        t3 = clock()
        path, bonus = accept(proposal, nxt[0].tolist())
        kept = [0, *path]
        spec.commit(kv, a, kept)
        new, start_at = verified[:, kept], a
        emitted = ([proposal.tokens[i] for i in path] + [bonus])[: limit - len(ids)]
        ends = [i for i, t in enumerate(emitted) if t in eos]
        emitted = emitted[: ends[0] + 1] if ends else emitted
        ids += emitted
        taus.append(len(path) + 1)
        t4 = clock()
        phases["draft"] += t1 - t0
        phases["verify"] += t3 - t2
        phases["overhead"] += (t2 - t1) + (t4 - t3)
    _sync(spec)
    return Decoded(ids, taus, clock() - start, phases)

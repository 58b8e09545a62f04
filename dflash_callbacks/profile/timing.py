"""`profile_costs`: a device's `Costs`, timed with real forwards of the real models (`rounds`' pieces).

Each piece is run `warmup` times, then timed `repeats` times, all pieces in turns (synchronising the device
around each on a GPU), and the mean of its times kept, the fastest and slowest tenth left out (`trimmed_mean`):
- verify: the target's forward of n = 1 .. N query tokens (a chain; the mask's size, not its pattern, sets the
  cost) after a KV cache of each context length L, N the most tokens a scored method verifies;
- draft: the drafter's round at each block size B at the middle context length: its context grown by B // 2
  committed tokens (about a round's), the block forward, the head's log-probs (DFlash 2: its selector, timed
  apart);
- overhead: the round's bookkeeping at each block size: the chain's argmax, or DDTree's tree of each node budget
  (top@k: the tree of k x P nodes), the acceptance walk, and the KV cache cut back to the accepted path (a
  branch's gathered).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .. import __version__
from ..checks import dtype_name
from ..scoring.costs import Costs
from .rounds import Speculator, accept, chain, tree


def device_name(device: torch.device) -> str:
    """The device in words: the GPU's name, or the CPU's architecture and torch's threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine() or 'unknown'}, {torch.get_num_threads()} threads)"


@dataclass
class Piece:
    """What is timed: `run`, after `setup` (untimed), then `reset` (untimed)."""

    run: Callable[[], object]
    setup: Callable[[], object] | None = None
    reset: Callable[[], object] | None = None


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""How a piece's seconds are counted: wall-clock (what a user waits), or the calling thread's CPU time (on a CPU
with one torch thread, the same work without the time a busy machine's other processes take from it; what the
validation on a shared machine compares)."""


def piece_seconds(pieces: dict, device: torch.device, warmup: int, repeats: int, clock: str = "wall") -> dict:
    """The seconds of each piece of `pieces` (their `trimmed_mean`), timed in turns (one of each, `warmup` +
    `repeats` times), so that what else the machine does at a moment falls on every piece alike."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    now = CLOCKS[clock]
    times = {key: [] for key in pieces}
    for i in range(warmup + repeats):
        for key, piece in pieces.items():
            if piece.setup is not None:
                piece.setup()
            sync()
            start = now()
            piece.run()
            sync()
            if i >= warmup:
                times[key].append(now() - start)
            if piece.reset is not None:
                piece.reset()
    return {key: trimmed_mean(found) for key, found in times.items()}


def trimmed_mean(values: Sequence[float], cut: float = 0.1) -> float:
    """The mean of `values` without the `cut` share at each end: what a decoder's many rounds add up to (the time
    a busy machine takes away from a piece now and then is in it, a rare stall is not)."""
    ordered = sorted(values)
    drop = int(len(ordered) * cut)
    kept = ordered[drop : len(ordered) - drop]
    return sum(kept) / len(kept)


def verified_tokens(proposals: int, budgets: Sequence[int], topk: Sequence[int]) -> list[tuple[str, int]]:
    """(kind, n) of every round a block of `proposals` draft slots is verified in: the chain's proposals + 1,
    DDTree's N + 1 per budget, top@k's k x proposals + 1."""
    return ([("chain", proposals + 1)] + [("tree", n + 1) for n in budgets]
            + [("tree", k * proposals + 1) for k in topk])


@torch.no_grad()
def profile_costs(model, drafter, *, block_sizes: Sequence[int], ddtree_budgets: Sequence[int] = (4, 8),
                  topk: Sequence[int] = (), contexts: Sequence[int] = (128, 512, 2048), batch_size: int = 1,
                  repeats: int = 10, warmup: int = 3, baseline=None, source: str = "profile",
                  clock: str = "wall") -> Costs:
    """The costs of one speculative round of `drafter` (and `baseline`'s draft, where given) with the target
    `model` on their device, in their dtype, `batch_size` requests side by side, at each block size of
    `block_sizes` and every method `ddtree_budgets` and `topk` score; `clock`: "wall" (CLOCKS)."""
    if batch_size < 1 or repeats < 1 or warmup < 0 or not block_sizes or not contexts:
        raise ValueError(f"need batch_size >= 1, repeats >= 1, warmup >= 0 and some block sizes and contexts; got "
                         f"batch_size={batch_size}, repeats={repeats}, warmup={warmup}, block_sizes={list(block_sizes)}, "
                         f"contexts={list(contexts)}")
    contexts = sorted(set(int(c) for c in contexts))
    spec = Speculator(model.eval(), drafter.eval())
    device, b = spec.device, batch_size
    vocab = spec.embed.weight.shape[0]
    shapes = {B: verified_tokens(len(drafter.draft_rows(B)), ddtree_budgets, topk) for B in block_sizes}
    largest = max(n for per in shapes.values() for _, n in per)
    ids = lambda *shape: torch.randint(0, vocab, shape, device=device)  # noqa: E731

    def filled(length: int) -> tuple[DynamicCache, torch.Tensor]:
        kv = DynamicCache()
        _, features = spec.verify(kv, ids(b, length), list(range(length)), list(range(-1, length - 1)))
        return kv, features

    pieces = {}
    for L in contexts:
        kv, _ = filled(L)
        for n in range(1, largest + 1):
            pieces[("verify", L, n)] = Piece(
                lambda kv=kv, n=n: spec.verify(kv, ids(b, n), list(range(n)), list(range(-1, n - 1))),
                reset=lambda kv=kv, L=L: Speculator.commit(kv, L, []))  # back to the L cached tokens

    middle = statistics.median_low(contexts)
    kv, features = filled(middle + largest)
    Speculator.commit(kv, middle, [])
    anchors = torch.full((b,), middle, device=device)
    for role, d in (("draft", drafter), ("baseline_draft", baseline)):
        if d is None:
            continue
        other = Speculator(model, d.eval())
        for B in block_sizes:
            m = max(1, B // 2)
            grown, _ = other.draft(None, features[:, : middle - m], 0, ids(b), anchors, B)

            def one_round(other=other, grown=grown, B=B, m=m, d=d):
                _, slots = other.draft(grown, features[:, middle - m : middle], middle - m, ids(b), anchors, B)
                return slots if d.family == "dflash2" else other.logprobs(slots)

            pieces[(role, B)] = Piece(one_round)
            if role == "draft" and d.family == "dflash2":
                pieces[("selector", B)] = Piece(lambda slots=one_round(), other=other: other.selector(slots, ids(b)))

    for B, per in shapes.items():
        P = len(drafter.draft_rows(B))
        logprobs = torch.log_softmax(torch.randn(P, vocab, device=device), dim=-1)
        for kind, n in per:
            proposal = chain(0, logprobs) if kind == "chain" else tree(0, logprobs, n - 1)
            verified = spec.verify(kv, ids(1, len(proposal.tokens)), proposal.depths, proposal.parents)[1]
            Speculator.commit(kv, middle, [])
            # the target agrees with the first half of the tree's deepest path: a walk and a cut of its length
            deepest = max(range(len(proposal.tokens)), key=lambda i: proposal.depths[i])
            path = [deepest]
            while proposal.parents[path[-1]] > 0:
                path.append(proposal.parents[path[-1]])
            agreed = path[::-1][: max(1, len(path) // 2)]
            target_tokens = [0] * len(proposal.tokens)
            for parent, child in zip([0, *agreed], agreed):
                target_tokens[parent] = proposal.tokens[child]

            def bookkeeping(kind=kind, n=n, tokens=target_tokens, verified=verified):
                p = chain(0, logprobs) if kind == "chain" else tree(0, logprobs, n - 1)
                found, _ = accept(p, tokens)
                kept = [0, *found]
                Speculator.commit(kv, middle, kept)
                return verified[:, kept]

            pieces[(kind, B, n)] = Piece(  # each after a forward that filled the cache
                bookkeeping, setup=lambda p=proposal: spec.verify(kv, ids(1, len(p.tokens)), p.depths, p.parents),
                reset=lambda: Speculator.commit(kv, middle, []))

    if clock not in CLOCKS or (clock == "cpu" and device.type != "cpu"):
        raise ValueError(f"clock must be one of {list(CLOCKS)} ('cpu' on a CPU device only); got {clock!r}")
    found = piece_seconds(pieces, device, warmup, repeats, clock)
    verify = {L: [found[("verify", L, n)] for n in range(1, largest + 1)] for L in contexts}
    draft = {B: found[("draft", B)] for B in block_sizes}
    selector = {B: found[("selector", B)] for B in block_sizes if ("selector", B) in found}
    baseline_draft = None if baseline is None else {B: found[("baseline_draft", B)] for B in block_sizes}
    overhead = {"chain": {}, "tree": {}}
    for key, seconds in found.items():
        if key[0] == "chain":
            overhead["chain"][key[1]] = seconds
        elif key[0] == "tree":
            overhead["tree"].setdefault(key[1], {})[key[2]] = seconds

    config = model.config.get_text_config()
    dc = drafter.config
    return Costs(
        device=device_name(device), device_type=device.type, dtype=dtype_name(spec.head.dtype), batch_size=b,
        target={"hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                "num_layers": config.num_hidden_layers},
        drafter={"family": drafter.family, "hidden_size": dc.hidden_size, "num_layers": dc.num_hidden_layers},
        contexts=contexts, verify=verify, draft=draft, selector=selector, baseline_draft=baseline_draft,
        overhead=overhead, source=source, library_version=__version__, created=time.time(),
        extra={"repeats": repeats, "warmup": warmup, "torch": torch.__version__, "clock": clock},
    )

"""The `live` aggregate equals what real greedy speculative decoding measures.

A plain speculative-decoding loop with the toy target and the toy baseline drafter:
draft a block from the target's hidden states of the committed text, verify it with
the target, accept the matching prefix plus the bonus token, continue. Its per-round
tau must equal the report's `live_rounds` on the same prompt: for vanilla (a chain of
argmaxes) and for DDTree (the tree of Algorithm 1, walked along the target's greedy
tokens, as liranringel/ddtree verifies it); and for a drafter with a sliding layer, which
the loop runs as vLLM serves it (causal inside the block, the window counted from each
query) and the scorer scores the same way."""

import heapq
from dataclasses import replace

import pytest
import torch

from dflash_callbacks import DFlashDrafter, load_drafter
from dflash_callbacks.cache.extract import load_target
from dflash_callbacks.model import TargetHead
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_task, summarize
from dflash_callbacks.demos.toy.world import TOY_BASELINE_DIR, TOY_LAYER_IDS, build_toy_cache, toy_target_path


def ddtree_tree(logprobs: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """DDTree Algorithm 1: the `budget` best prefixes (sum of per-depth log-probs) over the
    top-min(budget, V) tokens of each depth of `logprobs` [B-1, V], as token-id tuples."""
    values, tokens = logprobs.double().topk(min(budget, logprobs.shape[-1]), dim=-1)
    values, tokens = values.tolist(), tokens.tolist()
    heap, tree = [(-values[0][0], (0,))], set()
    while heap and len(tree) < budget:
        neg, ranks = heapq.heappop(heap)
        tree.add(tuple(tokens[d][r] for d, r in enumerate(ranks)))
        depth, r = len(ranks), ranks[-1]
        parent = -neg - values[depth - 1][r]
        if r + 1 < len(values[0]):
            heapq.heappush(heap, (-(parent + values[depth - 1][r + 1]), ranks[:-1] + (r + 1,)))
        if depth < len(values):
            heapq.heappush(heap, (neg - values[depth][0], ranks + (0,)))
    return tree


@torch.no_grad()
def speculative_decode(target, drafter, head, prompt: torch.Tensor, total_len: int, budget: int | None = None):
    """Greedy speculative decoding until the text is `total_len` tokens long; returns
    the committed tokens and each round's (anchor, tau). budget None: vanilla (the
    drafter's argmax chain); else a DDTree tree of `budget` nodes."""
    B, mask = drafter.config.block_size, drafter.config.mask_token_id
    ids = prompt.tolist()
    first = target(torch.tensor([ids])).logits[0, -1].argmax()
    ids.append(int(first))  # the bonus token of the prefill: the first anchor
    rounds = []
    while len(ids) < total_len:
        a = len(ids) - 1
        states = target(torch.tensor([ids[:a]]), output_hidden_states=True).hidden_states
        context = torch.cat([states[i + 1] for i in TOY_LAYER_IDS], dim=-1)
        block = torch.tensor([[ids[a]] + [mask] * (B - 1)])
        out = drafter(context, head.embed_tokens(block), torch.arange(a + B)[None])
        logits = head.lm_head(out[0, 1:])
        if budget is None:
            drafts = logits.argmax(dim=-1).tolist()
            verify = target(torch.tensor([ids + drafts])).logits[0, a:].argmax(dim=-1).tolist()  # posterior at a..a+B-1
            accepted = 0
            while accepted < B - 1 and drafts[accepted] == verify[accepted]:
                accepted += 1
            new = drafts[:accepted] + [verify[accepted]]
        else:
            tree, new = ddtree_tree(torch.log_softmax(logits.float(), dim=-1), budget), []
            while True:  # follow the target's greedy token while the tree holds it
                token = int(target(torch.tensor([ids + new])).logits[0, -1].argmax())
                new.append(token)
                if tuple(new) not in tree:
                    break
            accepted = len(new) - 1
        ids += new
        rounds.append((a, accepted + 1))
    return ids, rounds


def with_a_sliding_layer(drafter, window: int):
    """The same weights with the first layer sliding (window `window`)."""
    config = replace(drafter.config, layer_types=["sliding_attention"] + drafter.config.layer_types[1:],
                     sliding_window=window)
    return DFlashDrafter.from_state_dict(config, drafter.state_dict())


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy coding10 cache (64 new tokens), the toy target, its head and the toy baseline."""
    cache = build_toy_cache(tmp_path_factory.mktemp("live") / "cache", tasks="coding10", max_new_tokens=64)
    target, _ = load_target(toy_target_path(), dtype=torch.float32)
    return cache, target, TargetHead.from_pretrained(toy_target_path()), load_drafter(TOY_BASELINE_DIR, dtype=torch.float32)


@pytest.mark.skipif(not (TOY_BASELINE_DIR / "model.safetensors").is_file(), reason="toy baseline not built")
@pytest.mark.parametrize("method, window, tasks", [("vanilla", None, 3), ("ddtree@4", None, 3), ("vanilla", 12, 1)])
def test_live_aggregate_equals_real_speculative_decoding(toy, method, window, tasks):
    cache, target, head, drafter = toy
    if window is not None:
        drafter = with_a_sliding_layer(drafter, window)
        assert drafter.attention[0].causal and drafter.attention[0].window == window
    budget = None if method == "vanilla" else int(method.split("@")[1])
    config = ScoringConfig(ddtree_budgets=[budget] if budget else [], device="cpu", max_rounds=1000)
    checked_rounds, other_rule_differs = 0, window is None
    for name in cache.task_names[:tasks]:
        task = cache.task(name)
        T, P, B = task.num_tokens, task.prompt_len, drafter.config.block_size
        streaks = score_task(drafter, head, task, config, B)
        report_rounds = summarize(streaks, config, dict.fromkeys(streaks.streaks, B))[method]["live_rounds"]
        ids, live = speculative_decode(target, drafter, head, task.input_ids[:P], T, budget)
        assert ids[:T] == task.input_ids.tolist()  # the same greedy text
        # rounds whose block lies inside the cached text are comparable one to one
        inside = [tau for a, tau in live if a + B - 1 <= T - 1]
        assert report_rounds[: len(inside)] == inside
        checked_rounds += len(inside)
        assert max(inside) > 1  # the drafter does get tokens accepted: the comparison is not vacuous
        if window is not None:  # scored bidirectionally (as before), the same drafter gives other rounds
            other = score_task(drafter, head, task, replace(config, attention="bidirectional"), B)
            other_rule_differs |= not torch.equal(other.streaks[method], streaks.streaks[method])
    assert checked_rounds >= 5 * tasks and other_rule_differs

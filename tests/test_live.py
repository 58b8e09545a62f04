"""The `live` aggregate equals what real greedy speculative decoding measures.

A plain speculative-decoding loop with the toy target and the toy baseline drafter:
draft a block from the target's hidden states of the committed text, verify it with
the target, accept the matching prefix plus the bonus token, continue. Its per-round
tau must equal the report's `live_rounds` for vanilla on the same prompt."""

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.cache.extract import load_target
from dflash_callbacks.model import TargetHead
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_task, summarize
from dflash_callbacks.demos.toy.world import TOY_BASELINE_DIR, TOY_LAYER_IDS, build_toy_cache, toy_target_path


@torch.no_grad()
def speculative_decode(target, drafter, head, prompt: torch.Tensor, total_len: int):
    """Greedy speculative decoding until the text is `total_len` tokens long; returns
    the committed tokens and each round's (anchor, tau)."""
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
        drafts = head.lm_head(out[0, 1:]).argmax(dim=-1).tolist()
        verify = target(torch.tensor([ids + drafts])).logits[0, a:].argmax(dim=-1).tolist()  # posterior at a..a+B-1
        accepted = 0
        while accepted < B - 1 and drafts[accepted] == verify[accepted]:
            accepted += 1
        ids += drafts[:accepted] + [verify[accepted]]
        rounds.append((a, accepted + 1))
    return ids, rounds


@pytest.mark.skipif(not (TOY_BASELINE_DIR / "model.safetensors").is_file(), reason="toy baseline not built")
def test_live_aggregate_equals_real_speculative_decoding(tmp_path):
    cache = build_toy_cache(tmp_path / "cache", tasks="coding10", max_new_tokens=64)
    target, _ = load_target(toy_target_path(), dtype=torch.float32)
    drafter = load_drafter(TOY_BASELINE_DIR, dtype=torch.float32)
    head = TargetHead.from_pretrained(toy_target_path())
    config = ScoringConfig(ddtree_budgets=[], device="cpu", max_rounds=1000)
    checked_rounds = 0
    for name in cache.task_names[:3]:
        task = cache.task(name)
        T, P, B = task.num_tokens, task.prompt_len, drafter.config.block_size
        streaks = score_task(drafter, head, task, config, B)
        report_rounds = summarize(streaks, config, B)["vanilla"]["live_rounds"]
        ids, live = speculative_decode(target, drafter, head, task.input_ids[:P], T)
        assert ids[:T] == task.input_ids.tolist()  # the same greedy text
        # rounds whose block lies inside the cached text are comparable one to one
        inside = [tau for a, tau in live if a + B - 1 <= T - 1]
        assert report_rounds[: len(inside)] == inside
        checked_rounds += len(inside)
        assert max(inside) > 1  # the drafter does get tokens accepted: the comparison is not vacuous
    assert checked_rounds >= 10

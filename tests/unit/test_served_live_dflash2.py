"""DFlash 2 served live: its selector walk (the argmax at T = 0, a draw from softmax(score / T) over the K
candidates at T > 0, q those candidates' softmax) in the live speculative-sampling loop, held to vLLM's walk
on the fixture, to the scorer's greedy schedule at T = 0, and (slow) to the offline expected-streak estimate
on a sampled cache at T = 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_callbacks import load_drafter
from dflash_callbacks.cache.extract import extract_cache
from dflash_callbacks.cache.sampling import Sampling
from dflash_callbacks.cache.tasks import load_tasks
from dflash_callbacks.demos.toy.dflash2 import toy_dflash2_drafter
from dflash_callbacks.demos.toy.threads import torch_threads
from dflash_callbacks.demos.toy.world import TOY_LAYER_IDS, build_toy_cache, build_toy_training_cache, toy_target_path
from dflash_callbacks.model import TargetHead
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_drafter
from served_live import live_runs, live_tau, selector_walk

FAMILIES = Path(__file__).resolve().parents[1] / "fixtures" / "families"


@pytest.fixture(autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.mark.parametrize("case", ["dflash2-full", "dflash2-sliding"])
def test_the_walks_q_is_the_one_vllm_verifies_with(case):
    """Along the path vLLM's walk sampled at T = 0.8, `selector_walk`'s q at each slot is softmax of the draft
    logits vLLM caches for its verifier, over T; at T = 0 the walk is vLLM's greedy walk."""
    drafter = load_drafter(FAMILIES / case / "checkpoint")
    inputs, expected = (load_file(str(FAMILIES / case / f"{f}.safetensors")) for f in ("inputs", "expected"))
    tokens, anchors = inputs["context_input_ids"], inputs["anchors"]
    for i, a in enumerate(anchors.tolist()):
        stats = drafter.slot_stats(expected["hidden"][i : i + 1, 1:], inputs["target_lm_head"],
                                   torch.zeros(1, 4, dtype=torch.long), tokens[a].repeat(1, 4), 0)

        walked = expected["serve_T0.8_tokens"][i]
        q_want = (expected["serve_T0.8_draft_logits"][i] / 0.8).softmax(-1)
        rows = [(stats.candidate_ids[j] == walked[j]).int().argmax() for j in range(4)]
        row = 0
        for j in range(4):  # the walk's q at slot j is the softmax of the row of the candidate taken before
            scores = stats.edge_scores[j, row] / 0.8
            q = torch.zeros(97).index_put_((stats.candidate_ids[j],), scores.softmax(-1))
            torch.testing.assert_close(q, q_want[j], atol=2e-6, rtol=0)
            row = int(rows[j])
        drafts, q = selector_walk(stats, 97, 0, torch.Generator())
        assert torch.equal(drafts, expected["serve_greedy_tokens"][i]) and torch.equal(q.sum(-1), torch.ones(4))
        drafts, q = selector_walk(stats, 97, 0.8, torch.Generator().manual_seed(i))
        assert (q > 0).sum(-1).tolist() == [4] * 4 and torch.allclose(q.sum(-1), torch.ones(4))
        assert all(int(d) in stats.candidate_ids[j].tolist() for j, d in enumerate(drafts))


@pytest.fixture(scope="module")
def toy_dflash2(tmp_path_factory):
    """The toy DFlash 2 drafter, trained 40 steps on 16 answers to held-out requests (not coding10's)."""
    training = build_toy_training_cache(tmp_path_factory.mktemp("d2") / "train", n_sequences=16, seq_len=96,
                                        progress=False)
    return toy_dflash2_drafter(training.path, steps=40)


def test_at_temperature_0_the_dflash2_loop_decodes_the_greedy_text_on_the_scorers_schedule(toy_dflash2, tmp_path):
    tasks = load_tasks("coding10")[:2]
    cache = build_toy_cache(tmp_path / "greedy", tasks, max_new_tokens=40)
    report = score_drafter(toy_dflash2, cache, TargetHead.from_pretrained(toy_target_path()),
                           ScoringConfig(ddtree_budgets=[], device="cpu", max_rounds=40))
    for rule in ("argmax", "sample"):
        runs = live_runs(toy_target_path(), toy_dflash2, tasks, Sampling(), runs_per_prompt=1, max_new_tokens=40,
                         draft_rule=rule)
        for run in runs:
            assert run.tokens == cache.task(run.task).input_ids.tolist()
            assert run.taus == report.tasks[run.task]["vanilla"]["live_rounds"], rule
    assert report.mean["vanilla"]["dense"] > 1.2  # a drafter that drafts


@pytest.mark.slow
def test_the_live_mean_lies_in_the_offline_expected_estimates_interval(toy_dflash2, tmp_path):
    """T = 1, top-p 0.95, eight coding10 prompts, 48 new tokens: DFlash 2 served live (its walk sampled at T,
    verified with q over its candidates; 3 requests per prompt, seed 2, about 950 rounds) against the scorer on
    a cache of 5 answers per prompt sampled at those settings (seed 1): the live loop's mean lies in the offline
    live interval (its rounds on a draw of the acceptance coins, seed 0). Both are noisy estimates of one number:
    over 4 live seeds x 2 cache seeds x 2 coin seeds the interval held the live mean 14 times of 16."""
    sampling, tasks, n = Sampling(1.0, 0.95), load_tasks("coding10")[:8], 48
    runs = live_runs(toy_target_path(), toy_dflash2, tasks, sampling, runs_per_prompt=3, max_new_tokens=n, seed=2,
                     draft_rule="sample")
    live, lo, hi = live_tau(runs)
    cache = extract_cache(toy_target_path(), tmp_path / "sampled", tasks, TOY_LAYER_IDS, max_new_tokens=n,
                          progress=False, temperature=1.0, top_p=0.95, samples=5, seed=1)
    report = score_drafter(toy_dflash2, cache, TargetHead.from_pretrained(toy_target_path()),
                           ScoringConfig(ddtree_budgets=[], device="cpu", max_rounds=n))
    assert all("expected" in entry["vanilla"] for entry in report.tasks.values())
    low, high = report.intervals["mean"]["vanilla"]["live"]
    offline = report.mean["vanilla"]["live"]
    assert sum(len(r.taus) for r in runs) > 600 and len(cache) == 40 and live > 1.05
    assert low <= live <= high, f"live {live:.3f} [{lo:.3f}, {hi:.3f}] outside offline {offline:.3f} [{low:.3f}, {high:.3f}]"

"""The conditional estimators on a sampled cache that keeps the served support (scoring.acceptance): each streak
term's last factor its expectation given the text before it, alpha = sum_x min(p(x), q(x)) (p(d) for an argmax
draft d), and the live schedule's expected visits of each anchor over the acceptance coins, against brute-force
enumeration and a plain per-anchor reference on a real sampled toy cache."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.cache.extract import extract_cache
from dflash_callbacks.demos.toy.world import TOY_LAYER_IDS, toy_baseline_path
from dflash_callbacks.model import TargetHead
from dflash_callbacks.model.attention import resolve_attention
from dflash_callbacks.scoring.aggregates import decode_expected, pooled_numbers, task_streaks
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_drafter
from dflash_callbacks.scoring.acceptance import conditional_streaks, expected_visits


def test_expected_visits_are_the_schedules_visit_chances_by_enumeration():
    """Every assignment of the coins of 5 anchors x 2 slots, weighed by its chance: how often the schedule
    (a0 = 0, a <- a + streak + 1) takes each anchor equals the dynamic programme's visits."""
    rng = np.random.default_rng(0)
    accept = rng.uniform(0.1, 0.9, (5, 2))
    accept[1, 1] = 0.0  # a slot past the text
    n, depth = accept.shape
    want = np.zeros(n)
    for bits in itertools.product((0, 1), repeat=n * depth):
        coins = np.array(bits).reshape(n, depth)
        weight = np.prod(np.where(coins == 1, accept, 1 - accept))
        anchor = 0
        while anchor < n:
            want[anchor] += weight
            anchor += int(np.cumprod(coins[anchor]).sum()) + 1
    np.testing.assert_allclose(expected_visits(accept), want, rtol=1e-12, atol=1e-15)


def test_the_conditional_streak_is_unbiased_over_every_text():
    """An argmax draft d over 3 slots of independent served distributions p_k on 3 tokens: over every text,
    weighed by its chance, the conditional expected streak sum_k prod_{j<k} [x_j = d_j] p_k(d_k) averages the
    exact expected streak sum_k prod_{j<=k} p_j(d_j), as the indicator streak does, with less variance."""
    p = np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.7, 0.2, 0.1]])
    draft = [0, 1, 2]
    exact = sum(np.prod([p[j, draft[j]] for j in range(k + 1)]) for k in range(3))
    mean = second = indicator_second = 0.0
    for text in itertools.product(range(3), repeat=3):
        chance = np.prod([p[k, x] for k, x in enumerate(text)])
        accept = np.array([[float(x == d) for x, d in zip(text, draft)]])
        alpha = np.array([[p[k, draft[k]] for k in range(3)]])
        found = conditional_streaks(accept, alpha)
        assert found.reach.shape == (1, 3) and found.visits.tolist() == [1.0]
        mean += chance * found.expected[0]
        second += chance * found.expected[0] ** 2
        indicator_second += chance * float(np.cumprod(accept[0]).sum()) ** 2
    assert mean == pytest.approx(exact, rel=1e-12)
    assert second - mean ** 2 < indicator_second - exact ** 2


@pytest.fixture(scope="module")
def sampled_toy(tmp_path_factory, toy_target):
    """Two coding10 prompts' answers the toy target sampled at T = 0.7, top-p 0.95 (32 new tokens), with the
    served support; the toy baseline; the target's head."""
    from dflash_callbacks.cache.tasks import load_tasks

    tasks = load_tasks("coding10")[:2]
    cache = extract_cache(toy_target, tmp_path_factory.mktemp("sampled") / "cache", tasks, TOY_LAYER_IDS,
                          max_new_tokens=32, progress=False, temperature=0.7, top_p=0.95, seed=3)
    return cache, load_drafter(toy_baseline_path()), TargetHead.from_pretrained(toy_target)


@torch.no_grad()
def block_hidden(drafter, head, task, anchor_token: int, a: int) -> torch.Tensor:
    """The drafter's hidden states [B, H] of the block at anchor `a` (the anchor's token, then masks), read
    with the plain forward under the default rule: what both plain references below score."""
    block = torch.tensor([anchor_token] + [drafter.mask_token_id] * (drafter.block_size - 1))
    return drafter(task.hidden[:a][None], head.embed_tokens(block)[None], torch.arange(a + drafter.block_size)[None],
                   attention=resolve_attention(drafter.config, "auto"))[0]


def plain_conditional(drafter, head, task, rule: str, temperature: float):
    """Per anchor, one block through the drafter's forward: c_j (argmax: [label = d_j]; sampled: min(1, q / p) of
    the label) and alpha_j (argmax: p(d_j); sampled: sum over the served support of min(p, q)), q softmax(logits / T)."""
    ids, B, lm_head = task.input_ids, drafter.block_size, head.lm_head.weight
    support_ids, support_probs = task.support_ids.long(), task.support_probs.double()
    accept, alpha = [], []
    for a in range(task.prompt_len, task.num_tokens - 1):
        hidden = block_hidden(drafter, head, task, int(ids[a]), a)
        c, al = np.zeros(B - 1), np.zeros(B - 1)
        for j in range(B - 1):
            at = a + 1 + j
            if at >= task.num_tokens:
                break
            logits = (hidden[1 + j] @ lm_head.T).double()
            inside = support_ids[at] >= 0
            p = torch.zeros(logits.shape[0], dtype=torch.float64)
            p[support_ids[at][inside]] = support_probs[at][inside]
            label = int(ids[at])
            if rule == "greedy":
                d = int(logits.argmax())
                c[j], al[j] = float(label == d), float(p[d])
            else:
                q = (logits / temperature).softmax(-1)
                c[j] = min(1.0, float(q[label]) / float(task.target_logprob[at].double().exp()))
                al[j] = float(torch.minimum(p, q).sum())
        accept.append(c)
        alpha.append(al)
    return np.array(accept), np.array(alpha)


@pytest.mark.parametrize("rule", ["greedy", "probabilistic"])
def test_the_scorer_keeps_the_conditional_streaks_and_visits_of_a_plain_reference(sampled_toy, rule):
    """On the sampled toy cache: the report's expected streaks and visits are those of the plain reference's
    c and alpha (to the thousandths they are kept in); dense is their mean + 1, live and pooled the expected
    schedule's sum(visits x tau) / sum(visits); the report says the estimators are conditional. The same cache
    with max_rounds set, or estimators 'coins', is scored as before and says 'coin draws'."""
    cache, drafter, head = sampled_toy
    assert all(cache.task(n).support_ids is not None for n in cache.task_names)
    assert all(cache.entry(n)["support"]["size"] == 64 for n in cache.task_names)
    config = ScoringConfig(ddtree_budgets=[], device="cpu", draft_rule=rule)
    report = score_drafter(drafter, cache, head, config)
    assert report.estimators == "conditional" and "estimators: conditional" in report.served()
    top = drafter.block_size
    for name in cache.task_names:
        numbers = report.tasks[name]["vanilla"]
        accept, alpha = plain_conditional(drafter, head, cache.task(name), rule, 0.7)
        want = conditional_streaks(accept, alpha)
        np.testing.assert_allclose(decode_expected(numbers["expected"], top), want.expected, atol=5e-4 + 1e-6)
        np.testing.assert_allclose(decode_expected(numbers["visits"], 2), want.visits, atol=5e-4 + 1e-6)
        streaks = task_streaks(numbers, top)
        assert numbers["dense"] == pytest.approx(streaks.expected.mean() + 1, rel=1e-12)
        assert numbers["live"] == pytest.approx(pooled_numbers(streaks)[0], rel=1e-12)
        assert numbers["live"] == pytest.approx(
            float((streaks.visits * (streaks.expected + 1)).sum() / streaks.visits.sum()), rel=1e-12)
    from dflash_callbacks.scoring.basis import Basis

    assert Basis.of_run(config, cache, None).sampling == Basis.of_report(report).sampling
    assert Basis.of_report(report).sampling.endswith("estimators conditional")
    for other in (dataclasses.replace(config, max_rounds=30), dataclasses.replace(config, estimators="coins")):
        before = score_drafter(drafter, cache, head, other)
        assert before.estimators == "coin draws" and all("visits" not in e["vanilla"] for e in before.tasks.values())
        assert Basis.of_run(other, cache, None).sampling == Basis.of_report(before).sampling  # a pair of its own
        assert Basis.of_report(before).differences(Basis.of_report(report))


def test_the_served_support_is_bounded_and_its_dropped_mass_recorded(sampled_toy, tmp_path):
    """served_support keeps the S most probable tokens (ties to the lower id), -1 and 0 past the support, and
    the mass past the bound; the sampled toy cache's support is each drawn token's distribution (the token
    inside it, its probability the cached one); a greedy cache's task takes none."""
    import math

    from dflash_callbacks.cache.format import read_manifest, write_task
    from dflash_callbacks.cache.sampling import served_support

    uniform = torch.full((1, 100), -math.log(100))
    ids, probs, dropped = served_support(uniform, 64)
    assert ids[0].tolist() == list(range(64)) and float(dropped[0]) == pytest.approx(0.36, abs=1e-6)
    peaked = torch.tensor([[0.0, -math.inf, -math.inf]])
    ids, probs, dropped = served_support(peaked, 4)
    assert ids[0].tolist() == [0, -1, -1, -1] and probs[0].tolist() == [1.0, 0, 0, 0] and float(dropped[0]) == 0
    cache = sampled_toy[0]
    for name in cache.task_names:
        task, entry = cache.task(name), cache.entry(name)
        answer = slice(task.prompt_len, task.num_tokens)
        held = task.support_ids[answer].long() == task.input_ids[answer, None]
        assert bool(held.any(-1).all())  # every drawn token is in its support
        torch.testing.assert_close(task.support_probs[answer][held].log(), task.target_logprob[answer], atol=1e-5,
                                   rtol=1e-5)
        assert (task.support_ids[: task.prompt_len] == -1).all() and 0 <= entry["support"]["dropped"] < 1e-5
    assert "support" in read_manifest(cache.path)["tasks"][0]
    with pytest.raises(ValueError, match="a greedy cache's task takes no support"):
        from dflash_callbacks.cache.format import TargetInfo, new_manifest, open_for_writing

        folder = tmp_path / "greedy"
        open_for_writing(folder, new_manifest(TargetInfo("t", 2, 8, 16, "float32"), [1]))
        write_task(folder, "x", torch.arange(4), torch.zeros(4, 8), 2,
                   support=(torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2)))


@torch.no_grad()
def test_a_dflash2_slots_alpha_is_the_sum_of_min_p_q_over_the_served_support(tmp_path):
    """The DFlash 2 fixture on its text with vLLM's walks at T = 0.8 written in, with a made-up served support at
    each completion position (the cached token with p, twenty other tokens sharing 1 - p): alpha at every slot of every anchor is
    sum_x min(p(x), q(x)), q the selector's softmax(score / T) over the K candidates given the true token
    before the slot (0 elsewhere), and c min(1, q / p) of the cached token, as a plain per-block forward
    gives them; the report's expected streaks are those."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from dflash_callbacks.cache.format import HiddenStateCache, TargetInfo, new_manifest, open_for_writing, write_task
    from dflash_callbacks.cache.sampling import Sampling

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "families" / "dflash2-full"
    inputs = load_file(str(fixtures / "inputs.safetensors"))
    drafter = load_drafter(fixtures / "checkpoint")
    expected = load_file(str(fixtures / "expected.safetensors"))
    T, tokens = 0.8, inputs["context_input_ids"].clone()
    for i, a in enumerate(inputs["anchors"].tolist()):  # vLLM's walk sampled these: candidates given the one before
        tokens[a + 1 : a + 5] = expected["serve_T0.8_tokens"][i]
    target, folder = tmp_path / "target", tmp_path / "cache"
    target.mkdir()
    save_file({"model.embed_tokens.weight": inputs["target_embed_tokens"].contiguous(),
               "lm_head.weight": inputs["target_lm_head"].contiguous()}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64}))
    open_for_writing(folder, new_manifest(TargetInfo(str(target), 8, 64, 97, "float32"), [1, 3, 5],
                                          sampling=Sampling(T)))
    g = torch.Generator().manual_seed(0)
    n = tokens.numel()
    p = 0.05 + 0.9 * torch.rand(n, generator=g)
    ids = torch.full((n, 24), -1, dtype=torch.int32)
    probs = torch.zeros(n, 24)
    for t in range(3, n):
        others = [int(x) for x in torch.randperm(97, generator=g) if int(x) != int(tokens[t])][:20]
        ids[t, :21] = torch.tensor([int(tokens[t]), *others], dtype=torch.int32)
        probs[t, :21] = torch.tensor([float(p[t]), *(float(1 - p[t]) / 20,) * 20])
    logprob = torch.where(torch.arange(n) < 3, 0.0, probs[:, 0].clamp(min=1e-30).log()).float()
    write_task(folder, "fixture", tokens, inputs["target_hidden"], 3, target_logprob=logprob, sample=0,
               support=(ids, probs))
    cache, head = HiddenStateCache(folder), TargetHead.from_pretrained(target)
    report = score_drafter(drafter, cache, head, ScoringConfig(ddtree_budgets=[], device="cpu"))
    assert report.estimators == "conditional"
    task, B, lm_head = cache.task("fixture"), drafter.block_size, head.lm_head.weight
    sel, k = drafter.candidate_selector, drafter.settings.selector_top_k
    accept, alpha = [], []
    for a in range(task.prompt_len, task.num_tokens - 1):
        hidden = block_hidden(drafter, head, task, int(tokens[a]), a)
        c, al = np.zeros(B - 1), np.zeros(B - 1)
        for j in range(min(B - 1, task.num_tokens - 1 - a)):
            at, prev = a + 1 + j, int(tokens[a + j])
            logits = hidden[1 + j] @ lm_head.T
            cand = logits.topk(k).indices
            pair = (sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ hidden[1 + j])) @ \
                sel.successor_codebook[cand].T
            q = torch.zeros(97, dtype=torch.float64)
            q[cand] = ((logits[cand] + pair) / T).softmax(-1).double()
            served = torch.zeros(97, dtype=torch.float64)
            served[ids[at].long()] = probs[at].double()
            c[j] = min(1.0, float(q[int(tokens[at])] / served[int(tokens[at])]))
            al[j] = float(torch.minimum(served, q).sum())
        accept.append(c)
        alpha.append(al)
    want = conditional_streaks(np.array(accept), np.array(alpha))
    assert (np.array(alpha) > 0).any()
    assert np.abs(want.expected - np.cumprod(np.array(accept), axis=1).sum(axis=1)).max() > 0.01  # not c's
    np.testing.assert_allclose(decode_expected(report.tasks["fixture"]["vanilla"]["expected"], B), want.expected,
                               atol=5e-4 + 1e-5)
    np.testing.assert_allclose(decode_expected(report.tasks["fixture"]["vanilla"]["visits"], 2), want.visits,
                               atol=5e-4 + 1e-5)


def test_a_cache_where_some_tasks_keep_no_support_is_scored_with_the_coins_throughout(sampled_toy, tmp_path):
    """A sampled cache extracted before the support was kept and finished after (one task with it, one
    without): one estimator for the whole report, the coins', and the basis says so."""
    import shutil

    from dflash_callbacks.cache.format import HiddenStateCache, write_task
    from dflash_callbacks.scoring.basis import Basis

    cache, drafter, head = sampled_toy
    mixed = tmp_path / "mixed"
    shutil.copytree(cache.path, mixed)
    first = cache.task(cache.task_names[0])
    write_task(mixed, first.name, first.input_ids, first.hidden, first.prompt_len, target_logprob=first.target_logprob,
               sample=cache.entry(first.name)["sample"])
    mixed = HiddenStateCache(mixed)
    assert mixed.task(first.name).support_ids is None and mixed.task(mixed.task_names[1]).support_ids is not None
    config = ScoringConfig(ddtree_budgets=[], device="cpu")
    report = score_drafter(drafter, mixed, head, config)
    assert report.estimators == "coin draws" and all("visits" not in e["vanilla"] for e in report.tasks.values())
    assert Basis.of_run(config, mixed, None).sampling == Basis.of_report(report).sampling

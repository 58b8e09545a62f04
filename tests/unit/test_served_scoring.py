"""tau as served at T > 0 (scoring.acceptance): a sampled draft's chance of acceptance min(1, q / p) against
vLLM's own q (the DFlash 2 fixture's T = 0.8 tensors) and a plain per-anchor reference, the expected
streaks a report keeps, the coins live runs along, and the refusals."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_callbacks import load_drafter
from dflash_callbacks.callbacks.stopping import TrailingBaselineStop
from dflash_callbacks.cache.format import HiddenStateCache, TargetInfo, new_manifest, open_for_writing, write_task
from dflash_callbacks.cache.sampling import Sampling
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.engine.stop import Moment
from dflash_callbacks.model import TargetHead
from dflash_callbacks.model.attention import resolve_attention
from dflash_callbacks.scoring.aggregates import decode_expected, decode_streaks
from dflash_callbacks.scoring.basis import Basis
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.intervals import paired_comparison, report_intervals, taus
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.scorer import score_drafter, score_task
from dflash_callbacks.scoring.acceptance import ServedDraft, coins, expected_streaks
from made_reports import judged_by

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DFLASH2 = {"dflash2-full": "auto", "dflash2-sliding": "anchored-bidirectional"}  # the trainer's pattern
T = 0.8


def load_inputs() -> tuple[dict, dict]:
    folder = FIXTURES / "families" / "dflash2-full"
    return load_file(str(folder / "inputs.safetensors")), load_file(str(folder / "expected.safetensors"))


def served_logprob(tokens: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A made-up served log p of each completion token (prompt 3): p in [0.05, 0.95), 0 in the prompt."""
    p = 0.05 + 0.9 * torch.rand(tokens.numel(), generator=torch.Generator().manual_seed(seed))
    return torch.where(torch.arange(tokens.numel()) < 3, 0.0, p.log()).float()


def sampled_cache(root: Path, inputs: dict, tasks: dict[str, torch.Tensor], sampling: Sampling | None = Sampling(T)):
    """The target's head and a cache of the fixture's hidden states with `tasks`' tokens (20, prompt 3), sampled
    at `sampling` (None: a greedy cache)."""
    target, cache = root / "target", root / "cache"
    target.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": inputs["target_embed_tokens"].contiguous(),
               "lm_head.weight": inputs["target_lm_head"].contiguous()}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64}))
    open_for_writing(cache, new_manifest(TargetInfo(str(target), 8, 64, 97, "float32"), [1, 3, 5], sampling=sampling))
    for i, (name, tokens) in enumerate(tasks.items()):
        extra = {} if sampling is None else {"target_logprob": served_logprob(tokens, i), "sample": 0}
        write_task(cache, name, tokens, inputs["target_hidden"], 3, **extra)
    return TargetHead.from_pretrained(target), HiddenStateCache(cache)


def walked_tasks(inputs: dict, expected: dict) -> dict[str, torch.Tensor]:
    """The fixture's text, and per fixture anchor a copy whose tokens a+1 .. a+4 are the ones vLLM's walk
    sampled there at T = 0.8 (each a candidate of its slot given the one before)."""
    tokens = inputs["context_input_ids"]
    tasks = {"fixture": tokens}
    for i, a in enumerate(inputs["anchors"].tolist()):
        walked = tokens.clone()
        walked[a + 1 : a + 5] = expected["serve_T0.8_tokens"][i]
        tasks[f"a{a}"] = walked
    return tasks


@pytest.mark.parametrize("case", DFLASH2)
def test_a_dflash2_slots_chance_is_min_1_q_over_p_with_vllms_q(case, tmp_path):
    """Along the text vLLM's selector walk sampled at T = 0.8, the scorer's chance of acceptance at each slot is
    min(1, q / p) with q the distribution vLLM hands its verifier there (softmax of the cached draft logits / T,
    `serve_T0.8_draft_logits`) and p the cache's served probability of the token."""
    inputs, _ = load_inputs()
    expected = load_file(str(FIXTURES / "families" / case / "expected.safetensors"))
    drafter = load_drafter(FIXTURES / "families" / case / "checkpoint")
    tasks = walked_tasks(inputs, expected)
    head, cache = sampled_cache(tmp_path, inputs, tasks)
    config = ScoringConfig(ddtree_budgets=[], device="cpu", attention=DFLASH2[case])
    served = ServedDraft.of(config, cache.sampling, drafter.family)
    assert served.sampled and served.temperature == T
    for i, a in enumerate(inputs["anchors"].tolist()):
        task = cache.task(f"a{a}")
        accept = score_task(drafter, head, task, config, 5, served=served).accept["vanilla"][a - 3]
        q = (expected["serve_T0.8_draft_logits"][i] / T).softmax(-1)  # [4 slots, 97]
        tokens = expected["serve_T0.8_tokens"][i]
        p = task.target_logprob[a + 1 : a + 5].double().exp()
        want = torch.minimum(torch.ones(4, dtype=torch.float64), q[torch.arange(4), tokens].double() / p)
        torch.testing.assert_close(accept, want, atol=2e-5, rtol=1e-5)
        assert (want > 0).all() and (want < 1).any()  # every slot a candidate; the test tells min from q / p


@torch.no_grad()
def plain_expected_streaks(drafter, head, task, attention: str, temperature: float, rule: str) -> list[float]:
    """Per anchor, one block at a time through the drafter's forward, the chance of each slot written out:
    DFlash 2 (rule "selector"): the top-K of the slot's logits, score(c | true previous) = logit[c] +
    <pred[prev] * W h, succ[c]>, q = softmax(score / T) on the candidates; DFlash ("softmax"): softmax(logits / T).
    c = min(1, q(label) / p(label)); expected streak = sum_k prod_{j<=k} c_j over the labels inside the text."""
    ids, lp, B = task.input_ids, task.target_logprob.double(), drafter.block_size
    lm_head = head.lm_head.weight
    out = []
    for a in range(task.prompt_len, task.num_tokens - 1):
        block = torch.tensor([int(ids[a])] + [drafter.mask_token_id] * (B - 1))
        hidden = drafter(task.hidden[:a][None], head.embed_tokens(block)[None], torch.arange(a + B)[None],
                         attention=resolve_attention(drafter.config, attention))[0]
        total, run = 0.0, 1.0
        for j in range(B - 1):
            if a + 1 + j >= task.num_tokens:
                break
            label, prev = int(ids[a + 1 + j]), int(ids[a + j])
            logits = hidden[1 + j] @ lm_head.T
            if rule == "selector":
                sel, k = drafter.candidate_selector, drafter.settings.selector_top_k
                cand = logits.topk(k).indices
                pair = (sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ hidden[1 + j])) @ \
                    sel.successor_codebook[cand].T
                q = ((logits[cand] + pair) / temperature).softmax(-1)
                q_label = float(q[cand == label].sum())
            else:
                q_label = float((logits / temperature).softmax(-1)[label])
            run *= min(1.0, q_label / math.exp(float(lp[a + 1 + j])))
            total += run
        out.append(total)
    return out


@pytest.mark.parametrize("family", ["dflash2", "dflash-probabilistic"])
def test_the_expected_streaks_a_report_keeps_are_the_plain_per_anchor_ones(family, tmp_path):
    """dense = the mean expected tau (thousandths of a token kept per anchor), the strict reader holds the report
    to them; streaks are one draw of the coins and live runs along it; the curve is the mean chance of reaching
    each depth; the report records the cache's settings and the coin seed."""
    inputs, expected = load_inputs()
    if family == "dflash2":
        drafter, rule, config = load_drafter(FIXTURES / "families" / "dflash2-full" / "checkpoint"), "selector", {}
    else:
        drafter, rule = load_drafter(FIXTURES / "trainers" / "speculators-full" / "checkpoint"), "softmax"
        config = {"draft_rule": "probabilistic"}
    head, cache = sampled_cache(tmp_path, inputs, walked_tasks(inputs, expected))
    config = ScoringConfig(ddtree_budgets=[2], topk=[3], device="cpu", max_rounds=4, coin_seed=7, block_sizes=[3],
                           **config)
    report = score_drafter(drafter, cache, head, config)
    assert all(("expected" in numbers) == method.startswith("vanilla")
               for entry in report.tasks.values() for method, numbers in entry.items())
    assert report.cache["sampling"] == Sampling(T).to_dict() and report.scoring["coin_seed"] == 7
    for name in cache.task_names:
        numbers = report.tasks[name]["vanilla"]
        kept = decode_expected(numbers["expected"], 5)
        want = plain_expected_streaks(drafter, head, cache.task(name), "auto", T, rule)
        np.testing.assert_allclose(kept, want, atol=5e-4 + 1e-5)
        assert numbers["dense"] == pytest.approx(kept.mean() + 1, rel=1e-12)
        drawn = decode_streaks(numbers["streaks"], 5)
        assert numbers["live_rounds"][0] == drawn[0] + 1 and len(numbers["live_rounds"]) <= 4
        assert len(numbers["curve"]) == 4 and numbers["curve"][0] >= numbers["curve"][-1]
        assert "expected" not in report.tasks[name]["ddtree@2"]  # trees: the sampled token in the tree, integers
    assert any(0 < v < 4 and v != round(v) for n in cache.task_names
               for v in decode_expected(report.tasks[n]["vanilla"]["expected"], 5))
    again = EvalReport.from_dict(json.loads(report.to_json()))
    assert again.to_dict() == report.to_dict()
    raw = json.loads(report.to_json())
    text = raw["tasks"]["fixture"]["vanilla"]["expected"]
    raw["tasks"]["fixture"]["vanilla"]["expected"] = ("z" if text[0] != "z" else "0") + text[1:]
    with pytest.raises(ValueError, match="'dense' is .*expected streaks' mean tau|'expected' holds the streak"):
        EvalReport.from_dict(raw)
    other = score_drafter(drafter, cache, head, dataclasses.replace(config, coin_seed=8))
    assert other.mean["vanilla"]["dense"] == report.mean["vanilla"]["dense"]  # the expectation has no coins
    assert Basis.of_report(other).differences(Basis.of_report(report)) == [
        "served sampling temperature 0.8, top_p 1, top_k 0, draft rule "
        f"{config.draft_rule}, coin seed 7, estimators coin draws (this run: temperature 0.8, top_p 1, top_k 0, "
        f"draft rule {config.draft_rule}, coin seed 8, estimators coin draws)"]


def test_an_argmax_draft_keeps_integer_streaks_and_a_greedy_cache_every_report_as_it_was(tmp_path, capsys):
    """DFlash under vLLM's default draft rule proposes its argmax: at T > 0 its streaks on the sampled text are
    the served acceptance, integers, as before (no `expected`); so is DFlash 2 on a greedy cache."""
    inputs, expected = load_inputs()
    tasks = walked_tasks(inputs, expected)
    head, sampled = sampled_cache(tmp_path / "s", inputs, tasks)
    _, greedy = sampled_cache(tmp_path / "g", inputs, tasks, None)
    dflash = load_drafter(FIXTURES / "trainers" / "speculators-full" / "checkpoint")
    config = ScoringConfig(ddtree_budgets=[2], device="cpu")
    on_sampled, on_greedy = (score_drafter(dflash, c, head, config) for c in (sampled, greedy))
    for name in tasks:
        assert on_sampled.tasks[name] == on_greedy.tasks[name]  # the same tokens: the same streaks
        assert "expected" not in on_sampled.tasks[name]["vanilla"]
    assert "sampling" in on_sampled.cache and "sampling" not in on_greedy.cache
    assert Basis.of_report(on_sampled).sampling is not None and Basis.of_report(on_greedy).sampling is None
    on_sampled.to_json(tmp_path / "sampled.json")
    on_greedy.to_json(tmp_path / "greedy.json")
    assert cli_main(["compare", str(tmp_path / "sampled.json"), str(tmp_path / "greedy.json")]) == 2
    assert "was scored with served sampling none (a greedy cache) (this run: temperature 0.8, top_p 1, top_k 0, " \
        "draft rule greedy, coin seed 0, estimators coin draws)" in capsys.readouterr().err
    assert cli_main(["compare", str(tmp_path / "sampled.json"), str(tmp_path / "greedy.json"), "--force"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("ours: attention auto, cache temperature 0.8, top_p 1.0, top_k 0, samples 1, seed 0, "
                              "draft rule greedy, coin seed 0, estimators: coin draws; the drafter's patterns differ: trained bidirectional x3; "
                              "vllm causal x3; scored (auto) bidirectional x3")  # speculators' flag false: vLLM causal
    assert out[-1].startswith("drafter: attention auto, cache greedy;")
    dflash2 = load_drafter(FIXTURES / "families" / "dflash2-full" / "checkpoint")
    assert all("expected" not in entry["vanilla"] for entry in score_drafter(dflash2, greedy, head, config).tasks.values())


def test_the_coins_and_the_draw():
    """A slot's coin depends on (seed, task, slot) and the anchor's index alone: the same for any number of slots
    or anchors; the draw's streaks average the expected ones (Monte Carlo, 4 standard errors)."""
    first = coins(3, "task", 50, 4)
    assert first.shape == (50, 4) and ((first >= 0) & (first < 1)).all()
    np.testing.assert_array_equal(coins(3, "task", 20, 7)[:, :4], first[:20])
    assert not np.array_equal(coins(4, "task", 50, 4), first) and not np.array_equal(coins(3, "other", 50, 4), first)
    rng = np.random.default_rng(0)
    accept = rng.uniform(0.3, 1.0, (40, 6)) * (rng.random((40, 6)) > 0.1)
    found = expected_streaks(accept, first[:40, :4].repeat(2, axis=1)[:, :6])
    plain = [sum(np.prod(row[: k + 1]) for k in range(6)) for row in accept]
    np.testing.assert_allclose(found.expected, plain)
    draws = np.stack([expected_streaks(accept, coins(seed, "t", 40, 6)).drawn for seed in range(2000)])
    sd = draws.std(axis=0) / math.sqrt(len(draws))
    assert (np.abs(draws.mean(axis=0) - found.expected) <= 4 * sd + 1e-9).all()
    one_hot = expected_streaks(np.array([[1.0, 1, 0, 1], [0, 1, 1, 1]]), coins(0, "t", 2, 4))
    assert one_hot.drawn.tolist() == [2, 0] and one_hot.expected.tolist() == [2.0, 0.0]


def test_settings_the_cache_was_not_sampled_at_are_refused(tmp_path):
    """One line each naming the fix: another temperature, top-p or top-k than the cache's, a temperature for a
    greedy cache, T < 0 and top-p outside (0, 1] in the config itself, a probabilistic draft for DSpark."""
    inputs, expected = load_inputs()
    head, cache = sampled_cache(tmp_path / "s", inputs, {"fixture": inputs["context_input_ids"]})
    _, greedy = sampled_cache(tmp_path / "g", inputs, {"fixture": inputs["context_input_ids"]}, None)
    drafter = load_drafter(FIXTURES / "families" / "dflash2-full" / "checkpoint")
    with pytest.raises(ValueError, match=r"was sampled at temperature 0\.8, top_p 1, top_k 0, but scoring asks for "
                                         r"temperature 1, top_p 0\.9: .*extract --temperature 1 --top-p 0\.9\)"):
        score_drafter(drafter, cache, head, ScoringConfig(device="cpu", served_temperature=1.0, served_top_p=0.9))
    with pytest.raises(ValueError, match=r"holds greedy answers, but scoring asks for temperature 0\.7"):
        score_drafter(drafter, greedy, head, ScoringConfig(device="cpu", served_temperature=0.7))
    assert score_drafter(drafter, cache, head, ScoringConfig(ddtree_budgets=[], device="cpu", served_temperature=0.8, served_top_k=0))
    with pytest.raises(ValueError) as found:
        ScoringConfig(served_temperature=-0.5, served_top_p=1.5, served_top_k=-1, draft_rule="sampled")
    lines = str(found.value).splitlines()
    assert len(lines) == 4 and lines[0].startswith("served_temperature must be >= 0") and lines[1].startswith("served_top_p must be in (0, 1]")
    dspark = load_drafter(FIXTURES / "families" / "dspark" / "checkpoint")
    with pytest.raises(ValueError, match="draft_rule 'probabilistic' can not be scored for a dspark drafter: .*where dspark_draft_topk is set"):
        score_drafter(dspark, cache, head, ScoringConfig(ddtree_budgets=[], device="cpu", draft_rule="probabilistic"))


def test_expected_streaks_carry_through_the_intervals_the_comparison_and_the_stop(tmp_path):
    """A sampled draft's dense numbers come from its expected streaks everywhere a report is read: the anchors'
    taus the intervals resample, the dense interval, the paired comparison and the stop's monitor. Two coin seeds
    draw other streaks (live differs) but hold the same expectation: dense, its interval and its paired delta
    (exactly 0) are the same, so no number of the dense kind depends on the draw."""
    inputs, expected = load_inputs()
    head, cache = sampled_cache(tmp_path, inputs, walked_tasks(inputs, expected))
    drafter = load_drafter(FIXTURES / "families" / "dflash2-full" / "checkpoint")
    config = ScoringConfig(ddtree_budgets=[], device="cpu", coin_seed=3)
    ours = score_drafter(drafter, cache, head, config)
    other = score_drafter(drafter, cache, head, dataclasses.replace(config, coin_seed=11))
    drawn_means = []
    for name, entry in ours.tasks.items():
        kept = decode_expected(entry["vanilla"]["expected"], 5)
        np.testing.assert_array_equal(taus(ours, name, "vanilla"), kept + 1)
        drawn_means.append(decode_streaks(entry["vanilla"]["streaks"], 5).mean() + 1)
    assert ours.mean["vanilla"]["dense"] == pytest.approx(np.mean([e["vanilla"]["dense"] for e in ours.tasks.values()]))
    assert ours.mean["vanilla"]["dense"] != pytest.approx(float(np.mean(drawn_means)), abs=1e-3)  # not the draw's
    assert any(ours.tasks[t]["vanilla"]["streaks"] != other.tasks[t]["vanilla"]["streaks"] for t in ours.tasks)
    assert ours.intervals["mean"]["vanilla"]["dense"] == other.intervals["mean"]["vanilla"]["dense"]
    assert ours.intervals["tasks"] == report_intervals(ours)["tasks"]
    versus = paired_comparison(ours, other)
    dense, live = versus["vanilla/dense"]["mean"], versus["vanilla/live"]["mean"]
    assert dense.delta.value == 0 and dense.ratio.value == 1 and dense.delta.lo == dense.delta.hi == 0
    assert live.delta.value == pytest.approx(ours.mean["vanilla"]["live"] - other.mean["vanilla"]["live"])
    stop = TrailingBaselineStop(monitor="vanilla/dense", min_ratio=0.9)
    judged_by(stop)(ours, other, Moment(step=1, horizon=10), print, print, versus=dense)
    assert stop.history == [(1, ours.mean["vanilla"]["dense"])] and stop.bounds == {1: dense.ratio.hi}


def test_engine_settings_under_which_the_scores_are_not_exact_give_one_warning_naming_them():
    """vLLM's block verification and SGLang's acceptance thresholds below 1, declared in
    scoring.served_engine_settings, are named in one line; exact settings, and none declared, say nothing; a
    setting that is not KEY=VALUE is refused."""
    from dflash_callbacks.scoring.acceptance import engine_settings_warning

    assert engine_settings_warning([]) is None
    assert engine_settings_warning(["rejection_sample_method=standard", "speculative_accept_threshold_acc=1.0",
                                    "num_speculative_tokens=7"]) is None
    line = engine_settings_warning(["rejection_sample_method = block", "speculative_accept_threshold_single=0.8",
                                    "speculative_accept_threshold_acc=1"])
    assert "\n" not in line and "rejection_sample_method=block" in line \
        and "speculative_accept_threshold_single=0.8" in line and "threshold_acc" not in line
    config = ScoringConfig(served_engine_settings=["rejection_sample_method=block"])
    assert config.served_engine_settings == ["rejection_sample_method=block"]
    assert ScoringConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="served_engine_settings holds 'block': give each setting as KEY=VALUE"):
        ScoringConfig(served_engine_settings=["block"])

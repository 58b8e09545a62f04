"""vLLM's window rule: a drafter layer that declares no window is served with the engine's model-level window
(the target's, where every target layer slides), so `attention="vllm"` on the toy target (all layers sliding,
window 64) scores the toy baseline as a copy of it with that window written into its config; SGLang builds such a
layer without one."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash_callbacks import load_drafter
from dflash_callbacks.demos.toy.world import toy_baseline_path
from dflash_callbacks.model import TargetHead
from dflash_callbacks.model.attention import LayerAttention, resolve_attention, vllm_model_window
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_drafter
from dflash_callbacks.scoring.service import ServiceSpec, preflight

SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.mark.parametrize("config,window", [
    ({"sliding_window": 64, "layer_types": [SLIDING] * 4, "use_sliding_window": True}, 64),  # the toy target
    ({"sliding_window": 4096}, 4096),  # Mistral: no layer types, every layer slides
    ({"sliding_window": 64, "layer_types": [SLIDING, FULL]}, None),  # interleaved: the global layers keep none
    ({"sliding_window": 64, "use_sliding_window": False, "num_hidden_layers": 2}, None),  # Qwen3's default
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 0, "num_hidden_layers": 2}, 64),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1, "num_hidden_layers": 2}, None),
    ({"sliding_window": 0}, None), ({"sliding_window": None}, None), ({}, None),
    ({"text_config": {"sliding_window": 512}}, 512),  # a multimodal config: its text model's
])
def test_the_engines_model_level_window_from_a_target_config(config, window):
    assert vllm_model_window(config) == window


def test_only_vllm_gives_a_layer_without_a_window_the_targets(toy_target):
    config = load_drafter(toy_baseline_path()).config
    assert config.layer_types == [FULL, FULL] and config.sliding_window is None
    assert resolve_attention(config, "vllm", 64) == [LayerAttention(False, 64)] * 2
    for rule in ("auto", "sglang", "causal", "trained", "no-window"):
        assert all(layer.window is None for layer in resolve_attention(config, rule, 64)), rule
    assert TargetHead.from_pretrained(toy_target).model_window == 64


def test_vllm_on_a_windowed_target_scores_the_drafter_as_a_copy_with_that_window_in_its_config(
        toy_cache, toy_target, tmp_path):
    """The toy baseline under "vllm" equals a copy whose config declares sliding layers of window 64 (and keeps
    them bidirectional, as vLLM serves its full layers), scored under the default rule; the window costs
    something on the toy's answers, so the config as written scores otherwise; the report says where the
    patterns differ."""
    copy = tmp_path / "windowed"
    shutil.copytree(toy_baseline_path(), copy)
    raw = json.loads((copy / "config.json").read_text())
    raw.update(layer_types=[SLIDING, SLIDING], sliding_window=64, use_sliding_window=True)
    raw["dflash_config"]["causal"] = False
    (copy / "config.json").write_text(json.dumps(raw))
    head = TargetHead.from_pretrained(toy_target)
    tasks = toy_cache.task_names[:4]

    def report(folder, rule):
        config = ScoringConfig(device="cpu", ddtree_budgets=[4], tasks=tasks, attention=rule)
        return score_drafter(load_drafter(folder), toy_cache, head, config)

    served, windowed, written = report(toy_baseline_path(), "vllm"), report(copy, "auto"), report(toy_baseline_path(), "auto")
    assert served.attention == windowed.attention == ["bidirectional, window 64 from the query"] * 2
    base = windowed.methods
    assert base == ["vanilla", "ddtree@4"] and written.methods == base  # auto: no window, nothing beside it
    assert served.methods == [*base, "vanilla:vllm-as-written", "ddtree@4:vllm-as-written"]
    for task in tasks:
        for method in base:
            assert served.tasks[task][method]["streaks"] == windowed.tasks[task][method]["streaks"]
            # the config as written, scored beside: the toy baseline's own config under vLLM's rule, as auto reads it
            assert served.tasks[task][f"{method}:vllm-as-written"] == written.tasks[task][method]
    assert {m: served.mean[m] for m in base} == windowed.mean
    for method in base:  # each method's interval is its own: the same beside the served rule as alone
        assert served.intervals["mean"][f"{method}:vllm-as-written"] == written.intervals["mean"][method]
    assert any(served.tasks[t]["vanilla"]["streaks"] != written.tasks[t]["vanilla"]["streaks"] for t in tasks)
    assert written.attention_patterns == {"trained": ["bidirectional"] * 2,
                                          "vllm": ["bidirectional, window 64 from the query"] * 2}
    assert "vllm bidirectional, window 64 from the query x2" in written.served()
    assert written.window_cost() is None and windowed.window_cost() is None


def test_a_report_under_vllm_says_what_the_targets_window_costs(toy_cache, toy_target):
    """Under "vllm" on a windowed target the report carries the config as written beside what is served, and its
    line gives the paired difference of the first method's live tau with its interval and both numbers; the
    same cost computed by hand from the two methods' per-task numbers lies inside it; `score_as_written: false`
    scores the served rule alone, and so does a target without a model-level window."""
    head = TargetHead.from_pretrained(toy_target)
    tasks = toy_cache.task_names
    config = ScoringConfig(device="cpu", ddtree_budgets=[], tasks=tasks, attention="vllm")
    drafter = load_drafter(toy_baseline_path())
    served = score_drafter(drafter, toy_cache, head, config)
    from dflash_callbacks.scoring.intervals import method_comparison

    cost = method_comparison(served, "vanilla", "vanilla:vllm-as-written", "live")
    by_hand = served.value("vanilla/live") - served.value("vanilla:vllm-as-written/live")
    assert cost.delta.lo < by_hand < cost.delta.hi and cost.delta.value == pytest.approx(by_hand, abs=1e-9)
    assert cost.delta.lo > 0  # on the toy's answers the window helps its baseline, beyond the noise
    line = served.served()
    assert (f"the target's window on the layers without their own moves vanilla live by {cost.delta.show(sign=True)} "
            f"({served.value('vanilla/live'):.2f} served, {served.value('vanilla:vllm-as-written/live'):.2f} as "
            "written: vanilla:vllm-as-written)") in line
    again = type(served).from_dict(json.loads(served.to_json()))
    assert again.window_cost() == served.window_cost()  # read back from its JSON, the same line
    alone = score_drafter(drafter, toy_cache, head, ScoringConfig(device="cpu", ddtree_budgets=[], tasks=tasks,
                                                                   attention="vllm", score_as_written=False))
    assert alone.methods == ["vanilla"] and alone.window_cost() is None
    assert alone.tasks == {t: {"vanilla": served.tasks[t]["vanilla"]} for t in tasks}
    lines = []
    preflight(ServiceSpec(str(toy_cache.path), str(toy_target), None, config), drafter.config, warn=lines.append)
    assert [line for line in lines if "vllm-as-written" in line] == [
        "attention vllm: the target's model-level window (64) reaches the drafter's layers that declare none, so "
        "every method is also scored as the config is written (METHOD:vllm-as-written), the window's cost in each "
        "report's line; scoring.score_as_written: false scores the served rule alone"]
    head.model_window = None  # a target whose layers do not all slide: nothing to compare
    assert score_drafter(drafter, toy_cache, head, config).methods == ["vanilla"]
    assert config.methods == ["vanilla"] and config.methods_on(64) == ["vanilla", "vanilla:vllm-as-written"]
    asked = ScoringConfig(attention="vllm", ddtree_budgets=[], attentions=["vllm-as-written"])
    assert asked.methods_on(64) == asked.methods == ["vanilla", "vanilla:vllm-as-written"]  # asked for: once

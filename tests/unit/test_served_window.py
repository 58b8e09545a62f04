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
    for task in tasks:
        for method in served.methods:
            assert served.tasks[task][method]["streaks"] == windowed.tasks[task][method]["streaks"]
    assert served.mean == windowed.mean
    assert any(served.tasks[t]["vanilla"]["streaks"] != written.tasks[t]["vanilla"]["streaks"] for t in tasks)
    assert written.attention_patterns == {"trained": ["bidirectional"] * 2,
                                          "vllm": ["bidirectional, window 64 from the query"] * 2}
    assert "vllm bidirectional, window 64 from the query x2" in written.served()

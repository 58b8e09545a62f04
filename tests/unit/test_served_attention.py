"""The serving engines' attention rules, named (`model.attention`): "vllm" as vLLM resolves a config (a
speculators folder's `sliding_window_non_causal` over every layer), "sglang", "trained" (each trainer's own
mask, held to the trainers' logits), the window over the context only, and every method scored under
another rule beside the run's (`METHOD:RULE`), the report saying once where the patterns differ."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_callbacks import load_drafter
from dflash_callbacks.cache.format import HiddenStateCache, TargetInfo, new_manifest, open_for_writing, write_task
from dflash_callbacks.model import DrafterConfig, TargetHead, build_drafter
from dflash_callbacks.model.attention import LayerAttention, resolve_attention
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.methods import Method
from dflash_callbacks.scoring.scorer import score_drafter

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TRAINERS = FIXTURES / "trainers"
CAUSAL, BIDIRECTIONAL = "causal", "bidirectional"


def speculators_config(case: str, **changes) -> DrafterConfig:
    raw = json.loads((TRAINERS / case / "checkpoint" / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return DrafterConfig.from_dict(raw)


def kinds(config: DrafterConfig, rule: str) -> list[str]:
    return [CAUSAL if layer.causal else BIDIRECTIONAL for layer in resolve_attention(config, rule)]


@pytest.mark.parametrize("case", ["speculators-full", "speculators-sliding-causal", "speculators-sliding-noncausal"])
@pytest.mark.parametrize("non_causal", [False, True, None])
def test_vllm_reads_a_speculators_folders_flag_over_every_layer(case, non_causal):
    """vLLM maps a speculators folder to dflash_config.causal = not sliding_window_non_causal (absent: true) and
    applies it to every layer, full layers included: every layer causal when the flag is false, every layer
    bidirectional when it is true or absent. A sliding layer keeps its window, counted from each query."""
    config = speculators_config(case, sliding_window_non_causal=non_causal)
    want = [CAUSAL] * 3 if non_causal is False else [BIDIRECTIONAL] * 3
    assert kinds(config, "vllm") == want
    windows = [layer.window for layer in resolve_attention(config, "vllm")]
    assert windows == ([6, None, 6] if "sliding" in case else [None] * 3)
    assert not any(layer.anchored for layer in resolve_attention(config, "vllm"))
    again = DrafterConfig.from_dict(config.to_dict())  # a snapshot's copy is served as the folder it came from
    assert again.speculators and kinds(again, "vllm") == want and again == config


def test_vllm_sglang_and_auto_on_other_configs():
    """The published layout: vLLM and `auto` read is_causal / dflash_config.causal over every layer, else sliding
    layers causal; SGLang reads is_causal alone. A speculators DSpark folder gets no override from vLLM."""
    raw = json.loads((TRAINERS / "specforge-sliding" / "hf_export" / "config.json").read_text())
    plain = DrafterConfig.from_dict(raw)
    for rule in ("vllm", "sglang", "auto"):
        assert kinds(plain, rule) == [CAUSAL, BIDIRECTIONAL, CAUSAL], rule
    nested = DrafterConfig.from_dict({**raw, "dflash_config": {**raw["dflash_config"], "causal": True}})
    assert kinds(nested, "vllm") == kinds(nested, "auto") == [CAUSAL] * 3
    assert kinds(nested, "sglang") == [CAUSAL, BIDIRECTIONAL, CAUSAL]  # SGLang reads no dflash_config.causal
    top = DrafterConfig.from_dict({**raw, "is_causal": False})
    assert kinds(top, "vllm") == kinds(top, "sglang") == [BIDIRECTIONAL] * 3
    dflash2 = load_drafter(FIXTURES / "families" / "dflash2-sliding" / "checkpoint").config  # flag true by default
    assert resolve_attention(dflash2, "trained") == resolve_attention(dflash2, "anchored-bidirectional")
    assert kinds(dflash2, "vllm") == [BIDIRECTIONAL] * 3
    dspark = load_drafter(FIXTURES / "families" / "dspark" / "checkpoint").config
    assert dspark.speculators and kinds(dspark, "vllm") == ["causal" if t == "sliding_attention" else BIDIRECTIONAL
                                                            for t in dspark.layer_types]


@torch.no_grad()
def trainer_logits(drafter, inputs: dict, rule: str) -> torch.Tensor:
    anchors, hidden = inputs["anchors"], inputs["target_hidden"]
    noise = inputs["block_embeddings"] if "block_embeddings" in inputs else \
        inputs["target_embed_tokens"][inputs["block_input_ids"]]
    C = int(anchors.max())
    context = drafter.encode_context(hidden[:C][None], torch.arange(C)[None])
    return drafter.decode_blocks(context, noise, anchors, resolve_attention(drafter.config, rule))


@pytest.mark.parametrize("case, what", [("speculators-full", "checkpoint"), ("speculators-sliding-causal", "checkpoint"),
                                        ("speculators-sliding-noncausal", "checkpoint"),
                                        ("specforge-full", "hf_export"), ("specforge-sliding", "hf_export")])
def test_trained_is_each_trainers_own_pattern(case, what):
    """`trained` computes the hidden states each trainer's own code computed on the fixture (its training mask),
    speculators' anchored window and SpecForge's per-query one alike; vLLM's pattern does not, where it differs."""
    drafter = load_drafter(TRAINERS / case / what)
    inputs = load_file(str(TRAINERS / case / "inputs.safetensors"))
    expected = load_file(str(TRAINERS / case / "expected.safetensors"))
    want = expected["hidden_training_mask" if case.startswith("specforge") else "hidden"]
    torch.testing.assert_close(trainer_logits(drafter, inputs, "trained"), want, atol=2e-5, rtol=0)
    if case in ("speculators-full", "speculators-sliding-causal"):  # served causal everywhere: whole logits off
        assert float((trainer_logits(drafter, inputs, "vllm") - want).abs().max()) > 0.1


def test_a_window_over_the_context_only_keeps_the_whole_block():
    """SpecForge's training mask windows the context from each query and keeps the whole (causal) block: with a
    block longer than the window the two paths (blocks side by side, the masked forward) agree, and differ from
    the window counted over the block too."""
    raw = json.loads((TRAINERS / "specforge-sliding" / "hf_export" / "config.json").read_text())
    config = DrafterConfig.from_dict({**raw, "sliding_window": 3})
    torch.manual_seed(0)
    drafter = build_drafter(config).eval()
    hidden, noise = torch.randn(12, config.num_target_features), torch.randn(3, 5, config.hidden_size)
    anchors = torch.tensor([4, 7, 11])
    trained = resolve_attention(config, "trained")
    assert trained[0] == LayerAttention(True, 3, context_only=True) and str(trained[0]).endswith("over the context only")
    with torch.no_grad():
        context = drafter.encode_context(hidden[:11][None], torch.arange(11)[None])
        batched = drafter.decode_blocks(context, noise, anchors, trained)
        alone = torch.cat([drafter(hidden[:a][None], noise[i : i + 1], torch.arange(a + 5)[None], attention=trained)
                           for i, a in enumerate(anchors.tolist())])
        per_query = drafter.decode_blocks(context, noise, anchors, resolve_attention(config, "causal"))
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    assert float((batched - per_query).abs().max()) > 1e-3


def fixture_cache(root: Path, inputs: dict) -> tuple[TargetHead, HiddenStateCache]:
    """speculators' fixture: its hidden states and tokens as a greedy cache (prompt 3), the target its head."""
    target, cache = root / "target", root / "cache"
    target.mkdir(parents=True)
    head = load_drafter(TRAINERS / "speculators-full" / "checkpoint").stored_head
    save_file({"model.embed_tokens.weight": head["embed_tokens.weight"].contiguous(),
               "lm_head.weight": head["lm_head.weight"].contiguous()}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64}))
    open_for_writing(cache, new_manifest(TargetInfo(str(target), 8, 64, 97, "float32"), [1, 3, 5]))
    write_task(cache, "fixture", inputs["context_input_ids"], inputs["target_hidden"], 3)
    write_task(cache, "shifted", inputs["context_input_ids"].roll(1), inputs["target_hidden"], 3)
    return TargetHead.from_pretrained(target), HiddenStateCache(cache)


def test_every_method_under_another_rule_beside_the_runs(tmp_path):
    """scoring.attentions scores each method again under each rule, named METHOD[:bB]:RULE, the same numbers as a
    run whose own rule it is; the report records once how the drafter was trained and how vLLM serves it where
    those differ, and says it in its one line."""
    drafter = load_drafter(TRAINERS / "speculators-sliding-causal" / "checkpoint")
    head, cache = fixture_cache(tmp_path, load_file(str(TRAINERS / "speculators-full" / "inputs.safetensors")))
    config = ScoringConfig(ddtree_budgets=[2], device="cpu", block_sizes=[3], attentions=["vllm", "trained"])
    both = score_drafter(drafter, cache, head, config)
    assert both.methods == ["vanilla", "ddtree@2", "vanilla:b3", "ddtree@2:b3", "vanilla:vllm", "ddtree@2:vllm",
                            "vanilla:b3:vllm", "ddtree@2:b3:vllm", "vanilla:trained", "ddtree@2:trained",
                            "vanilla:b3:trained", "ddtree@2:b3:trained"]
    for rule in ("vllm", "trained"):
        alone = score_drafter(drafter, cache, head, dataclasses.replace(config, attention=rule, attentions=[]))
        for method in alone.methods:
            named = str(Method.parse(method).under(rule))
            for task in cache.task_names:
                assert both.tasks[task][named] == alone.tasks[task][method], (rule, method, task)
            assert both.intervals["mean"][named]["dense"] != [] and alone.attention_patterns == both.attention_patterns
    assert both.attention_patterns == {
        "trained": ["causal, window 6 from the anchor", "bidirectional", "causal, window 6 from the anchor"],
        "vllm": ["causal, window 6 from the query", "causal", "causal, window 6 from the query"]}
    assert "the drafter's patterns differ: trained causal, window 6 from the anchor" in both.served()
    assert both.served().startswith("attention auto, cache greedy;")
    full = load_drafter(TRAINERS / "specforge-full" / "hf_export")
    assert score_drafter(full, cache, head, ScoringConfig(ddtree_budgets=[], device="cpu")).attention_patterns is None
    assert "attention_patterns" not in score_drafter(full, cache, head, ScoringConfig(ddtree_budgets=[],
                                                                                      device="cpu")).to_dict()
    with pytest.raises(ValueError, match="attentions holds attention 'auto'"):
        ScoringConfig(attentions=["auto"])
    with pytest.raises(ValueError, match="attentions must be one of"):
        ScoringConfig(attentions=["served"])

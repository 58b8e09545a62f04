"""Every public DFlash trainer's checkpoint, loaded exactly as the trainer saved it, computes
the trainer's own numbers: the logits and hidden states its own code computed (fixtures/trainers,
see its README), to 2e-5 in fp32, under the attention pattern that trainer applies. Both of
this library's paths are held to them: the scorer's (`decode_blocks`, many blocks side by
side) and the live loop's (the drafter's forward, one block at a time). Then each checkpoint
is scored end to end: SpecForge's training_state.pt through `dflash-callbacks score`, and
speculators folders, whose stored copy of the target's head is checked against the target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_callbacks import load_drafter
from dflash_callbacks.cache.format import HiddenStateCache, TargetInfo, new_manifest, open_for_writing, write_task
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.model import TargetHead, read_checkpoint
from dflash_callbacks.model.attention import resolve_attention
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.scorer import score_drafter, score_task

from naive_scorer import score_task_naive
from suite_paths import FIXTURES

TRAINERS = FIXTURES / "trainers"
STATE = "checkpoints/run-step10/training_state.pt"
SPECFORGE_STATE = {"state_key": "draft_state_dict"}  # + config: the case's draft_config.json

CASES = {  # id: (case folder, what is loaded, the trainer's pattern as a rule, the expected tensors' suffix)
    "specforge-full export, training mask": ("specforge-full", "hf_export", "auto", "_training_mask"),
    "specforge-full export, spec_generate": ("specforge-full", "hf_export", "no-window", "_spec_generate"),
    "specforge-full training_state.pt": ("specforge-full", STATE, "auto", "_training_mask"),
    # SpecForge's training mask makes sliding layers causal, the window counted from each query: vLLM's choice
    "specforge-sliding export, training mask": ("specforge-sliding", "hf_export", "auto", "_training_mask"),
    "specforge-sliding export, spec_generate": ("specforge-sliding", "hf_export", "no-window", "_spec_generate"),
    "specforge-sliding training_state.pt": ("specforge-sliding", STATE, "causal", "_training_mask"),
    "speculators-full": ("speculators-full", "checkpoint", "auto", ""),
    "speculators-sliding-causal": ("speculators-sliding-causal", "checkpoint", "anchored-causal", ""),
    "speculators-sliding-noncausal": ("speculators-sliding-noncausal", "checkpoint", "anchored-bidirectional", ""),
    "speculators-draft-vocab": ("speculators-draft-vocab", "checkpoint", "auto", ""),
}


def load_case(case: str, what: str):
    folder = TRAINERS / case
    if what == STATE:
        return load_drafter(folder / what, config=folder / "draft_config.json", **SPECFORGE_STATE)
    return load_drafter(folder / what)


def target_lm_head(case: str, drafter) -> torch.Tensor:
    """The target's LM head: given with the inputs, or (speculators' full vocabulary) the
    checkpoint's copy of it, which is the verifier's."""
    inputs = load_file(str(TRAINERS / case / "inputs.safetensors"))
    return inputs["target_lm_head"] if "target_lm_head" in inputs else drafter.stored_head["lm_head.weight"]


@torch.no_grad()
def both_paths(drafter, inputs, rule):
    """Hidden states [n, B, H] of the fixture's blocks: the scorer's path and the live loop's."""
    attention = resolve_attention(drafter.config, rule)
    anchors, hidden = inputs["anchors"], inputs["target_hidden"]
    if "block_embeddings" in inputs:  # speculators: its own copy of the target's embedding
        noise = inputs["block_embeddings"]
    else:
        noise = inputs["target_embed_tokens"][inputs["block_input_ids"]]
    C, B = int(anchors.max()), noise.shape[1]
    context = drafter.encode_context(hidden[:C][None], torch.arange(C)[None])
    batched = drafter.decode_blocks(context, noise, anchors, attention)
    alone = torch.cat([drafter(hidden[:a][None], noise[i : i + 1], torch.arange(a + B)[None], attention=attention)
                       for i, a in enumerate(anchors.tolist())])
    return batched, alone


@pytest.mark.parametrize("name", CASES)
def test_every_trainer_checkpoint_computes_the_trainers_own_logits(name):
    case, what, rule, suffix = CASES[name]
    drafter = load_case(case, what)
    inputs = load_file(str(TRAINERS / case / "inputs.safetensors"))
    expected = load_file(str(TRAINERS / case / "expected.safetensors"))
    lm_head = target_lm_head(case, drafter)
    if drafter.vocab_ids is not None:  # the draft vocabulary's rows of the target's head, in draft order
        assert torch.equal(drafter.vocab_ids, inputs["draft_to_target_ids"])
        lm_head = lm_head[drafter.vocab_ids]
    for hidden in both_paths(drafter, inputs, rule):
        torch.testing.assert_close(hidden, expected[f"hidden{suffix}"], atol=2e-5, rtol=0)
        # the head multiplies the hidden state's fp32 rounding by the logit's size: held relative as well
        # (speculators' case is 2.1e-5 off at a logit of 3.07, 6.9e-6 relative, under transformers 5.24)
        torch.testing.assert_close(hidden @ lm_head.T, expected[f"logits{suffix}"], atol=2e-5, rtol=1e-5)
        if drafter.vocab_ids is not None:  # scattered to target ids, -inf elsewhere, as vLLM serves it
            full = torch.full(expected["logits_target_vocab"].shape, float("-inf"))
            full[..., drafter.vocab_ids] = hidden @ lm_head.T
            torch.testing.assert_close(full, expected["logits_target_vocab"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case, trainers_rule, other_rule", [
    ("specforge-sliding", "auto", "bidirectional"),  # what this library computed before: 2.4 and more off
    ("speculators-sliding-causal", "anchored-causal", "auto"),  # vLLM counts the window from each query
    ("speculators-sliding-noncausal", "anchored-bidirectional", "auto"),
])
def test_a_sliding_layers_pattern_decides_the_numbers(case, trainers_rule, other_rule):
    """On the sliding cases the rules are not interchangeable: another pattern than the
    trainer's is off by whole logits, so the pattern a report records is part of its meaning."""
    drafter = load_case(case, "checkpoint" if case.startswith("speculators") else "hf_export")
    inputs = load_file(str(TRAINERS / case / "inputs.safetensors"))
    lm_head = target_lm_head(case, drafter)
    right, _ = both_paths(drafter, inputs, trainers_rule)
    wrong, _ = both_paths(drafter, inputs, other_rule)
    assert float(((right - wrong) @ lm_head.T).abs().max()) > 1.0


def test_a_speculators_config_maps_onto_the_published_fields():
    drafter = load_drafter(TRAINERS / "speculators-draft-vocab" / "checkpoint")
    config = drafter.config
    assert config.target_layer_ids == [1, 3, 5]  # aux_hidden_state_layer_ids [2, 4, 6], one off
    assert (config.block_size, config.mask_token_id, config.vocab_size, config.draft_vocab_size) == (5, 96, 97, 48)
    assert config.sliding_window_non_causal is False
    assert type(config).from_dict(config.to_dict()) == config  # written back in the published layout
    assert set(drafter.stored_head) == {"embed_tokens.weight", "lm_head.weight", "t2d"}
    assert "embed_tokens.weight" not in drafter.state_dict() and "d2t" in drafter.state_dict()
    noncausal = load_drafter(TRAINERS / "speculators-sliding-noncausal" / "checkpoint")
    assert [str(a) for a in noncausal.attention] == ["bidirectional, window 6 from the query", "bidirectional",
                                                     "bidirectional, window 6 from the query"]
    raw = json.loads((TRAINERS / "speculators-full" / "checkpoint" / "config.json").read_text())
    for key, value, match in [("aux_hidden_state_layer_ids", [0, 2], "list of integers >= 1"),
                              ("speculators_model_type", "eagle3", "not a drafter family this library scores"),
                              ("sample_from_anchor", True, "drafts a token from the anchor's own slot"),
                              ("projector_type", "domino", "a Domino drafter, but field 'speculators_model_type' is 'dflash'")]:
        with pytest.raises(ValueError, match=match):
            type(config).from_dict({**raw, key: value})


def target_and_cache(root: Path, case: str, embed: torch.Tensor, lm_head: torch.Tensor) -> tuple[Path, Path]:
    """A target folder holding `embed` and `lm_head`, and a one-task cache of the case's inputs
    (20 tokens, prompt 3: anchors 3 .. 18)."""
    inputs = load_file(str(TRAINERS / case / "inputs.safetensors"))
    target, cache = root / "target", root / "cache"
    target.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": embed.contiguous(), "lm_head.weight": lm_head.contiguous()},
              str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64}))
    open_for_writing(cache, new_manifest(TargetInfo(str(target), 8, 64, 97, "float32"), [1, 3, 5]))
    write_task(cache, "fixture", inputs["context_input_ids"], inputs["target_hidden"], 3)
    return target, cache


@pytest.mark.parametrize("case", ["speculators-full", "speculators-draft-vocab"])
def test_a_speculators_folder_is_scored_against_its_own_target_and_refused_against_another(case, tmp_path):
    """Its stored embedding and LM head equal the target's: scored, as the naive scorer scores
    it. A target whose embedding (or LM head) differs in one row is refused, naming the tensor."""
    folder = TRAINERS / case / "checkpoint"
    stored = load_file(str(folder / "model.safetensors"))
    inputs = load_file(str(TRAINERS / case / "inputs.safetensors"))
    lm_head = inputs.get("target_lm_head", stored["lm_head.weight"])
    target, cache = target_and_cache(tmp_path / "right", case, stored["embed_tokens.weight"], lm_head)
    config = ScoringConfig(ddtree_budgets=[2, 8], topk=[3], device="cpu")
    drafter, head = load_drafter(folder), TargetHead.from_pretrained(target)
    report = score_drafter(drafter, HiddenStateCache(cache), head, config)
    assert report.tasks["fixture"]["vanilla"]["anchors"] == 16
    task = HiddenStateCache(cache).task("fixture")
    fast, slow = score_task(drafter, head, task, config, 5), score_task_naive(drafter, head, task, config, 5)
    assert all(torch.equal(fast.streaks[m], slow.streaks[m]) for m in config.methods)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        embed, other = stored["embed_tokens.weight"].clone(), lm_head.clone()
        row = int(drafter.vocab_ids[5]) if drafter.vocab_ids is not None else 5  # a row the drafter's head uses
        (embed if name == "embed_tokens.weight" else other)[row] += 0.5
        wrong, _ = target_and_cache(tmp_path / name, case, embed, other)
        with pytest.raises(ValueError, match=f"the drafter's stored {name} differs from the target's in 1 of"):
            score_drafter(load_drafter(folder), HiddenStateCache(cache), TargetHead.from_pretrained(wrong), config)


def test_a_specforge_training_state_scores_through_the_cli_as_its_export_does(tmp_path, capsys):
    """`score --drafter training_state.pt --state-key draft_state_dict --drafter-config ...`:
    the weights SpecForge trains, read with weights_only=True, give the report of the folder
    SpecForge exports from them; the report records each layer's pattern."""
    case = TRAINERS / "specforge-sliding"
    inputs = load_file(str(case / "inputs.safetensors"))
    target, cache = target_and_cache(tmp_path, "specforge-sliding", inputs["target_embed_tokens"], inputs["target_lm_head"])
    common = ["--cache", str(cache), "--target", str(target), "--budgets", "2,4", "--topk", "3", "--device", "cpu",
              "--baseline-cache-dir", str(tmp_path / "baselines")]
    assert cli_main(["score", "--drafter", str(case / STATE), "--state-key", "draft_state_dict", "--drafter-config",
                     str(case / "draft_config.json"), "--json", str(tmp_path / "state.json"), *common]) == 0
    assert cli_main(["score", "--drafter", str(case / "hf_export"), "--json", str(tmp_path / "export.json"), *common]) == 0
    from_state, exported = EvalReport.load(tmp_path / "state.json"), EvalReport.load(tmp_path / "export.json")
    assert from_state.tasks == exported.tasks
    assert from_state.attention == ["causal, window 6 from the query", "bidirectional", "causal, window 6 from the query"]
    assert cli_main(["score", "--drafter", str(case / STATE), "--state-key", "draft_state_dict", "--attention",
                     "no-window", "--drafter-config", str(case / "draft_config.json"), "--json",
                     str(tmp_path / "served.json"), *common]) == 0
    served = EvalReport.load(tmp_path / "served.json")
    assert served.scoring["attention"] == "no-window" and served.attention == ["bidirectional"] * 3
    capsys.readouterr()
    assert cli_main(["score", "--drafter", str(case / STATE), *common]) == 2
    assert "is a checkpoint file, which holds no drafter config: give the config.json it was trained with as " \
           "--drafter-config" in capsys.readouterr().err
    assert cli_main(["score", "--drafter", str(case / "hf_export"), "--state-key", "draft_state_dict", *common]) == 2
    assert "--state-key goes with a torch checkpoint file" in capsys.readouterr().err
    assert cli_main(["score", "--drafter", str(case / STATE), "--drafter-config", str(case / "draft_config.json"),
                     *common]) == 2
    assert "is not a state dict (tensor name -> tensor); it holds ['draft_state_dict', 'epoch'" in capsys.readouterr().err


class NotATensor:
    pass


def test_wrapper_prefixes_are_stripped_and_said_and_only_tensors_are_read(tmp_path, capsys):
    """A state dict saved under DDP and torch.compile (`module._orig_mod.`) or SpecForge's
    training model (`draft_model.`) loads as the plain one, with one line saying what was
    stripped; a file that needs more than weights_only=True to load is refused."""
    case = TRAINERS / "specforge-full"
    plain = read_checkpoint(case / STATE, "draft_state_dict", log=None)
    expected = load_drafter(case / STATE, config=case / "draft_config.json", **SPECFORGE_STATE).state_dict()
    for prefix in ("module._orig_mod.", "draft_model."):
        torch.save({"draft_state_dict": {prefix + k: v for k, v in plain.items()}}, tmp_path / "wrapped.pt")
        capsys.readouterr()
        drafter = load_drafter(tmp_path / "wrapped.pt", config=case / "draft_config.json", **SPECFORGE_STATE)
        said = capsys.readouterr().err.splitlines()
        assert said == [f"{tmp_path / 'wrapped.pt'}['draft_state_dict']: stripped the wrapper prefix '{prefix}' from "
                        f"its {len(plain)} tensor names"]
        assert all(torch.equal(drafter.state_dict()[k], v) for k, v in expected.items())
    shutil.copy(case / STATE, tmp_path / "state.pt")
    with pytest.raises(ValueError, match=r"has no 'model'; its keys are \['draft_state_dict', 'epoch'"):
        read_checkpoint(tmp_path / "state.pt", "model")
    torch.save({"draft_state_dict": {"fc.weight": NotATensor()}}, tmp_path / "code.pt")
    with pytest.raises(ValueError, match="is not a torch checkpoint that loads with weights_only=True"):
        read_checkpoint(tmp_path / "code.pt", "draft_state_dict")

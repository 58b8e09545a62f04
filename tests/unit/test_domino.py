"""The Domino family (model/families/domino.py) against fixtures/families/domino: SpecForge's export, and the
numbers SpecForge's decoding (`spec_generate`) and training wrapper computed, reproduced to 2e-5 in float32
through both of this library's paths; then scored through `score_task`."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.model import DrafterConfig, save_drafter
from dflash_callbacks.model.families import domino
from dflash_callbacks.model.families.walk import greedy_walk
from dflash_callbacks.model.geometry import block_inputs
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_task

from family_cases import FAMILIES, case, decode, head, one_task_cache

FOLDER = FAMILIES / "domino" / "checkpoint"
TOL = dict(atol=2e-5, rtol=0)


def test_the_export_loads_with_its_settings_and_writes_back(tmp_path):
    drafter = load_drafter(FOLDER)
    assert drafter.config.family == "domino"
    assert drafter.config.family_config == domino.Settings(emb_dim=16, gru_hidden_dim=32, pure_draft_prefix_len=1,
                                                           shift_label=True)
    assert list(drafter.draft_rows(5)) == [0, 1, 2, 3]  # 4 proposals: rows 0 .. 3, row 4 unused
    written = drafter.config.to_dict()
    assert written["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 3, 5], "projector_type": "domino",
                                        "pure_draft_prefix_len": 1, "emb_dim": 16, "gru_hidden_dim": 32,
                                        "shift_label": True}
    assert DrafterConfig.from_dict(written) == drafter.config
    again = load_drafter(save_drafter(tmp_path / "saved", drafter.config, drafter.state_dict()))
    state = drafter.state_dict()
    assert again.config == drafter.config and all(torch.equal(again.state_dict()[k], state[k]) for k in state)


def test_domino_computes_spec_generates_and_the_training_wrappers_numbers():
    """Hidden states and base logits (both paths); the GRU-corrected logits teacher-forced (the training
    wrapper's, all five rows) and along SpecForge's greedy path; the greedy walk's proposals."""
    drafter = load_drafter(FOLDER)
    inputs, expected = case("domino")
    lm_head, embed = inputs["target_lm_head"], head(inputs).embed_tokens
    weight = drafter.head_weight(lm_head)
    for hidden in decode(drafter, inputs):
        torch.testing.assert_close(hidden, expected["spec_hidden"], **TOL)
        torch.testing.assert_close(hidden, expected["train_hidden"], **TOL)
        torch.testing.assert_close(hidden @ lm_head.T, expected["spec_base_logits"], **TOL)
        torch.testing.assert_close(hidden @ lm_head.T, expected["train_base_logits"], **TOL)
        tokens, labels, _ = block_inputs(inputs["context_input_ids"], inputs["anchors"], 5, 96, 5)
        previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)
        assert torch.equal(previous, expected["train_prev_ids"]) and torch.equal(labels, expected["train_target_ids"])
        with torch.no_grad():
            trained = drafter.row_features(hidden, previous, embed) @ weight.T  # every row, as SpecForge trains
            served = drafter.slot_features(hidden, previous[:, :4], embed) @ weight.T
        torch.testing.assert_close(trained, expected["train_final_logits"], **TOL)
        torch.testing.assert_close(served, trained[:, :4], **TOL)
        torch.testing.assert_close(trained[:, 0], hidden[:, 0] @ lm_head.T, **TOL)  # pure_draft_prefix_len 1
        walk, logits = greedy_walk(drafter, hidden, tokens[:, 0], lm_head, embed)
        assert torch.equal(walk, expected["spec_greedy_tokens"])
        torch.testing.assert_close(logits, expected["spec_final_logits_greedy_path"][:, :4], **TOL)


def test_the_scored_streak_is_the_greedy_walks_run_of_true_tokens(tmp_path):
    """Per anchor of a one-task cache (anchors 3 .. 18), the vanilla streak through `score_task` is the number of
    leading proposals of the greedy walk equal to the true tokens; on text that follows anchor 3's greedy path,
    all B - 1 = 4 proposals are accepted there."""
    inputs, expected = case("domino")
    drafter = load_drafter(FOLDER)
    config = ScoringConfig(ddtree_budgets=[], topk=[2], device="cpu")
    text, anchors = inputs["context_input_ids"], torch.arange(3, 19)
    for on_its_path in (False, True):
        tokens = torch.cat([text[:4], expected["spec_greedy_tokens"][0], text[8:]]) if on_its_path else text
        task = one_task_cache(tmp_path / str(on_its_path), inputs, tokens).task("fixture")
        streaks = score_task(drafter, head(inputs), task, config, 5).streaks
        hidden, _ = decode(drafter, inputs, anchors, tokens)
        walk, _ = greedy_walk(drafter, hidden, tokens[anchors], inputs["target_lm_head"], head(inputs).embed_tokens)
        if not on_its_path:
            assert torch.equal(walk[(anchors[:, None] == inputs["anchors"]).any(1)], expected["spec_greedy_tokens"])
        _, labels, valid = block_inputs(tokens, anchors, 5, 96, 4)
        assert torch.equal(streaks["vanilla"], ((walk == labels) & valid).long().cumprod(1).sum(1))
        assert bool((streaks["top@2"] >= streaks["vanilla"]).all())
    assert int(streaks["vanilla"][0]) == 4


def test_specforges_logged_accept_len_follows_from_our_streaks():
    """SpecForge's `accept_len` = mean over blocks of (leading argmax matches with the true tokens + 1), all
    B rows of the shifted layout (row B-1 too, which serving never proposes); `base_accept_len` the same on
    the base logits; `accuracy_denom` the valid labels. Its anchors: every position whose token and the next
    are supervised (0 .. 18 of 20). Random weights: no match anywhere, so 1.0, as our served streaks give."""
    inputs, expected = case("domino")
    drafter = load_drafter(FOLDER)
    anchors = torch.arange(19)
    hidden, _ = decode(drafter, inputs, anchors)
    tokens, labels, valid = block_inputs(inputs["context_input_ids"], anchors, 5, 96, 5)
    previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)
    with torch.no_grad():
        final = drafter.row_features(hidden, previous, head(inputs).embed_tokens) @ drafter.head_weight(
            inputs["target_lm_head"]).T
    base = hidden @ inputs["target_lm_head"].T
    for logits, name in ((final, "accept_len"), (base, "base_accept_len")):
        streak = ((logits.argmax(-1) == labels) | ~valid).long().cumprod(1).mul(valid).sum(1)
        assert (streak + 1).float().mean().item() == pytest.approx(float(expected[f"train_metric.{name}"]), abs=1e-6)
    assert valid.sum() == expected["train_metric.accuracy_denom"] == 85
    with torch.no_grad():
        stats = drafter.slot_stats(drafter.slot_features(hidden, previous[:, :4], head(inputs).embed_tokens),
                                   drafter.head_weight(inputs["target_lm_head"]), labels[:, :4], previous[:, :4], 0)
    served = ((stats.label_order == 0).view(19, 4) & valid[:, :4]).long().cumprod(1).sum(1)
    assert (served + 1).float().mean().item() == pytest.approx(float(expected["train_metric.accept_len"]), abs=1e-6)


def test_without_shift_label_the_block_is_dflashs():
    """shift_label false (SpecForge): rows 1 .. B-1 draft a+1 .. a+B-1; row k >= 1 + pure_draft_prefix_len
    is corrected by the GRU's state after the block's tokens 0 .. k-1, as `apply_logits_head` reads them."""
    raw = json.loads((FOLDER / "config.json").read_text())
    raw["dflash_config"]["shift_label"] = False
    drafter = load_drafter(FOLDER, config=DrafterConfig.from_dict(raw))
    assert list(drafter.draft_rows(5)) == [1, 2, 3, 4]
    inputs, _ = case("domino")
    hidden, _ = decode(drafter, inputs)
    tokens, labels, _ = block_inputs(inputs["context_input_ids"], inputs["anchors"], 5, 96, 4)
    previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)
    embed = head(inputs).embed_tokens
    with torch.no_grad():
        logits = drafter.slot_features(hidden, previous, embed) @ drafter.head_weight(inputs["target_lm_head"]).T
        states = drafter.prefix_gru(embed(previous))[0]  # state k-1: after tokens 0 .. k-1
        corrected = drafter.embed_proj(torch.cat([hidden[:, 2:], states[:, 1:]], dim=-1))
    base = hidden[:, 1:] @ inputs["target_lm_head"].T
    torch.testing.assert_close(logits[:, 0], base[:, 0], **TOL)  # row 1 < 1 + pure_draft_prefix_len
    torch.testing.assert_close(logits[:, 1:], base[:, 1:] + corrected, **TOL)


def test_configs_no_domino_code_reads_the_same_way_are_refused():
    raw = json.loads((FOLDER / "config.json").read_text())
    assert "Domino's GRU" in load_drafter(FOLDER).ddtree_refusal
    for change, match in [
        ({"projector_type": "domino2"}, "field 'projector_type' is 'domino2': no drafter family this library scores"),
        ({"gru_hidden_dim": None, "emb_dim": None}, "no field 'emb_dim' or 'gru_hidden_dim' in dflash_config"),
        ({"pure_draft_prefix_len": -1}, "field 'pure_draft_prefix_len' must be an integer >= 0"),
        ({"shift_label": "yes"}, "field 'shift_label' must be true or false"),
    ]:
        config = copy.deepcopy(raw)
        for key, value in change.items():
            if value is None:
                config["dflash_config"].pop(key)
            else:
                config["dflash_config"][key] = value
        with pytest.raises(ValueError, match=match):
            DrafterConfig.from_dict(config)
    with pytest.raises(ValueError, match="field 'draft_vocab_size' is 48: a Domino drafter drafts over the whole"):
        DrafterConfig.from_dict({**raw, "draft_vocab_size": 48})

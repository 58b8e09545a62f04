"""The DSpark family (model/families/dspark.py) against fixtures/families/dspark: one set of weights saved by
speculators 0.9.0 and by DeepSeek's DeepSpec, and the numbers both computed (per-slot logits, confidence
logits, the greedy Markov path, the logged metrics), reproduced to 2e-5 in float32 through both of this
library's paths; then scored through `score_task`."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.model import DrafterConfig, build_drafter, save_drafter
from dflash_callbacks.model.families import dspark
from dflash_callbacks.model.families.walk import greedy_walk
from dflash_callbacks.model.geometry import block_inputs
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.scorer import score_task

from family_cases import FAMILIES, case, decode, head, one_task_cache

CASE = FAMILIES / "dspark"
FORMATS = {"speculators": CASE / "checkpoint", "deepspec": CASE / "deepspec_checkpoint"}
TOL = dict(atol=2e-5, rtol=0)


def teacher_forced(drafter, inputs, hidden, anchors):
    """(slot logits [n, B, V], confidence logits [n, B], labels, valid) at `anchors`, the true token before
    each slot (the anchor, then the labels)."""
    tokens, labels, valid = block_inputs(inputs["context_input_ids"], anchors, 5, 96, 5)
    previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)
    embed = head(inputs).embed_tokens
    with torch.no_grad():
        logits = drafter.slot_features(hidden, previous, embed) @ drafter.head_weight(inputs["target_lm_head"]).T
        return logits, drafter.confidence_logits(hidden, previous), labels, valid, previous


def test_both_formats_load_one_drafter(tmp_path):
    """speculators' folder and DeepSpec's load the same config and the same tensors; DeepSpec's copy of the
    target's embedding and LM head is kept aside and checked against the target's, as speculators' is."""
    inputs, _ = case("dspark")
    ours, theirs = (load_drafter(path) for path in FORMATS.values())
    assert ours.config.family_config == theirs.config.family_config == dspark.Settings(
        sample_from_anchor=True, markov_rank=8, markov_head_type="vanilla", enable_confidence_head=True,
        confidence_head_with_markov=True)
    for name in ("block_size", "mask_token_id", "target_layer_ids", "vocab_size", "hidden_size", "layer_types"):
        assert getattr(ours.config, name) == getattr(theirs.config, name), name
    assert ours.config.target_layer_ids == [1, 3, 5]  # speculators' aux ids [2, 4, 6], one off
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias"} <= set(a)
    assert set(theirs.stored_head) == {"embed_tokens.weight", "lm_head.weight"} and not ours.stored_head
    assert theirs.head_problems(inputs["target_embed_tokens"], inputs["target_lm_head"]) == []
    wrong = inputs["target_lm_head"].clone()
    wrong[7] += 1
    assert theirs.head_problems(inputs["target_embed_tokens"], wrong) == [
        "the drafter's stored lm_head.weight differs from the target's in 1 of 97 rows: it was trained against "
        "another target; score it with that one"]
    for drafter in (ours, theirs):  # written back in the published layout, read back the same
        assert DrafterConfig.from_dict(drafter.config.to_dict()) == drafter.config
        again = load_drafter(save_drafter(tmp_path / str(id(drafter)), drafter.config, drafter.state_dict()))
        assert again.config == drafter.config and all(torch.equal(again.state_dict()[k], a[k]) for k in a)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dspark_computes_the_trainers_numbers(fmt):
    """Hidden states, base and Markov-corrected logits, confidence logits, teacher-forced: speculators'
    training forward and DeepSpec's (training and evaluation), both paths of this library."""
    drafter = load_drafter(FORMATS[fmt])
    inputs, expected = case("dspark")
    lm_head, anchors = inputs["target_lm_head"], inputs["anchors"]
    assert list(drafter.draft_rows(5)) == [0, 1, 2, 3, 4]
    for hidden in decode(drafter, inputs):
        torch.testing.assert_close(hidden, expected["hidden"], **TOL)
        torch.testing.assert_close(hidden, expected["deepspec_eval_hidden"], **TOL)
        torch.testing.assert_close(hidden @ lm_head.T, expected["base_logits"], **TOL)
        torch.testing.assert_close(hidden @ lm_head.T, expected["deepspec_eval_base_logits"], **TOL)
        logits, confidence, labels, _, previous = teacher_forced(drafter, inputs, hidden, anchors)
        assert torch.equal(previous, expected["teacher_forced_prev_ids"])
        assert torch.equal(labels, expected["deepspec_train_target_ids"])
        torch.testing.assert_close(logits, expected["logits_teacher_forced"], **TOL)
        torch.testing.assert_close(logits, expected["deepspec_train_logits"], **TOL)
        torch.testing.assert_close(confidence, expected["confidence_logits_teacher_forced"], **TOL)
        torch.testing.assert_close(confidence, expected["deepspec_train_confidence_logits"], **TOL)


def test_the_greedy_markov_walk_and_deepspecs_confidence_cut():
    """Each slot's argmax given the previous proposal: DeepSpec's sampler's tokens and corrected logits;
    the confidence head along that path, and DeepSpec's evaluation cut at thresholds 0 and 0.5."""
    drafter = load_drafter(FORMATS["deepspec"])
    inputs, expected = case("dspark")
    hidden, _ = decode(drafter, inputs)
    tokens, logits = greedy_walk(drafter, hidden, inputs["context_input_ids"][inputs["anchors"]],
                                 inputs["target_lm_head"], head(inputs).embed_tokens)
    assert torch.equal(tokens, expected["greedy_tokens"]) and torch.equal(tokens, expected["deepspec_eval_tokens"])
    torch.testing.assert_close(logits, expected["greedy_logits"], **TOL)
    assert torch.equal(torch.nn.functional.one_hot(tokens, 97).float(), expected["deepspec_eval_draft_probs_T0"])
    base_argmax = (hidden @ inputs["target_lm_head"].T).argmax(-1)
    assert int((base_argmax != tokens).sum()) == 1  # the Markov head moves one slot
    with torch.no_grad():
        confidence = drafter.confidence_logits(hidden, torch.cat([inputs["block_input_ids"][:, :1], tokens[:, :-1]], 1))
    torch.testing.assert_close(confidence, expected["greedy_confidence_logits"], **TOL)
    torch.testing.assert_close(confidence, expected["deepspec_eval_confidence_logits"], **TOL)
    for threshold in (0.0, 0.5):
        cut = dspark.confidence_cut(confidence, threshold)
        assert torch.equal(cut, expected[f"deepspec_eval_proposal_len_thr{threshold}"])
    assert dspark.cut_reach(dspark.confidence_cut(confidence, 0.5), 5) == [0.5, 0.0, 0.0, 0.0, 0.0]


def test_the_scored_streak_is_the_greedy_walks_run_of_true_tokens(tmp_path):
    """Through `score_task` on a one-task cache of the fixture's sequence (anchors 3 .. 18): per anchor,
    the vanilla streak is the number of leading slots where the greedy walk proposes the true token (the
    fixture's walk at its anchors, this library's elsewhere), top@k is an upper bound. With the text after
    anchor 3 replaced by that anchor's greedy path, all B = 5 proposals are accepted there: tau reaches
    B + 1 (the block's every row drafts)."""
    inputs, expected = case("dspark")
    drafter = load_drafter(FORMATS["speculators"])
    config = ScoringConfig(ddtree_budgets=[], topk=[3], device="cpu")
    text = inputs["context_input_ids"]
    anchors = torch.arange(3, 19)
    for on_its_path in (False, True):
        tokens = torch.cat([text[:4], expected["greedy_tokens"][0], text[9:]]) if on_its_path else text
        task = one_task_cache(tmp_path / str(on_its_path), inputs, tokens).task("fixture")
        streaks = score_task(drafter, head(inputs), task, config, 5).streaks
        hidden, _ = decode(drafter, inputs, anchors, tokens)
        walk, _ = greedy_walk(drafter, hidden, tokens[anchors], inputs["target_lm_head"], head(inputs).embed_tokens)
        if not on_its_path:
            assert torch.equal(walk[(anchors[:, None] == inputs["anchors"]).any(1)], expected["greedy_tokens"])
        block, labels, valid = block_inputs(tokens, anchors, 5, 96, 5)
        assert torch.equal(streaks["vanilla"], ((walk == labels) & valid).long().cumprod(1).sum(1))
        assert bool((streaks["top@3"] >= streaks["vanilla"]).all())
        # the confidence cut, teacher-forced (the true tokens before each slot) or served (the walk's
        # proposals): the same proposals accepted, min(streak, cut), at every threshold
        with torch.no_grad():
            forced = drafter.confidence_logits(hidden, torch.cat([block[:, :1], labels[:, :-1]], 1))
            served = drafter.confidence_logits(hidden, torch.cat([block[:, :1], walk[:, :-1]], 1))
        for threshold in torch.linspace(0.05, 0.95, 19).tolist():
            cuts = (dspark.confidence_cut(forced, threshold), dspark.confidence_cut(served, threshold))
            assert torch.equal(*(torch.minimum(streaks["vanilla"], cut) for cut in cuts))
    assert int(streaks["vanilla"][0]) == 5  # anchor 3, on its own greedy path


def test_ddtree_is_refused_while_a_markov_head_ties_the_slots():
    drafter = load_drafter(FORMATS["speculators"])
    assert "Markov head" in drafter.ddtree_refusal
    with pytest.raises(ValueError, match="every node of a DDTree tree would need its own full-vocabulary head pass"):
        drafter.ddtree_streaks(None, torch.ones(1, 5, dtype=torch.bool), [4])
    raw = json.loads((FORMATS["deepspec"] / "config.json").read_text())
    plain = build_drafter(DrafterConfig.from_dict({**raw, "markov_rank": 0, "confidence_head_with_markov": False}))
    assert plain.ddtree_refusal is None and plain.markov_head is None  # independent slots: the closed form is exact


def test_the_trainers_logged_metrics_follow_from_our_slots_and_streaks():
    """speculators' `accept_len` (1 + sum of prefix products of 1 - TV), `accept_rate` and greedy `eal` (mean of
    streak + 1 against the verifier's argmax), DeepSpec's `tau_probabilistic` and `accept_rate@k`: from this
    library's teacher-forced slot distributions, and for `eal` its per-anchor streak (`slot_stats`' label
    order), on the anchors each trainer drew (all of them: 0 .. 14 for speculators, which keeps whole blocks,
    0 .. 18 for DeepSpec)."""
    inputs, expected = case("dspark")
    drafter = load_drafter(FORMATS["speculators"])
    lm_head = inputs["target_lm_head"]

    def tv_accept(q_logits, p_logits):
        return 1 - 0.5 * (q_logits.softmax(-1) - p_logits.softmax(-1)).abs().sum(-1)

    # speculators: the verifier's logits at a + k, its last hidden state crafted as (slot-0 hidden of block
    # a+k) / verifier_norm.weight (README): the verifier's final norm, whose weight that recovers
    anchors = torch.arange(15)
    hidden, _ = decode(drafter, inputs, anchors)
    q, _, _, _, previous = teacher_forced(drafter, inputs, hidden, anchors)
    v = inputs["verifier_last_hidden"]
    norm_weight = (hidden[:, 0] / v[:15]).median(dim=0).values
    verifier = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight) @ lm_head.T
    p = verifier[anchors[:, None] + torch.arange(5)]
    accept = tv_accept(q, p)
    metric = {k[len("train_metric."):]: float(t) for k, t in expected.items() if k.startswith("train_metric.")}
    assert accept.sum().item() == pytest.approx(metric["accept_rate_sum"], abs=1e-4)
    assert (accept.cumprod(1).sum(1) + 1).sum().item() == pytest.approx(metric["accept_len_sum"], abs=1e-4)
    assert metric["accept_len_total"] == metric["eal_total"] == 15
    weight = drafter.head_weight(lm_head)
    with torch.no_grad():
        stats = drafter.slot_stats(drafter.slot_features(hidden, previous, head(inputs).embed_tokens), weight,
                                   p.argmax(-1), previous, 0)
    matches = (stats.label_order == 0).view(15, 5)
    streak = matches.long().cumprod(1).sum(1)
    assert (streak + 1).sum().item() == metric["eal_sum"] == 32
    assert [int(matches[:, k].sum()) for k in range(5)] == [metric[f"position_{k}_acc_sum"] for k in range(5)]

    # DeepSpec: target logits lm_head(target_last_hidden[a + k]), labels a+1 .. a+5 while inside the text
    anchors = torch.arange(19)
    hidden, _ = decode(drafter, inputs, anchors)
    q, _, _, valid, _ = teacher_forced(drafter, inputs, hidden, anchors)
    positions = (anchors[:, None] + torch.arange(5)).clamp(max=19)
    accept = tv_accept(q, (inputs["deepspec_metrics_target_last_hidden"] @ lm_head.T)[positions]).clamp(0, 1) * valid
    tau = (accept.cumprod(1).sum(1) + 1).sum()
    assert tau.item() == pytest.approx(float(expected["deepspec_metric.tau_probabilistic.num"]), abs=1e-4)
    assert valid.any(1).sum() == expected["deepspec_metric.tau_probabilistic.den"] == 19
    for k in range(5):
        assert accept[:, k].sum().item() == pytest.approx(float(expected[f"deepspec_metric.accept_rate@{k}.num"]),
                                                          abs=1e-4)
        assert valid[:, k].sum() == expected[f"deepspec_metric.accept_rate@{k}.den"]


def test_configs_no_dspark_code_reads_the_same_way_are_refused():
    raw = json.loads((FORMATS["speculators"] / "config.json").read_text())
    flat = json.loads((FORMATS["deepspec"] / "config.json").read_text())
    for config, change, match in [
        (raw, {"markov_head_type": "gated"}, "field 'markov_head_type' is 'gated': this library scores the 'vanilla'"),
        (flat, {"markov_head_type": "fir"}, "field 'markov_head_type' is 'fir'"),
        (flat, {"markov_rank": -1}, "field 'markov_rank' must be an integer >= 0"),
        (flat, {"markov_rank": 0}, "field 'confidence_head_with_markov' is true but markov_rank is 0"),
        (raw, {"speculators_model_type": "dspark2"}, "field 'speculators_model_type' is 'dspark2'"),
        (flat, {"dflash_config": {"projector_type": "dspark"}}, "field 'projector_type' is 'dspark'"),
        (flat, {"architectures": ["Qwen3DSparkModel"], "speculators_model_type": "dflash"},
         "field 'architectures' is \\['Qwen3DSparkModel'\\], a DSpark drafter, but field 'speculators_model_type'"),
    ]:
        with pytest.raises(ValueError, match=match):
            DrafterConfig.from_dict({**copy.deepcopy(config), **change})


def test_without_sample_from_anchor_the_block_is_dflashs():
    """sample_from_anchor false (speculators): row 0 holds the anchor, rows 1 .. B-1 draft a+1 .. a+B-1, the
    Markov head reading the token before each (row 1: the anchor), as speculators trains it."""
    raw = json.loads((FORMATS["speculators"] / "config.json").read_text())
    drafter = load_drafter(FORMATS["speculators"], config=DrafterConfig.from_dict({**raw, "sample_from_anchor": False}))
    assert list(drafter.draft_rows(5)) == [1, 2, 3, 4]
    assert drafter.config.to_dict()["sample_from_anchor"] is False
    inputs, _ = case("dspark")
    hidden, _ = decode(drafter, inputs)
    tokens, labels, _ = block_inputs(inputs["context_input_ids"], inputs["anchors"], 5, 96, 4)
    previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)
    with torch.no_grad():
        logits = drafter.slot_features(hidden, previous, head(inputs).embed_tokens) @ drafter.head_weight(
            inputs["target_lm_head"]).T
    markov = drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(previous)).detach()
    torch.testing.assert_close(logits, hidden[:, 1:] @ inputs["target_lm_head"].T + markov, **TOL)

"""What a report says of its drafter's family: its settings beside its name, DSpark's confidence cut
(`scoring.confidence_threshold`: the truncated draft scored, and the distribution of the cut per depth,
`confidence_reach`, checked by the strict reader), the refusals a family's scoring needs (a threshold without
a confidence head; DDTree only where a head ties the slots), and the one note of how two drafters differ
(`basis.drafter_difference`) with the comparison table's title naming each side's family."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.model import DrafterConfig, build_drafter
from dflash_callbacks.model.families import dspark
from dflash_callbacks.model.geometry import block_inputs
from dflash_callbacks.scoring.basis import Basis, drafter_difference
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.report import EvalReport, family_title
from dflash_callbacks.scoring.table import comparison_table
from dflash_callbacks.scoring.scorer import block_problems, score_drafter

from family_cases import FAMILIES, case, decode, head, one_task_cache

DSPARK = FAMILIES / "dspark" / "checkpoint"


def plain_streaks_and_cuts(drafter, inputs, tokens, anchors, threshold):
    """The reference, one block at a time (`forward`): per anchor the vanilla streak (leading slots whose
    teacher-forced argmax is the true token) and the teacher-forced confidence cut."""
    _, hidden = decode(drafter, inputs, anchors, tokens)
    block, labels, valid = block_inputs(tokens, anchors, 5, 96, 5)
    previous = torch.cat([block[:, :1], labels[:, :-1]], dim=1)
    with torch.no_grad():
        logits = drafter.slot_features(hidden, previous, head(inputs).embed_tokens) @ \
            drafter.head_weight(inputs["target_lm_head"]).T
        cut = dspark.confidence_cut(drafter.confidence_logits(hidden, previous), threshold)
    streak = ((logits.argmax(-1) == labels) & valid).long().cumprod(1).sum(1)
    return streak, cut


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.7])
def test_a_confidence_threshold_scores_the_draft_cut_as_deepspec_evaluates_it(tmp_path, threshold):
    """Each anchor's streak is min(streak, cut), the cut teacher-forced; at the fixture's anchors and threshold
    0.5 the accepted count equals the one DeepSpec's own evaluation cut gives (its proposal lengths, served);
    `confidence_reach` is `dspark.cut_reach` of the cuts, and the full-block report holds none."""
    inputs, expected = case("dspark")
    drafter = load_drafter(DSPARK)
    tokens, anchors = inputs["context_input_ids"], torch.arange(3, 19)
    cache = one_task_cache(tmp_path, inputs, tokens)
    config = ScoringConfig(ddtree_budgets=[], topk=[3], device="cpu", anchors_per_forward=5)
    full = score_drafter(drafter, cache, head(inputs), config)
    cut_report = score_drafter(drafter, cache, head(inputs), dataclasses.replace(config, confidence_threshold=threshold))
    streak, cut = plain_streaks_and_cuts(drafter, inputs, tokens, anchors, threshold)
    from dflash_callbacks.scoring.aggregates import decode_streaks

    numbers, plain = cut_report.tasks["fixture"], full.tasks["fixture"]
    assert torch.equal(torch.from_numpy(decode_streaks(plain["vanilla"]["streaks"], 6)), streak)
    assert torch.equal(torch.from_numpy(decode_streaks(numbers["vanilla"]["streaks"], 6)), torch.minimum(streak, cut))
    top = torch.from_numpy(decode_streaks(plain["top@3"]["streaks"], 6))
    assert torch.equal(torch.from_numpy(decode_streaks(numbers["top@3"]["streaks"], 6)), torch.minimum(top, cut))
    assert numbers["vanilla"]["confidence_reach"] == numbers["top@3"]["confidence_reach"] == dspark.cut_reach(cut, 5)
    assert "confidence_reach" not in plain["vanilla"] and cut_report.scoring["confidence_threshold"] == threshold
    if threshold == 0.5:
        at = anchors[(anchors[:, None] == inputs["anchors"]).any(1)] - 3
        served = expected["deepspec_eval_proposal_len_thr0.5"].long()
        assert torch.equal(torch.minimum(streak[at], cut[at]), torch.minimum(streak[at], served))
    assert EvalReport.from_dict(json.loads(cut_report.to_json())).tasks == cut_report.tasks


def test_the_strict_reader_holds_confidence_reach_to_its_shape_and_to_the_curve(tmp_path):
    inputs, _ = case("dspark")
    cache = one_task_cache(tmp_path, inputs, inputs["context_input_ids"])
    config = ScoringConfig(ddtree_budgets=[], device="cpu", confidence_threshold=0.3)
    raw = json.loads(score_drafter(load_drafter(DSPARK), cache, head(inputs), config).to_json())
    numbers = raw["tasks"]["fixture"]["vanilla"]
    reach, curve = numbers["confidence_reach"], numbers["curve"]
    assert len(reach) == 5 and all(c <= r for c, r in zip(curve, reach)) and reach[0] > 0
    bad = {"short": (reach[:4], r"'confidence_reach' must be a list of 5 shares \(depths 1 to 5\)"),
           "rising": ([0.1, 0.2, 0, 0, 0], r"'confidence_reach' rises from 0.1 to 0.2 at depth 2"),
           "below the curve": ([0.25, 0, 0, 0, 0], r"'curve' at depth 1 is 0.5, above 'confidence_reach' there \(0.25\)"),
           "not a share": ([1.5, 0, 0, 0, 0], r"'confidence_reach' at depth 1 is 1.5, not a finite number from 0 to 1")}
    for what, (value, message) in bad.items():
        spoiled = json.loads(json.dumps(raw))
        spoiled["tasks"]["fixture"]["vanilla"]["confidence_reach"] = value
        spoiled["tasks"]["fixture"]["vanilla"]["curve"][0] = 0.5 if what == "below the curve" else curve[0]
        with pytest.raises(ValueError, match=r"task 'fixture', vanilla: " + message):
            EvalReport.from_dict(spoiled)


def test_a_threshold_is_refused_without_a_confidence_head_and_ddtree_only_where_a_markov_head_ties_the_slots():
    raw = json.loads((DSPARK / "config.json").read_text())
    with_heads = DrafterConfig.from_dict(raw)
    no_confidence = DrafterConfig.from_dict({**raw, "enable_confidence_head": False})
    independent = DrafterConfig.from_dict({**raw, "markov_rank": 0, "confidence_head_with_markov": False})
    dflash = dataclasses.replace(with_heads, family="dflash", family_config=None)
    cut = ScoringConfig(ddtree_budgets=[], confidence_threshold=0.5)
    assert block_problems(with_heads, cut) == []
    for config, why in ((dflash, "DFlash drafter's block: it has no confidence head"),
                        (no_confidence, "DSpark drafter's block: it has no confidence head (enable_confidence_head is "
                                        "false)")):
        assert block_problems(config, cut) == [f"scoring.confidence_threshold=0.5 can not cut a {why}; leave it None "
                                               "(the full block)"]
    assert block_problems(independent, ScoringConfig()) == []  # independent slots: DFlash's closed form is exact
    (problem,) = block_problems(with_heads, ScoringConfig())
    assert problem.startswith("ddtree@N can not be scored for a DSpark drafter: DSpark's Markov head") and \
        problem.endswith("score it without DDTree (scoring.ddtree_budgets=[]) and monitor vanilla or top@k (e.g. the "
                         "stop's monitor='vanilla/live')")
    for value in (0, 1, -0.5, "0.5", True):
        with pytest.raises(ValueError, match=r"confidence_threshold must be None or a number between 0 and 1 "
                                             r"\(exclusive\); got "):
            ScoringConfig(confidence_threshold=value)


def test_a_report_records_its_familys_settings_and_the_basis_its_threshold(tmp_path):
    inputs, _ = case("dspark")
    cache = one_task_cache(tmp_path, inputs, inputs["context_input_ids"])
    drafter = load_drafter(DSPARK)
    cut = score_drafter(drafter, cache, head(inputs), ScoringConfig(ddtree_budgets=[], device="cpu",
                                                                   confidence_threshold=0.5))
    assert cut.family == {"name": "dspark", "proposals": {"5": 5},
                          "settings": dataclasses.asdict(drafter.config.family_config)}
    basis = Basis.of_run(ScoringConfig(ddtree_budgets=[], device="cpu"), cache, 5)
    assert basis.mismatches(cut, "ours") == ["ours was scored with confidence threshold 0.5 (this run: None)"]
    assert Basis.from_dict({k: v for k, v in basis.to_dict().items() if k != "confidence_threshold"}) == basis
    with pytest.raises(ValueError, match=r"'family.settings' is 3, not an object of the family's settings or null"):
        EvalReport.from_dict({**json.loads(cut.to_json()), "family": {**cut.family, "settings": 3}})


def test_one_note_says_how_two_drafters_differ_and_the_table_names_each_sides_family(tmp_path):
    """Two families; one family of other settings; two kinds of attention too: one note. The table's title
    names each side's family when they differ; a report of before families reads as DFlash."""
    inputs, _ = case("dspark")
    cache = one_task_cache(tmp_path, inputs, inputs["context_input_ids"])
    config = ScoringConfig(ddtree_budgets=[], topk=[3], device="cpu")
    raw = json.loads((DSPARK / "config.json").read_text())
    markov = score_drafter(load_drafter(DSPARK), cache, head(inputs), config)
    plain_config = DrafterConfig.from_dict({**raw, "markov_rank": 0, "confidence_head_with_markov": False,
                                            "enable_confidence_head": False})
    torch.manual_seed(0)
    plain = score_drafter(build_drafter(plain_config), cache, head(inputs), config)
    dflash = score_drafter(build_drafter(dataclasses.replace(plain_config, family="dflash", family_config=None,
                                                             layer_types=["full_attention"] * 3, causal=True)),
                           cache, head(inputs), config)
    old = EvalReport.from_dict({**json.loads(dflash.to_json()), "family": None})
    assert drafter_difference(markov, markov) is None and drafter_difference(dflash, old) is None
    assert family_title(old) == "DFlash" and family_title(markov) == "DSpark"
    assert drafter_difference(markov, plain) == (
        "the drafters are DSpark drafters of other settings (ours: confidence_head_with_markov True, "
        "enable_confidence_head True, markov_rank 8; the baseline: confidence_head_with_markov False, "
        "enable_confidence_head False, markov_rank 0): each is scored as it is served, but they are not one "
        "architecture")
    assert drafter_difference(markov, dflash) == (
        "the drafters are of two families (ours: DSpark; the baseline: DFlash) and attend differently inside the "
        "block (ours: bidirectional; the baseline: causal): each is scored as it is served, but they are not one "
        "architecture")
    title = comparison_table(markov, dflash).splitlines()[0]
    assert title.endswith("; ours a DSpark drafter, the baseline a DFlash one; [95% within-task interval]: 1 task, "
                          "too few for a run-level one (at least 3), so the mean's is the text's noise alone")
    assert "drafter" not in comparison_table(markov, plain).splitlines()[0]
    assert "a DFlash one" in comparison_table(markov, old).splitlines()[0]

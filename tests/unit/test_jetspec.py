"""The JetSpec family (model/families/jetspec.py) against fixtures/families/jetspec: NeMo Automodel's consolidated
export (its shard index), the numbers Automodel's trainer and the JetSpec reference computed (block-causal slot
logits, the greedy path, the reference on the checkpoint as saved, the accum_logp tree and its accepted length,
the logged metrics) reproduced to 2e-5 in float32 through both of this library's paths; the three spellings of
causality named at preflight in one line; then `score` on the checkpoint folder under both attention rules."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.model import DrafterConfig, save_drafter
from dflash_callbacks.model.attention import attention_note, resolve_attention
from dflash_callbacks.model.families import jetspec
from dflash_callbacks.model.families.walk import greedy_walk
from dflash_callbacks.model.geometry import block_inputs
from dflash_callbacks.model.io import read_state_shapes, safetensors_files
from dflash_callbacks.scoring.aggregates import decode_streaks
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.service import ServiceSpec, preflight

from family_cases import FAMILIES, case, decode, head, tasks_cache

FOLDER = FAMILIES / "jetspec" / "checkpoint"
TOL = dict(atol=2e-5, rtol=0)
GREEDY = {"trained": "ref_greedy_tokens", "vllm": "ref_as_saved_greedy_tokens"}
"""The reference's greedy path under each rule: block-causal (`causal_head: true` added), and on the checkpoint
as saved (bidirectional)."""


def test_the_automodel_export_loads_through_its_index_and_writes_back(tmp_path):
    assert [f.name for f in safetensors_files(FOLDER)] == ["model-00001-of-00001.safetensors"]
    drafter = load_drafter(FOLDER)
    config = drafter.config
    assert config.family == "jetspec" and config.family_config == jetspec.Settings(causal=True, causal_head=None)
    assert config.causal is False and config.is_causal is False  # the recipe's top-level stamp, read first
    assert list(drafter.draft_rows(5)) == [1, 2, 3, 4] and drafter.ddtree_refusal is None
    written = config.to_dict()
    assert written["architectures"] == ["Qwen3DFlashDraftModel"] and written["is_causal"] is False
    assert written["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 3, 5], "causal": True}
    assert written["block_size"] == 5
    assert DrafterConfig.from_dict(written) == config
    again = load_drafter(save_drafter(tmp_path / "saved", config, drafter.state_dict()))
    state = drafter.state_dict()
    assert again.config == config and all(torch.equal(again.state_dict()[k], state[k]) for k in state)


def test_jetspec_computes_the_trainers_and_the_references_numbers():
    """Under `trained` (block-causal): the trainer's hidden states and logits (all five rows) and the reference's
    (slots 1 .. 4) and greedy path; under `vllm` (what vLLM makes of the checkpoint as saved): the reference's
    numbers on the checkpoint as saved, which read it bidirectionally too: logits 5.2 apart, 7 of 16 slots other.
    The reference's float32 logits are 1.1e-5 from the float64 value of the same math and the trainer's 1.3e-5
    from them: the one-block forward in float32 lands 2.2e-5 from the reference's, so that path is held to the
    reference's logits within 2e-5 in float64 (both paths are), 2.5e-5 in float32, and to the trainer's within
    2e-5 in float32."""
    drafter = load_drafter(FOLDER)
    inputs, expected = case("jetspec")
    lm_head, embed, anchors = inputs["target_lm_head"], head(inputs).embed_tokens, inputs["anchors"]
    assert [str(a) for a in resolve_attention(drafter.config, "trained")] == ["causal"] * 3
    assert [str(a) for a in resolve_attention(drafter.config, "vllm")] == ["bidirectional"] * 3
    assert resolve_attention(drafter.config, "auto") == resolve_attention(drafter.config, "vllm")
    wide = load_drafter(FOLDER, dtype=torch.float64)
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    for rule, reference in (("trained", "ref"), ("vllm", "ref_as_saved")):
        batched, alone = decode(drafter, inputs, rule=rule)
        for hidden in (batched, alone):
            if rule == "trained":
                torch.testing.assert_close(hidden, expected["train_hidden"], **TOL)
                torch.testing.assert_close(hidden @ lm_head.T, expected["train_logits"], **TOL)
            walk, logits = greedy_walk(drafter, hidden, inputs["context_input_ids"][anchors], lm_head, embed)
            assert torch.equal(walk, expected[f"{reference}_greedy_tokens"])
        torch.testing.assert_close(logits, expected[f"{reference}_logits"], atol=2.5e-5, rtol=0)
        torch.testing.assert_close(batched[:, 1:] @ lm_head.T, expected[f"{reference}_logits"], **TOL)
        for hidden in decode(wide, inputs64, rule=rule):
            torch.testing.assert_close(hidden[:, 1:] @ inputs64["target_lm_head"].T,
                                       expected[f"{reference}_logits"].double(), **TOL)
    apart = expected["ref_logits"] - expected["ref_as_saved_logits"]
    assert 5.1 < float(apart.abs().max()) < 5.2
    assert int((expected["ref_greedy_tokens"] != expected["ref_as_saved_greedy_tokens"]).sum()) == 7


def test_the_accum_logp_tree_and_its_accepted_length():
    """The tree of each anchor's trained slot distributions (width 2, budget 8): the reference's token ids,
    parents, depths and cumulative log-probs, node for node; its accepted length along the true text (0: a
    random drafter on real text), and along each anchor's own greedy path, the depth of the tree's all-best
    branch, read off the reference's tree."""
    drafter = load_drafter(FOLDER)
    inputs, expected = case("jetspec")
    hidden, _ = decode(drafter, inputs, rule="trained")
    top = torch.log_softmax(hidden[:, 1:] @ inputs["target_lm_head"].T, dim=-1).topk(2, dim=-1)
    _, labels, _ = block_inputs(inputs["context_input_ids"], inputs["anchors"], 5, 96, 4)
    for i, anchor in enumerate(inputs["anchors"].tolist()):
        tree = jetspec.accum_logp_tree(top.values[i], budget=8)
        n = len(tree.parents)
        ids = [int(inputs["context_input_ids"][anchor])] + [int(top.indices[i, d - 1, c])
                                                           for c, d in zip(tree.choice[1:], tree.depth[1:])]
        assert n == int((expected["ref_tree_parents"][i] != -2).sum()) == 8
        assert ids == expected["ref_tree_token_ids"][i, :n].tolist()
        assert tree.parents == expected["ref_tree_parents"][i, :n].tolist()
        assert tree.depth == expected["ref_tree_depth"][i, :n].tolist()
        torch.testing.assert_close(torch.tensor(tree.cum_logprob, dtype=torch.float32),
                                   expected["ref_tree_cum_logprob"][i, :n], **TOL)
        choice = [next((j for j in range(2) if int(top.indices[i, d, j]) == int(labels[i, d])), -1) for d in range(4)]
        assert jetspec.tree_accepted(tree, choice) == int(expected["ref_tree_accepted"][i]) == 0
        parents, depth = expected["ref_tree_parents"][i].tolist(), expected["ref_tree_depth"][i].tolist()
        best = [0]  # the reference's nodes whose every choice is its depth's best (its first child)
        for node in range(1, n):
            if parents[node] in best and node == min(c for c in range(1, n) if parents[c] == parents[node]):
                best.append(node)
        assert jetspec.tree_accepted(tree, [0, 0, 0, 0]) == max(depth[node] for node in best) == 3


def test_the_trainers_logged_metrics_are_against_the_teachers_argmax():
    """Automodel's JetSpec metrics on every anchor 0 .. 15: `loss` the forward KL against the teacher's logits
    (T = 1), `accuracy` the share of slots whose argmax is the TEACHER's, `accept_len` the mean over blocks of the
    leading run of such slots + 1. Our vanilla streak runs against the cached text instead: fed the teacher's
    argmax as the text (what a greedy cache of the target holds), it is `accept_len` - 1 per block; against the
    fixture's own tokens it is another number."""
    drafter = load_drafter(FOLDER)
    inputs, expected = case("jetspec")
    anchors = torch.arange(16)
    batched, alone = decode(drafter, inputs, anchors, rule="trained")
    torch.testing.assert_close(batched, alone, **TOL)
    logits = batched[:, 1:] @ inputs["target_lm_head"].T
    teacher = inputs["metrics_target_logits"][anchors[:, None] + torch.arange(4)]  # slot k: the row of a + k - 1
    kl = (teacher.softmax(-1) * (teacher.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)
    assert kl.mean().item() == pytest.approx(float(expected["train_metric.loss"]), abs=2e-5)
    tokens, labels, valid = block_inputs(inputs["context_input_ids"], anchors, 5, 96, 4)
    previous = torch.cat([tokens[:, :1], labels[:, :-1]], dim=1)
    for text, runs in ((teacher.argmax(-1), 17), (labels, None)):
        with torch.no_grad():
            stats = drafter.slot_stats(drafter.slot_features(batched, previous, head(inputs).embed_tokens),
                                       drafter.head_weight(inputs["target_lm_head"]), text, previous, 0)
        hits = (stats.label_order == 0).view(16, 4) & valid
        streak = hits.long().cumprod(1).sum(1)
        if runs is not None:
            assert int(hits.sum()) == int(expected["train_metric.correct_tokens"]) == 19
            assert int(valid.sum()) == int(expected["train_metric.valid_tokens"]) == 64
            assert int((streak + 1).sum()) == int(expected["train_metric.accept_len_sum"]) == 33
            assert (streak + 1).float().mean().item() == pytest.approx(float(expected["train_metric.accept_len"]))
            assert hits.float().mean().item() == pytest.approx(float(expected["train_metric.accuracy"]))
        else:
            assert int((streak + 1).sum()) != 33  # the fixture's teacher is not its text


def test_the_mismatch_is_named_at_preflight_in_one_line(tmp_path):
    """What the trainer meant, what vLLM will serve, the rule that scores each, the setting that scores both;
    none once both are scored; the reference's spelling read too (no is_causal: vLLM reads neither)."""
    inputs, _ = case("jetspec")
    cache = tasks_cache(tmp_path, inputs, {"fixture": inputs["context_input_ids"]})
    config = load_drafter(FOLDER).config
    lines: list[str] = []
    spec = ServiceSpec(str(cache.path), str(tmp_path / "target"), scoring=ScoringConfig(ddtree_budgets=[], device="cpu"))
    preflight(spec, config, read_state_shapes(FOLDER), warn=lines.append)
    assert lines == [
        "JetSpec attention: the checkpoint says is_causal false, dflash_config.causal true; its trainer meant every "
        "layer block-causal (attention='trained' scores that), vLLM will serve every layer bidirectional (it reads "
        "the top-level is_causal first; attention='vllm' scores that, as does the default 'auto'); the JetSpec "
        "reference, reading only causal_head, runs it bidirectional too; scoring.attentions=['trained'] scores both"]
    assert attention_note(config, ["auto", "trained"]).endswith("runs it bidirectional too")
    assert attention_note(config, ["trained"]).endswith("; scoring.attentions=['vllm'] scores both")
    raw = json.loads((FOLDER / "config.json").read_text())
    del raw["is_causal"]
    assert attention_note(DrafterConfig.from_dict(raw), ["auto"]) is None  # vLLM then reads dflash_config.causal
    reference = copy.deepcopy(raw)
    reference["architectures"] = ["DFlashDraftModel"]  # the reference's class name, z-lab's
    reference["dflash_config"] = {**raw["dflash_config"], "causal_head": True}
    del reference["dflash_config"]["causal"]
    config = DrafterConfig.from_dict(reference)
    assert config.family == "jetspec" and config.family_config == jetspec.Settings(causal=None, causal_head=True)
    assert resolve_attention(config, "trained") != resolve_attention(config, "vllm")
    assert "says dflash_config.causal_head true;" in attention_note(config, ["auto"])
    assert "(it reads is_causal and dflash_config.causal, never causal_head;" in attention_note(config, ["auto"])


def test_score_on_the_checkpoint_folder_gives_the_greedy_walks_streaks_under_both_rules(tmp_path, capsys):
    """`score` of the export on a cache whose task i follows fixture anchor i's greedy path (tokens a+1 .. a+4),
    scored under `trained` and, beside it, `vllm`: at every fixture anchor whose block the change leaves alone
    the vanilla streak is the run of the fixture's own greedy walk (the reference's, per rule) along the text, at
    the anchor whose path the text follows all 4 under `trained`; every anchor's streak is the run of our walk.
    The preflight line comes first, the report says the patterns differ."""
    inputs, expected = case("jetspec")
    text, fixture_anchors = inputs["context_input_ids"], inputs["anchors"].tolist()
    texts = {f"follows-{a}": torch.cat([text[: a + 1], expected[GREEDY["trained"]][i], text[a + 5:]])
             for i, a in enumerate(fixture_anchors)}
    cache = tasks_cache(tmp_path, inputs, texts)
    out = tmp_path / "ours.json"
    assert cli_main(["score", "--drafter", str(FOLDER), "--cache", str(cache.path), "--target", str(tmp_path / "target"),
                     "--attention", "trained", "--attentions", "vllm", "--budgets", "", "--topk", "2", "--device", "cpu",
                     "--json", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("warning:")] == [
        f"warning: {attention_note(load_drafter(FOLDER).config, ['trained', 'vllm'])}"]
    report = EvalReport.load(out)
    assert report.attention_patterns == {"trained": ["causal"] * 3, "vllm": ["bidirectional"] * 3}
    assert "the drafter's patterns differ" in report.served()
    drafter, anchors = load_drafter(FOLDER), torch.arange(3, 19)
    for name, tokens in texts.items():
        followed = int(name.split("-")[1])
        _, labels, valid = block_inputs(tokens, anchors, 5, 96, 4)
        for rule, method in (("trained", "vanilla"), ("vllm", "vanilla:vllm")):
            streaks = torch.from_numpy(decode_streaks(report.tasks[name][method]["streaks"], 5))
            hidden, _ = decode(drafter, inputs, anchors, tokens, rule=rule)
            walk, _ = greedy_walk(drafter, hidden, tokens[anchors], inputs["target_lm_head"], head(inputs).embed_tokens)
            assert torch.equal(streaks, ((walk == labels) & valid).long().cumprod(1).sum(1)), (name, rule)
            for i, a in enumerate(fixture_anchors):
                if tokens[a] == text[a]:  # the block and its context as in the fixture: its walk is the fixture's
                    run = (expected[GREEDY[rule]][i] == tokens[a + 1 : a + 5]).long().cumprod(0).sum()
                    assert streaks[a - 3] == run, (name, rule, a)
            if rule == "trained":
                assert streaks[followed - 3] == 4


def test_configs_no_jetspec_code_reads_the_same_way_are_refused(tmp_path):
    raw = json.loads((FOLDER / "config.json").read_text())
    for change, match in [
        ({"causal": None}, "neither dflash_config.causal nor dflash_config.causal_head is true .* NeMo Automodel also "
                           "writes Qwen3DFlashDraftModel for its DFlash and Domino drafters"),
        ({"causal": False}, "neither dflash_config.causal nor dflash_config.causal_head is true"),
        ({"causal_head": False}, "dflash_config.causal is True but dflash_config.causal_head is False: the config "
                                 "contradicts itself"),
        ({"causal": "yes"}, "field 'dflash_config.causal' must be true, false or null; got 'yes'"),
    ]:
        config = copy.deepcopy(raw)
        for key, value in change.items():
            if value is None:
                config["dflash_config"].pop(key)
            else:
                config["dflash_config"][key] = value
        with pytest.raises(ValueError, match=match):
            DrafterConfig.from_dict(config)
    sliding = {**raw, "layer_types": ["sliding_attention", "full_attention", "full_attention"], "sliding_window": 4,
               "use_sliding_window": True}
    with pytest.raises(ValueError, match="a JetSpec drafter with a sliding window is not scored here"):
        load_drafter(FOLDER, config=DrafterConfig.from_dict(sliding))
    with pytest.raises(ValueError, match="the config's causal is None but its is_causal \\(False\\)"):
        jetspec.Drafter(dataclasses.replace(DrafterConfig.from_dict(raw), causal=None))
    domino = {**raw, "dflash_config": {**raw["dflash_config"], "projector_type": "domino"}}
    with pytest.raises(ValueError, match="a JetSpec drafter, but field 'projector_type' is 'domino', a Domino one: the "
                                         "config contradicts itself"):
        DrafterConfig.from_dict(domino)

"""The DFlare family (model/families/dflare.py) against fixtures/families/dflare: AngelSlim's `save_pretrained`
folder, and the numbers AngelSlim's trainer (its BlockMask) and `spec_generate` computed (per-layer target fusion,
the context's own K/V, the greedy path, the logged loss and accuracy) reproduced to 2e-5 in float32 through both
of this library's paths; then `score` on the checkpoint folder."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.demos.objective import block_loss, slot_weights
from dflash_callbacks.model import DrafterConfig, build_drafter, save_drafter
from dflash_callbacks.model.families.walk import greedy_walk
from dflash_callbacks.model.geometry import block_inputs
from dflash_callbacks.scoring.aggregates import decode_streaks
from dflash_callbacks.scoring.report import EvalReport

from family_cases import FAMILIES, case, decode, head, tasks_cache

FOLDER = FAMILIES / "dflare" / "checkpoint"
TOL = dict(atol=2e-5, rtol=0)
ANGELSLIM_FIELDS = ("num_anchors", "loss_decay_gamma", "attention_backend", "aux_hidden_states_layer_ids",
                    "embed_weight_key", "trust_remote_code", "gamma_warmup", "gamma_warmup_step",
                    "target_model_name_or_path")


def test_the_save_pretrained_folder_loads_and_writes_back(tmp_path):
    """No fc; the fusion weights and the context projections; the training script's fields kept and written back."""
    drafter = load_drafter(FOLDER)
    raw = json.loads((FOLDER / "config.json").read_text())
    assert drafter.config.family == "dflare" and drafter.config.family_config is None
    assert list(drafter.draft_rows(5)) == [1, 2, 3, 4] and drafter.ddtree_refusal is None
    state = drafter.state_dict()
    assert "fc.weight" not in state and state["layer_fusion_weights"].shape == (3, 3)
    assert state["layers.0.self_attn.k_proj_target.weight"].shape == (32, 64)
    written = drafter.config.to_dict()
    assert written["architectures"] == ["QwenDFlareDraftModel"]
    assert {name: written[name] for name in ANGELSLIM_FIELDS} == {name: raw[name] for name in ANGELSLIM_FIELDS}
    assert DrafterConfig.from_dict(written) == drafter.config
    again = load_drafter(save_drafter(tmp_path / "saved", drafter.config, state))
    assert again.config == drafter.config and all(torch.equal(again.state_dict()[k], state[k]) for k in state)
    fresh = build_drafter(drafter.config).fusion_probs()  # each draft layer leans on one target layer at first
    assert fresh.argmax(dim=1).tolist() == [0, 1, 2]


def test_dflare_computes_the_trainers_and_spec_generates_numbers():
    """The fusion probabilities; hidden states and logits (the trainer's five rows, spec_generate's slots 1 .. 4)
    and spec_generate's greedy path; the RoPE frequencies rounded to bfloat16 as AngelSlim's bf16 build leaves
    them: the exact ones are 3.4e-3 off."""
    drafter = load_drafter(FOLDER)
    inputs, expected = case("dflare")
    lm_head, anchors = inputs["target_lm_head"], inputs["anchors"]
    torch.testing.assert_close(drafter.fusion_probs(), expected["fusion_probs"], **TOL)
    for hidden in decode(drafter, inputs):
        torch.testing.assert_close(hidden, expected["train_hidden"], **TOL)
        torch.testing.assert_close(hidden, expected["spec_hidden"], **TOL)
        torch.testing.assert_close(hidden @ lm_head.T, expected["train_logits"], **TOL)
        torch.testing.assert_close(hidden[:, 1:] @ lm_head.T, expected["spec_logits"], **TOL)
        walk, logits = greedy_walk(drafter, hidden, inputs["context_input_ids"][anchors], lm_head,
                                   head(inputs).embed_tokens)
        assert torch.equal(walk, expected["spec_greedy_tokens"])
    exact = load_drafter(FOLDER)
    exact.rotary_emb.inv_freq = build_drafter(DrafterConfig.from_dict({**json.loads(
        (FOLDER / "config.json").read_text()), "architectures": ["DFlashDraftModel"]})).rotary_emb.inv_freq
    assert not torch.equal(exact.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq)
    off = (decode(exact, inputs)[0] @ lm_head.T - expected["train_logits"]).abs().max()
    assert 3e-3 < float(off) < 4e-3


def test_the_trainers_logged_loss_is_our_objective():
    """AngelSlim's logged loss (decay-weighted cross-entropy, w_k = exp(-(k-1)/7), over slots 1 .. 4 of the
    blocks its sampler drew, 3, 8, 11, 14) is `demos.objective.block_loss` at gamma 7, and its accuracy (argmax
    == true token, every slot) 0 as ours."""
    drafter = load_drafter(FOLDER)
    inputs, expected = case("dflare")
    with torch.no_grad():
        loss = block_loss(drafter, head(inputs), inputs["context_input_ids"], inputs["target_hidden"],
                          inputs["anchors"], slot_weights(4, 7.0))
    assert loss.item() == pytest.approx(float(expected["train_loss"]), abs=2e-5)
    hidden, _ = decode(drafter, inputs)
    _, labels, valid = block_inputs(inputs["context_input_ids"], inputs["anchors"], 5, 96, 4)
    hits = ((hidden[:, 1:] @ inputs["target_lm_head"].T).argmax(-1) == labels) & valid
    assert hits.float().mean().item() == float(expected["train_accuracy"]) == 0.0


def test_score_on_the_checkpoint_folder_gives_the_greedy_walks_streaks(tmp_path):
    """`score` of the folder on a cache whose task i follows fixture anchor i's greedy path: at every fixture
    anchor whose block the change leaves alone the vanilla streak is the run of spec_generate's greedy path
    along the text, all 4 at the anchor whose path the text follows; every anchor's, the run of our walk."""
    inputs, expected = case("dflare")
    text, fixture_anchors = inputs["context_input_ids"], inputs["anchors"].tolist()
    greedy = expected["spec_greedy_tokens"]
    texts = {f"follows-{a}": torch.cat([text[: a + 1], greedy[i], text[a + 5:]]) for i, a in enumerate(fixture_anchors)}
    cache = tasks_cache(tmp_path, inputs, texts)
    out = tmp_path / "ours.json"
    assert cli_main(["score", "--drafter", str(FOLDER), "--cache", str(cache.path), "--target", str(tmp_path / "target"),
                     "--budgets", "4", "--topk", "2", "--device", "cpu", "--json", str(out)]) == 0
    report = EvalReport.load(out)
    assert report.family["name"] == "dflare" and report.attention_patterns is None
    drafter, anchors = load_drafter(FOLDER), torch.arange(3, 19)
    for name, tokens in texts.items():
        streaks = torch.from_numpy(decode_streaks(report.tasks[name]["vanilla"]["streaks"], 5))
        hidden, _ = decode(drafter, inputs, anchors, tokens)
        walk, _ = greedy_walk(drafter, hidden, tokens[anchors], inputs["target_lm_head"], head(inputs).embed_tokens)
        _, labels, valid = block_inputs(tokens, anchors, 5, 96, 4)
        assert torch.equal(streaks, ((walk == labels) & valid).long().cumprod(1).sum(1)), name
        for i, a in enumerate(fixture_anchors):
            if tokens[a] == text[a]:
                assert streaks[a - 3] == (greedy[i] == tokens[a + 1 : a + 5]).long().cumprod(0).sum(), (name, a)
        assert streaks[int(name.split("-")[1]) - 3] == 4


def test_configs_no_dflare_code_reads_the_same_way_are_refused(tmp_path):
    raw = json.loads((FOLDER / "config.json").read_text())
    with pytest.raises(ValueError, match=r"field 'aux_hidden_states_layer_ids' is \[1, 2, 5\] but target_layer_ids is "
                                         r"\[1, 3, 5\]: the layers AngelSlim's trainer captured"):
        DrafterConfig.from_dict({**raw, "aux_hidden_states_layer_ids": [1, 2, 5]})
    with pytest.raises(ValueError, match="field 'target_hidden_size' is 128"):
        DrafterConfig.from_dict({**raw, "target_hidden_size": 128})
    drafter = load_drafter(FOLDER)
    state = {**drafter.state_dict(), "fc.weight": torch.zeros(64, 192)}
    with pytest.raises(ValueError, match=r"unexpected tensor 'fc.weight' \(shape \[64, 192\]\)"):
        load_drafter(state, config=drafter.config)
    dflash = copy.deepcopy(raw)
    dflash["architectures"] = ["DFlashDraftModel"]
    with pytest.raises(ValueError, match=r"missing tensor 'fc.weight'.*\n.*unexpected tensor 'layer_fusion_weights'"):
        load_drafter(FOLDER, config=DrafterConfig.from_dict(dflash))

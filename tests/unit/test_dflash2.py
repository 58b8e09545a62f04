"""The DFlash 2 family: its two config forms, its checkpoint keys, its convolution and selector
against plain references, the exact DDTree over its candidate tree against a tree built node by
node, and its training loss on the toy world. (tests/unit/test_dflash2_fixtures.py: the trainer's
and vLLM's own numbers.)"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from dflash_callbacks import DFlashDrafter, DrafterConfig, TargetHead, load_drafter
from dflash_callbacks.demos.toy.world import toy_drafter_config, toy_target_path
from dflash_callbacks.kernels.candidate_ddtree import candidate_ddtree_streaks
from dflash_callbacks.model import build_drafter
from dflash_callbacks.model.families.dflash2 import Drafter, Settings, block_conv, read_config
from dflash_callbacks.model.families.dflash2_selector import NOT_PROPOSED
from dflash_callbacks.demos.objective import CacheSequences, default_gamma, depth_weights, sequence_loss
from suite_paths import FIXTURES

FULL = FIXTURES / "families" / "dflash2-full"


def fixture_raw() -> dict:
    return json.loads((FULL / "checkpoint" / "config.json").read_text())


def tiny_config(settings: Settings | None = None, **overrides) -> DrafterConfig:
    raw = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               head_dim=8, block_size=4, mask_token_id=29, target_layer_ids=[0, 1], vocab_size=30,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=128,
               family="dflash2", family_config=settings or Settings(4, 2, 3, 4))
    raw.update(overrides)
    return DrafterConfig(**raw)


# ---------------------------------------------------------------- configs and checkpoints


def test_speculators_config_reads_the_family_fields_and_its_defaults():
    config = DrafterConfig.from_dict(fixture_raw())
    assert config.family == "dflash2" and config.target_layer_ids == [1, 3, 5]  # aux ids [2, 4, 6], one off
    assert config.family_config == Settings(conv_group_size=16, conv_kernel_size=2, selector_rank=8, selector_top_k=4)
    assert config.sliding_window_non_causal is True and config.draft_vocab_size is None
    raw = fixture_raw()
    del raw["sliding_window_non_causal"]
    assert DrafterConfig.from_dict(raw).sliding_window_non_causal is True  # this family's default
    raw["sliding_window_non_causal"] = False
    assert DrafterConfig.from_dict(raw).sliding_window_non_causal is False


def test_zlab_form_is_written_and_loads_the_same_weights_to_the_same_numbers(tmp_path):
    speculators = DrafterConfig.from_dict(fixture_raw())
    zlab = speculators.to_dict()
    assert zlab["architectures"] == ["DFlash2DraftModel"] and zlab["model_type"] == "qwen3"
    assert "speculators_model_type" not in zlab and "transformer_layer_config" not in zlab
    assert zlab["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 3, 5], "block_size": 5,
                                     "conv_group_size": 16, "conv_kernel_size": 2, "selector_rank": 8,
                                     "selector_top_k": 4, "output_multiplier": 1.0, "final_logit_softcapping": None}
    assert DrafterConfig.from_dict(zlab) == speculators
    state = load_file(str(FULL / "checkpoint" / "model.safetensors"))
    inputs = load_file(str(FULL / "inputs.safetensors"))
    outs = []
    for config in (speculators, DrafterConfig.from_dict(json.loads(json.dumps(zlab)))):
        drafter = load_drafter(state, config=config)
        with torch.no_grad():
            context = drafter.encode_context(inputs["target_hidden"][:14][None], torch.arange(14)[None])
            outs.append(drafter.decode_blocks(context, inputs["block_embeddings"], inputs["anchors"]))
    assert torch.equal(outs[0], outs[1])


def test_zlab_serving_fields_are_read_and_neutral_values_normalised():
    zlab = DrafterConfig.from_dict(fixture_raw()).to_dict()
    zlab["dflash_config"].update(output_multiplier=2.0, final_logit_softcapping=30.0, input_embedding_scale=0.5)
    settings = DrafterConfig.from_dict(zlab).family_config
    serving = (settings.output_multiplier, settings.final_logit_softcapping, settings.input_embedding_scale)
    assert serving == (2.0, 30.0, 0.5)
    assert DrafterConfig.from_dict(DrafterConfig.from_dict(zlab).to_dict()).family_config == settings
    zlab["dflash_config"].update(output_multiplier=None, final_logit_softcapping=0)  # vLLM: 1 and no softcap
    settings = DrafterConfig.from_dict(zlab).family_config
    assert (settings.output_multiplier, settings.final_logit_softcapping) == (1.0, None)


def test_bad_family_fields_are_refused_each_named_at_once():
    raw = fixture_raw()
    del raw["selector_top_k"], raw["selector_rank"]
    with pytest.raises(ValueError, match="no field 'selector_rank', 'selector_top_k' .*: a DFlash 2 config names its convolution and selector"):
        DrafterConfig.from_dict(raw)
    raw = {**fixture_raw(), "conv_group_size": 0, "selector_rank": True, "conv_kernel_size": 2.0}
    with pytest.raises(ValueError) as error:
        DrafterConfig.from_dict(raw)
    lines = str(error.value).splitlines()
    assert [line.split(" must ")[0] for line in lines] == [
        "field 'conv_group_size'", "field 'conv_kernel_size'", "field 'selector_rank'"]
    with pytest.raises(ValueError, match=r"field 'output_multiplier' must be a finite number > 0; got -1\n"
                                         r"field 'final_logit_softcapping' must be None or a finite number > 0"):
        Settings(16, 2, 8, 4, output_multiplier=-1, final_logit_softcapping=-3.0)
    with pytest.raises(ValueError, match=r"field 'conv_group_size' \(5\) must divide hidden_size \(16\)\n"
                                         r"field 'selector_top_k' \(31\) exceeds vocab_size \(30\)"):
        Drafter(tiny_config(Settings(5, 2, 3, 31)))
    with pytest.raises(ValueError, match="field 'draft_vocab_size' is 20: a DFlash 2 drafter drafts over the whole"):
        Drafter(tiny_config(draft_vocab_size=20))
    with pytest.raises(ValueError, match="field 'speculators_model_type' is 'dflash'"):
        read_config({**fixture_raw(), "speculators_model_type": "dflash"})


def test_a_checkpoint_of_the_other_family_is_refused_naming_its_tensors():
    """DFlash 2 weights under a DFlash config: every convolution and selector tensor is unexpected;
    DFlash weights under a DFlash 2 config: they are missing."""
    state = load_file(str(FULL / "checkpoint" / "model.safetensors"))
    raw = {k: v for k, v in fixture_raw().items() if k not in ("conv_group_size", "conv_kernel_size", "selector_rank",
                                                               "selector_top_k")}
    dflash = DrafterConfig.from_dict({**raw, "speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"]})
    assert dflash.family == "dflash"
    with pytest.raises(ValueError) as error:
        load_drafter(state, config=dflash)
    for key in ("layers.0.attention_conv.base_kernel", "layers.2.mlp_conv.kernel_projection.weight",
                "candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight"):
        assert f"unexpected tensor {key!r}" in str(error.value)
    own = {k: v for k, v in state.items() if "conv" not in k and "candidate_selector" not in k}
    with pytest.raises(ValueError, match=r"missing tensor 'layers.0.attention_conv.base_kernel' \(expected shape "
                                         r"\[2, 2, 64\]\)"):
        load_drafter(own, config=DrafterConfig.from_dict(fixture_raw()))
    assert set(load_drafter(state, config=DrafterConfig.from_dict(fixture_raw())).state_dict()) == set(state)


# ---------------------------------------------------------------- the backbone


def test_block_conv_matches_a_plain_loop_and_never_reaches_across_a_block():
    g = torch.Generator().manual_seed(0)
    b, blocks, block, hidden, taps, groups = 2, 3, 4, 8, 3, 2
    y = torch.randn(b, blocks * block, hidden, generator=g, dtype=torch.float64)
    delta = torch.randn(b, blocks * block, taps, groups, generator=g, dtype=torch.float64)
    base = torch.randn(taps, hidden, generator=g, dtype=torch.float64)
    expected = torch.zeros_like(y)
    for i, t, tap, c in itertools.product(range(b), range(blocks * block), range(taps), range(hidden)):
        if t % block >= tap:
            expected[i, t, c] += y[i, t - tap, c] * (base[tap, c] + delta[i, t, tap, c // (hidden // groups)])
    torch.testing.assert_close(block_conv(y, delta, base, block), expected, atol=1e-12, rtol=0)
    # a kernel longer than the block reads nothing before the block's start
    torch.testing.assert_close(block_conv(y, delta, base, 2), block_conv(y, delta[..., :2, :], base[:2], 2))


def test_fresh_convolutions_are_the_identity_so_the_drafter_is_dflash():
    torch.manual_seed(0)
    config = tiny_config()
    dflash2 = build_drafter(config).eval()
    assert isinstance(dflash2, Drafter)
    dflash = DFlashDrafter(dataclasses.replace(config, family="dflash", family_config=None)).eval()
    dflash.load_state_dict({k: v for k, v in dflash2.state_dict().items() if "conv" not in k and "selector" not in k})
    hidden, noise = torch.randn(1, 12, config.num_target_features), torch.randn(3, 4, 16)
    anchors = torch.tensor([3, 7, 12])
    with torch.no_grad():
        outs = [d.decode_blocks(d.encode_context(hidden, torch.arange(12)[None]), noise, anchors)
                for d in (dflash, dflash2)]
    assert torch.equal(outs[0], outs[1])


def test_block_size_of_the_forward_and_the_embedding_scale():
    """The forward's blocks are `block_size` rows (default the config's): two blocks of 2 packed equal each
    alone; rows that are no whole number of blocks are refused. input_embedding_scale s is the block's
    embeddings times s."""
    torch.manual_seed(1)
    config = tiny_config(Settings(4, 3, 3, 4))
    drafter = build_drafter(config).eval()
    with torch.no_grad():  # convolutions away from the identity
        for name, p in drafter.named_parameters():
            if "conv" in name:
                p.normal_(0, 0.5)
    ctx, noise = torch.randn(1, 10, config.num_target_features), torch.randn(1, 4, 16)
    positions = torch.cat([torch.arange(10), torch.tensor([6, 7, 9, 10])])
    mask = torch.zeros(4, 14, dtype=torch.bool)
    mask[:2, :6], mask[2:, :9], mask[:2, 10:12], mask[2:, 12:] = True, True, True, True
    with torch.no_grad():
        packed = drafter(ctx, noise, positions[None], mask, block_size=2)
        alone = torch.cat([drafter(ctx[:, :a], noise[:, i : i + 2], torch.arange(a + 2)[None], block_size=2)
                           for i, a in ((0, 6), (2, 9))], dim=1)
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
        assert not torch.allclose(packed, drafter(ctx, noise, positions[None], mask), atol=1e-3)  # one block of 4
        with pytest.raises(ValueError, match="6 block rows, not whole blocks of block_size 4"):
            drafter(ctx, torch.randn(1, 6, 16), torch.arange(16)[None])
        scaled = Drafter(dataclasses.replace(config, family_config=Settings(4, 3, 3, 4, input_embedding_scale=0.5)))
        scaled.load_state_dict(drafter.state_dict())
        torch.testing.assert_close(scaled.eval()(ctx, noise, positions[None], mask, block_size=2),
                                   drafter(ctx, noise * 0.5, positions[None], mask, block_size=2), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- the selector


def integer_drafter(settings: Settings, seed: int = 0) -> Drafter:
    """A drafter whose selector weights are small integers: every score below is an exact integer."""
    drafter = Drafter(tiny_config(settings)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.candidate_selector.parameters():
            p.copy_(torch.randint(-1, 2, p.shape, generator=g).float())
    return drafter


def reference_stats(drafter: Drafter, features, weight, labels, previous, top_n):
    """The selector's statistics by their definitions, one slot at a time, in float64 Python numbers."""
    s, sel = drafter.settings, drafter.candidate_selector
    pred, succ, proj = (t.double().tolist() for t in (sel.predecessor_codebook, sel.successor_codebook,
                                                      sel.hidden_projection.weight))
    n, slots, _ = features.shape
    out = {k: [] for k in ("ids", "scores", "edges", "lse", "logprob", "rank", "order", "top", "index")}
    for b in range(n):
        before = [int(previous[b, 0])] * s.selector_top_k
        for j in range(slots):
            z = (features[b, j].double() @ weight.double().T).tolist()
            ids = sorted(range(len(z)), key=lambda v: (-z[v], v))[: s.selector_top_k]
            unary = [z[c] * s.output_multiplier for c in ids]
            if s.final_logit_softcapping:
                unary = [math.tanh(u / s.final_logit_softcapping) * s.final_logit_softcapping for u in unary]
            h = [sum(w * x for w, x in zip(row, features[b, j].double().tolist())) for row in proj]

            def score(p, i):
                return unary[i] + sum(pred[p][r] * h[r] * succ[ids[i]][r] for r in range(len(h)))

            out["edges"].append([[score(p, i) for i in range(len(ids))] for p in before])
            scores = [score(int(previous[b, j]), i) for i in range(len(ids))]
            lse = math.log(sum(math.exp(x) for x in scores))
            label = int(labels[b, j])
            if label in ids:
                i = ids.index(label)
                rank = sum(x > scores[i] for x in scores)
                order = rank + sum(x == scores[i] for x in scores[:i])
                logprob = scores[i] - lse
            else:
                i, rank, order, logprob = -1, NOT_PROPOSED, NOT_PROPOSED, -math.inf
            top = sorted((x - lse for x in scores), reverse=True)[:top_n]
            for key, value in (("ids", ids), ("scores", scores), ("lse", lse), ("logprob", logprob), ("rank", rank),
                               ("order", order), ("top", top + [-math.inf] * (top_n - len(top))), ("index", i)):
                out[key].append(value)
            before = ids
    return out


@pytest.mark.parametrize("settings, exact", [
    (Settings(4, 2, 3, 4), True),
    (Settings(4, 2, 3, 5, output_multiplier=0.7, final_logit_softcapping=2.5), False),
    (Settings(4, 2, 5, 30), True),  # K = V
])
def test_selector_stats_match_their_definition(settings, exact):
    drafter = integer_drafter(settings)
    g = torch.Generator().manual_seed(1)
    n, slots = 5, 3
    features = torch.randint(-2, 3, (n, slots, 16), generator=g).float()
    weight = torch.randint(-1, 2, (30, 16), generator=g).float()
    labels, previous = torch.randint(0, 30, (n, slots), generator=g), torch.randint(0, 30, (n, slots), generator=g)
    z = features @ weight.T
    labels[0] = z[0].argmax(-1)  # candidates, some chosen: every branch is taken
    labels[1, 1:] = z[1, 1:].topk(2).indices[:, 1]
    previous[1, 1:] = z[1, :-1].topk(3).indices[:, 2]  # the true previous token is a candidate before it
    top_n = 6
    for chunk in (None, 7):
        stats = drafter.slot_stats(features, weight, labels, previous, top_n, "torch", chunk)
        ref = reference_stats(drafter, features, weight, labels, previous, top_n)
        assert stats.candidate_ids.tolist() == ref["ids"]
        close = dict(atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(stats.candidate_scores, torch.tensor(ref["scores"]).float(), **close)
        torch.testing.assert_close(stats.edge_scores, torch.tensor(ref["edges"]).float(), **close)
        torch.testing.assert_close(stats.lse, torch.tensor(ref["lse"]).float(), **close)
        torch.testing.assert_close(stats.label_logprob, torch.tensor(ref["logprob"]).float(), **close)
        torch.testing.assert_close(stats.top_logprobs, torch.tensor(ref["top"]).float(), **close)
        assert stats.label_index.tolist() == ref["index"]
        if exact:  # integer scores, ties and all
            assert stats.label_rank.tolist() == ref["rank"] and stats.label_order.tolist() == ref["order"]
        # the teacher-forced row is the edge row of the true previous token, bitwise, where it is a candidate
        edges = stats.edge_scores.view(n, slots, *stats.edge_scores.shape[1:])
        assert torch.equal(stats.candidate_scores.view(n, slots, -1)[:, 0], edges[:, 0, 0])
        assert torch.equal(stats.candidate_scores.view(n, slots, -1)[1, 1:], edges[1, 1:].gather(
            1, (stats.candidate_ids.view(n, slots, -1)[1, :-1] == previous[1, 1:, None]).int().argmax(-1)[:, None, None]
            .expand(-1, 1, edges.shape[-1]))[:, 0])
    low = drafter.to(torch.bfloat16).slot_stats(features.bfloat16(), weight.bfloat16(), labels, previous, top_n)
    assert low.lse.dtype == torch.float32 and torch.isfinite(low.lse).all()


# ---------------------------------------------------------------- DDTree over the candidate tree


def brute_force_streak(edge_logprobs: torch.Tensor, label_index: list[int], valid: list[bool], budget: int) -> int:
    """One anchor: every node of the candidate tree (depth L, K children each, a child's log-prob read
    from its parent's row), ordered by score then rank tuple; the label path walked down the best N."""
    length, k, _ = edge_logprobs.shape
    lp = edge_logprobs.double().tolist()
    nodes = []  # (score, rank tuple, path of candidate indices)

    def grow(slot: int, parent: int, score: float, ranks: tuple, path: tuple) -> None:
        if slot == length:
            return
        row = lp[slot][parent]
        order = sorted(range(k), key=lambda c: (-row[c], c))
        for rank, c in enumerate(order):
            nodes.append((score + row[c], ranks + (rank,), path + (c,)))
            grow(slot + 1, c, score + row[c], ranks + (rank,), path + (c,))

    grow(0, 0, 0.0, (), ())
    popped = {path for _, _, path in sorted(nodes, key=lambda node: (-node[0], node[1]))[:budget]}
    streak = 0
    while streak < length and valid[streak] and label_index[streak] >= 0 and \
            tuple(label_index[: streak + 1]) in popped:
        streak += 1
    return streak


@pytest.mark.parametrize("kind", ["gaussian", "ties", "confident"])
def test_candidate_ddtree_is_algorithm_1_on_the_tree(kind):
    """Against the tree built node by node, over 120 anchors of random depth and width, with exact ties
    (repeated scores) and log-probs of 0.0 (a confident child ties its parent)."""
    g = torch.Generator().manual_seed(sum(map(ord, kind)))
    budgets = [1, 2, 3, 5, 8, 20]
    for length, k in itertools.product((1, 2, 4), (1, 2, 3)):
        scores = {"gaussian": lambda: torch.randn(10, length, k, k, generator=g),
                  "ties": lambda: torch.randint(-1, 2, (10, length, k, k), generator=g).float(),
                  "confident": lambda: torch.randint(0, 2, (10, length, k, k), generator=g).float() * 40}[kind]()
        scores[:, 0] = scores[:, 0, :1]  # slot 0: every row the anchor's
        edge_logprobs = scores.log_softmax(-1)
        label_index = torch.randint(-1, k, (10, length), generator=g)
        label_index[:5] = label_index[:5].clamp(min=0)
        valid = torch.rand(10, length, generator=g) < 0.9
        out = candidate_ddtree_streaks(edge_logprobs, label_index, valid, budgets)
        for budget, i in itertools.product(budgets, range(10)):
            assert int(out[budget][i]) == brute_force_streak(edge_logprobs[i], label_index[i].tolist(),
                                                             valid[i].tolist(), budget), (length, k, budget, i)


def test_the_drafters_ddtree_reads_its_slot_stats():
    drafter = integer_drafter(Settings(4, 2, 3, 3), seed=2)
    g = torch.Generator().manual_seed(3)
    features = torch.randint(-2, 3, (6, 3, 16), generator=g).float()
    weight = torch.randint(-1, 2, (30, 16), generator=g).float()
    z = features @ weight.T
    labels = z.argmax(-1)  # the unary argmax: a candidate, often the walk's
    previous = torch.cat([torch.randint(0, 30, (6, 1), generator=g), labels[:, :-1]], dim=1)
    stats = drafter.slot_stats(features, weight, labels, previous, 4)
    valid = torch.ones(6, 3, dtype=torch.bool)
    valid[5, 2] = False
    out = drafter.ddtree_streaks(stats, valid, [1, 4, 9])
    edges = stats.edge_logprobs.view(6, 3, 3, 3)
    for budget, i in itertools.product((1, 4, 9), range(6)):
        assert int(out[budget][i]) == brute_force_streak(edges[i], stats.label_index.view(6, 3)[i].tolist(),
                                                         valid[i].tolist(), budget)
    with pytest.raises(ValueError, match="budgets must be integers"):
        drafter.ddtree_streaks(stats, valid, [0])


# ---------------------------------------------------------------- training


def test_thirty_steps_on_the_toy_world_lower_the_loss(toy_training_cache_dir):
    config = dataclasses.replace(toy_drafter_config(block_size=8), family="dflash2",
                                 family_config=Settings(16, 2, 16, 4))
    torch.manual_seed(0)
    drafter, head = build_drafter(config), TargetHead.from_pretrained(toy_target_path()).requires_grad_(False)
    data, weights = CacheSequences(toy_training_cache_dir), depth_weights(8, default_gamma(8))
    before_conv = copy.deepcopy(drafter.layers[0].attention_conv.state_dict())

    def held_out() -> float:  # the loss on 8 sequences, at the same anchors each time
        g, total = torch.Generator().manual_seed(123), 0.0
        with torch.no_grad():
            for i in range(8):
                s = data[i]
                loss = sequence_loss(drafter, head, s["input_ids"], s["hidden"], s["prompt_len"], 8, weights, g)
                total += loss.item()
        return total / 8

    before = held_out()
    optimizer, g = torch.optim.AdamW(drafter.parameters(), lr=3e-3), torch.Generator().manual_seed(0)
    for step in range(30):
        s = data[step % len(data)]
        loss = sequence_loss(drafter, head, s["input_ids"], s["hidden"], s["prompt_len"], 4, weights, g)
        optimizer.zero_grad()
        loss.backward()
        assert drafter.candidate_selector.successor_codebook.grad.abs().sum() > 0  # the selector's part trains it
        optimizer.step()
    assert held_out() < before - 0.5
    moved = drafter.layers[0].attention_conv.state_dict()
    assert not all(torch.equal(moved[k], v) for k, v in before_conv.items())  # the convolutions learn too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_selector_stats_and_ddtree_on_cuda_equal_the_cpus():
    drafter = integer_drafter(Settings(4, 2, 3, 4))
    g = torch.Generator().manual_seed(4)
    features = torch.randint(-2, 3, (7, 3, 16), generator=g).float()
    weight = torch.randint(-1, 2, (30, 16), generator=g).float()
    labels, previous = (features @ weight.T).argmax(-1), torch.randint(0, 30, (7, 3), generator=g)
    valid = torch.ones(7, 3, dtype=torch.bool)
    cpu = drafter.slot_stats(features, weight, labels, previous, 8)
    gpu = drafter.cuda().slot_stats(features.cuda(), weight.cuda(), labels.cuda(), previous.cuda(), 8)
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=0)
    budgets = [1, 3, 8]
    on_cpu, on_gpu = drafter.cpu().ddtree_streaks(cpu, valid, budgets), drafter.ddtree_streaks(gpu, valid.cuda(), budgets)
    assert all(torch.equal(on_cpu[n], on_gpu[n].cpu()) for n in budgets)

import json

import pytest
import torch

from dflash_callbacks import DFlashDrafter, TargetHead
from dflash_callbacks.cache.format import CacheTask, HiddenStateCache
from dflash_callbacks.scoring.config import ScoringConfig
from naive_scorer import score_task_naive
from dflash_callbacks.scoring.report import EvalReport
from dflash_callbacks.scoring.table import comparison, comparison_table
from dflash_callbacks.model.attention import resolve_attention
from dflash_callbacks.model.geometry import anchor_range, block_attention_mask
from dflash_callbacks.scoring.scorer import score_drafter, score_task

from synthetic import build_world, drafter_config


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A random drafter (one sliding, one full layer), a random head, a 3-task cache."""
    w = build_world(tmp_path_factory.mktemp("world"))
    return w.drafter, w.head, HiddenStateCache(w.cache)


def test_anchor_range_and_mask():
    assert list(anchor_range(5, 12)) == [5, 6, 7, 8, 9, 10]
    assert list(anchor_range(5, 12, window=3)) == [5, 6, 7]
    mask = block_attention_mask(torch.tensor([2, 4]), 2, 4)
    expected = torch.tensor([
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 1],
        [1, 1, 1, 1, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("anchors_per_forward,window", [(1, None), (4, 10), (64, None)])
def test_batched_equals_naive_anchor_by_anchor(world, anchors_per_forward, window):
    drafter, head, cache = world
    config = ScoringConfig(ddtree_budgets=[1, 4, 8, 32], topk=[2, 5], window=window,
                           anchors_per_forward=anchors_per_forward, vocab_chunk=5, device="cpu")
    seen_nonzero = set()
    for name in cache.task_names:
        task = cache.task(name)
        fast = score_task(drafter, head, task, config, block_size=6)
        slow = score_task_naive(drafter, head, task, config, block_size=6)
        assert fast.first_anchor == slow.first_anchor == task.prompt_len
        methods = [str(m) for m in config.methods]
        assert set(fast.streaks) == set(methods) == set(slow.streaks)
        for method in methods:
            assert torch.equal(fast.streaks[method], slow.streaks[method]), (name, method)
            if fast.streaks[method].any():
                seen_nonzero.add(method)
    assert {"vanilla", "ddtree@4", "ddtree@32", "top@5"} <= seen_nonzero  # the comparison is not vacuous


def test_confident_drafter_ddtree_ties_resolve_as_algorithm_1(world):
    """A head scaled 300x makes the drafter sure of itself: most of its fp32 log-probs are
    0.0, so a prefix ties with its child of rank 0. DDTree pops n prefixes, so ddtree@n
    never exceeds n; the closed form used to count every tied depth as accepted."""
    drafter, head, cache = world
    sure = TargetHead(head.embed_tokens.weight.clone(), head.lm_head.weight * 300)
    config = ScoringConfig(ddtree_budgets=[1, 2, 4], device="cpu")
    tied = 0
    for name in cache.task_names:
        task = cache.task(name)
        fast = score_task(drafter, sure, task, config, block_size=6)
        slow = score_task_naive(drafter, sure, task, config, block_size=6)
        for budget in config.ddtree_budgets:
            method = f"ddtree@{budget}"
            assert torch.equal(fast.streaks[method], slow.streaks[method]), (name, method)
            assert int(fast.streaks[method].max()) <= budget
        tied += int((fast.streaks["vanilla"] > 1).sum())
    assert tied > 0  # some anchors have two sure and correct depths: the case is exercised


@pytest.mark.parametrize("anchors_per_forward", [1, 5])
def test_batched_equals_naive_with_a_window_under_a_block_from_anchor_0(world, anchors_per_forward):
    """A sliding window (3) smaller than the block (6), and a task whose first anchor is 0
    (its first block sees no context; with one anchor per forward, no context key at all)."""
    drafter, head, cache = world
    narrow = DFlashDrafter(drafter_config(sliding_window=3)).eval()
    narrow.load_state_dict(drafter.state_dict())
    short = cache.task("short")
    config = ScoringConfig(ddtree_budgets=[4], topk=[3], anchors_per_forward=anchors_per_forward, device="cpu")
    seen_nonzero = False
    for task in (short, CacheTask("from_zero", 0, short.input_ids, short.hidden)):
        fast = score_task(narrow, head, task, config, block_size=6)
        slow = score_task_naive(narrow, head, task, config, block_size=6)
        for method in map(str, config.methods):
            assert torch.equal(fast.streaks[method], slow.streaks[method]), (task.name, method)
            seen_nonzero |= bool(fast.streaks[method].any())
    assert seen_nonzero


def test_a_smaller_block_size_is_scored_and_recorded_and_a_larger_one_refused(world):
    """Served at num_speculative_tokens + 1, a drafter often runs at a smaller block than it was trained at:
    scored, both recorded. A larger one is refused: its slots past the trained block never learnt to draft."""
    drafter, head, cache = world
    config = ScoringConfig(ddtree_budgets=[4], block_size=4, device="cpu")
    report = score_drafter(drafter, cache, head, config)
    assert report.block_size == 4 and report.drafter_block_size == 6
    task = cache.task("long")
    slow = score_task_naive(drafter, head, task, config, block_size=4)
    curve = report.tasks["long"]["vanilla"]["curve"]
    assert len(curve) == 3
    assert report.tasks["long"]["vanilla"]["dense"] == pytest.approx(float(slow.streaks["vanilla"].double().mean() + 1))
    with pytest.raises(ValueError, match=r"block size 7 is above the drafter's trained block size 6: the slots past it "
                                         r"never learnt to draft; score at most block size 6"):
        score_drafter(drafter, cache, head, ScoringConfig(ddtree_budgets=[4], block_sizes=[7], device="cpu"))


def test_several_block_sizes_in_one_report_are_methods_of_their_own(world):
    """`block_sizes` scores every method again at each other block size, named METHOD:bB, with the numbers,
    curve and tau range of that block: each equals a report scored at that block alone, and the intervals
    pair them on the same anchors."""
    drafter, head, cache = world
    both = score_drafter(drafter, cache, head, ScoringConfig(ddtree_budgets=[4], topk=[2], block_sizes=[3], device="cpu"))
    alone = score_drafter(drafter, cache, head, ScoringConfig(ddtree_budgets=[4], topk=[2], block_size=3, device="cpu"))
    full = score_drafter(drafter, cache, head, ScoringConfig(ddtree_budgets=[4], topk=[2], device="cpu"))
    assert both.methods == ["vanilla", "ddtree@4", "top@2", "vanilla:b3", "ddtree@4:b3", "top@2:b3"]
    assert both.family == {"name": "dflash", "proposals": {"6": 5, "3": 2}, "settings": None}
    assert [both.max_tau(m) for m in both.methods] == [6, 6, 6, 3, 3, 3]
    for task in both.tasks:
        for method in alone.methods:
            assert both.tasks[task][f"{method}:b3"] == alone.tasks[task][method]
            assert both.tasks[task][method] == full.tasks[task][method]
    assert EvalReport.from_dict(json.loads(both.to_json())).to_dict() == both.to_dict()
    assert "vanilla:b3" in both.intervals["mean"] and both.value("ddtree@4:b3/live") == alone.value("ddtree@4/live")


def test_report_shape_json_round_trip_and_table(world, tmp_path):
    drafter, head, cache = world
    report = score_drafter(drafter, cache, head, ScoringConfig(ddtree_budgets=[4, 8], topk=[3], device="cpu"), step=7, name="rand")
    raw = json.loads(report.to_json(tmp_path / "r.json"))
    assert raw["step"] == 7 and raw["drafter"] == "rand" and raw["block_size"] == 6
    assert raw["cache"] == {"path": str(cache.path), "fingerprint": cache.fingerprint}
    assert set(raw["tasks"]) == {"long", "short", "one_anchor"}
    entry = raw["tasks"]["short"]["ddtree@8"]
    assert set(entry) >= {"dense", "live", "curve"} and len(entry["curve"]) == 5
    assert 1 <= entry["live"] <= 6 and entry["anchors"] == 25 - 1 - 3
    assert raw["tasks"]["one_anchor"]["vanilla"]["anchors"] == 1
    for method in ("vanilla", "ddtree@4", "ddtree@8", "top@3"):
        mean = sum(raw["tasks"][t][method]["live"] for t in raw["tasks"]) / 3
        assert raw["mean"][method]["live"] == pytest.approx(mean)
    again = EvalReport.load(tmp_path / "r.json")
    assert again.to_dict() == report.to_dict()
    table = comparison_table(report, again)
    assert "| **mean** |" in table and "+0.00 [+0.00, +0.00] | 100% [100%, 100%] |" in table  # paired: no doubt
    assert "vanilla live: 100% [100%, 100%] of the baseline, not distinguishable from it" in table
    # one builder for the markdown table and W&B's: methods the baseline lacks are left out
    raw = report.to_dict()
    intervals = {**raw["intervals"], "mean": {m: v for m, v in raw["intervals"]["mean"].items() if m != "top@3"},
                 "tasks": {t: {m: v for m, v in entry.items() if m != "top@3"} for t, entry in raw["intervals"]["tasks"].items()}}
    fewer = EvalReport.from_dict({**raw, "intervals": intervals, "tasks": {
        t: {m: v for m, v in entry.items() if m != "top@3"} for t, entry in raw["tasks"].items()}})
    columns, rows = comparison(report, fewer)
    assert not any(c.startswith("top@3") for c in columns) and len(rows) == 4
    assert rows[-1][:5] == ["mean", *[report.value("vanilla/live")] * 2, 0.0, 1.0]


def test_scoring_config_rejects_impossible_values():
    with pytest.raises(ValueError, match=r"ddtree_budgets must be a list of integers >= 1; got 0 in \[0\]"):
        ScoringConfig(ddtree_budgets=[0])
    with pytest.raises(ValueError, match="backend must be one of"):
        ScoringConfig(backend="cuda")
    with pytest.raises(ValueError, match="dtype must be one of"):
        ScoringConfig(dtype="int8")
    with pytest.raises(ValueError, match="block_size must be None or an integer >= 2"):
        ScoringConfig(block_size=1)


@pytest.mark.parametrize("max_head_rows", [None, 7, 40])
def test_head_stats_gets_the_whole_task_in_bounded_calls(world, monkeypatch, max_head_rows):
    """The LM-head statistics run once per task over every chunk's drafts, or in calls
    of at most MAX_HEAD_ROWS rows (whole chunks; a chunk above the bound goes alone);
    the streaks do not depend on the batching."""
    from dflash_callbacks.scoring import scorer

    drafter, head, cache = world
    config = ScoringConfig(ddtree_budgets=[4], topk=[2], anchors_per_forward=4, device="cpu")
    task = cache.task("long")
    calls = []
    real = drafter.slot_stats  # the family's statistics: the LM-head statistics for DFlash
    monkeypatch.setattr(drafter, "slot_stats",
                        lambda slots, *a, **k: calls.append(slots.shape[0] * slots.shape[1]) or real(slots, *a, **k))
    if max_head_rows:
        monkeypatch.setattr(scorer, "MAX_HEAD_ROWS", max_head_rows)
    fast = score_task(drafter, head, task, config, block_size=6)
    rows = [min(4, 34 - a) * 5 for a in range(0, 34, 4)]  # anchors 5..38 in chunks of 4, 5 depths each
    assert sum(calls) == sum(rows)
    if max_head_rows is None:
        assert calls == [sum(rows)]
    else:
        assert len(calls) > 1 and all(c <= max(max_head_rows, 20) for c in calls)
    slow = score_task_naive(drafter, head, task, config, block_size=6)
    for method in map(str, config.methods):
        assert torch.equal(fast.streaks[method], slow.streaks[method]), method


def test_a_memory_budget_sizes_the_chunks_and_leaves_the_streaks_alone(world, monkeypatch):
    """A smaller max_memory_gib gives fewer blocks per forward and fewer draft rows per
    LM-head call; the streaks are those of the unbounded run; a budget that holds less
    than one block is refused, naming what scoring needs."""
    from dflash_callbacks.scoring import scorer

    drafter, head, cache = world
    base = dict(ddtree_budgets=[4], topk=[2], anchors_per_forward=16, device="cpu")
    unbounded = score_drafter(drafter, cache, head, ScoringConfig(**base))
    plans = {}
    real_plan = scorer.memory_plan
    monkeypatch.setattr(scorer, "memory_plan", lambda *a: plans.setdefault(a[0].max_memory_gib, real_plan(*a)))
    longest = max(cache.entry(n)["num_tokens"] for n in cache.task_names)
    roomy = real_plan(ScoringConfig(**base, max_memory_gib=1.0), drafter, head.vocab_size, longest, 6)
    assert roomy == scorer.MemoryPlan(16, scorer.MAX_HEAD_ROWS)  # 1 GiB holds everything of this toy
    resident, per_anchor, per_row = scorer.memory_needs(ScoringConfig(**base), drafter, head.vocab_size, longest, 6)
    half = 3 * per_anchor + 40 * per_row
    tight = (resident + 2 * half) / 2**30  # half of the room for 3 blocks per forward, half for draft rows
    for budget in (1.0, tight):
        bounded = score_drafter(drafter, cache, head, ScoringConfig(**base, max_memory_gib=budget))
        assert bounded.tasks == unbounded.tasks
    assert plans[tight] == scorer.MemoryPlan(3, half // per_row)
    with pytest.raises(ValueError, match=r"max_memory_gib=0.01 is below what scoring needs at the least: about 0\.\d+ GiB"):
        real_plan(ScoringConfig(**base, max_memory_gib=0.01), drafter, head.vocab_size, longest, 6)


def pruned(drafter, vocab_ids):
    """`drafter` with a pruned draft vocabulary: the target ids `vocab_ids`, ascending."""
    config = drafter_config(draft_vocab_size=len(vocab_ids))
    d2t = torch.tensor(vocab_ids) - torch.arange(len(vocab_ids))
    return DFlashDrafter.from_state_dict(config, {**drafter.state_dict(), "d2t": d2t})


def test_a_pruned_draft_vocabulary_is_scored_over_its_own_target_ids(world):
    """A draft vocabulary of 9 of the 16 target ids: the batched scorer (the LM head's rows of
    those ids, labels mapped onto them) equals the naive one over the whole vocabulary with
    -inf off those ids; a label off them is never accepted, whatever the method; a budget
    above the draft vocabulary (32 > 9) pads the top log-probs."""
    drafter, head, cache = world
    ids = [0, 1, 3, 4, 6, 8, 9, 12, 14]
    small = pruned(drafter, ids)
    assert small.vocab_ids.tolist() == ids and "d2t" in small.state_dict()
    config = ScoringConfig(ddtree_budgets=[1, 4, 32], topk=[2, 12], anchors_per_forward=4, vocab_chunk=4, device="cpu")
    accepted, refused = 0, 0
    for name in cache.task_names:
        task = cache.task(name)
        fast = score_task(small, head, task, config, block_size=6)
        slow = score_task_naive(small, head, task, config, block_size=6)
        first = task.input_ids[task.prompt_len + 1 : task.num_tokens].tolist()  # each anchor's first label
        off = torch.tensor([label not in ids for label in first])
        for method in map(str, config.methods):
            assert torch.equal(fast.streaks[method], slow.streaks[method]), (name, method)
            assert not fast.streaks[method][off[: len(fast.streaks[method])]].any(), (name, method)
            accepted += int(fast.streaks[method].sum())
        refused += int(off.sum())
    assert accepted > 0 and refused > 0  # labels on and off the draft vocabulary both occur


@pytest.mark.parametrize("rule", ["bidirectional", "anchored-causal", "no-window"])
def test_another_attention_rule_is_scored_as_the_naive_forward_runs_it_and_recorded(world, rule):
    """The world's drafter has a sliding layer (window 7 over 40-token tasks): each rule scores
    other numbers than auto's, equal to the naive per-anchor forward under that rule, and the
    report and its basis record the rule, so reports of two rules are never mixed."""
    from dflash_callbacks.scoring.basis import Basis

    drafter, head, cache = world
    config = ScoringConfig(ddtree_budgets=[4], topk=[3], attention=rule, device="cpu")
    task = cache.task("long")
    fast, slow = score_task(drafter, head, task, config, 6), score_task_naive(drafter, head, task, config, 6)
    auto = score_task(drafter, head, task, ScoringConfig(ddtree_budgets=[4], topk=[3], device="cpu"), 6)
    for method in map(str, config.methods):
        assert torch.equal(fast.streaks[method], slow.streaks[method]), method
    assert any(not torch.equal(fast.streaks[m], auto.streaks[m]) for m in fast.streaks)
    report = score_drafter(drafter, cache, head, config)
    assert report.scoring["attention"] == rule
    assert report.attention == [str(a) for a in resolve_attention(drafter.config, rule)]
    assert EvalReport.from_dict(report.to_dict()).attention == report.attention
    auto_basis = Basis.of_run(ScoringConfig(ddtree_budgets=[4], topk=[3], device="cpu"), cache, 6)
    assert auto_basis.mismatches(report, "ours") == [f"ours was scored with attention rule {rule} (this run: auto)"]
    with pytest.raises(ValueError, match=r"'attention' is 3, not a list of strings \(one per drafter layer\) or null"):
        EvalReport.from_dict({**report.to_dict(), "attention": 3})
    with pytest.raises(ValueError, match=r"attention must be one of \['auto', 'causal', 'bidirectional'"):
        ScoringConfig(attention="sliding")


def test_two_architectures_are_compared_with_a_warning_naming_how_each_attends(world, tmp_path, capsys):
    """Each drafter is scored as it is served: a full-attention drafter against the world's (a
    sliding layer) compares under one rule, and `compare` says how their layers differ."""
    from dflash_callbacks.cli import main as cli_main

    drafter, head, cache = world
    full = DFlashDrafter.from_state_dict(drafter_config(layer_types=[]), drafter.state_dict())
    config = ScoringConfig(ddtree_budgets=[4], device="cpu")
    score_drafter(full, cache, head, config).to_json(tmp_path / "ours.json")
    score_drafter(drafter, cache, head, config).to_json(tmp_path / "base.json")
    assert cli_main(["compare", str(tmp_path / "ours.json"), str(tmp_path / "base.json")]) == 0
    assert ("warning: the drafters attend differently inside the block (ours: bidirectional; the baseline: "
            "bidirectional; causal, window 7 from the query)") in capsys.readouterr().err
    # another number of layers of one kind is one architecture as far as attention goes: no warning
    shallow = DFlashDrafter(drafter_config(layer_types=[], num_hidden_layers=1))
    score_drafter(shallow, cache, head, config).to_json(tmp_path / "shallow.json")
    assert cli_main(["compare", str(tmp_path / "shallow.json"), str(tmp_path / "ours.json")]) == 0
    assert "attend differently" not in capsys.readouterr().err


def test_a_float64_drafter_scores_as_its_float32_copy(world):
    """float64 weights (a drafter trained in float64) are scored in the configured dtype; float64
    itself is no scoring dtype (refused at the config, naming the legal ones)."""
    drafter, head, cache = world
    config = ScoringConfig(ddtree_budgets=[4], topk=[3], device="cpu")
    wide = DFlashDrafter.from_state_dict(drafter.config, {k: v.double() for k, v in drafter.state_dict().items()})
    assert wide.fc.weight.dtype == torch.float64
    assert score_drafter(wide, cache, head, config).tasks == score_drafter(drafter, cache, head, config).tasks
    with pytest.raises(ValueError, match=r"dtype must be one of \['float32', 'bfloat16', 'float16'\]; got 'float64'"):
        ScoringConfig(dtype="float64")

"""benchmarks/against_vllm/run.py's half without vLLM, at its smallest size (two toy tasks), so that it can not
rot while the suite never needs vLLM: the export vLLM loads, the library's side under attention="vllm" with the
live schedule run to each answer's end, and the comparison's arithmetic against an engine whose every step is
the library's own round."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.demos.toy.world import toy_baseline_path
from dflash_callbacks.model.attention import resolve_attention
from dflash_callbacks.scoring.aggregates import AGGREGATES

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "against_vllm" / "run.py"
TASKS = ["fizzbuzz", "binary_search"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("against_vllm_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def exported(bench, toy_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("against-vllm")
    return out, bench.export(toy_cache, out, tasks=TASKS)


@pytest.fixture(scope="module")
def library(bench, exported, toy_cache):
    return bench.library_side(exported[1], toy_cache)


def test_export_is_what_vllm_is_given(exported, toy_cache):
    out, plan = exported
    assert json.loads((out / "plan.json").read_text()) == plan
    assert plan["num_speculative_tokens"] == 7 and plan["max_tokens"] == 96 and plan["window"] == 64
    assert plan["stop_token_ids"] == [258, 256]
    for row in plan["tasks"]:  # the cache's own prompt ids and its whole answer
        task = toy_cache.task(row["name"])
        assert row["prompt_ids"] + row["answer_ids"] == task.input_ids.tolist()
        assert len(row["prompt_ids"]) == task.prompt_len
    baseline = load_drafter(toy_baseline_path())
    for label, folder in plan["drafters"].items():
        drafter = load_drafter(folder)
        for name, tensor in baseline.state_dict().items():
            assert torch.equal(drafter.state_dict()[name], tensor), (label, name)
    assert load_drafter(plan["drafters"]["as-written"]).config == baseline.config
    raw = json.loads((Path(plan["drafters"]["target-window"]) / "config.json").read_text())
    # what vLLM's qwen3_dflash reads: every layer sliding over 64 keys, is_causal false (bidirectional)
    assert raw["layer_types"] == ["sliding_attention"] * 2 and raw["sliding_window"] == 64
    assert raw["is_causal"] is False and raw["use_sliding_window"] is True
    copy = load_drafter(plan["drafters"]["target-window"]).config
    assert [str(layer) for layer in resolve_attention(copy, "vllm")] == ["bidirectional, window 64 from the query"] * 2


def test_library_side_runs_each_answer_to_its_end(library, exported, toy_cache):
    plan = exported[1]
    for label, lib in library.items():
        assert set(lib["rounds"]) == set(TASKS)
        for name, rounds in lib["rounds"].items():
            task = toy_cache.task(name)
            anchors = task.num_tokens - 1 - task.prompt_len  # anchors P .. T-2
            assert sum(rounds[:-1]) < anchors <= sum(rounds), (label, name)  # the last round starts at the last anchors
            assert len(lib["streaks"][name]) == anchors
        pooled = lib["pooled"]
        assert pooled.lo <= pooled.value <= pooled.hi
        if "pooled" not in AGGREGATES:  # the script's own pooling: 1 + accepted / rounds over every round
            taus = [tau for rounds in lib["rounds"].values() for tau in rounds]
            assert pooled.value == pytest.approx(sum(taus) / len(taus), rel=1e-12)
        assert lib["per_task"].value == pytest.approx(np.mean([np.mean(r) for r in lib["rounds"].values()]))
    assert library["target-window"]["attention"] == ["bidirectional, window 64 from the query"] * 2
    if library["as-written"]["attention"] == library["target-window"]["attention"]:  # the served window rule is in
        for name in TASKS:
            assert np.array_equal(library["as-written"]["streaks"][name], library["target-window"]["streaks"][name])
    assert plan["drafters"].keys() == library.keys()


def engine_of(lib: dict, plan: dict) -> dict:
    """serve.py's result for an engine whose steps are the library's live rounds (the comparison's oracle)."""
    tasks = {}
    for row in plan["tasks"]:
        accepted = [tau - 1 for tau in lib["rounds"][row["name"]]]
        tasks[row["name"]] = {"drafts": len(accepted), "accepted_tokens": sum(accepted), "step_accepted": accepted,
                              "accepted_tokens_per_pos": [sum(a >= d for a in accepted) for d in range(1, 8)],
                              "mean_acceptance_length": 1 + sum(accepted) / len(accepted),
                              "token_ids": row["answer_ids"]}
    run = {name: sum(t[name] for t in tasks.values()) for name in ("drafts", "accepted_tokens")}
    run["accepted_tokens_per_pos"] = list(np.sum([t["accepted_tokens_per_pos"] for t in tasks.values()], axis=0))
    return {"vllm": "oracle", "draft_windows": [64, 64], **run,
            "mean_acceptance_length": 1 + run["accepted_tokens"] / run["drafts"], "tasks": tasks}


def test_comparison_against_an_engine_that_is_the_library(bench, library, exported):
    plan = exported[1]
    lib = library["target-window"]
    engine = engine_of(lib, plan)
    steps = {name: t["step_accepted"] for name, t in engine["tasks"].items()}
    agree, total = bench.steps_agreeing(steps, lib["streaks"])
    assert agree == total == sum(len(r) for r in lib["rounds"].values())
    first = TASKS[0]
    moved = {**steps, first: [steps[first][0] + 1, *steps[first][1:]]} if steps[first][0] < 7 else \
        {**steps, first: [steps[first][0] - 1, *steps[first][1:]]}
    assert bench.steps_agreeing(moved, lib["streaks"])[0] < total  # the first step and the anchors after it move
    assert bench.past_the_end(engine, plan) == 0  # its last rounds are cut at the answers' ends, as the library's
    if "pooled" not in AGGREGATES:  # the script's pooling is the engine's count over the same rounds
        assert engine["mean_acceptance_length"] == pytest.approx(lib["pooled"].value, rel=1e-12)
    assert bench.live_position_rates(lib) == pytest.approx(
        [a / engine["drafts"] for a in engine["accepted_tokens_per_pos"]])
    text = bench.table(plan, {"target-window": engine}, {"target-window": lib})
    assert f"**{engine['mean_acceptance_length']:.2f}**" in text and f"**{lib['pooled'].show()}**" in text
    assert f"{total} / {total} (100%)" in text and "equal the cache's on 2 of 2 prompts" in text

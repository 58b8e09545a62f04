"""DrafterEvaluator: the engine in a plain PyTorch loop (one process, DDP, FSDP2), held to the same
guarantees as the Lightning callback: every report of the weights of its step, on disk before it is
logged, W&B rows of the loop's own never lost, every mistake listed before the first step. The faults it
survives with nothing lost, as every adapter does, are in test_faults_every_adapter.py."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_callbacks import DrafterEvaluator, TrailingBaselineStop
from dflash_callbacks.scoring.service import PreflightError, ScoringService, ServiceSpec

from fsdp1 import FullyShardedDataParallel  # FSDP1 needs an accelerator: a stand-in of its name
from loops import SCORING, DrafterModel, plain_fit, two_ranks
from runs import assert_clean, records
from suite_paths import SCRIPTS
from train_run import shared_world, world_paths


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    path = shared_world(tmp_path_factory.getbasetemp() / "reliability-world")
    return SimpleNamespace(path=path, **world_paths(path))


def evaluator(world, tmp_path: Path, **kwargs) -> DrafterEvaluator:
    args = dict(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2, scoring=SCORING,
                dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc", verbose=False, busy="queue",
                max_pending=8, wait_timeout=300)
    return DrafterEvaluator(**{**args, **kwargs})


def test_a_plain_loop_scores_each_step_as_score_does_and_logs_at_the_snapshots_step(world, tmp_path, monkeypatch):
    """The weights scored are those of the captured step (the optimizer pre-hook waits for the copy), every
    report goes to results.jsonl, to `log=` at the snapshot's step and to the active W&B run, whose own rows,
    logged with `step=`, are all kept."""
    import wandb

    from wandb_records import read_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    logged, weights = [], {}
    ev = evaluator(world, tmp_path, keep_last=10, log=lambda metrics, step: logged.append((step, dict(metrics))),
                   max_steps=10)
    run = wandb.init(project="dflash-loop", dir=str(tmp_path))
    try:
        def after(model, step):
            weights[step] = {k: v.detach().clone() for k, v in model.drafter.state_dict().items()}
            run.log({"train/loss_seen": float(step)}, step=step)  # the loop's own rows, at its own steps

        plain_fit(world, 10, ev, after_step=after)
    finally:
        wandb.finish()
    assert [r.step for r in ev.reports] == [2, 4, 6, 8, 10] and ev.errors == 0
    service = ScoringService(ServiceSpec(str(world.cache), str(world.target), None, SCORING))
    for report in ev.reports:
        assert report.tasks == service.score(world.config, weights[report.step], step=report.step).tasks
    assert [step for step, _ in logged] == [2, 4, 6, 8, 10]
    for (step, metrics), report in zip(logged, ev.reports):
        assert metrics["dflash/ddtree@4/live/mean"] == pytest.approx(report.value("ddtree@4/live"))
        assert metrics["dflash/ratio/ddtree@4/live/mean"] == pytest.approx(
            report.value("ddtree@4/live") / ev.baseline_report.value("ddtree@4/live"))
    assert ev.metrics["dflash/step"] == 10.0
    assert [r["step"] for r in records(tmp_path / "d")] == [2, 4, 6, 8, 10]

    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    history = read_run(folder)["history"]
    assert sorted(r["train/loss_seen"] for r in history if "train/loss_seen" in r) == [float(s) for s in range(1, 11)]
    ours = [r for r in history if "dflash/ddtree@4/live/mean" in r]
    assert [r["dflash/step"] for r in ours] == [2, 4, 6, 8, 10]  # each report in a row of its own
    assert all(any(k.startswith("dflash/live_table/") for k in r) for r in ours)
    assert_clean(tmp_path / "d", ev.reports)


def test_every_mistake_is_listed_before_the_first_step(world, tmp_path):
    model = DrafterModel(world.config, world.target)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ev = evaluator(world, tmp_path, cache=tmp_path / "no-cache")
    with pytest.raises(PreflightError) as info:
        ev.attach(model.drafter, other)
    message = str(info.value)
    assert re.search(r"the optimizer does not step \d+ of the drafter's trainable parameters \(fc.weight, "
                     r"hidden_norm.weight, layers.0.\S+ and \d+ more\): pass the optimizer", message)
    assert "cache:" in message and "no-cache" in message  # both problems, at once
    assert not (tmp_path / "d").exists()

    sharded = DrafterModel(world.config, world.target)
    sharded.drafter.layers[0] = FullyShardedDataParallel(sharded.drafter.layers[0])
    with pytest.raises(ValueError, match=r"attach\(drafter, optimizer\): the drafter's layers.0 is a "
                                         r"FullyShardedDataParallel, which is not supported: FSDP1"):
        evaluator(world, tmp_path).attach(sharded.drafter, torch.optim.AdamW(sharded.drafter.parameters()))

    ev = evaluator(world, tmp_path)
    with pytest.raises(RuntimeError, match=r"call DrafterEvaluator.attach\(drafter, optimizer\) before step\(\)"):
        ev.step(1)
    optimizer = torch.optim.AdamW(model.drafter.parameters())
    ev.attach(model.drafter, optimizer)
    ev.step(4)
    with pytest.raises(ValueError, match=r"step\(\) got step 3 after step 4: steps go forward"):
        ev.step(3)
    with pytest.warns(UserWarning, match=r"step\(6\): the optimizer has not stepped since step\(4\)"):
        ev.step(6)
    ev.close()
    with pytest.raises(TypeError, match=r"drafter_config must be a DrafterConfig, a config.json path or None; got int"):
        evaluator(world, tmp_path, drafter_config=3)
    with pytest.raises(TypeError, match=r"stop must be a TrailingBaselineStop"):
        evaluator(world, tmp_path, stop="ddtree@8/live")
    with pytest.raises(ValueError, match=r"TrailingBaselineStop monitors 'ddtree@8/live', but 'dflash' scores only "
                                         r"\['vanilla', 'ddtree@4'\]"):
        evaluator(world, tmp_path, stop=TrailingBaselineStop(monitor="ddtree@8/live"))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_score_on_rank0_alone_and_stop_together(world, tmp_path, parallel):
    """torchrun, 2 gloo processes: the drafter in DDP, or sharded per layer by FSDP2 `fully_shard` (the
    snapshot's gather is a collective on every rank). Rank 0 scores alone; every report is written once;
    `step()` returns True on both ranks at the same step; rank 1 holds rank 0's history and run id."""
    root = tmp_path / "run"
    r0, r1 = two_ranks(SCRIPTS / "train_loop.py",
                       ["--world", str(world.path), "--max-steps", "200", "--every", "2", "--stop-min-ratio",
                        "5", "--stop-patience", "2", "--parallel", parallel],
                       root, port=29400 + os.getpid() % 500 + (7 if parallel == "fsdp2" else 0))
    assert r0["should_stop"] and r1["should_stop"] and r0["step"] == r1["step"] == r0["stopped_step"] == r1["stopped_step"] < 200
    assert r0["stop_reason"] == r1["stop_reason"] and r0["stop_reason"].startswith("dflash: stopping at step ")
    assert r1["reports"] == [] and r1["threads_on_rank1"] == [] and r0["reports"]
    assert r1["run_id"] == r0["run_id"] and set(r1["history"]) <= set(r0["history"])
    steps = [r["step"] for r in records(root / "dflash")]
    assert steps == sorted(set(steps)) == r0["reports"]
    assert_clean(root / "dflash")


def test_under_vllm_on_a_windowed_target_every_method_is_scored_as_written_beside_its_baseline(world, tmp_path):
    """A target whose layers all slide (Mistral-style: a window, no layer types) gives its window to the drafter's
    full layer under "vllm": the run scores each method as the config is written beside it, for the drafter and
    its baseline alike, so the run's basis holds both, the report's line says what the window costs, and each
    METHOD:vllm-as-written key is logged with its ratio to the baseline's."""
    import json
    import shutil

    target = tmp_path / "windowed-target"
    shutil.copytree(world.target, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "sliding_window": 5}))
    logged = []
    ev = evaluator(world, tmp_path, target=target, scoring={**SCORING, "attention": "vllm"}, max_steps=2,
                   log=lambda metrics, step: logged.append(dict(metrics)))
    plain_fit(world, 2, ev)
    (report,) = ev.reports
    assert report.methods == ["vanilla", "ddtree@4", "vanilla:vllm-as-written", "ddtree@4:vllm-as-written"]
    assert ev.baseline_report.methods == report.methods and ev.errors == 0
    assert "the target's window on the layers without their own moves vanilla live by" in report.served()
    for method in report.methods:
        assert logged[-1][f"dflash/{method}/live/mean"] == pytest.approx(report.value(f"{method}/live"))
        assert f"dflash/ratio/{method}/live/mean" in logged[-1]

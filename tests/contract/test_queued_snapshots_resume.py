"""An exception inside `with evaluator:` with busy='queue' leaves every snapshot still queued in
memory on disk, with no error line, as a kill would have left a written one: the resume from a
checkpoint scores every one of them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_callbacks import DrafterEvaluator

from loops import SCORING, plain_fit
from runs import assert_clean, records, run_dir

from train_run import shared_world, world_paths, write_cache


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    return SimpleNamespace(**world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world")))


def test_snapshots_queued_in_memory_when_the_loop_raises_are_scored_by_the_resume(world, tmp_path):
    slow = write_cache(world.cache.parent, tmp_path / "slow-cache", [("slow", 200, 4)])  # about a second per snapshot

    def evaluator(max_pending: int = 4) -> DrafterEvaluator:
        return DrafterEvaluator(cache=slow, target=world.target, every_n_steps=1, busy="queue", max_pending=max_pending,
                                dirpath=tmp_path / "eval", scoring={**SCORING, "anchors_per_forward": 1},
                                verbose=False, wait_timeout=300)

    def fail(model, step):
        if step == 4:  # steps 2 to 4 are queued in memory behind step 1, still being scored
            raise RuntimeError("the loop failed")

    first = evaluator()
    with pytest.warns(UserWarning, match=r"the loop stopped on RuntimeError: the snapshots of steps \[.*2, 3, 4\] are"):
        with pytest.raises(RuntimeError, match="the loop failed"):
            plain_fit(world, 6, first, ckpt_dir=tmp_path / "ckpt", ckpt_every=1, after_step=fail)
    folder = run_dir(tmp_path / "eval")
    on_disk = {int(p.name.split("-")[1]) for p in (folder / "snapshots").iterdir()}
    scored = {r["step"] for r in records(tmp_path / "eval")}
    assert all("error" not in r for r in records(tmp_path / "eval")) and first.errors == 0
    assert {2, 3, 4} <= on_disk - scored and scored | on_disk == {1, 2, 3, 4}

    # room for every snapshot the first run left (up to 4, step 1's too when it was not scored in time) beside
    # step 5's: with max_pending=4 a resume holding 4 of them skips step 5 as busy, as it should
    second = evaluator(max_pending=8)
    plain_fit(world, 6, second, resume=tmp_path / "ckpt" / "step=3.pt")
    lines = records(tmp_path / "eval")
    assert [(r["step"], "tasks" in r) for r in lines] == [(step, True) for step in range(1, 7)]
    assert second.errors == 0 and second.skipped == 0
    assert_clean(tmp_path / "eval", [*first.reports, *second.reports])

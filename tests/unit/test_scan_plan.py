"""`plan_scan`, pure: which checkpoints one poll scores, from what the folder shows (its reads given as
functions), with no file and no watcher: step order, settling, the trainer's marker, a save that died,
a checkpoint deleted before it was scored."""

from __future__ import annotations

from pathlib import Path

from dflash_callbacks.watch.scan_plan import Seen, plan_scan


def folder(stamps: dict[int, str | None], marked: set[int] = frozenset(), broken: dict[int, str] | None = None):
    """The reads of a folder whose step-N checkpoint has fingerprint stamps[N] (None: no file yet), the marker
    on the steps `marked`, and `broken[N]` saying why step N is not whole."""
    found = {step: Path(f"ckpt-{step}") for step in stamps}
    step_of = lambda source: int(source.name.split("-")[1])  # noqa: E731
    return found, {"fingerprint": lambda s: stamps[step_of(s)], "marked": lambda s: step_of(s) in marked,
                   "unfinished": lambda s: (broken or {}).get(step_of(s))}


def test_a_checkpoint_is_ready_once_settled_or_marked_in_step_order():
    found, reads = folder({2: "a", 4: "b", 6: "c"}, marked={6})
    first = plan_scan(found, set(), {}, now=0.0, settle=30.0, **reads)
    assert first.ready == [] and first.deleted == [] and set(first.seen) == {2, 4, 6}  # 6 waits for 2 and 4
    assert first.said == [(("behind", 6), "watch: step 6 is complete: scored after step 2, which is still being "
                                          "written (step order)")]
    settled = plan_scan(found, set(), first.seen, now=30.0, settle=30.0, **reads)
    assert settled.ready == [2, 4, 6] and settled.said == []


def test_a_changed_checkpoint_settles_again_and_holds_back_the_later_ones():
    found, reads = folder({2: "a", 4: "b"})
    seen = {2: Seen(Path("ckpt-2"), "old", 0.0), 4: Seen(Path("ckpt-4"), "b", 0.0)}
    plan = plan_scan(found, set(), seen, now=40.0, settle=30.0, **reads)
    assert plan.seen[2] == Seen(Path("ckpt-2"), "a", 40.0) and plan.ready == []  # 2 changed: 4 waits for it
    assert plan_scan(found, set(), plan.seen, now=70.0, settle=30.0, **reads).ready == [2, 4]


def test_a_save_that_died_holds_back_nothing_and_is_said():
    found, reads = folder({2: "a", 4: "b"}, broken={2: "model.safetensors holds 10 of its 20 bytes"})
    plan = plan_scan(found, set(), {}, now=0.0, settle=0.0, **reads)
    assert plan.ready == [4]
    assert plan.said == [(2, "watch: step 2: waiting for ckpt-2: model.safetensors holds 10 of its 20 bytes")]


def test_done_steps_files_not_there_yet_and_deleted_checkpoints():
    found, reads = folder({2: "a", 4: None, 6: "c"})
    seen = {8: Seen(Path("ckpt-8"), "d", 0.0), 2: Seen(Path("ckpt-2"), "a", 0.0)}
    plan = plan_scan(found, {2}, seen, now=100.0, settle=30.0, **reads)
    assert 4 not in plan.seen and plan.deleted == [8] and plan.ready == []  # 6 first seen now: settling
    assert plan_scan(found, {2, 8}, plan.seen, now=130.0, settle=30.0, **reads).ready == [6]

"""A training script whose own loop raises after the evaluation is attached dies of its own
exception: exit status 1 and its traceback, never `terminate called without an active
exception` and SIGABRT (a scoring thread, or a worker, still running as the interpreter
exits), for every loop and runner, whatever the scorer is doing at that moment; what was
scored stays in results.jsonl, what was not stays on disk for a resume.

This file is also the script (`python test_exit_on_raise.py WORLD OUT`) that runs the cases: each
attaches the evaluation to a plain loop, a Lightning fit or a transformers Trainer, and raises
at step 3 (`raise`: a RuntimeError of the loop; `backwards`: a step() that goes back, plain
loop only), while the baseline or a snapshot is being scored."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS / "support", TESTS / "scripts"):  # run as a script too: its helpers as the suite has them
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

MESSAGE = "the user's loop failed at step 3"
SCORING = {"ddtree_budgets": [4], "device": "cpu"}
CASES = [  # (loop, runner, when): 20 runs in all
    *[("plain", "thread", "raise")] * 6, *[("plain", "thread", "backwards")] * 4,
    *[("plain", "process", "raise")] * 2, *[("lightning", "thread", "raise")] * 4,
    *[("hf", "thread", "raise")] * 3, ("hf", "process", "raise"),
]


def settings(world: Path, out: Path, runner: str) -> dict:
    return dict(cache=world / "cache", target=world / "target", baseline=world / "baseline", every_n_steps=1,
                dirpath=out, scoring=SCORING, runner=runner, busy="queue", max_pending=4, verbose=False)


def run_plain(world: Path, out: Path, runner: str, when: str) -> None:
    import torch

    from dflash_callbacks import DFlashDrafter, DrafterConfig, DrafterEvaluator

    drafter = DFlashDrafter(DrafterConfig.from_file(world / "baseline"))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    evaluator = DrafterEvaluator(**settings(world, out, runner))
    evaluator.attach(drafter, optimizer)
    for step in range(1, 4):
        optimizer.step()
        evaluator.step(step)
    if when == "backwards":
        evaluator.step(1)
    raise RuntimeError(MESSAGE)


def run_lightning(world: Path, out: Path, runner: str, when: str) -> None:
    import lightning.pytorch as pl

    from dflash_callbacks import DrafterEvalCallback
    from train_run import make_loader, make_module

    class Fails(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == 3:
                raise RuntimeError(MESSAGE)

    s = settings(world, out, runner)
    s["every_n_train_steps"] = s.pop("every_n_steps")
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=out,
                         callbacks=[DrafterEvalCallback(**s), Fails()])
    trainer.fit(make_module(world), make_loader(world))


def run_hf(world: Path, out: Path, runner: str, when: str) -> None:
    from transformers import TrainerCallback

    from dflash_callbacks import DrafterEvalTrainerCallback
    from loops import hf_fit
    from train_run import world_paths

    class Fails(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise RuntimeError(MESSAGE)

    callback = DrafterEvalTrainerCallback(**settings(world, out, runner))
    hf_fit(SimpleNamespace(**world_paths(world)), out / "trainer", 10, [callback, Fails()])


def fork_each(world: Path, root: Path, cases: list[tuple[str, str, str]], at_once: int = 2) -> None:
    """Run every case in a process of its own, `at_once` at a time: a fork of this one, which has imported
    torch and the frameworks once (20 fresh interpreters would take minutes on 2 cores). The child runs the
    loop and lets its exception go: Python prints the traceback and exits as any script does, the
    interpreter's shutdown included. Each child's output goes to root/NN.log, its exit code to root/NN.exit."""
    gc.freeze()  # what is imported stays out of the children's collections (their last one copies every page)
    running: dict[int, int] = {}
    for i, case in enumerate(cases):
        if len(running) == at_once:
            pid, status = os.wait()
            (root / f"{running.pop(pid):02d}.exit").write_text(str(os.waitstatus_to_exitcode(status)))
        pid = os.fork()
        if pid == 0:  # the child: a training script that raises
            log = os.open(root / f"{i:02d}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            loop, runner, when = case
            {"plain": run_plain, "lightning": run_lightning, "hf": run_hf}[loop](world, root / f"{i:02d}", runner, when)
        running[pid] = i
    while running:
        pid, status = os.wait()
        (root / f"{running.pop(pid):02d}.exit").write_text(str(os.waitstatus_to_exitcode(status)))
    gc.unfreeze()


@pytest.mark.slow  # about 45 s on 2 busy cores
def test_a_loop_that_raises_after_attach_exits_1_with_its_own_traceback_in_20_of_20_runs(tmp_path_factory, tmp_path):
    from runs import records, run_dir
    from train_run import shared_world

    world = shared_world(tmp_path_factory.getbasetemp() / "reliability-world")
    subprocess.run([sys.executable, __file__, str(world), str(tmp_path)], check=True, timeout=300)
    for i, case in enumerate(CASES):
        code, log = int((tmp_path / f"{i:02d}.exit").read_text()), (tmp_path / f"{i:02d}.log").read_text()
        said = f"{case}: exit {code}\n{log[-3000:]}"
        expected = "ValueError: step() got step 1 after step 3" if case[2] == "backwards" else f"RuntimeError: {MESSAGE}"
        assert code == 1, said
        assert "Traceback (most recent call last)" in log and expected in log and "terminate called" not in log, said
        folder = run_dir(tmp_path / f"{i:02d}")
        lines = records(tmp_path / f"{i:02d}")
        on_disk = {int(p.name.split("-")[1]) for p in (folder / "snapshots").glob("step-*")}
        assert all("error" not in line for line in lines), said  # nothing scored is lost, nothing unscored fails
        assert {line["step"] for line in lines} | on_disk == {1, 2, 3}, said  # a resume scores the rest


if __name__ == "__main__":
    import lightning.pytorch  # noqa: F401  (imported once, before the forks)
    import torch
    import transformers  # noqa: F401

    import dflash_callbacks.hf  # noqa: F401

    torch.set_num_threads(1)
    fork_each(Path(sys.argv[1]), Path(sys.argv[2]), CASES)

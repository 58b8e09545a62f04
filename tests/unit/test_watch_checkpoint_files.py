"""`watch --checkpoints` on the files a real folder holds (issue #31): a damaged checkpoint (a
safetensors header that is none, a config.json nested too deeply, a symlink loop) is one error
line naming its file and the watcher goes on; a torch file in the legacy format is scored; torch
files without --state-key are named with the flag; and checkpoints are scored in step order even
when a later one completes first."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

from dflash_callbacks.cli import build_parser
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.model import save_drafter
from dflash_callbacks.model.io import UnreadableFile
from dflash_callbacks.cli.score import scoring_config
from dflash_callbacks.cli.watch import checkpoint_settings
from dflash_callbacks.watch.checkpoint_folder import Checkpoints
from dflash_callbacks.watch.checkpoint_watcher import CheckpointWatcher

from synthetic import build_world
from checkpoint_watch import assert_same, results, scored, trained, watch_args


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("watch-files-world"))


def write_header(file: Path, header, length: int | None = None) -> None:
    """A safetensors file of this header (its length field `length`, else the header's own)."""
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + bytes(16))


ENTRY = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
BAD = {  # kind -> (what spoils a good checkpoint folder, the file it names)
    "huge-header-length": (lambda ck: write_header(ck / "model.safetensors", {"w": ENTRY}, 2**62), "model.safetensors"),
    "no-data-offsets": (lambda ck: write_header(ck / "model.safetensors", {"w": {"dtype": "F32", "shape": [1]}}),
                        "model.safetensors"),
    "list-header": (lambda ck: write_header(ck / "model.safetensors", [ENTRY]), "model.safetensors"),
    "nested-config": (lambda ck: (ck / "config.json").write_text("[" * 100_000 + "]" * 100_000), "config.json"),
    "weights-symlink-loop": (lambda ck: ((ck / "model.safetensors").unlink(),
                                         os.symlink("model.safetensors", ck / "model.safetensors")), "model.safetensors"),
}


def spoiled(world, root: Path, step: int, kind: str) -> Path:
    """A checkpoint folder of `step` spoiled as BAD[kind] says; the file its error names."""
    folder = save_drafter(root / f"checkpoint-{step}", world.config, trained(world, step))
    spoil, name = BAD[kind]
    spoil(folder)
    return folder / name


def self_link(path: Path) -> Path:
    os.symlink(path.name, path)
    return path


@pytest.mark.parametrize("kind", [*BAD, "checkpoint-symlink-loop"])
def test_each_damaged_checkpoint_reads_as_one_error_naming_its_file(world, tmp_path, kind):
    """Listing the folder, testing the checkpoint for completeness and reading its shapes never
    raise anything but an error naming the file; nothing is waited for (it will never change); the
    runner's read names the file too."""
    root = tmp_path / "ckpts"
    save_drafter(root / "checkpoint-2", world.config, trained(world, 2))
    bad = self_link(root / "checkpoint-3") if kind == "checkpoint-symlink-loop" else spoiled(world, root, 3, kind)
    checkpoints = Checkpoints(root, None, None, "training_state.pt", None, root / "dflash-eval", say=print)
    found = checkpoints.find()
    assert sorted(found) == [2, 3]
    source = found[3]
    assert checkpoints.fingerprint(source) is not None and checkpoints.unfinished(source) is None
    with pytest.raises(UnreadableFile if kind != "nested-config" else ValueError, match=re.escape(str(bad))):
        checkpoints.shapes(source)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        checkpoints.read(source, 3)


def test_a_symlink_loop_naming_no_step_is_passed_over(world, tmp_path):
    root = tmp_path / "ckpts"
    save_drafter(root / "checkpoint-2", world.config, trained(world, 2))
    self_link(root / "latest")
    assert list(Checkpoints(root, None, None, "training_state.pt", None, root / "dflash-eval", say=print).find()) == [2]


def test_a_watcher_folder_seeded_with_every_bad_file_scores_every_good_checkpoint_in_step_order(world, tmp_path,
                                                                                                 capsys):
    """Good HF checkpoints at steps 2, 4, 6, 8, 10 (10 holding a junk symlink loop of its own), and
    every bad file among them, the first step among the bad ones: `--once` exits 0, every good step
    has a report equal to `score`'s, every bad one an error line naming its file, all in step order."""
    root = tmp_path / "ckpts"
    for step in (2, 4, 6, 8, 10):
        save_drafter(root / f"checkpoint-{step}", world.config, trained(world, step))
    self_link(root / "checkpoint-10" / "junk")
    named = {step: spoiled(world, root, step, kind) for step, kind in zip((1, 3, 5, 7, 9), BAD)}
    named[11] = self_link(root / "checkpoint-11")
    self_link(root / "latest")
    assert cli_main(watch_args(world, root, "--once", "--settle-seconds", "0")) == 0, capsys.readouterr().err
    out = root / "dflash-eval"
    reports, errors = results(out)
    assert sorted(reports) == [2, 4, 6, 8, 10] and sorted(errors) == [1, 3, 5, 7, 9, 11]
    for step, file in named.items():
        assert str(file) in errors[step]["error"], (step, errors[step])
    lines = [json.loads(line)["step"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert lines == sorted(lines) == list(range(1, 12))
    assert_same(reports[10], scored(world, root / "checkpoint-10", tmp_path))
    assert_same(reports[2], scored(world, root / "checkpoint-2", tmp_path))


def test_a_damaged_first_checkpoint_waits_for_a_good_one_to_start_the_run(world, tmp_path, capsys):
    """With only a damaged checkpoint there, nothing refuses: it is said, and recorded as its error
    line once a good one has started the run."""
    root = tmp_path / "ckpts"
    bad = spoiled(world, root, 1, "nested-config")
    args = build_parser().parse_args(watch_args(world, root, "--settle-seconds", "0"))
    watcher = CheckpointWatcher(checkpoint_settings(args, scoring_config(args)))
    watcher.check()
    assert watcher.scan() == 0 and not watcher.started
    assert f"watch: {bad} is not valid JSON" in capsys.readouterr().out
    save_drafter(root / "checkpoint-2", world.config, trained(world, 2))
    assert watcher.scan() == 2
    finish(watcher)
    reports, errors = results(root / "dflash-eval")
    assert sorted(reports) == [2] and sorted(errors) == [1] and str(bad) in errors[1]["error"]


def finish(watcher: CheckpointWatcher) -> None:
    """Publish every report as the watcher's own loop does, then close it."""
    while watcher.engine.pending:
        watcher.publish()
    watcher.close(ok=True)


def marked(folder: Path) -> None:
    (folder / "trainer_state.json").write_text("{}")  # the transformers Trainer's marker: complete at once


def test_a_later_checkpoint_that_completes_first_waits_for_an_earlier_one_still_being_written(world, tmp_path,
                                                                                                capsys):
    """Step order by rule, not by timing: step 6 with the Trainer's marker waits while step 4 (no
    marker) has not settled; the marker on 4 releases both, 4 first. An earlier checkpoint that has
    settled and is still not whole (a save that died) holds nothing back, and is scored when it
    completes."""
    root = tmp_path / "ckpts"
    for step in (2, 4, 6):
        save_drafter(root / f"checkpoint-{step}", world.config, trained(world, step))
    marked(root / "checkpoint-2")
    marked(root / "checkpoint-6")
    args = build_parser().parse_args(watch_args(world, root, "--settle-seconds", "600"))
    watcher = CheckpointWatcher(checkpoint_settings(args, scoring_config(args)))
    watcher.check()
    assert watcher.scan() == 1 and watcher.done == {2}  # 4 settles for 600 s: 6 waits for it
    assert "watch: step 6 is complete: scored after step 4, which is still being written" in capsys.readouterr().out
    assert watcher.scan() == 0
    marked(root / "checkpoint-4")
    assert watcher.scan() == 2
    finish(watcher)

    # settled for good (--settle-seconds 0) and not whole: step 8 (half its weights) holds back no later step
    save_drafter(tmp_path / "staging", world.config, trained(world, 8))
    weights = (tmp_path / "staging" / "model.safetensors").read_bytes()
    shutil.copytree(tmp_path / "staging", root / "checkpoint-8")
    (root / "checkpoint-8" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    save_drafter(root / "checkpoint-10", world.config, trained(world, 10))
    args = build_parser().parse_args(watch_args(world, root, "--settle-seconds", "0"))
    watcher = CheckpointWatcher(checkpoint_settings(args, scoring_config(args)))
    watcher.check()
    assert watcher.scan() == 1 and 10 in watcher.done
    assert f"watch: step 8: waiting for {root / 'checkpoint-8'}: model.safetensors holds" in capsys.readouterr().out
    (root / "checkpoint-8" / "model.safetensors").write_bytes(weights)
    assert watcher.scan() == 1
    finish(watcher)
    reports, errors = results(root / "dflash-eval")
    assert sorted(reports) == [2, 4, 6, 8, 10] and not errors
    lines = [json.loads(line)["step"] for line in (root / "dflash-eval" / "results.jsonl").read_text().splitlines()]
    assert lines == [2, 4, 6, 10, 8]


def test_a_legacy_format_torch_file_is_scored(world, tmp_path):
    """`torch.save(..., _use_new_zipfile_serialization=False)`, which `torch.load(weights_only=True)`
    reads: scored as `score` scores the same weights, beside a file in the zip format."""
    root = tmp_path / "torch"
    root.mkdir()
    torch.save({"draft_state_dict": trained(world, 2)}, root / "step_2.pt", _use_new_zipfile_serialization=False)
    torch.save({"draft_state_dict": trained(world, 4)}, root / "step_4.pt")
    assert cli_main(watch_args(world, root, "--state-key", "draft_state_dict", "--drafter-config", world.baseline,
                               "--once", "--settle-seconds", "0")) == 0
    reports, errors = results(root / "dflash-eval")
    assert sorted(reports) == [2, 4] and not errors
    for step in (2, 4):
        hf = save_drafter(tmp_path / f"hf-{step}", world.config, trained(world, step))
        assert_same(reports[step], scored(world, hf, tmp_path))


def test_torch_files_watched_without_state_key_are_named_with_the_flag(world, tmp_path, capsys):
    root = tmp_path / "torch"
    root.mkdir()
    for step in (2, 4):
        torch.save({"draft_state_dict": trained(world, step)}, root / f"ckpt_{step}.pt")
    (root / "notes.pt").write_bytes(b"")  # no step: not a checkpoint
    assert cli_main(watch_args(world, root, "--once", "--settle-seconds", "0")) == 0
    out = capsys.readouterr().out
    assert (f"watch: ckpt_2.pt, ckpt_4.pt in {root}: torch checkpoint files are read only with --state-key KEY"
            in out), out
    assert "--drafter-config CONFIG" in out and f"watch: no complete checkpoint in {root}" in out

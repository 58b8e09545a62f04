"""`dflash-callbacks watch --checkpoints DIR`: a watcher of the checkpoints any trainer saves. Each
report equals `dflash-callbacks score` on the same weights (HF folders, single and sharded, and
torch checkpoint files, SpecForge's own among them); a checkpoint is never read half-written; W&B
gets each report at its checkpoint's step; bad input is one line each, before any scoring. (A SIGKILLed
watcher started again: faults/test_killed_processes.py.)"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_callbacks.cli import build_parser, main as cli_main
from dflash_callbacks.model import DFlashDrafter, DrafterConfig, save_drafter
from dflash_callbacks.scoring.report import EvalReport

from checkpoint_watch import assert_same, results, scored, spawn_watcher, trained, wait_for, watch_args
from runs import audit, wait_until
from suite_paths import FIXTURES
from synthetic import build_world
from test_cli import fails
from wandb_records import finished_records, read_run


SPECFORGE = FIXTURES / "trainers" / "specforge-full"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("watch-world"))


def write_slowly(folder: Path, files: dict[str, bytes], pause: float, chunks: int = 4) -> None:
    """What a trainer saving in place does: each file appears and grows chunk by chunk."""
    folder.mkdir(parents=True)
    for name, data in files.items():
        with open(folder / name, "wb") as f:
            for i in range(chunks):
                f.write(data[i * len(data) // chunks:(i + 1) * len(data) // chunks])
                f.flush()
                time.sleep(pause)  # the behaviour under test: a file the watcher sees grow between its polls


def sharded_files(config: DrafterConfig, state: dict, tmp: Path) -> dict[str, bytes]:
    """The files of a sharded `save_pretrained` folder, in the order it writes them: config.json,
    the shards, then their index."""
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    files = {"config.json": (json.dumps(config.to_dict(), indent=2) + "\n").encode()}
    for name, part in halves.items():
        save_file({k: state[k].contiguous() for k in part}, str(tmp / name), metadata={"format": "pt"})
        files[name] = (tmp / name).read_bytes()
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, part in halves.items() for k in part}}).encode()
    return files


def test_a_trainer_writing_checkpoints_while_the_watcher_runs_gets_each_scored_once_as_score_would(world, tmp_path):
    """The watcher starts on an empty folder; a trainer thread then saves four checkpoints: atomically
    (save_drafter), in place file by file, sharded shard by shard with the transformers Trainer's
    marker last, and atomically again. Each is scored once, in step order, from its whole files:
    every report equals `dflash-callbacks score` on the finished folder. W&B (offline, read back)
    holds each report at its checkpoint's step, in the group given."""
    root, out = tmp_path / "ckpts", tmp_path / "ckpts" / "dflash-eval"
    root.mkdir()
    log = tmp_path / "watch.log"
    proc = spawn_watcher(watch_args(world, root, "--settle-seconds", "1", "--poll-seconds", "0.2", "--idle-exit", "5",
                                    "--wandb-project", "dflash-watch", "--wandb-group", "train-17",
                                    "--wandb-name", "eval-17"), log)

    def trainer():
        save_drafter(root / "checkpoint-2", world.config, trained(world, 2))
        time.sleep(0.5)  # the behaviour under test: checkpoints that come while the watcher polls, not all at once
        save_drafter(tmp_path / "staging", world.config, trained(world, 4))
        write_slowly(root / "checkpoint-4", {name: (tmp_path / "staging" / name).read_bytes()
                                             for name in ("config.json", "model.safetensors")}, pause=0.25)
        (tmp_path / "shards").mkdir()
        write_slowly(root / "checkpoint-6", sharded_files(world.config, trained(world, 6), tmp_path / "shards"),
                     pause=0.15)
        time.sleep(0.3)  # the behaviour under test: the Trainer's marker written last, after the shards
        (root / "checkpoint-6" / "trainer_state.json").write_text(json.dumps({"global_step": 6}))
        save_drafter(root / "checkpoint-8", world.config, trained(world, 8))

    try:
        wait_for(lambda: "watch: scoring the checkpoints" in log.read_text(), proc, log)
        writer = threading.Thread(target=trainer)
        writer.start()
        writer.join()
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, log.read_text()[-4000:]
    reports, errors = results(out)
    assert sorted(reports) == [2, 4, 6, 8] and not errors, log.read_text()[-4000:]
    lines = [json.loads(line)["step"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert lines == [2, 4, 6, 8]  # in step order
    for step, report in reports.items():
        assert_same(report, scored(world, root / f"checkpoint-{step}", tmp_path))
        assert report.drafter == str(root / f"checkpoint-{step}")
    assert audit(out)["lost"] == 0

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    rows = [r for r in read_run(run_dir)["history"] if "dflash/ddtree@4/live/mean" in r]
    assert [(r["_step"], r["dflash/step"]) for r in rows] == [(2, 2), (4, 4), (6, 6), (8, 8)]
    assert [r["dflash/ddtree@4/live/mean"] for r in rows] == [reports[s].value("ddtree@4/live") for s in (2, 4, 6, 8)]
    (records,) = [[r for r in finished_records(p) if r.WhichOneof("record_type") == "run"]
                  for p in run_dir.glob("*.wandb")]
    assert (records[0].run.run_group, records[0].run.display_name) == ("train-17", "eval-17")


def test_a_checkpoint_deleted_or_of_another_shape_after_start_is_an_error_line_naming_it(world, tmp_path, capsys):
    """A checkpoint seen still settling and then deleted (the trainer's rotation) is an error line
    naming its step; so is one that is deleted after it was queued, and one of another drafter shape
    that appears later (naming its config.json). The others are scored, and the watcher goes on."""
    from dflash_callbacks.cli.score import scoring_config
    from dflash_callbacks.cli.watch import checkpoint_settings
    from dflash_callbacks.watch.checkpoint_watcher import CheckpointWatcher

    root, out = tmp_path / "ckpts", tmp_path / "ckpts" / "dflash-eval"
    save_drafter(root / "checkpoint-2", world.config, trained(world, 2))
    (root / "checkpoint-2" / "trainer_state.json").write_text("{}")  # the Trainer's marker: complete at once
    save_drafter(root / "checkpoint-4", world.config, trained(world, 4))  # no marker: settles for 60 s
    args = build_parser().parse_args(watch_args(world, root, "--settle-seconds", "60"))
    watcher = CheckpointWatcher(checkpoint_settings(args, scoring_config(args)))
    watcher.check()
    assert watcher.scan() == 1 and watcher.seen.keys() == {2, 4}
    shutil.rmtree(root / "checkpoint-4")
    other = DrafterConfig(**{**world.config.__dict__, "intermediate_size": 48})
    save_drafter(root / "checkpoint-6", other, DFlashDrafter(other).state_dict())
    (root / "checkpoint-6" / "trainer_state.json").write_text("{}")
    assert watcher.scan() == 2
    with pytest.raises(FileNotFoundError, match="the checkpoint of step 8, .* was deleted before it was scored"):
        watcher.checkpoints.read(root / "checkpoint-8", 8)

    def all_published() -> bool:  # published as they are scored, as the watcher's own loop does
        watcher.publish()
        return not watcher.engine.pending

    wait_until(all_published, what="the watcher publishing every report")
    watcher.close(ok=True)
    reports, errors = results(out)
    assert sorted(reports) == [2] and sorted(errors) == [4, 6]
    assert "the checkpoint of step 4" in errors[4]["error"] and "deleted before it was scored" in errors[4]["error"]
    assert f"{root / 'checkpoint-6' / 'config.json'}: a drafter of another shape" in errors[6]["error"]
    assert "intermediate_size 48 (the run's: 64)" in errors[6]["error"]
    assert "step 4 failed" in capsys.readouterr().err


def test_bad_input_is_one_line_each_before_any_scoring(world, tmp_path, capsys):
    root = tmp_path / "ckpts"
    save_drafter(root / "checkpoint-2", world.config, trained(world, 2))
    base = watch_args(world, root)
    no_dir = ["watch", "--cache", str(world.cache), "--target", str(world.target)]
    fails(no_dir, capsys, "give exactly one of --dir", "or --checkpoints")
    fails([*no_dir, "--dir", str(tmp_path), "--checkpoints", str(root)], capsys, "give exactly one of --dir")
    fails([*no_dir, "--dir", str(tmp_path), "--settle-seconds", "3", "--state-key", "x"], capsys,
          "--state-key, --settle-seconds go with --checkpoints, not --dir")
    fails(watch_args(world, tmp_path / "ckpt"), capsys, f"--checkpoints {tmp_path / 'ckpt'} is not a folder (it does "
          "not exist): give the folder your trainer saves its checkpoints into")
    err = fails([*base, "--settle-seconds", "-1", "--state-key", "draft_state_dict", "--step-pattern", "step_(\\d+",
                 "--wandb-name", "x", "--patience", "2"], capsys)
    for text in ("--settle-seconds must be finite numbers >= 0", "give the drafter's config.json with --drafter-config",
                 "--step-pattern 'step_(\\\\d+' is not a regular expression",
                 "--wandb-name and --wandb-group name a run",
                 "--patience set the stop, which compares with the baseline: give --baseline"):
        assert text in err
    assert len(err.splitlines()) == 5
    fails([*base, "--drafter-config", str(world.baseline)], capsys,
          "--state-file and --drafter-config go with --state-key")

    # a torch checkpoint without the state key: the keys it has are named
    torch_root = tmp_path / "torch"
    torch_root.mkdir()
    torch.save({"model": trained(world, 2), "step": 2}, torch_root / "ckpt_2.pt")
    fails(watch_args(world, torch_root, "--state-key", "draft_state_dict", "--drafter-config", world.baseline), capsys,
          f"{torch_root / 'ckpt_2.pt'} has no 'draft_state_dict'; its keys are ['model', 'step']: give the key of the "
          "drafter's state dict (--state-key")
    # a checkpoint of another shape among those there at start: refused naming the file, nothing scored
    other = DrafterConfig(**{**world.config.__dict__, "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    save_drafter(root / "checkpoint-4", other, DFlashDrafter(other).state_dict())
    fails(base, capsys, f"{root / 'checkpoint-4' / 'config.json'}: a drafter of another shape than the run's "
          f"({root / 'checkpoint-2' / 'config.json'}): num_hidden_layers 1 (the run's: 2)")
    shutil.rmtree(root / "checkpoint-4")
    save_drafter(root / "checkpoint-4", world.config, {**trained(world, 4), "extra.weight": torch.zeros(2)})
    fails(base, capsys, f"{root / 'checkpoint-4' / 'model.safetensors'}: its tensors are not the run's drafter",
          "unexpected tensor 'extra.weight'")
    assert not (root / "dflash-eval").exists()
    shutil.rmtree(root / "checkpoint-4")

    # a restart with other scoring settings than the run folder's reports stand on
    assert cli_main([*base, "--once", "--settle-seconds", "0"]) == 0
    capsys.readouterr()
    fails([*base, "--once", "--settle-seconds", "0", "--budgets", "8"], capsys,
          f"--out {root / 'dflash-eval'} holds reports scored with no ddtree@8",
          "watch with its settings, or give another --out")
    fails([*base, "--once", "--out", str(root / "checkpoint-2" / "config.json")], capsys, "is a file")
    assert sorted(results(root / "dflash-eval")[0]) == [2]


def specforge_world(tmp_path: Path) -> tuple[Path, Path]:
    """A target head and a cache that fit the SpecForge fixture drafter (vocab 97, hidden 64, layer
    ids 1, 3, 5 of 8): the fixture's own context as one task, random hidden states as another."""
    from dflash_callbacks.cache.format import TargetInfo, new_manifest, open_for_writing, write_task

    inputs = load_file(str(SPECFORGE / "inputs.safetensors"))
    target = tmp_path / "target"
    target.mkdir()
    save_file({"model.embed_tokens.weight": inputs["target_embed_tokens"], "lm_head.weight": inputs["target_lm_head"]},
              str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64}))
    cache = tmp_path / "cache"
    open_for_writing(cache, new_manifest(TargetInfo(str(target), 8, 64, 97, "float32"), [1, 3, 5]))
    write_task(cache, "specforge", inputs["context_input_ids"], inputs["target_hidden"], 3)
    g = torch.Generator().manual_seed(0)
    write_task(cache, "random", torch.randint(0, 96, (30,), generator=g), torch.randn(30, 192, generator=g), 6)
    return target, cache


def test_specforge_torch_checkpoints_equal_score_on_their_hf_export(tmp_path, capsys):
    """SpecForge's own `training_state.pt` (weights under draft_state_dict), in its checkpoint folder
    layout, and the same weights saved by a DDP-wrapped, compiled trainer (prefixed keys) as a bare
    file whose name's last integer is not its step (--step-pattern): each report equals
    `dflash-callbacks score` on SpecForge's own HF export of them."""
    target, cache = specforge_world(tmp_path)
    root = tmp_path / "checkpoints"
    shutil.copytree(SPECFORGE / "checkpoints", root)
    (root / "run-latest").write_text("run-step10")  # SpecForge's pointer file: no step, not a checkpoint
    state = torch.load(root / "run-step10" / "training_state.pt", map_location="cpu", weights_only=True)
    torch.save({"draft_state_dict": {f"module._orig_mod.{k}": v for k, v in state["draft_state_dict"].items()}},
               root / "step20-v2.pt")
    args = ["watch", "--checkpoints", str(root), "--cache", str(cache), "--target", str(target), "--device", "cpu",
            "--state-key", "draft_state_dict", "--drafter-config", str(SPECFORGE / "draft_config.json"),
            "--step-pattern", r"step(\d+)", "--settle-seconds", "0", "--once"]
    assert cli_main(args) == 0, capsys.readouterr().err
    reports, errors = results(root / "dflash-eval")
    assert sorted(reports) == [10, 20] and not errors
    out = tmp_path / "hf.json"
    assert cli_main(["score", "--drafter", str(SPECFORGE / "hf_export"), "--cache", str(cache), "--target", str(target),
                     "--device", "cpu", "--json", str(out)]) == 0
    reference = EvalReport.load(out)
    for report in reports.values():
        assert_same(report, reference)
    assert reports[10].drafter == str(root / "run-step10" / "training_state.pt")
    assert reports[20].drafter == str(root / "step20-v2.pt")
    assert reports[10].value("vanilla/live") >= 1.0

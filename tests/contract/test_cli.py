"""Every CLI checks its inputs before any work starts and answers an ordinary mistake with
one `error: ...` line per problem and exit status 2; `--debug` shows the traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.model import DrafterConfig
from dflash_callbacks.scoring.intervals import paired_comparison
from dflash_callbacks.scoring.report import EvalReport

from synthetic import build_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("cli-world"))


def score_args(world, **kw) -> list[str]:
    args = {"--drafter": world.baseline, "--cache": world.cache, "--target": world.target, "--budgets": "4",
            "--device": "cpu"}
    args.update(kw)
    return ["score"] + [str(x) for flag, value in args.items() if value is not None for x in (flag, value)]


def fails(argv, capsys, *expected) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err and all(line.startswith("error: ") for line in err.splitlines()), err
    assert "Traceback" not in err
    for text in expected:
        assert text in err, err
    return err


def test_score_mistakes_are_one_line_each(world, tmp_path, capsys):
    fails(score_args(world, **{"--drafter": tmp_path / "nope"}), capsys, "--drafter", "is not a folder")
    fails(score_args(world, **{"--drafter": world.baseline / "config.json"}), capsys, "is not a folder")
    fails(score_args(world, **{"--drafter": world.target}), capsys,
          "drafter config", "no field 'num_hidden_layers'", "is this a DFlash drafter config?")
    fails(score_args(world, **{"--tasks": "long,fizzbuzz"}), capsys,
          "scoring.tasks ['fizzbuzz'] are not in the cache")
    fails(score_args(world, **{"--cache": tmp_path / "no-cache"}), capsys, f"--cache {tmp_path / 'no-cache'} does not exist")
    fails(score_args(world, **{"--cache": world.target}), capsys, "cache: ", "has no manifest.json")
    fails(score_args(world, **{"--target": world.cache}), capsys, "target: ")
    if not torch.cuda.is_available():
        fails(score_args(world, **{"--device": "cuda"}), capsys, "scoring.device='cuda', but CUDA is not available")
        fails(score_args(world, **{"--backend": "triton"}), capsys, "backend='triton' runs on CUDA devices only")


def test_every_bad_scoring_value_is_one_error_line(world, tmp_path, capsys):
    """All at once, from the flags and from --config alike, each named as the command line names it."""
    err = fails(score_args(world, **{"--budgets": "0", "--topk": "0", "--window": "0"}), capsys)
    assert err.splitlines() == ["error: ddtree_budgets must be a list of integers >= 1; got 0 in [0]",
                                "error: topk must be a list of integers >= 1; got 0 in [0]",
                                "error: window must be None or an integer >= 1; got 0"]
    config = tmp_path / "scoring.yaml"
    config.write_text("ddtree_budgets: 8\ntopk: 4\nmax_rounds: 0\nwindw: 3\n")
    err = fails(score_args(world, **{"--config": config, "--budgets": None, "--window": "0"}), capsys)
    assert err.splitlines() == [f"error: config key 'ddtree_budgets' in {config}: ddtree_budgets is a list: write ddtree_budgets: [8]",
                                f"error: config key 'topk' in {config}: topk is a list: write topk: [4]",
                                f"error: config key 'windw' in {config}: Key 'windw' not in 'ScoringConfig'. Did you mean: 'window'?",
                                "error: window must be None or an integer >= 1; got 0",
                                "error: max_rounds must be None or an integer >= 1; got 0"]


def test_every_problem_of_one_invocation_is_listed_together(world, tmp_path, capsys):
    """`score --drafter x --cache y --target z`, none of them there, named only the drafter; the cache and the
    target came on later tries. Every problem of the paths and the flags is one line, all at once, and so are
    those found once the drafter has been read (a drafter whose config does not read, beside a cache folder
    that holds no cache); `watch` and `extract` alike."""
    x, y, z = (tmp_path / name for name in "xyz")
    err = fails(["score", "--drafter", str(x), "--cache", str(y), "--target", str(z), "--window", "0",
                 "--attention", "vlm", "--json", str(tmp_path / "no" / "r.json")], capsys)
    assert [line.split(" ", 2)[1] for line in err.splitlines()] == ["--json", "--drafter", "--cache", "--target",
                                                                    "window", "attention"], err
    broken = shutil.copytree(world.baseline, tmp_path / "broken")
    (broken / "config.json").write_text("{")
    err = fails(score_args(world, **{"--drafter": broken, "--cache": world.target}), capsys)
    assert len(err.splitlines()) == 2 and "not valid JSON" in err and f"{world.target} has no manifest.json" in err
    err = fails(["watch", "--dir", str(x), "--once", "--cache", str(y), "--target", str(z), "--topk", "0"], capsys)
    assert [line.split(" ", 2)[1] for line in err.splitlines()] == ["--cache", "--target", "topk", "--dir"], err
    err = fails(["extract", "--target", str(z), "--out", str(y), "--layer-ids", "1", "--tasks", "coding11",
                 "--max-new-tokens", "0", "--temperature", "-1"], capsys)
    assert [line.split(" ", 2)[1] for line in err.splitlines()] == ["--target", "--tasks:", "--max-new-tokens",
                                                                    "temperature"], err
    assert "did you mean 'coding10'?" in err


def test_a_file_given_for_a_folder_is_named_a_file(world, capsys):
    fails(score_args(world, **{"--target": world.target / "config.json", "--cache": world.cache / "manifest.json"}),
          capsys, f"target {world.target / 'config.json'} is a file: give the target model's folder (e.g. {world.target})",
          f"cache {world.cache / 'manifest.json'} is a file: give the cache's folder (e.g. {world.cache})")
    err = fails(["extract", "--target", str(world.target / "config.json"), "--out", str(world.cache.parent / "c"),
                 "--layer-ids", "1"], capsys, f"target {world.target / 'config.json'} is a file")
    assert "does not exist" not in err


def test_an_unknown_option_is_named_with_the_one_meant(capsys):
    """argparse alone says `--cache` is required, and nothing of the `--cahce` that was given."""
    for argv, expected in ((["score", "--cahce", "X"], ["unrecognized argument --cahce; did you mean --cache?"]),
                           (["score", "--drafter", "d", "--cahce=X", "--tagret", "t", "--zzz"],
                            ["unrecognized argument --cahce; did you mean --cache?",
                             "unrecognized argument --tagret; did you mean --target?", "unrecognized argument --zzz"]),
                           (["--debugg", "score"], ["unrecognized argument --debugg; did you mean --debug?"])):
        with pytest.raises(SystemExit) as exit:
            cli_main(argv)
        assert exit.value.code == 2
        errors = [line.split(" error: ", 1)[1] for line in capsys.readouterr().err.splitlines() if " error: " in line]
        assert errors == expected
    with pytest.raises(SystemExit):  # a prefix of an option is still argparse's to expand
        cli_main(["score", "--budg", "4"])
    assert "the following arguments are required: --drafter, --cache, --target" in capsys.readouterr().err


def test_score_checks_the_baseline_and_the_output_folder_before_scoring_ours(world, tmp_path, capsys):
    started = time.time()
    fails(score_args(world, **{"--baseline": tmp_path / "basline"}), capsys,
          f"baseline {tmp_path / 'basline'} does not exist")
    fails(score_args(world, **{"--json": tmp_path / "no-folder" / "ours.json"}), capsys,
          "--json", "the folder", "does not exist")
    (tmp_path / "ours.json").mkdir()
    fails(score_args(world, **{"--json": tmp_path / "ours.json"}), capsys, f"--json {tmp_path / 'ours.json'} is a folder")
    fails(score_args(world, **{"--baseline-json": tmp_path / "base.json"}), capsys,
          "--baseline-json writes the baseline's report: give the baseline with --baseline")
    fails(score_args(world, **{"--baseline": world.baseline, "--json": tmp_path / "r.json", "--baseline-json":
                               tmp_path / "." / "r.json"}), capsys, "--json and --baseline-json are both")
    assert not (tmp_path / "no-folder").exists() and not list(tmp_path.glob(".*tmp*"))
    assert time.time() - started < 30


def test_score_uses_the_baseline_cache_and_writes_both_reports(world, tmp_path, capsys):
    args = score_args(world, **{"--baseline": world.baseline, "--baseline-cache-dir": tmp_path / "bc",
                                "--json": tmp_path / "ours.json", "--baseline-json": tmp_path / "base.json"})
    assert cli_main(args) == 0
    assert "| **mean** |" in capsys.readouterr().out
    cached = list((tmp_path / "bc").glob("baseline-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["tasks"] == \
        json.loads((tmp_path / "base.json").read_text())["tasks"]


def test_score_says_its_table_on_stdout_and_its_progress_as_plain_lines_on_stderr(world, tmp_path, capsys):
    """stdout holds what `score` reports (the table, the verdicts, each side's served settings); stderr its
    progress, which without a terminal is one plain line per task scored, no bar per chunk nested in it, no
    carriage return or cursor move (a redirected log filled with tqdm's escape codes)."""
    args = score_args(world, **{"--baseline": world.baseline, "--baseline-cache-dir": tmp_path / "bc"})
    assert cli_main(args) == 0
    said = capsys.readouterr()
    assert "| **mean** |" in said.out and "scoring" not in said.out
    assert "\r" not in said.err and "\x1b" not in said.err
    done = [line.split(",")[0] for line in said.err.splitlines()]
    assert done.count(f"scoring {world.baseline}: 3/3 tasks") == 2  # ours, then the baseline (one folder here)
    assert [line for line in said.err.splitlines() if not re.fullmatch(r"scoring \S+: \d/3 tasks, \d+ s", line)] == []


@pytest.mark.parametrize("edit,field", [
    (lambda c: c.pop("hidden_size"), "no field 'hidden_size'"),
    (lambda c: c.__setitem__("hidden_size", "32"), "field 'hidden_size' must be a positive integer; got '32'"),
    (lambda c: c.__setitem__("num_hidden_layers", [2]), "field 'num_hidden_layers' must be a positive integer"),
    (lambda c: c.__setitem__("dflash_config", [1]), "field 'dflash_config' must be an object"),
])
def test_a_broken_drafter_config_names_the_file_and_the_field(world, tmp_path, capsys, edit, field):
    folder = shutil.copytree(world.baseline, tmp_path / "drafter")
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    fails(score_args(world, **{"--drafter": folder}), capsys, f"drafter config {folder / 'config.json'}", field)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json: a drafter config is a JSON object; got list"):
        DrafterConfig.from_file(folder)


def test_debug_shows_the_traceback(world, tmp_path):
    from dflash_callbacks.cli import UsageError

    with pytest.raises(UsageError, match=r"--cache \S+no-cache does not exist"):
        cli_main(["--debug"] + score_args(world, **{"--cache": tmp_path / "no-cache"}))
    run = subprocess.run([sys.executable, "-m", "dflash_callbacks.cli", *score_args(world, **{"--cache": tmp_path})],
                         capture_output=True, text=True, env={**os.environ, "DFLASH_DEBUG": "1"})
    assert run.returncode == 1 and "Traceback" in run.stderr


def test_compare_takes_reports_and_results_jsonl(world, tmp_path, capsys):
    assert cli_main(score_args(world, **{"--json": tmp_path / "a.json"})) == 0
    capsys.readouterr()
    report = json.loads((tmp_path / "a.json").read_text())
    lines = [{**report, "step": step} for step in (2, 4)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 6, "error": "x"}\n')
    assert cli_main(["compare", str(tmp_path / "results.jsonl"), str(tmp_path / "a.json")]) == 0
    assert "step 4" in capsys.readouterr().out  # default: the last step with a report
    assert cli_main(["compare", str(tmp_path / "results.jsonl"), str(tmp_path / "a.json"), "--step", "2"]) == 0
    assert "step 2" in capsys.readouterr().out
    fails(["compare", str(tmp_path / "results.jsonl"), str(tmp_path / "a.json"), "--step", "3"], capsys,
          "has no report of step 3; it has steps [2, 4]")
    fails(["compare", str(tmp_path / "results.jsonl"), str(tmp_path / "a.json"), "--step", "6"], capsys,
          "step 6 of", "was not scored: x")
    # a later step that failed, and a line that is no report (torn, or not strict JSON), are said, not passed over
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write(json.dumps({**report, "step": 8}).replace('"seconds": ', '"seconds": NaN, "was": ', 1) + "\n")
        f.write(json.dumps({**report, "step": 10})[:300])
    assert cli_main(["compare", str(tmp_path / "results.jsonl"), str(tmp_path / "a.json")]) == 0
    captured = capsys.readouterr()
    assert "step 4" in captured.out
    assert [line.split(": ")[0] for line in captured.err.splitlines()] == ["warning"] * 3, captured.err
    assert "line 4: " in captured.err and "line 5: " in captured.err and "step 6 of" in captured.err
    (tmp_path / "list.json").write_text("[1, 2]")
    fails(["compare", str(tmp_path / "list.json"), str(tmp_path / "a.json")], capsys,
          "not a report: a JSON object was expected, found list")
    fails(["compare", str(tmp_path / "missing.json"), str(tmp_path / "a.json")], capsys, "no report at")
    # swapped arguments, and a drafter folder where a report belongs, say what to give instead
    fails(["compare", str(tmp_path / "a.json"), str(tmp_path / "results.jsonl")], capsys,
          f"the baseline {tmp_path / 'results.jsonl'} is a results.jsonl", "are they swapped?")
    fails(["compare", str(tmp_path / "a.json"), str(world.baseline)], capsys,
          f"the baseline {world.baseline} is a folder", f"score --drafter OURS --baseline {world.baseline} --baseline-json")
    fails(["compare", str(world.baseline), str(tmp_path / "a.json")], capsys, "is a folder", "results.jsonl")


def test_extract_refuses_a_missing_target_without_asking_the_hub(tmp_path, capsys):
    fails(["extract", "--target", str(tmp_path / "Qwen3-8B"), "--out", str(tmp_path / "c"), "--layer-ids", "1"],
          capsys, f"--target {tmp_path / 'Qwen3-8B'} does not exist", "nothing is downloaded")
    if not torch.cuda.is_available():
        (tmp_path / "t").mkdir()
        (tmp_path / "t" / "config.json").write_text("{}")
        fails(["extract", "--target", str(tmp_path / "t"), "--out", str(tmp_path / "c"), "--layer-ids", "1",
               "--device", "cuda"], capsys, "--device='cuda', but CUDA is not available")


def test_watch_refuses_what_can_not_work_and_logs_what_it_scores(world, tmp_path, capsys):
    base = ["watch", "--cache", str(world.cache), "--target", str(world.target), "--budgets", "4", "--device", "cpu"]
    fails([*base, "--dir", str(tmp_path / "runs-typo"), "--once"], capsys, "--dir", "is not a folder")
    fails([*base, "--dir", str(world.cache / "manifest.json")], capsys, "--dir", "is not a folder")
    # started before the training run creates its dirpath: it waits, and creates nothing
    assert cli_main([*base, "--dir", str(tmp_path / "runs-later"), "--idle-exit", "0"]) == 0
    assert "runs-later does not exist yet, waiting" in capsys.readouterr().out
    assert not (tmp_path / "runs-typo").exists() and not (tmp_path / "runs-later").exists()
    for bad in (["--poll-seconds", "-1"], ["--poll-seconds", "inf"], ["--poll-seconds", "nan"], ["--idle-exit", "nan"]):
        fails([*base, "--dir", str(tmp_path), *bad], capsys, "--poll-seconds and --idle-exit must be finite numbers >= 0")
    fails([*base, "--dir", str(tmp_path), "--baseline", str(tmp_path / "nope")], capsys, "baseline")

    # a run folder with one snapshot: it is scored and logged
    from dflash_callbacks.engine.run_folder import RunFolder
    from dflash_callbacks.engine.snapshot import Snapshot

    run = RunFolder.create(tmp_path / "runs", "run-a")
    run.write_snapshot(Snapshot(3, 0, world.config, {k: v.clone() for k, v in world.drafter.state_dict().items()}))
    run.unlock()
    assert cli_main([*base, "--dir", str(tmp_path / "runs"), "--once"]) == 0
    out = capsys.readouterr().out
    assert "watch: run-a step 3: live tau vanilla" in out
    assert f"watch: scoring the snapshots of the runs in {tmp_path / 'runs'} (once)" in out and "Ctrl-C" not in out
    report = run.read_report(run.report_path(3))
    assert report.step == 3 and report.snapshot_id == run.snapshot_id(run.snapshot_path(3))
    assert (run.path / "watcher.json").is_file()  # the heartbeat of a run it scores

    # a watcher scores each snapshot once; a report naming another snapshot is scored again
    from dflash_callbacks.watch.runs import Watcher
    from dflash_callbacks.scoring.service import ScoringService, ServiceSpec

    spec = ServiceSpec(str(world.cache), str(world.target), None, {"ddtree_budgets": [4], "device": "cpu"})
    later = Watcher(ScoringService(spec), tmp_path / "runs-later", log=lambda line: None)
    assert later.scan_once() == 0 and not (tmp_path / "runs-later").exists()
    shutil.copytree(tmp_path / "runs", tmp_path / "runs-later")  # the training run made it meanwhile
    (tmp_path / "runs-later" / "run-a" / "reports" / "step-00000003.json").unlink()
    assert later.scan_once() == 1
    watcher = Watcher(ScoringService(spec), tmp_path / "runs", log=lambda line: None)
    assert watcher.scan_once() == 0 and watcher.scan_once() == 0
    stale = {**json.loads(run.report_path(3).read_text()), "snapshot_id": "0" * 16}
    run.write_report(3, stale)
    assert watcher.scan_once() == 1 and run.read_report(run.report_path(3)).snapshot_id == report.snapshot_id


def test_demo_help_lists_every_setting_and_output(capsys):
    with pytest.raises(SystemExit):
        cli_main(["demo", "--help"])
    out = capsys.readouterr().out
    for key in ("train.max_steps = 600", "eval.every_n_train_steps = 25", "stop.grace_steps = 250",
                "eval.scoring.topk = [4]", "wandb = 'offline'"):
        assert key in out
    for output in ("world/", "baseline-reports/", "results.jsonl", "csv/", "wandb/", "live_tau.png"):
        assert output in out


def test_demo_overrides_name_the_key(capsys):
    fails(["demo", "train.max_steps=abc"], capsys, "override 'train.max_steps=abc': Value 'abc'")
    fails(["demo", "train.max_step=300"], capsys, "error: override 'train.max_step=300': Key 'max_step' not in 'TrainConfig'")
    fails(["demo", "eval.scoring.topk=4"], capsys, "error: override 'eval.scoring.topk=4': topk is a list: "
          "write eval.scoring.topk=[4]")
    fails(["demo", "train.max_steps"], capsys, "override 'train.max_steps' is not key=value")


def test_the_demo_checks_its_whole_config_before_building_anything(tmp_path, capsys):
    """A monitor the demo does not score, and every other mistake with it, is named at once, in
    seconds, and nothing is built or written under `out` (it ran 32 s and made csv/ first)."""
    out = tmp_path / "out"
    started = time.time()
    err = fails(["demo", f"out={out}", "stop.monitor=ddtree@16/live"], capsys)
    assert err.splitlines() == ["error: stop.monitor='ddtree@16/live', but eval.scoring scores only ['vanilla', "
                                "'ddtree@4', 'ddtree@8', 'top@4']: monitor one of those, or add 16 to eval.scoring.ddtree_budgets; "
                                "did you mean 'ddtree@8/live'?"]
    err = fails(["demo", f"out={out}", "stop.monitor=top@8/dense", "train.max_steps=0", "train.seq_len=64", "wandb=x",
                 "eval.every_n_train_steps=0", f"eval.cache={tmp_path / 'nope'}", "eval.scoring.window=0"], capsys)
    assert err.splitlines() == ["error: window must be None or an integer >= 1; got 0"]  # the config's values first
    err = fails(["demo", f"out={out}", "stop.monitor=top@8/dense", "train.max_steps=0", "train.seq_len=64", "wandb=x",
                 "eval.every_n_train_steps=0", f"eval.cache={tmp_path / 'nope'}", "eval.runner=external"], capsys)
    assert err.splitlines() == [
        "error: wandb must be one of ['offline', 'online', 'disabled']; got 'x'",
        "error: train.max_steps must be an integer >= 1; got 0",
        "error: train.seq_len must be an integer >= 65; got 64",
        f"error: eval.cache {tmp_path / 'nope'} does not exist: give a folder, or toy for the toy world's",
        "error: eval.runner='external' scores nothing without a `dflash-callbacks watch`, and the demo starts none: "
        "use thread or process",
        "error: eval: every_n_train_steps must be an integer >= 1; got 0",
    ]
    fails(["demo", f"out={out}", "stop.monitor=top@8/dense"], capsys, "or add 8 to eval.scoring.topk")
    assert time.time() - started < 20 and not out.exists()


def test_watch_retries_a_failed_baseline(world, tmp_path):
    """A baseline that fails to score (NaN weights) is an error file the run can read, and
    is tried again on the next poll: once it scores, its report replaces the error."""
    from safetensors.torch import load_file, save_file

    from dflash_callbacks.engine.run_folder import RunFolder
    from dflash_callbacks.watch.runs import Watcher
    from dflash_callbacks.scoring.report import EvalReport
    from dflash_callbacks.scoring.service import ScoringService, ServiceSpec

    baseline = shutil.copytree(world.baseline, tmp_path / "baseline")
    good = load_file(str(baseline / "model.safetensors"))
    save_file({**good, "norm.weight": torch.full_like(good["norm.weight"], float("nan"))},
              str(baseline / "model.safetensors"))
    run = RunFolder.create(tmp_path / "runs", "run-a")
    run.unlock()
    lines = []
    spec = ServiceSpec(str(world.cache), str(world.target), str(baseline), {"ddtree_budgets": [4], "device": "cpu"},
                       str(tmp_path / "bc"))
    watcher = Watcher(ScoringService(spec), tmp_path / "runs", log=lines.append)
    watcher.scan_once()
    first = run.read_report(run.report_path(None))
    assert not isinstance(first, EvalReport) and "NaN or Inf weights" in first.message
    assert "scoring the baseline failed (retried next poll)" in lines[-1]
    save_file(good, str(baseline / "model.safetensors"))
    watcher.scan_once()
    assert isinstance(run.read_report(run.report_path(None)), EvalReport) and "scored" in lines[-1]


def test_score_reads_a_scoring_config_file_and_flags_win(world, tmp_path, capsys):
    config = tmp_path / "scoring.yaml"
    config.write_text("ddtree_budgets: [2]\ntopk: [3]\ndevice: cuda:7\nmax_rounds: 0\n")  # the flag fixes max_rounds
    args = score_args(world, **{"--config": config, "--json": tmp_path / "ours.json", "--max-rounds": 7,
                                "--max-memory-gib": 4})
    assert cli_main(args + ["--release-memory"]) == 0
    scoring = json.loads((tmp_path / "ours.json").read_text())["scoring"]
    assert (scoring["ddtree_budgets"], scoring["topk"], scoring["device"]) == ([4], [3], "cpu")  # the flags win
    assert (scoring["max_rounds"], scoring["max_memory_gib"], scoring["release_memory"]) == (7, 4.0, True)
    capsys.readouterr()
    config.write_text("ddtree_budget: [2]\n")
    fails(score_args(world, **{"--config": config}), capsys, f"config key 'ddtree_budget' in {config}")
    fails(score_args(world, **{"--config": tmp_path / "nope.yaml"}), capsys, "--config", "is not a file")


def test_the_shipped_scoring_yaml_works_with_score_and_watch(world, tmp_path, capsys):
    from dflash_callbacks.engine.run_folder import RunFolder
    from dflash_callbacks.engine.snapshot import Snapshot
    from dflash_callbacks.config_files import CONF_DIR

    assert "--config conf/scoring.yaml" in (CONF_DIR / "scoring.yaml").read_text()
    assert cli_main(score_args(world, **{"--config": CONF_DIR / "scoring.yaml"})) == 0
    run = RunFolder.create(tmp_path / "runs", "run-a")
    run.write_snapshot(Snapshot(3, 0, world.config, {k: v.clone() for k, v in world.drafter.state_dict().items()}))
    run.unlock()
    assert cli_main(["watch", "--dir", str(tmp_path / "runs"), "--cache", str(world.cache), "--target", str(world.target),
                     "--config", str(CONF_DIR / "scoring.yaml"), "--device", "cpu", "--budgets", "4", "--once",
                     "--max-memory-gib", "2", "--release-memory"]) == 0
    scoring = json.loads(run.report_path(3).read_text())["scoring"]
    assert (scoring["ddtree_budgets"], scoring["max_memory_gib"], scoring["release_memory"]) == ([4], 2.0, True)


def test_watch_names_a_dir_without_run_folders_and_the_one_meant(world, tmp_path, capsys):
    from dflash_callbacks.engine.run_folder import RunFolder
    from dflash_callbacks.engine.snapshot import Snapshot

    base = ["watch", "--cache", str(world.cache), "--target", str(world.target), "--budgets", "4", "--device", "cpu"]
    run = RunFolder.create(tmp_path / "runs" / "demo" / "dflash", "run-a")
    run.write_snapshot(Snapshot(3, 0, world.config, {k: v.clone() for k, v in world.drafter.state_dict().items()}))
    run.unlock()
    demo, dflash = tmp_path / "runs" / "demo", tmp_path / "runs" / "demo" / "dflash"
    fails([*base, "--dir", str(demo), "--once"], capsys, f"--dir {demo} holds no run folder; did you mean --dir {dflash}?")
    fails([*base, "--dir", str(tmp_path / "runs"), "--once"], capsys, f"did you mean --dir {dflash}?")
    fails([*base, "--dir", str(run.snapshots_dir), "--once"], capsys, f"did you mean --dir {run.path}?")
    (tmp_path / "empty").mkdir()
    fails([*base, "--dir", str(tmp_path / "empty"), "--once"], capsys, "holds no run folder (a run folder holds run.json)")
    assert not (demo / "watcher.json").exists()
    # without --once a notice, and the watcher keeps polling: runs may appear later
    assert cli_main([*base, "--dir", str(demo), "--idle-exit", "0", "--poll-seconds", "0"]) == 0
    assert f"watch: {demo} holds no run folder yet, waiting for one; did you mean --dir {dflash}?" in capsys.readouterr().out


def test_watch_skips_runs_of_another_runner_and_logs_it_once(world, tmp_path):
    from dflash_callbacks.engine.run_folder import RunFolder
    from dflash_callbacks.engine.snapshot import Snapshot
    from dflash_callbacks.watch.runs import Watcher
    from dflash_callbacks.scoring.service import ScoringService, ServiceSpec

    runs = {}
    for name, about in (("thread-run", {"runner": "thread"}), ("external-run", {"runner": "external"}), ("old-run", {})):
        runs[name] = RunFolder.create(tmp_path / "runs", name, about)
        runs[name].write_snapshot(Snapshot(3, 0, world.config, {k: v.clone() for k, v in world.drafter.state_dict().items()}))
        runs[name].unlock()
    lines = []
    spec = ServiceSpec(str(world.cache), str(world.target), None, {"ddtree_budgets": [4], "device": "cpu"})
    watcher = Watcher(ScoringService(spec), tmp_path / "runs", log=lines.append)
    assert watcher.scan_once() == 2 and watcher.scan_once() == 0
    assert not runs["thread-run"].report_path(3).exists()
    assert runs["external-run"].report_path(3).is_file() and runs["old-run"].report_path(3).is_file()
    assert [line for line in lines if "skipping" in line] == \
        ["watch: skipping thread-run: its runner is 'thread', not 'external' (it scores its own snapshots)"]


def test_a_truncated_safetensors_file_is_one_error_line_naming_it(world, tmp_path, capsys):
    def truncated(folder, name):
        copy = shutil.copytree(folder, tmp_path / name)
        data = (copy / "model.safetensors").read_bytes()
        (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
        return copy / "model.safetensors"

    damaged = "is not a readable safetensors file (truncated or corrupt?)"
    drafter, baseline, target = truncated(world.baseline, "d"), truncated(world.baseline, "b"), truncated(world.target, "t")
    fails(score_args(world, **{"--drafter": drafter.parent}), capsys, f"{drafter} {damaged}")
    err = fails(score_args(world, **{"--baseline": baseline.parent, "--target": target.parent}), capsys,
                f"baseline {baseline.parent}: {baseline} {damaged}", f"target: {target} {damaged}")
    assert "internal error" not in err

    # a shard index without its weight map is named the same way
    indexed = shutil.copytree(world.target, tmp_path / "indexed")
    (indexed / "model.safetensors.index.json").write_text('{"metadata": {}}')
    err = fails(score_args(world, **{"--target": indexed}), capsys,
                f"{indexed / 'model.safetensors.index.json'} has no 'weight_map' object")
    assert "internal error" not in err


def test_a_report_the_watcher_can_not_write_is_retried_and_the_other_runs_go_on(world, tmp_path, monkeypatch):
    """A folder where a report file goes (as a full disk, the write fails), a `reports` that is a
    file, a run folder removed: each is logged once and retried on the next poll, the other runs
    are scored, and a report scored once is written without scoring it again."""
    from dflash_callbacks.engine.run_folder import RunFolder
    from dflash_callbacks.engine.snapshot import Snapshot
    from dflash_callbacks.watch.runs import Watcher
    from dflash_callbacks.scoring.service import ScoringService, ServiceSpec

    runs = {}
    for name in ("a-blocked", "b-reports-is-a-file", "c-removed", "d-good"):
        runs[name] = RunFolder.create(tmp_path / "runs", name, {"runner": "external"})
        runs[name].write_snapshot(Snapshot(3, 0, world.config, {k: v.clone() for k, v in world.drafter.state_dict().items()}))
        runs[name].unlock()
    runs["a-blocked"].report_path(3).mkdir(parents=True)
    runs["b-reports-is-a-file"].reports_dir.write_text("")
    lines = []
    spec = ServiceSpec(str(world.cache), str(world.target), None, {"ddtree_budgets": [4], "device": "cpu"})
    watcher = Watcher(ScoringService(spec), tmp_path / "runs", log=lines.append)
    scored, score_folder, list_snapshots = [], watcher.service.score_folder, RunFolder.list_snapshots
    monkeypatch.setattr(watcher.service, "score_folder", lambda folder: scored.append(folder) or score_folder(folder))

    def removed_meanwhile(run):  # the training run's folder is removed while the watcher is at it
        found = list_snapshots(run)
        if run.path.name == "c-removed":
            shutil.rmtree(run.path)
        return found

    monkeypatch.setattr(RunFolder, "list_snapshots", removed_meanwhile)
    assert watcher.scan_once() == 1 and watcher.scan_once() == 0
    assert runs["d-good"].report_path(3).is_file() and not runs["c-removed"].path.exists()
    failed = [line for line in lines if "(retried next poll)" in line]
    assert len(failed) == 2 and "a-blocked: writing" in failed[0] and "b-reports-is-a-file: " in failed[1], lines
    assert not list(runs["a-blocked"].reports_dir.glob(".*tmp*"))
    runs["a-blocked"].report_path(3).rmdir()
    assert watcher.scan_once() == 1  # a-blocked's report is written now, and was scored once
    assert [f.parent.parent.name for f in scored].count("a-blocked") == 1
    assert runs["a-blocked"].read_report(runs["a-blocked"].report_path(3)).step == 3


def test_compare_prints_intervals_and_pairs_two_drafters(world, tmp_path, capsys):
    """`score` and `compare` print every number as `mean [lo, hi]`; `compare` of two drafters'
    reports (not only against the baseline) gives the paired interval of their difference and
    a verdict."""
    from dflash_callbacks import DFlashDrafter, save_drafter

    assert cli_main(score_args(world, **{"--json": tmp_path / "a.json", "--topk": "2"})) == 0
    out = capsys.readouterr().out
    assert "[95% interval] over 3 tasks" in out and re.search(r"\| \*\*mean\*\* \| \d\.\d\d \[\d\.\d\d, \d\.\d\d\] \|", out)
    other = DFlashDrafter(world.config)  # another drafter: a fresh one
    other.reset_parameters(std=0.3)
    save_drafter(tmp_path / "other", world.config, other.state_dict())
    assert cli_main(score_args(world, **{"--drafter": tmp_path / "other", "--json": tmp_path / "b.json",
                                         "--topk": "2"})) == 0
    capsys.readouterr()
    assert cli_main(["compare", str(tmp_path / "b.json"), str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    ours, theirs = (EvalReport.load(tmp_path / name) for name in ("b.json", "a.json"))
    paired = paired_comparison(ours, theirs)["vanilla/live"]["mean"]
    assert f"| {paired.delta.show(sign=True)} | {paired.ratio.show(percent=True)} |" in out
    assert f"vanilla live: {paired.ratio.show(percent=True)} of {theirs.drafter}, {paired.says('it')}" in out


def test_compare_refuses_methods_that_differ_unless_force_which_says_what_it_drops(world, tmp_path, capsys):
    """A method scored on one side only used to drop its columns silently, exit 0."""
    assert cli_main(score_args(world, **{"--json": tmp_path / "a.json", "--topk": "2"})) == 0
    assert cli_main(score_args(world, **{"--json": tmp_path / "fewer.json"})) == 0
    capsys.readouterr()
    fails(["compare", str(tmp_path / "fewer.json"), str(tmp_path / "a.json")], capsys,
          f"refusing to compare: the methods differ (top@2 only in {tmp_path / 'a.json'})", "use --force")
    assert cli_main(["compare", str(tmp_path / "fewer.json"), str(tmp_path / "a.json"), "--force"]) == 0
    captured = capsys.readouterr()
    assert "warning: dropping top@2: the table shows the methods both score" in captured.err
    assert "top@2" not in captured.out and "ddtree@4" in captured.out

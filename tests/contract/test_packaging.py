"""The wheel ships every module, conf/ (one copy, mapped by the build) and the toy assets, and an
installed package finds its defaults and the coding10 task set there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
from suite_paths import REPO

from dflash_callbacks.scoring.report import EvalReport



def test_the_wheel_ships_conf_and_an_install_finds_it(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("dflash_callbacks-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n for n in names if n.startswith("dflash_callbacks/conf/"))
    assert shipped == sorted(f"dflash_callbacks/conf/{p.relative_to(REPO / 'conf')}"
                             for p in (REPO / "conf").rglob("*.yaml"))
    assert "dflash_callbacks/demos/toy/assets/target/model.safetensors" in names
    assert "dflash_callbacks/py.typed" in names  # PEP 561: a user's mypy reads the typed settings of an install
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "dflash_callbacks").rglob("*.py"))
    assert [m for m in modules if m not in names] == []  # every subpackage ships (the engine, the watcher)
    assert not any(n.startswith(("tests/", "tools/", "conf/")) for n in names)

    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                              str(tmp_path / "site"), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    probe = ("import dflash_callbacks, json; from dflash_callbacks.config_files import CONF_DIR; "
             "from dflash_callbacks.cache.tasks import load_tasks; "
             "print(json.dumps([dflash_callbacks.__file__, str(CONF_DIR), len(load_tasks('coding10'))]))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert run.returncode == 0, run.stderr
    module, conf, tasks = json.loads(run.stdout)
    assert module.startswith(str(tmp_path / "site")) and conf == str(tmp_path / "site" / "dflash_callbacks" / "conf")
    assert tasks == 10


def test_the_engine_and_the_plain_loop_import_no_training_framework():
    """Only the adapters import the frameworks they adapt: the engine, the plain-loop evaluator, the
    scoring service (the process worker's import path), the watchers and the `score`, `compare` and
    `watch` commands load neither Lightning nor the transformers Trainer (the drafter keeps its
    transformers building blocks)."""
    code = ("import sys; import dflash_callbacks.engine, dflash_callbacks.loop, dflash_callbacks.scoring.service, "
            "dflash_callbacks.watch.checkpoint_watcher, dflash_callbacks.watch.runs, dflash_callbacks.engine.runners, "
            "dflash_callbacks.engine.eval_engine, dflash_callbacks.cli.score, dflash_callbacks.cli.watch; "
            "from dflash_callbacks import DrafterEvaluator; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning') "
            "or m in ('transformers.trainer', 'transformers.trainer_callback')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


HELPS = [["--help"]] + [[command, "--help"] for command in ("demo", "extract", "score", "compare", "watch", "plot")]
HEAVY = ("torch", "transformers", "lightning", "wandb")
ANSWER = ("import sys, time; started = time.perf_counter(); from dflash_callbacks.cli import main\n"
          "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
          f"print(code, round(time.perf_counter() - started, 2), sorted({{m.split('.')[0] for m in sys.modules}} & "
          f"set({HEAVY!r})))")


def answered(args: list[str], cwd=REPO) -> tuple[str, float, str, str]:
    """(the exit status, the seconds from import to answer, the heavy packages imported, stderr) of the CLI given
    `args`, in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", ANSWER, *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd)
    code, seconds, imported = done.stdout.strip().splitlines()[-1].split(" ", 2)
    return code, float(seconds), imported, done.stderr


@pytest.mark.parametrize("argv", HELPS, ids=lambda argv: " ".join(argv))
def test_every_help_and_every_refused_argument_answers_before_torch_loads(argv):
    """`--help` of the command and of each subcommand, and an argument the CLI refuses (a demo monitor it
    does not score, a watch given neither folder), answer from the settings alone: no torch, no
    transformers, no Lightning, no W&B imported (their imports alone take seconds on 2 cores)."""
    for args in (argv, ["demo", "stop.monitor=ddtree@16/live"] if argv == ["demo", "--help"] else None,
                 ["watch", "--cache", "c", "--target", "t"] if argv == ["watch", "--help"] else None):
        if args is None:
            continue
        exit_code, _, imported, err = answered(args)
        assert exit_code == ("0" if args == argv else "2"), err
        assert imported == "[]", (args, imported)


TOY = REPO / "dflash_callbacks" / "demos" / "toy" / "assets"  # a real drafter (block 8) and target folder


def refused_values(tmp_path) -> list[tuple[list, list[str]]]:
    """(arguments, words of each line that refuses them): a value of each kind the CLI checks without torch,
    beside folders that are there (so that the value is the only problem)."""
    run = tmp_path / "run"
    run.mkdir()
    report = EvalReport(drafter="d", cache={"path": "x", "fingerprint": "f"}, block_size=8,
                        tasks={"t": {m: {"dense": 1.5, "live": 1.5, "curve": []} for m in ("vanilla", "ddtree@8")}},
                        step=10)
    (run / "results.jsonl").write_text(json.dumps(report.to_dict()) + "\n")
    (tmp_path / "runs" / "dflash" / "r1").mkdir(parents=True)  # the demo's runs/demo, given for runs/demo/dflash
    (tmp_path / "runs" / "dflash" / "r1" / "run.json").write_text("{}")
    score = ["score", "--drafter", TOY / "baseline", "--cache", TOY / "target", "--target", TOY / "target"]
    watch = ["watch", "--checkpoints", tmp_path, "--cache", TOY / "target", "--target", TOY / "target",
             "--baseline", TOY / "baseline"]
    return [
        ([*score, "--attention", "vlm"], ["did you mean 'vllm'?"]),
        ([*score, "--attentions", "trained,sglng"], ["did you mean 'sglang'?"]),
        ([*score, "--block-sizes", "4", "--block-size", "4"], ["4 is already the run's block"]),
        ([*score, "--block-sizes", "1"], ["block_sizes must be a list of integers >= 2"]),
        ([*score, "--dtype", "bf16"], ["dtype must be one of"]),
        ([*score, "--aggregate", "densee"], ["did you mean 'dense'?"]),
        ([*score, "--budgets", "0"], ["ddtree_budgets must be a list of integers >= 1"]),
        (["score", "--drafter", tmp_path / "x", "--cache", tmp_path / "y", "--target", tmp_path / "z"],
         ["--drafter", "--cache", "--target"]),
        ([*watch, "--monitor", "ddtree@16/live"], ["did you mean 'ddtree@8/live'?"]),
        ([*watch, "--max-steps", "0"], ["--max-steps must be an integer >= 1"]),
        ([*watch, "--tensorboard", tmp_path / "tb", "--mlflow-experiment", "x"],
         ["--mlflow-experiment and --mlflow-run-id need --mlflow-uri"]),
        (["watch", "--dir", tmp_path, "--once", "--cache", TOY / "target", "--target", TOY / "target"],
         ["holds no run folder"]),
        (["plot", run, "--monitor", "ddtree@16/live"], ["did you mean 'ddtree@8/live'?"]),
        (["plot", run, "--patience", "0"], ["patience must be an integer >= 1"]),
        (["plot", tmp_path / "runs"], [f"holds none; did you mean {tmp_path / 'runs' / 'dflash'}?"]),
        (["extract", "--target", TOY / "target", "--out", tmp_path / "c", "--layer-ids", "1", "--tasks", "coding11"],
         ["did you mean 'coding10'?"]),
        (["extract", "--target", TOY / "target", "--out", tmp_path / "c", "--layer-ids", "1", "--top-p", "2"],
         ["top_p must be a number in (0, 1]"]),
        (["compare", run / "results.jsonl", tmp_path / "nope.json"], ["nope.json"]),
        (["demo", "eval.scoring.attention=vlm"], ["did you mean 'vllm'?"]),
        (["scroe"], ["did you mean 'score'?"]),
    ]


def test_every_refused_value_answers_before_torch_loads_in_one_line(tmp_path):
    """A misspelt attention rule, a block size the run is scored at already or under 2, a monitor the run does not
    score, a task set, a flag's choice, a sampling setting: each is refused in one line naming the
    one meant where one is close, exit status 2, before torch, transformers, Lightning or W&B load (they cost 10 to
    20 s on an idle machine, 2 minutes under load). How long each took is printed (docs/commands.md: under 2 s on
    an idle 2-core machine); the bound asserted here is loose, for a machine shared with other jobs."""
    for args, words in refused_values(tmp_path):
        exit_code, seconds, imported, err = answered(args)
        print(f"{seconds:5.2f} s  dflash-callbacks {' '.join(map(str, args))}")
        assert exit_code == "2" and imported == "[]", (args, imported, err)
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == len(words) and all(w in line for w, line in zip(words, lines)), (args, err)
        assert "Traceback" not in err and seconds < 20, (args, seconds, err)

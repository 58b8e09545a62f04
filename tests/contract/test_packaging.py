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
            "dflash_callbacks.watch.checkpoints, dflash_callbacks.watch.runs, dflash_callbacks.engine.runners, "
            "dflash_callbacks.engine.evaluator, dflash_callbacks.cli.score, dflash_callbacks.cli.watch; "
            "from dflash_callbacks import DrafterEvaluator; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning') "
            "or m in ('transformers.trainer', 'transformers.trainer_callback')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


HELPS = [["--help"]] + [[command, "--help"] for command in ("demo", "extract", "score", "compare", "watch", "plot")]


@pytest.mark.parametrize("argv", HELPS, ids=lambda argv: " ".join(argv))
def test_every_help_and_every_refused_argument_answers_before_torch_loads(argv):
    """`--help` of the command and of each subcommand, and an argument the CLI refuses (a demo monitor it
    does not score, a watch given neither folder), answer from the settings alone: no torch, no
    transformers, no Lightning, no W&B imported (their imports alone take seconds on 2 cores)."""
    heavy = ("torch", "transformers", "lightning", "wandb")
    code = ("import sys; from dflash_callbacks.cli import main\n"
            "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            f"print(code, sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))")
    for args in (argv, ["demo", "stop.monitor=ddtree@16/live"] if argv == ["demo", "--help"] else None,
                 ["watch", "--cache", "c", "--target", "t"] if argv == ["watch", "--help"] else None):
        if args is None:
            continue
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                              cwd=REPO)
        exit_code, imported = done.stdout.strip().splitlines()[-1].split(" ", 1)
        assert exit_code == ("0" if args == argv else "2"), done.stderr
        assert imported == "[]", (args, imported)

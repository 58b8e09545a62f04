"""The README's attach snippet is the example script, and the examples run as written; its Commands
section names every flag; its Guarantees table cites tests that exist."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_attach_snippet_is_the_example_script():
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"## Attach to an existing run.*?```python\n(.*?)```", readme, flags=re.S).group(1)
    example = (REPO / "examples" / "attach_to_existing_run.py").read_text()
    code = example.split('"""', 2)[2].strip()
    assert code.startswith(snippet.strip()), "the README's snippet and examples/attach_to_existing_run.py differ"


@pytest.fixture(scope="module")
def toy_world_folder(tmp_path_factory) -> Path:
    """The examples' toy world (`toy_world` with its defaults), built once for every example here."""
    from dflash_callbacks.demos.toy import toy_world

    folder = tmp_path_factory.mktemp("examples") / "world"
    toy_world(folder)
    return folder


def run_example(name: str, cwd: Path, world: Path) -> subprocess.CompletedProcess:
    """examples/<name>.py as a user runs it, in a fresh folder whose runs/<example>/world is the toy world
    already built (the script finds it and builds nothing)."""
    example = {"attach_to_existing_run": "attach-example", "hf_trainer": "hf-example"}[name]
    (cwd / "runs" / example).mkdir(parents=True)
    (cwd / "runs" / example / "world").symlink_to(world, target_is_directory=True)
    run = subprocess.run([sys.executable, str(REPO / "examples" / f"{name}.py")], cwd=cwd, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "WANDB_MODE": "offline"})
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def test_the_example_runs_as_written(tmp_path, toy_world_folder, home_sandbox):
    """As a user runs it; its run folder lands under runs/attach-example/dflash/, and its baseline
    report in the session's sandbox (conftest.py), never in the real home folder."""
    started = time.time()
    run = run_example("attach_to_existing_run", tmp_path, toy_world_folder)
    assert "3 reports in runs/attach-example/dflash/" in run.stdout
    (folder,) = (tmp_path / "runs" / "attach-example" / "dflash").iterdir()
    assert len((folder / "results.jsonl").read_text().splitlines()) == 3
    cached = [path.name for path in (home_sandbox / "cache" / "dflash_callbacks" / "baselines").glob("baseline-*.json")]
    real = Path.home() / ".cache" / "dflash_callbacks" / "baselines"
    assert cached and not [name for name in cached if (real / name).exists() and (real / name).stat().st_mtime >= started]


def test_the_hf_trainer_example_runs_as_written(tmp_path, toy_world_folder):
    """examples/hf_trainer.py: a transformers Trainer with the callback; its run folder lands under
    <output_dir>/dflash/ with a report every 20 of its 60 steps."""
    run = run_example("hf_trainer", tmp_path, toy_world_folder)
    assert "3 reports in runs/hf-example/dflash/" in run.stdout
    (folder,) = (tmp_path / "runs" / "hf-example" / "dflash").iterdir()
    assert [json.loads(line)["step"] for line in (folder / "results.jsonl").read_text().splitlines()] == [20, 40, 60]


def test_every_cli_flag_is_in_the_commands_section():
    """A flag a command takes and the README's Commands section does not name is a flag no newcomer finds."""
    from dflash_callbacks.cli import build_parser

    readme = (REPO / "README.md").read_text()
    commands = re.search(r"\n## Commands\n(.*?)\n## ", readme, flags=re.S).group(1)
    subparsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    missing = [f"{name} {flag}" for name, sub in subparsers.items() for action in sub._actions
               for flag in action.option_strings if flag.startswith("--") and flag not in ("--help", "--debug")
               and not re.search(rf"`{flag}\b", commands)]
    assert not missing, f"flags not in the README's Commands section: {missing}"


def test_every_guarantee_names_tests_that_exist():
    """Each row of the Guarantees table cites a test (`file.py::name`, `::name` in the file cited
    before it, a `name_*` prefix, or a whole file); each one must be there."""
    import ast

    readme = (REPO / "README.md").read_text()
    table = re.search(r"\n## Guarantees\n.*?\n(\| guarantee .*?)\n\n", readme, flags=re.S).group(1)
    tests = {path.name: {node.name for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
             for path in (REPO / "tests").glob("test_*.py")}
    missing = []
    for row in table.splitlines()[2:]:
        cited = re.findall(r"`([^`]+)`", row.rsplit(" | ", 1)[1])
        assert cited, f"a guarantee cites no test: {row}"
        file = None
        for ref in cited:
            if ref == "tests/runs.py":  # the audit every fault test runs (conftest.py fails the session)
                continue
            name_of_file, _, name = ref.partition("::")
            file = name_of_file or file
            names = tests.get(file, set())
            found = (file in tests if not name else any(t.startswith(name[:-1]) for t in names) if name.endswith("*")
                     else name in names)
            if not found:
                missing.append(f"{file}::{name}" if name else ref)
    assert not missing, f"the Guarantees table cites tests that do not exist: {missing}"

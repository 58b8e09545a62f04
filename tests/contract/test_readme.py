"""The README and the reference in docs/ hold to the code: each attach snippet is the start of its
example script, and the examples run as written; the quick start's test command is `.ci/run`'s;
every command line shown parses; docs/commands.md names every flag; every test the docs cite
(the Guarantees table's above all) exists; every link between them leads somewhere."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from suite_paths import REPO, TESTS

README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
TIERS = ("unit", "contract", "faults")  # the folders of tests/ that hold tests
CITATION = re.compile(r"(((tests/)?[\w/-]*test_\w+\.py)?::test_\w+|(tests/)?[\w/-]*test_\w+\.py$)")  # a test or its file


@pytest.mark.parametrize("heading, example", [
    ("### Lightning", "attach_to_existing_run"),
    ("### A plain PyTorch loop", "plain_loop"),
    ("### The transformers Trainer", "hf_trainer"),
])
def test_each_attach_snippet_is_the_start_of_its_example_script(heading, example):
    snippet = re.search(rf"\n{re.escape(heading)}\n.*?```python\n(.*?)```", README.read_text(), flags=re.S).group(1)
    code = (REPO / "examples" / f"{example}.py").read_text().split('"""', 2)[2].strip()
    assert code.startswith(snippet.strip()), f"the README's snippet under {heading!r} and examples/{example}.py differ"


def test_the_quick_starts_test_command_is_the_one_ci_runs():
    command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert command.startswith("pip install") and command in README.read_text().split("\n## ")[1]


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
    example = {"attach_to_existing_run": "attach-example", "hf_trainer": "hf-example",
               "plain_loop": "plain-loop-example"}[name]
    (cwd / "runs" / example).mkdir(parents=True)
    (cwd / "runs" / example / "world").symlink_to(world, target_is_directory=True)
    run = subprocess.run([sys.executable, str(REPO / "examples" / f"{name}.py")], cwd=cwd, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "WANDB_MODE": "offline"})
    assert run.returncode == 0, run.stderr[-4000:]
    return run


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_plain_loop_example_runs_as_written(tmp_path, toy_world_folder):
    """examples/plain_loop.py: DrafterEvaluator in a plain loop; its run folder lands under its dirpath
    with a report every 50 of its 150 steps."""
    run = run_example("plain_loop", tmp_path, toy_world_folder)
    assert "3 reports in runs/plain-loop-example/eval/" in run.stdout
    (folder,) = (tmp_path / "runs" / "plain-loop-example" / "eval").iterdir()
    assert [json.loads(line)["step"] for line in (folder / "results.jsonl").read_text().splitlines()] == [50, 100, 150]


@pytest.mark.slow
def test_the_hf_trainer_example_runs_as_written(tmp_path, toy_world_folder):
    """examples/hf_trainer.py: a transformers Trainer with the callback; its run folder lands under
    <output_dir>/dflash/ with a report every 20 of its 60 steps."""
    run = run_example("hf_trainer", tmp_path, toy_world_folder)
    assert "3 reports in runs/hf-example/dflash/" in run.stdout
    (folder,) = (tmp_path / "runs" / "hf-example" / "dflash").iterdir()
    assert [json.loads(line)["step"] for line in (folder / "results.jsonl").read_text().splitlines()] == [20, 40, 60]


def command_lines(text: str) -> list[str]:
    """Each `dflash-callbacks ...` command of the ```bash blocks in `text`, continuation lines joined,
    comments dropped, one command of `a && b` each."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split(" # ")[0].split("&&"):
                if part.strip().startswith("dflash-callbacks"):
                    commands.append(part.strip())
    return commands


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_shown_parses(page):
    """A command a reader copies takes the flags it shows, and every argument it needs: the CLI's own
    parser reads each one (a `<placeholder>` and a `$VARIABLE` are taken as written)."""
    from dflash_callbacks.cli import build_parser

    commands = command_lines(page.read_text())
    bad = []
    for command in commands:
        argv = shlex.split(re.sub(r"<[^>]*>", "X", command))[1:]
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            bad.append(command)
    assert not bad, f"commands in {page.name} the CLI refuses: {bad}"
    assert commands or page.parent == DOCS


def test_every_cli_flag_is_in_the_commands_reference():
    """A flag a command takes and docs/commands.md does not name is a flag no newcomer finds."""
    from dflash_callbacks.cli import build_parser

    commands = (DOCS / "commands.md").read_text()
    subparsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    missing = [f"{name} {flag}" for name, sub in subparsers.items() for action in sub._actions
               for flag in action.option_strings if flag.startswith("--") and flag not in ("--help", "--debug")
               and not re.search(rf"`{flag}\b", commands)]
    assert not missing, f"flags not in docs/commands.md: {missing}"


def suite_tests() -> dict[str, set[str]]:
    """The test functions of each test file of the suite's tiers, by its path under tests/ (`unit/test_x.py`)."""
    return {path.relative_to(TESTS).as_posix(): {node.name for node in ast.walk(ast.parse(path.read_text()))
                                                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
            for tier in TIERS for path in (TESTS / tier).glob("test_*.py")}


def missing_tests(cited: list[str], tests: dict[str, set[str]], file: str | None = None) -> list[str]:
    """The citations among `cited` (`tier/file.py::name` by its path under tests/, with `tests/` or without,
    `::name` in the file cited before it, a `name_*` prefix, `name[params]`, or a whole file) that name no
    test."""
    missing = []
    for ref in cited:
        if ref == "tests/support/runs.py":  # the audit every fault test runs (conftest.py fails the session)
            continue
        name_of_file, _, name = ref.partition("::")
        file = name_of_file.removeprefix("tests/") or file
        name = name.split("[")[0]
        names = tests.get(file, set())
        found = (file in tests if not name else any(t.startswith(name[:-1]) for t in names) if name.endswith("*")
                 else name in names)
        if not found:
            missing.append(f"{file}::{name}" if name else ref)
    return missing


def test_every_guarantee_names_tests_that_exist():
    """Each row of the Guarantees table cites a test (`tier/file.py::name`, `::name` in the file cited
    before it, a `name_*` prefix, or a whole file); each one must be there."""
    table = re.search(r"\n(\| guarantee .*?)\n\n", (DOCS / "guarantees.md").read_text(), flags=re.S).group(1)
    tests, missing = suite_tests(), []
    for row in table.splitlines()[2:]:
        cited = re.findall(r"`([^`]+)`", row.rsplit(" | ", 1)[1])
        assert cited, f"a guarantee cites no test: {row}"
        missing += missing_tests(cited, tests)
    assert not missing, f"the Guarantees table cites tests that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_test_a_page_cites_exists(page):
    """Outside the Guarantees table too: every test file and `file.py::name` a page names is a test (a file
    named without its tier's folder is not one)."""
    tests = suite_tests()
    cited = [ref for ref in re.findall(r"`([^`]+)`", page.read_text()) if CITATION.match(ref)]
    missing, file = [], None
    for ref in cited:
        file = ref.split("::")[0] or file
        missing += missing_tests([ref if ref.split("::")[0] else f"{file}{ref}"], tests)
    assert not missing, f"{page.name} cites tests that do not exist: {missing}"


def anchor(heading: str) -> str:
    """A heading's link anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_between_the_pages_leads_somewhere(page):
    """Each relative link names a file that exists and, after `#`, one of its headings."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif fragment and fragment not in {anchor(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)}:
            broken.append(target)
    assert not broken, f"links in {page.name} that lead nowhere: {broken}"


def test_the_readme_links_every_reference_page():
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README.read_text()))
    assert linked == {path.name for path in DOCS.glob("*.md")}

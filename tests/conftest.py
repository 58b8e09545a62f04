import atexit
import os
import sys
import shutil
import tempfile
from pathlib import Path

# No test writes to the home folder. Every place a tool writes there by default points into
# this session's own folder instead: this package's baseline cache ($XDG_CACHE_HOME), W&B's
# cache, settings, data and run folders, matplotlib's font cache and settings, Hugging Face's
# cache, Triton's kernel cache, CUDA's JIT cache. Set before anything is imported (matplotlib
# and huggingface_hub read theirs at import); subprocesses inherit it. Removed when pytest exits.
HOME_SANDBOX = Path(tempfile.mkdtemp(prefix="dflash-tests-home-"))
atexit.register(lambda pid=os.getpid(): os.getpid() == pid and shutil.rmtree(HOME_SANDBOX, ignore_errors=True))  # not a fork's
HOME_SETTINGS = {
    "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config", "XDG_DATA_HOME": "data", "XDG_STATE_HOME": "state",
    "WANDB_DIR": "wandb-runs", "WANDB_CACHE_DIR": "cache/wandb", "WANDB_CONFIG_DIR": "config/wandb",
    "WANDB_DATA_DIR": "data/wandb", "MPLCONFIGDIR": "config/matplotlib", "HF_HOME": "cache/huggingface",
    "TRITON_HOME": "triton", "CUDA_CACHE_PATH": "cache/nv",
}
os.environ.update({name: str(HOME_SANDBOX / folder) for name, folder in HOME_SETTINGS.items()})

# The suite's helpers (tests/support) and the training scripts some tests share pieces of (tests/scripts)
# import as top-level modules from every tier (tests/unit, tests/contract, tests/faults).
for folder in ("support", "scripts"):
    sys.path.insert(0, str(Path(__file__).resolve().parent / folder))

import pytest  # noqa: E402
import torch  # noqa: E402

from fixtures_cache import *  # noqa: E402,F401,F403  (toy world fixtures)
from toy_families import *  # noqa: E402,F401,F403  (test-only toy baselines of the other families)
from suite_paths import FIXTURES  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Every model in the tests is tiny: one intra-op thread is much faster than two on 2 shared cores.
torch.set_num_threads(1)

ZLAB_TINY = FIXTURES / "zlab-tiny-full"


@pytest.fixture(scope="session", autouse=True)
def home_sandbox() -> Path:
    """The session's stand-in for the home folder: every place in HOME_SETTINGS points into it."""
    assert all(os.environ[name] == str(HOME_SANDBOX / folder) for name, folder in HOME_SETTINGS.items())
    return HOME_SANDBOX


@pytest.fixture(autouse=True)
def fresh_wandb():
    """W&B keeps one setup per process (its service, its settings: the first run's folder) and hands the
    service to every subprocess through WANDB_SERVICE: each test starts from none, whatever ran before."""
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
        os.environ.pop("WANDB_SERVICE", None)


@pytest.fixture(scope="session")
def zlab_tiny() -> Path:
    """A tiny drafter in the published layout, made by the reference implementation (see fixtures/README.md)."""
    return ZLAB_TINY


def untracked_files() -> set[str] | None:
    """The checkout's files git neither tracks nor ignores (None: not a git checkout)."""
    import subprocess

    from suite_paths import REPO

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {line[3:] for line in out.stdout.splitlines() if line.startswith("??")} if out.returncode == 0 else None


UNTRACKED_AT_START: set[str] | None = None


def pytest_sessionstart(session):
    global UNTRACKED_AT_START
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        UNTRACKED_AT_START = untracked_files()


def pytest_sessionfinish(session, exitstatus):
    """Reports lost, duplicated or mismatched across every audited run fail the session, and so does a file
    the suite left in the checkout (a test writes under its tmp_path). Under pytest-xdist each worker hands
    its audit counts to the controller, which adds them up."""
    from runs import AUDIT

    if hasattr(session.config, "workeroutput"):  # an xdist worker
        session.config.workeroutput["dflash_audit"] = dict(AUDIT)
        return
    if AUDIT["lost"] or AUDIT["duplicated"] or AUDIT["mismatched"]:
        session.exitstatus = 1
    now = untracked_files()
    left = sorted(now - UNTRACKED_AT_START) if now is not None and UNTRACKED_AT_START is not None else []
    if left:
        session.config.dflash_left = left
        session.exitstatus = 1


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller of an xdist run: a finished worker's audit counts join the session's."""
    from runs import AUDIT

    for key, value in getattr(node, "workeroutput", {}).get("dflash_audit", {}).items():
        AUDIT[key] += value


def pytest_terminal_summary(terminalreporter):
    from runs import AUDIT

    left = getattr(terminalreporter.config, "dflash_left", None)
    if left:
        terminalreporter.write_line(f"the suite left {len(left)} file(s) in the checkout (write under tmp_path): "
                                    + ", ".join(left[:10]), red=True)

    if AUDIT["runs"]:
        terminalreporter.write_line(
            f"dflash audit: {AUDIT['runs']} run folders, {AUDIT['reports']} reports: {AUDIT['lost']} lost, "
            f"{AUDIT['duplicated']} duplicated, {AUDIT['mismatched']} mismatched"
        )

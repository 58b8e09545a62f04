import os
from pathlib import Path

import pytest
import torch

from fixtures_cache import *  # noqa: F401,F403  (toy world fixtures)

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Every model in the tests is tiny: one intra-op thread is much faster than two on 2 shared cores.
torch.set_num_threads(1)

ZLAB_TINY = Path(__file__).resolve().parent / "fixtures" / "zlab-tiny-full"


@pytest.fixture(scope="session")
def zlab_tiny() -> Path:
    """A tiny drafter in the published layout, made by the reference implementation (see fixtures/README.md)."""
    return ZLAB_TINY


def pytest_sessionfinish(session, exitstatus):
    """Reports lost, duplicated or mismatched across every audited run fail the session."""
    from runs import AUDIT

    if AUDIT["lost"] or AUDIT["duplicated"] or AUDIT["mismatched"]:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    from runs import AUDIT

    if AUDIT["runs"]:
        terminalreporter.write_line(
            f"dflash audit: {AUDIT['runs']} run folders, {AUDIT['reports']} reports: {AUDIT['lost']} lost, "
            f"{AUDIT['duplicated']} duplicated, {AUDIT['mismatched']} mismatched"
        )

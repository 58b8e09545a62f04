import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
ZLAB_TINY = SHARED / "fixtures" / "zlab-tiny-full"


@pytest.fixture(scope="session")
def zlab_tiny() -> Path:
    if not ZLAB_TINY.is_dir():
        pytest.fail(f"fixture folder {ZLAB_TINY} is missing: shared/ must sit beside the repository")
    return ZLAB_TINY

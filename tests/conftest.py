import os
from pathlib import Path

import pytest
import torch

from fixtures_cache import *  # noqa: F401,F403  (toy world fixtures)

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Every model in the tests is tiny: one intra-op thread is much faster than two on 2 shared cores.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
ZLAB_TINY = SHARED / "fixtures" / "zlab-tiny-full"


@pytest.fixture(scope="session")
def zlab_tiny() -> Path:
    if not ZLAB_TINY.is_dir():
        pytest.fail(f"fixture folder {ZLAB_TINY} is missing: shared/ must sit beside the repository")
    return ZLAB_TINY

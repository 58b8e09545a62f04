"""No test writes outside its tmp folders: every place a tool writes in the home folder by default
points into the session's sandbox (conftest.py), and a run of every writer leaves a home folder empty."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

from conftest import HOME_SETTINGS
from synthetic import build_world


def test_every_place_a_tool_writes_in_the_home_folder_points_into_the_sandbox(home_sandbox):
    import huggingface_hub.constants
    import matplotlib
    import wandb.env
    from triton import knobs

    from dflash_callbacks.scoring.service import default_baseline_cache_dir

    assert {name: Path(os.environ[name]) for name in HOME_SETTINGS} == \
        {name: home_sandbox / folder for name, folder in HOME_SETTINGS.items()}
    places = {"baseline cache": default_baseline_cache_dir(), "matplotlib settings": matplotlib.get_configdir(),
              "matplotlib cache": matplotlib.get_cachedir(), "huggingface": huggingface_hub.constants.HF_HOME,
              "wandb cache": wandb.env.get_cache_dir(), "wandb data": wandb.env.get_data_dir(),
              "wandb runs": wandb.env.get_dir(), "triton": knobs.cache.dir}
    outside = {what: place for what, place in places.items() if not Path(place).is_relative_to(home_sandbox)}
    assert not outside, f"these write outside {home_sandbox}: {outside}"


WRITERS = """
import sys
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import wandb

from dflash_callbacks.cli import main

out = Path(sys.argv[1])
plt.plot([1, 2], [3, 4])
plt.savefig(out / "plot.png")
run = wandb.init(mode="offline", dir=str(out), project="isolation")
run.log({"tau": 1.5})
run.finish()
# the baseline's report, cached where the callbacks and the CLI cache it by default
sys.exit(main(["score", "--drafter", sys.argv[2], "--baseline", sys.argv[2], "--cache", sys.argv[3],
               "--target", sys.argv[4], "--budgets", "4", "--device", "cpu"]))
"""


def test_a_run_of_every_writer_leaves_the_home_folder_empty(tmp_path, home_sandbox):
    """A plot, an offline W&B run and a scored baseline, with HOME an empty folder: nothing lands
    there, and the baseline's report lands in the sandbox's cache."""
    world = build_world(tmp_path / "world")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONUSERBASE": site.getuserbase()}  # packages installed --user stay found
    run = subprocess.run([sys.executable, "-c", WRITERS, str(tmp_path), str(world.baseline), str(world.cache),
                          str(world.target)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert (tmp_path / "plot.png").is_file() and list((tmp_path / "wandb").glob("offline-run-*"))
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []
    assert list((home_sandbox / "cache" / "dflash_callbacks" / "baselines").glob("baseline-*.json"))

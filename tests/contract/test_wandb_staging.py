"""An offline W&B run leaves no growing pile in W&B's data folder (~/.local/share/wandb/artifacts/
staging): the copies W&B keeps of the tables and plots each report logs go into the run's own folder,
where `wandb sync` reads them, and which goes with the run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from dflash_callbacks import DrafterEvaluator

from loops import SCORING, plain_fit

from train_run import shared_world, world_paths


def staged(folder: Path) -> list[Path]:
    return [p for p in folder.glob("**/artifacts/staging/*") if p.is_file()]


def test_an_offline_run_leaves_no_table_copies_in_wandbs_data_folder(tmp_path_factory, tmp_path, monkeypatch,
                                                                     home_sandbox):
    import wandb

    world = SimpleNamespace(**world_paths(shared_world(tmp_path_factory.getbasetemp() / "reliability-world")))
    home_before = staged(home_sandbox)
    data = tmp_path / "home-data"  # this test's own: what it finds there is its own run's
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    monkeypatch.setenv("WANDB_DATA_DIR", str(data / "wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = wandb.init(project="dflash-staging", dir=str(tmp_path / "wandb-runs"))
    evaluator = DrafterEvaluator(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=2,
                                 scoring=SCORING, dirpath=tmp_path / "d", baseline_cache_dir=tmp_path / "bc",
                                 verbose=False)
    plain_fit(world, 4, evaluator)
    folder = Path(run.settings.sync_dir)
    run.finish()
    assert len(evaluator.reports) == 2
    assert staged(data) == [] and staged(home_sandbox) == home_before
    # each report's table, curves and bands (1 + 2 methods + 2 methods), each copied for a later `wandb sync`
    assert len(staged(folder)) >= 2 * 5
    assert (Path(wandb.env.get_data_dir()) == data / "wandb")  # the setting is the user's again


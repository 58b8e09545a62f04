"""The adapters' signatures a type checker sees: the settings object itself (`settings=`) or its fields as
keywords typed by `EvalFields` / `LightningEvalFields` / `StopFields`. Each is held to the settings' fields
(nothing written twice without a check), and mypy, on a user's script, reports a misspelled setting and a
setting of the wrong type."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from dflash_callbacks.callbacks.eval_callback import DrafterEvalCallback
from dflash_callbacks.callbacks.stopping import TrailingBaselineStop
from dflash_callbacks.engine.adapter import EvalAdapter
from dflash_callbacks.engine.stop import StopPolicy
from dflash_callbacks.hf import DrafterEvalTrainerCallback
from dflash_callbacks.loop import DrafterEvaluator
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.settings import (
    LIGHTNING_NAMES, EvalFields, EvalSettings, LightningEvalFields, StopFields, StopSettings,
)
from dflash_callbacks.watch.watch_settings import WatchSettings

from suite_paths import REPO

POSITIONAL = ["cache", "target", "baseline"]


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def keywords(adapter) -> type:
    """The TypedDict an adapter's **fields is unpacked from."""
    hint = typing.get_type_hints(adapter.__init__, include_extras=True)["fields"]
    (typed,) = typing.get_args(hint)
    return typed


@pytest.mark.parametrize("adapter", [DrafterEvalCallback, DrafterEvaluator, DrafterEvalTrainerCallback])
def test_each_adapters_parameters_are_the_settings_fields(adapter):
    """Positional cache, target, baseline, then `settings=`, then every other field as a typed keyword:
    together exactly EvalSettings' fields (Lightning's also under its own spelling of every_n_steps)."""
    params = inspect.signature(adapter.__init__).parameters
    assert list(params)[1:4] == POSITIONAL == names(EvalSettings)[: EvalSettings.POSITIONAL]
    assert params["settings"].kind is inspect.Parameter.KEYWORD_ONLY and params["settings"].default is None
    typed = keywords(adapter)
    assert typed is (LightningEvalFields if adapter is DrafterEvalCallback else EvalFields)
    assert POSITIONAL + list(EvalFields.__annotations__) == names(EvalSettings)
    assert set(LightningEvalFields.__annotations__) - set(EvalFields.__annotations__) == set(LIGHTNING_NAMES.values())
    assert not set(params) & set(EvalFields.__annotations__)  # each setting in one place: the TypedDict


@pytest.mark.parametrize("stop", [StopPolicy, TrailingBaselineStop])
def test_each_stops_keywords_are_the_stop_settings_fields(stop):
    assert list(StopFields.__annotations__) == names(StopSettings)
    assert keywords(stop) is StopFields
    assert list(inspect.signature(stop.__init__).parameters)[1] == "settings"


def test_a_settings_object_or_its_fields_build_the_same_settings(tmp_path):
    settings = EvalSettings(tmp_path / "c", tmp_path / "t", every_n_steps=7, verbose=False)
    given = DrafterEvaluator(settings=settings)
    assert given.settings is settings
    assert DrafterEvaluator(tmp_path / "c", tmp_path / "t", every_n_steps=7, verbose=False).settings == settings
    assert DrafterEvalCallback(tmp_path / "c", tmp_path / "t", every_n_train_steps=7, verbose=False).settings == settings
    with pytest.raises(TypeError, match=r"takes settings=EvalSettings\(...\) or its fields, not both"):
        DrafterEvaluator(settings=settings, every_n_steps=3)
    with pytest.raises(TypeError, match="did you mean every_n_steps"):
        DrafterEvaluator(tmp_path / "c", tmp_path / "t", every_n_stpes=3)  # type: ignore[call-arg]
    stop = StopSettings(monitor="vanilla/live", patience=4)
    assert StopPolicy(stop).settings is stop and StopPolicy("vanilla/live", patience=4).settings == stop


SCRIPT = '''
from pathlib import Path

from dflash_callbacks.callbacks.stopping import TrailingBaselineStop
from dflash_callbacks.loop import DrafterEvaluator
from dflash_callbacks.scoring.config import ScoringConfig
from dflash_callbacks.settings import EvalSettings
from dflash_callbacks.watch.watch_settings import WatchSettings

DrafterEvaluator("cache", "target", every_n_stpes=500)
TrailingBaselineStop(monitor="ddtree@8/live", patience="3")
DrafterEvaluator(settings=EvalSettings(Path("c"), Path("t")), stop=TrailingBaselineStop(patience=3))
DrafterEvaluator("cache", "target", runner="thread", every_n_steps=100, wait_timeout=60.0)
settings = EvalSettings("cache", "target", baseline="base.json", dirpath=Path("runs"), baseline_cache_dir="baselines")
folder: Path = settings.cache / "meta.json"
found: Path | None = settings.baseline
watch = WatchSettings(checkpoints="ckpt", cache="cache", target=Path("target"), scoring=ScoringConfig(),
                      out="out", tensorboard="tb", drafter_config=None)
place: Path = watch.checkpoints / watch.cache.name
reveal_type(watch.out)
WatchSettings(cache="cache", target="target", scoring=ScoringConfig())
'''

MYPY_INI = """[mypy]
follow_imports = silent
ignore_missing_imports = True
[mypy-torch.*,lightning.*,transformers.*,wandb.*,numpy.*,safetensors.*,omegaconf.*,matplotlib.*,triton.*,scipy.*,yaml.*,tqdm.*,accelerate.*]
follow_imports = skip
"""


def test_mypy_reports_a_misspelled_setting_and_a_setting_of_the_wrong_type(tmp_path):
    """Those two errors (and a WatchSettings without its checkpoints) and no other: every path setting of
    EvalSettings and WatchSettings takes a str (or os.PathLike) and is read back as a Path (one mypy run)."""
    pytest.importorskip("mypy", reason="mypy is in the [dev] extra")
    (tmp_path / "user.py").write_text(SCRIPT)
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    found = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
                            "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "--hide-error-context",
                            str(tmp_path / "user.py")], capture_output=True, text=True, timeout=300, cwd=REPO)
    errors = [line for line in found.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 3, found.stdout + found.stderr
    assert "user.py:10:" in errors[0] and '"every_n_stpes"' in errors[0], errors
    assert "user.py:11:" in errors[1] and '"patience"' in errors[1] and '"str"' in errors[1] and '"int"' in errors[1], errors
    assert "user.py:21:" in errors[2] and '"checkpoints"' in errors[2], errors  # a required path stays required
    assert 'user.py:20: note: Revealed type is "pathlib.Path | None"' in found.stdout, found.stdout


def test_a_path_setting_given_as_a_str_is_a_path(tmp_path):
    settings = EvalSettings(str(tmp_path / "c"), "t", baseline="b.json", dirpath=str(tmp_path / "runs"))
    assert (settings.cache, settings.target, settings.baseline) == (tmp_path / "c", Path("t"), Path("b.json"))
    assert settings.dirpath == tmp_path / "runs" and settings.baseline_cache_dir is None
    watch = WatchSettings(checkpoints=str(tmp_path), cache="c", target="t", scoring=ScoringConfig(), tensorboard="tb")
    assert watch.out_folder == tmp_path / "dflash-eval" and watch.tensorboard == Path("tb") and watch.out is None
    assert isinstance(watch.cache, Path) and isinstance(watch.target, Path)
    with pytest.raises(TypeError, match="checkpoints must be a path"):
        WatchSettings(checkpoints=3, cache="c", target="t", scoring=ScoringConfig())  # type: ignore[arg-type]


def test_every_adapter_shows_the_run_under_the_same_names():
    """`.run`, `.reports`, `.history`, `.metrics`, `.errors`, `.should_stop`, ...: one definition, `EvalAdapter`'s,
    which no adapter redefines."""
    shown = [n for n in vars(EvalAdapter) if not n.startswith("_")]
    assert {"run", "run_id", "reports", "baseline_report", "history", "metrics", "errors", "skipped", "should_stop",
            "stop_reason", "subscribe", "state_dict"} <= set(shown)
    for adapter in (DrafterEvalCallback, DrafterEvaluator, DrafterEvalTrainerCallback):
        assert issubclass(adapter, EvalAdapter)
        assert [n for n in shown if getattr(adapter, n) is not getattr(EvalAdapter, n)] == [], adapter.__name__

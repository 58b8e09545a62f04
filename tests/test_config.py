import pytest

from dflash_callbacks import DrafterEvalCallback, TrailingBaselineStop
from dflash_callbacks.config import CONF_DIR, CallbacksConfig, build_callbacks, load_config
from dflash_callbacks.demos.demo import DemoConfig

REQUIRED = ["eval.cache=/data/cache", "eval.target=/models/target"]


def test_default_yaml_with_overrides_builds_both_callbacks():
    cfg = load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml",
                      REQUIRED + ["eval.every_n_train_steps=200", "eval.scoring.ddtree_budgets=[4,16]", "stop.patience=5"])
    eval_cb, stop_cb = build_callbacks(cfg)
    assert isinstance(eval_cb, DrafterEvalCallback) and isinstance(stop_cb, TrailingBaselineStop)
    assert eval_cb.every_n_train_steps == 200 and eval_cb.scoring.ddtree_budgets == [4, 16]
    assert eval_cb.scoring.methods == ["vanilla", "ddtree@4", "ddtree@16"]
    assert stop_cb.patience == 5 and stop_cb.monitor == "ddtree@8/live"
    off = load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", REQUIRED + ["stop.enabled=false"])
    assert len(build_callbacks(off)) == 1


@pytest.mark.parametrize("override,message", [
    ("eval.bogus=1", "Key 'bogus' not in 'EvalConfig'"),
    ("eval.every_n_train_steps=abc", "could not be converted to Integer"),
    ("eval.scoring.ddtree_budgets=[0]", r"ddtree_budgets must be integers in \[1, 1024\]; got 0"),
    ("eval.scoring.max_rounds=0", "max_rounds must be an integer >= 1; got 0"),
])
def test_bad_values_are_refused_with_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", REQUIRED + [override])


def test_impossible_callback_values_fail_when_built():
    cfg = load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", REQUIRED + ["eval.every_n_train_steps=0"])
    with pytest.raises(ValueError, match="every_n_train_steps must be an integer >= 1; got 0"):
        build_callbacks(cfg)
    cfg = load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", REQUIRED + ["stop.action=halt"])
    with pytest.raises(ValueError, match="action"):
        build_callbacks(cfg)


def test_missing_required_keys_are_named():
    with pytest.raises(ValueError, match=r"leaves required keys unset: \['eval.cache', 'eval.target'\]"):
        load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", [])


def test_demo_config_overrides():
    cfg = load_config(DemoConfig, None, ["train.max_steps=30", "stop.patience=2", "wandb=disabled"])
    assert cfg.train.max_steps == 30 and cfg.stop.patience == 2 and cfg.wandb == "disabled"
    assert cfg.eval.scoring.ddtree_budgets == [4, 8]

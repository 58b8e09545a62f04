import dataclasses
import inspect
import re
import typing

import pytest
import yaml
from omegaconf import OmegaConf

from dflash_callbacks import (
    DrafterEarlyStopping, DrafterEvalCallback, DrafterEvalTrainerCallback, DrafterEvaluator, ScoringConfig,
    TrailingBaselineStop,
)
from dflash_callbacks.callbacks.schema import CallbacksConfig, EvalConfig, StopConfig, build_callbacks
from dflash_callbacks.config_files import CONF_DIR, load_config
from dflash_callbacks.settings import (
    LIGHTNING_NAMES, EvalSettings, LightningEvalFields, StopFields, StopSettings,
)
from dflash_callbacks.demos.settings import DEMO_YAML, DemoConfig, TrainConfig, demo_config

from suite_paths import REPO

REQUIRED = ["eval.cache=/data/cache", "eval.target=/models/target"]
CONFIGURATION = REPO / "docs" / "configuration.md"  # the reference's argument tables


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
    ("eval.bogus=1", r"^override 'eval.bogus=1': Key 'bogus' not in 'EvalConfig'"),
    ("eval.every_n_train_steps=abc", r"^override 'eval.every_n_train_steps=abc': .*could not be converted to Integer"),
    ("eval.scoring.ddtree_budgets=[0]", r"ddtree_budgets must be a list of integers >= 1; got 0 in \[0\]"),
    ("eval.scoring.max_rounds=0", "max_rounds must be None or an integer >= 1; got 0"),
    ("eval.scoring.ddtree_budgets=16", r"^override 'eval.scoring.ddtree_budgets=16': ddtree_budgets is a list: "
                                       r"write eval.scoring.ddtree_budgets=\[16\]$"),
    ("eval.scoring.tasks=a,b", r"tasks is a list: write eval.scoring.tasks=\[a,b\]$"),
    ("eval.every_n_train_steps", r"override 'eval.every_n_train_steps' is not key=value"),
])
def test_bad_values_are_refused_with_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", REQUIRED + [override])


def test_a_yaml_file_that_is_a_list_names_the_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- eval\n- stop\n")
    with pytest.raises(ValueError, match=r"config file .*list.yaml must hold a mapping of keys to values, not a list"):
        load_config(CallbacksConfig, path)


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


def test_demo_config_overrides_name_the_key():
    cfg = demo_config(["train.max_steps=30", "stop.patience=2", "wandb=disabled"])
    assert cfg.train.max_steps == 30 and cfg.stop.patience == 2 and cfg.wandb == "disabled"
    assert cfg.eval.scoring.ddtree_budgets == [4, 8] and cfg.eval.every_n_train_steps == 25
    with pytest.raises(ValueError, match=r"^override 'train.max_steps=abc': Value 'abc'"):
        demo_config(["train.max_steps=abc"])


def test_an_override_typo_names_the_override_and_a_file_typo_the_file(tmp_path):
    """A key given on the command line is blamed on the override, never on the YAML file."""
    with pytest.raises(ValueError, match=r"^override 'train.max_step=300': Key 'max_step' not in 'TrainConfig'"):
        demo_config(["train.max_step=300"])
    path = tmp_path / "run.yaml"
    path.write_text("eval:\n  scoring:\n    topk: [4]\n    top_k: [4]\n")
    with pytest.raises(ValueError, match=r"^config key 'eval.scoring.top_k' in .*run.yaml: Key 'top_k' not in"):
        load_config(CallbacksConfig, path, REQUIRED)
    cfg = load_config(CallbacksConfig, CONF_DIR / "callbacks.yaml", REQUIRED + ["eval.scoring.topk=[4]"])
    assert cfg.eval.scoring.topk == [4]


def test_every_problem_of_a_yaml_file_and_its_overrides_is_named_at_once(tmp_path):
    """As the command line names them: a list key given a scalar says how to write the list, in
    the file's own syntax; then each impossible value."""
    path = tmp_path / "run.yaml"
    path.write_text("eval:\n  cache: /c\n  every_n_train_step: 5\n  scoring:\n    ddtree_budgets: 8\n    tasks: fizzbuzz\n"
                    "    max_rounds: 0\n    topk:\n      a: 1\nstop:\n  patience: x\n  grace_steps:\n    a: 1\n")
    with pytest.raises(ValueError) as error:
        load_config(CallbacksConfig, path, ["eval.scoring.topk=4", "stop.patiense=2"])
    assert str(error.value).splitlines() == [
        f"config key 'eval.every_n_train_step' in {path}: Key 'every_n_train_step' not in 'EvalConfig'. Did you mean one of: 'every_n_train_steps', "
        "'sync_every_n_steps'?",
        f"config key 'eval.scoring.ddtree_budgets' in {path}: ddtree_budgets is a list: write ddtree_budgets: [8]",
        f"config key 'eval.scoring.tasks' in {path}: tasks is a list: write tasks: [fizzbuzz]",
        f"config key 'eval.scoring.topk' in {path}: eval.scoring.topk takes a list, not a mapping",
        f"config key 'stop.patience' in {path}: Value 'x' of type 'str' could not be converted to Integer",
        f"config key 'stop.grace_steps' in {path}: Value '{{'a': 1}}' of type 'DictConfig' could not be converted to Integer",
        "override 'eval.scoring.topk=4': topk is a list: write eval.scoring.topk=[4]",
        "override 'stop.patiense=2': Key 'patiense' not in 'StopConfig'. Did you mean: 'patience'?",
        f"config in {path} leaves required keys unset: ['eval.target'] (set them with key=value)",
    ]
    path.write_text("eval:\n  scoring:\n    max_rounds: 0\n    window: 0\n")
    with pytest.raises(ValueError) as error:
        load_config(CallbacksConfig, path, REQUIRED + ["eval.scoring.anchors_per_forward=0"])
    assert str(error.value).splitlines() == ["window must be None or an integer >= 1; got 0",
                                             "max_rounds must be None or an integer >= 1; got 0",
                                             "anchors_per_forward must be an integer >= 1; got 0"]
    path.write_text("eval:\n  scoring:\n    window: ${nope}\n")
    with pytest.raises(ValueError, match=r"^config key 'eval.scoring.window' in .*: Interpolation key 'nope' not found$"):
        load_config(CallbacksConfig, path, REQUIRED)
    path.write_text("eval: [1\n")
    with pytest.raises(ValueError, match=r"^config file .*run.yaml is not valid YAML: while parsing"):
        load_config(CallbacksConfig, path, REQUIRED)


def test_scoring_config_names_every_bad_field_at_once():
    with pytest.raises(ValueError) as error:
        ScoringConfig(ddtree_budgets=[4, 2048], topk="4", window=0, tasks=[], device="gpu", release_memory="yes")
    assert str(error.value).splitlines() == [
        "ddtree_budgets must be at most 1024; got 2048 in [4, 2048]",
        "topk must be a list of integers >= 1, e.g. [4, 8]; got '4'",
        "window must be None or an integer >= 1; got 0",
        "tasks must be None (every task of the cache) or a non-empty list of task names",
        "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got 'gpu' (whether it exists here is checked before scoring starts)",
        "release_memory must be true or false; got 'yes'",
    ]
    with pytest.raises(ValueError, match=r"^window must be None or an integer >= 1; got -1\nmax_rounds"):  # the callbacks too
        DrafterEvalCallback(cache="c", target="t", scoring={"max_rounds": 0, "window": -1})
    assert ScoringConfig(ddtree_budgets=(4, 8), tasks=("a",)).ddtree_budgets == [4, 8]


# ---------------------------------------------------------------- one default, everywhere


def settings_taken(cls) -> tuple[type | None, dict[str, str]]:
    """The settings class an entry point takes the fields of as keywords (`**fields: Unpack[...]`), and the
    names it takes them under."""
    hint = typing.get_type_hints(cls.__init__, include_extras=True).get("fields")
    if hint is None:
        return None, {}
    (typed,) = typing.get_args(hint)
    settings = StopSettings if typed is StopFields else EvalSettings
    return settings, LIGHTNING_NAMES if typed is LightningEvalFields else {}


def accepted(cls) -> list[str]:
    """Every argument an entry point takes: its own parameters and the settings' fields."""
    settings, rename = settings_taken(cls)
    own = [name for name in inspect.signature(cls.__init__).parameters if name not in ("self", "settings", "fields")]
    return own + ([rename.get(f.name, f.name) for f in dataclasses.fields(settings)] if settings else [])


def signature_defaults(cls) -> dict:
    """Each argument's default: its own parameter's, or its settings field's (a field with a factory: None)."""
    settings, rename = settings_taken(cls)
    fields = {f.name: f for f in dataclasses.fields(settings)} if settings else {}
    out = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
           if name not in ("self", "settings", "fields", *fields) and p.default is not inspect.Parameter.empty}
    for name, f in fields.items():
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            out[rename.get(name, name)] = None if f.default is dataclasses.MISSING else f.default
    return out


def schema_defaults(schema) -> dict:
    instance = schema()
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(schema)}


def documented_defaults(heading: str) -> dict:
    """The `| `key` | `default` | ... |` rows of the docs/configuration.md table under `heading`."""
    text = CONFIGURATION.read_text()
    section = text[text.index(heading + "\n"):]
    section = section[: section.index("\n#", 1)] if "\n#" in section[1:] else section
    rows = re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", section, flags=re.M)
    assert rows, f"no table under {heading!r} in docs/configuration.md"
    return {key: yaml.safe_load(value) for key, value in rows}


def test_defaults_are_the_same_in_the_signature_the_schema_the_yaml_and_the_docs():
    eval_yaml = yaml.safe_load((CONF_DIR / "callbacks.yaml").read_text())
    scoring_yaml = yaml.safe_load((CONF_DIR / "scoring.yaml").read_text())
    scoring = dataclasses.asdict(ScoringConfig())

    evaluation = signature_defaults(DrafterEvalCallback)
    schema = schema_defaults(EvalConfig)
    assert {k: schema[k] for k in evaluation if k != "scoring"} == {k: v for k, v in evaluation.items() if k != "scoring"}
    assert dataclasses.asdict(schema["scoring"]) == scoring
    assert {k: v for k, v in eval_yaml["eval"].items() if k not in ("cache", "target", "scoring")} == \
        {k: v for k, v in evaluation.items() if k != "scoring"}
    assert eval_yaml["eval"]["scoring"] == scoring == scoring_yaml

    stop = signature_defaults(TrailingBaselineStop)
    assert {k: v for k, v in schema_defaults(StopConfig).items() if k != "enabled"} == stop
    assert {k: v for k, v in eval_yaml["stop"].items() if k != "enabled"} == stop

    assert documented_defaults("## DrafterEvalCallback") == {k: v for k, v in evaluation.items() if k != "scoring"}
    assert documented_defaults("## ScoringConfig") == scoring
    assert documented_defaults("## TrailingBaselineStop") == stop


@pytest.mark.parametrize("cls", [DrafterEvaluator, DrafterEvalTrainerCallback])
def test_the_other_entry_points_tables_hold_every_argument_they_do_not_share_with_the_callback(cls):
    """Each row is the signature's default; every argument whose default is not DrafterEvalCallback's
    (or that the callback lacks) has a row: the table's "the others are DrafterEvalCallback's" holds."""
    ours, callback = signature_defaults(cls), signature_defaults(DrafterEvalCallback)
    documented = documented_defaults(f"## {cls.__name__}")
    assert {k: ours.get(k, "not an argument") for k in documented} == documented
    assert {k for k, v in ours.items() if k not in callback or callback[k] != v} <= set(documented)
    assert set(accepted(cls)) >= \
        {k for k in callback if k not in ("every_n_train_steps", "drafter")} | set(documented)


def test_drafter_early_stopping_table_is_its_signature():
    assert documented_defaults("## DrafterEarlyStopping") == signature_defaults(DrafterEarlyStopping)


def test_the_demo_yaml_train_section_is_the_recipe_default():
    demo = yaml.safe_load(DEMO_YAML.read_text())
    assert demo["train"] == dataclasses.asdict(TrainConfig())
    assert {f.name for f in dataclasses.fields(DemoConfig)} >= set(demo)


def test_a_users_config_object_is_copied_never_changed():
    """Two callbacks that share one ScoringConfig, one with device=..., score on their own devices."""
    shared = ScoringConfig(ddtree_budgets=[4], device="auto")
    a = DrafterEvalCallback(cache="c", target="t", scoring=shared, device="cpu")
    b = DrafterEvalCallback(cache="c", target="t", scoring=shared)
    assert (shared.device, a.scoring.device, b.scoring.device) == ("auto", "cpu", "auto")
    assert a.scoring is not shared and b.scoring is not shared
    with pytest.raises(ValueError, match=r"scoring has no field 'budgets'; did you mean 'ddtree_budgets'\?"):
        DrafterEvalCallback(cache="c", target="t", scoring={"budgets": [4]})
    # Hydra's instantiate passes a nested section as a DictConfig
    from_yaml = OmegaConf.create("ddtree_budgets: [4]\ndevice: cpu\nwindow: ${max_rounds}\nmax_rounds: 7")
    c = DrafterEvalCallback(cache="c", target="t", scoring=from_yaml)
    assert (c.scoring.ddtree_budgets, c.scoring.device, c.scoring.window) == ([4], "cpu", 7)
    with pytest.raises(ValueError, match=r"scoring has no field 'budgets'; did you mean 'ddtree_budgets'\?"):
        DrafterEvalCallback(cache="c", target="t", scoring=OmegaConf.create({"budgets": [4]}))
    with pytest.raises(ValueError, match=r"scoring leaves required keys unset \(\?\?\?\): \['device', 'topk'\]"):
        DrafterEvalCallback(cache="c", target="t", scoring=OmegaConf.create("device: ???\ntopk: ???"))


@pytest.mark.parametrize("kwargs,message", [
    ({"ddtree_budgets": "16"}, r"ddtree_budgets must be a list of integers >= 1, e.g. \[4, 8\]; got '16'"),
    ({"topk": "12"}, r"topk must be a list of integers >= 1, e.g. \[4, 8\]; got '12'"),
    ({"ddtree_budgets": [4.7]}, r"ddtree_budgets must be a list of integers >= 1; got 4.7"),
    ({"window": 2.5}, r"window must be None or an integer >= 1; got 2.5"),
    ({"tasks": "long"}, r"tasks must be a list of names, e.g. \['fizzbuzz'\]; got 'long'"),
    ({"device": "gpu"}, r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got 'gpu'"),
    ({"device": "cuda:\u0661"}, r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got 'cuda:\u0661'"),
    ({"backend": "cuda"}, r"backend must be one of \['auto', 'torch', 'triton', 'reference'\]"),
])
def test_scoring_config_refuses_values_of_the_wrong_kind(kwargs, message):
    """Python gets the checks YAML already had: no string read as a list of digits, no float cut to an int."""
    with pytest.raises(ValueError, match=message):
        ScoringConfig(**kwargs)


def test_a_misspelt_scoring_field_or_choice_names_the_one_meant():
    """`scoring={"ddtree_budget": [8]}` listed all 22 fields; a slip of a name from a closed set (a field, an
    attention rule, a backend) names the one meant, one line each; a name close to none lists them all."""
    with pytest.raises(ValueError) as refused:
        DrafterEvalCallback(cache="c", target="t", scoring={"ddtree_budget": [8], "windw": 3})
    assert str(refused.value).splitlines() == ["scoring has no field 'ddtree_budget'; did you mean 'ddtree_budgets'?",
                                               "scoring has no field 'windw'; did you mean 'window'?"]
    with pytest.raises(ValueError, match=r"scoring has no field 'zzz'; the fields are \['ddtree_budgets', 'topk', "):
        ScoringConfig.from_dict({"zzz": 1})
    with pytest.raises(ValueError) as refused:
        ScoringConfig(attention="vlm", attentions=["traned"], backend="trito")
    assert [line.rsplit("; ", 1)[1] for line in str(refused.value).splitlines()] == [
        "did you mean 'triton'?", "did you mean 'vllm'?", "did you mean 'trained'?"]


def test_the_demo_stops_on_a_predicted_speedup_only_with_costs(tmp_path):
    """stop.monitor takes the speed-up form as every entry point does: with eval.scoring.costs it passes the
    demo's own check, without it one line says what to set; an unscored method is named either way."""
    from dflash_callbacks.demos.settings import check_demo

    costs = tmp_path / "costs.json"
    costs.write_text("{}")  # the check reads the setting, not the file (the engine reads it before training)
    check_demo(demo_config(["stop.monitor=speedup/ddtree@8/live", f"eval.scoring.costs={costs}"]))
    with pytest.raises(ValueError, match=r"stop.monitor='speedup/ddtree@8/live' is a predicted speed-up, but "
                                         r"eval.scoring has no costs"):
        check_demo(demo_config(["stop.monitor=speedup/ddtree@8/live"]))
    with pytest.raises(ValueError, match=r"stop.monitor='ddtree@16/live', but eval.scoring scores only"):
        check_demo(demo_config(["stop.monitor=speedup/ddtree@16/live", f"eval.scoring.costs={costs}"]))

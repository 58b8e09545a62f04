"""Every mistake is refused before the first training step, in one line naming what to fix: a bad cache
(its manifest, a truncated or bit-flipped file, NaN hidden states, a task with no anchor), a target head
that does not fit the drafter, a truncated baseline or target, a bad config value or YAML key, a block size
the cache can not label, a memory budget or device that can not work, a wait_timeout that is not a
positive number, a stop that can not follow its eval callback, two eval callbacks of one name. Lightning's
callback here; the plain loop's and the transformers Trainer's refusals are in their own files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import save_file

from dflash_callbacks import TrailingBaselineStop
from dflash_callbacks.cache.format import write_task
from dflash_callbacks.callbacks.schema import CallbacksConfig, build_callbacks
from dflash_callbacks.config_files import CONF_DIR, load_config
from dflash_callbacks.scoring.service import PreflightError

from train_run import SCORING, eval_cb, fit, shared_world, world_paths, write_cache


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return shared_world(tmp_path_factory.getbasetemp() / "reliability-world")


class CountBatches(pl.Callback):
    batches = 0

    def on_train_batch_start(self, *args):
        self.batches += 1


def refused_before_training(world, tmp_path, cb, message) -> None:
    counter = CountBatches()
    with pytest.raises(PreflightError, match=message):
        fit(world, tmp_path, [cb, counter], max_steps=4)
    assert counter.batches == 0 and not (tmp_path / "d").exists()


def edit_manifest(manifest: dict, how: str) -> None:
    if how == "wrong type":
        manifest["tasks"][0]["prompt_len"] = "5"
    elif how == "missing field":
        del manifest["layer_ids"]
    elif how == "unknown version":
        manifest["version"] = 99


@pytest.mark.parametrize("how,message", [
    ("wrong type", r"tasks\[0\]: field 'prompt_len' must be int, got str"),
    ("missing field", r"manifest.json: missing field 'layer_ids'"),
    ("unknown version", r"cache format version 99 is not supported"),
])


def test_bad_manifest_is_refused_before_training(world, tmp_path, how, message):
    cache = shutil.copytree(world / "cache", tmp_path / "cache")
    manifest = json.loads((cache / "manifest.json").read_text())
    edit_manifest(manifest, how)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    counter = CountBatches()
    with pytest.raises(PreflightError, match=message):
        fit(world, tmp_path, [eval_cb(world, tmp_path, cache=cache), counter], max_steps=4)
    assert counter.batches == 0 and not (tmp_path / "d").exists()


def cache_with(world: Path, folder: Path, hidden_fill=None, prompt_len: int = 4, tokens: int = 20) -> Path:
    write_cache(world, folder, [("t", tokens, prompt_len)])
    if hidden_fill is not None:
        from dflash_callbacks.cache.format import HiddenStateCache

        task = HiddenStateCache(folder).task("t")
        hidden = task.hidden.clone()
        hidden[3] = hidden_fill
        info = HiddenStateCache(folder)
        write_task(folder, "t", task.input_ids, hidden, prompt_len)
        assert info.layer_ids  # the manifest stays valid: write_task records the new size and sha256
    return folder


def test_nan_hidden_states_in_the_cache_are_refused_before_training(world, tmp_path):
    cb = eval_cb(world, tmp_path, cache=cache_with(world, tmp_path / "nan-cache", hidden_fill=float("nan")))
    refused_before_training(world, tmp_path, cb, r"task 't': .* holds NaN or Inf hidden states at 1 of 20 positions")


def test_a_damaged_cache_or_a_task_with_no_anchor_is_refused_before_training(world, tmp_path):
    truncated = shutil.copytree(world / "cache", tmp_path / "truncated")
    data = (truncated / "long.safetensors").read_bytes()
    (truncated / "long.safetensors").write_bytes(data[:-10])
    refused_before_training(world, tmp_path, eval_cb(world, tmp_path, cache=truncated),
                            r"task 'long': file .* is \d+ bytes but the manifest says \d+: truncated")
    flipped = shutil.copytree(world / "cache", tmp_path / "flipped")
    data = bytearray((flipped / "short.safetensors").read_bytes())
    data[-5] ^= 0x01
    (flipped / "short.safetensors").write_bytes(bytes(data))
    refused_before_training(world, tmp_path, eval_cb(world, tmp_path, cache=flipped),
                            r"task 'short': file .* has sha256 .* but the manifest says")
    no_anchor = cache_with(world, tmp_path / "no-anchor", prompt_len=19, tokens=20)
    refused_before_training(world, tmp_path, eval_cb(world, tmp_path, cache=no_anchor),
                            r"cache task 't' has no anchor to score: 19 prompt tokens and 20 in all")


def test_a_target_head_of_another_vocabulary_or_width_is_refused_before_training(world, tmp_path):
    paths = world_paths(world)
    vocab, hidden = paths["config"].vocab_size, paths["config"].hidden_size
    for name, shape, message in [
        ("wide-vocab", (vocab + 4, hidden), rf"the target's lm_head has {vocab + 4} rows but the drafter's vocabulary is {vocab}"),
        ("other-width", (vocab, hidden * 2), rf"the target's lm_head is {hidden * 2} wide but the drafter's hidden size is {hidden}"),
    ]:
        target = tmp_path / name
        target.mkdir()
        save_file({"model.embed_tokens.weight": torch.randn(*shape), "lm_head.weight": torch.randn(*shape)},
                  str(target / "model.safetensors"))
        (target / "config.json").write_text("{}")
        refused_before_training(world, tmp_path, eval_cb(world, tmp_path, target=target), message)


def test_a_truncated_baseline_or_target_weight_file_is_listed_before_training(world, tmp_path):
    """The drafter's target and baseline are read by the preflight: a damaged safetensors file is
    a line naming it, never a raw SafetensorError from setup."""
    damaged = {}
    for name in ("baseline", "target"):
        damaged[name] = shutil.copytree(world / name, tmp_path / f"damaged-{name}") / "model.safetensors"
        damaged[name].write_bytes(damaged[name].read_bytes()[:100])
    cb = eval_cb(world, tmp_path, target=damaged["target"].parent, baseline=damaged["baseline"].parent)
    refused_before_training(world, tmp_path, cb, rf"(?s)target: {re.escape(str(damaged['target']))} is not a readable "
                            rf"safetensors file \(truncated or corrupt\?\).*\n  baseline .*{re.escape(str(damaged['baseline']))} is not")


@pytest.mark.parametrize("override,message", [
    ("eval.bogus=1", r"override 'eval.bogus=1': Key 'bogus' not in 'EvalConfig'"),
    ("eval.scoring.ddtree_budgets=[4,0]", r"ddtree_budgets must be a list of integers >= 1; got 0 in \[4, 0\]"),
    ("eval.scoring.anchors_per_forward=0", r"anchors_per_forward must be an integer >= 1; got 0"),
    ("eval.every_n_train_steps=0", r"every_n_train_steps must be an integer >= 1; got 0"),
    ("eval.keep_last=-1", r"keep_last must be an integer >= 0; got -1"),
    ("stop.patience=0", r"`patience` must be an integer >= 1; got 0"),
    ("stop.min_ratio=0", r"`min_ratio` must be None or a finite number > 0; got 0"),
    ("stop.min_delta=-0.5", None),  # alone, from YAML: min_ratio defaults to null (defect: it was refused)
])


def test_bad_config_is_refused_before_a_trainer_exists(world, tmp_path, override, message):
    """load_config refuses unknown keys and wrong types (naming the override) and ScoringConfig's
    impossible values; the callbacks' own checks refuse the rest when they are built."""
    paths = world_paths(world)
    path = tmp_path / "run.yaml"
    path.write_text((CONF_DIR / "callbacks.yaml").read_text())
    overrides = [f"eval.cache={paths['cache']}", f"eval.target={paths['target']}", override]
    if message is None:
        stop = build_callbacks(load_config(CallbacksConfig, path, overrides))[1]
        assert (stop.min_ratio, stop.min_delta) == (None, -0.5)
        return
    with pytest.raises(ValueError, match=message):
        build_callbacks(load_config(CallbacksConfig, path, overrides))


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("eval:\n  cache: /c\n  target: /t\n  every_n_train_step: 5\n")
    with pytest.raises(ValueError, match=r"config key 'eval.every_n_train_step' in .*run\.yaml: Key 'every_n_train_step' not in"):
        load_config(CallbacksConfig, path)


def test_block_size_beyond_the_longest_completion_is_refused_before_training(world, tmp_path):
    """The rule: a block drafts B-1 tokens, so the longest completion (tokens after the
    prompt) must hold B tokens, else the deepest depths have no label anywhere. The
    drafter trains at block size 6; a cache whose one task completes in 4 tokens (8
    tokens, prompt 4) holds labels for a block of at most 4."""
    short = cache_with(world, tmp_path / "short-cache", prompt_len=4, tokens=8)
    counter = CountBatches()
    cb = eval_cb(world, tmp_path, cache=short)
    with pytest.raises(ValueError, match=r"block size 6 is larger than the cache .* allows: a block drafts 5 "
                                         r"tokens, but the longest completion \('t', 4 tokens\) has labels for "
                                         r"at most 3; use a block size <= 4"):
        fit(world, tmp_path, [cb, counter], max_steps=2)
    assert counter.batches == 0
    # a block past the trained one is refused on its own rule, whatever the cache holds
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "block_size": 7})
    with pytest.raises(ValueError, match=r"block size 7 is above the drafter's trained block size 6"):
        fit(world, tmp_path, [cb], max_steps=2)
    # at the limit it trains (scores nothing: every_n_train_steps=1000, no final snapshot)
    cb = eval_cb(world, tmp_path, cache=short, scoring={**SCORING, "block_size": 4}, every_n_train_steps=1000,
                 wait_on_end=False)
    assert fit(world, tmp_path, [cb], max_steps=1).global_step == 1


def test_a_memory_budget_too_small_for_one_block_is_refused_before_training(world, tmp_path):
    cb = eval_cb(world, tmp_path, scoring={**SCORING, "max_memory_gib": 0.001})
    refused_before_training(world, tmp_path, cb, r"max_memory_gib=0.001 is below what scoring needs at the least")


def test_a_device_that_is_not_here_is_refused_before_training(world, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA has the device")
    refused_before_training(world, tmp_path, eval_cb(world, tmp_path, device="cuda"),
                            r"scoring.device='cuda', but CUDA is not available here")


def test_wait_timeout_must_be_positive(world, tmp_path):
    for bad in (0, -1, "60"):
        with pytest.raises(ValueError, match=f"wait_timeout must be a finite number > 0; got {bad!r}"):
            eval_cb(world, tmp_path, wait_timeout=bad)


def test_a_monitor_that_is_not_scored_fails_before_training(world, tmp_path):
    counter = CountBatches()
    stop = TrailingBaselineStop(monitor="ddtree@8/live")
    with pytest.raises(ValueError, match=r"monitors 'ddtree@8/live', but 'dflash' scores only \['vanilla', 'ddtree@4'\]"):
        fit(world, tmp_path, [eval_cb(world, tmp_path), stop, counter], max_steps=4)
    assert counter.batches == 0


def test_the_stop_callback_finds_its_eval_callback_or_says_why_not(world, tmp_path):
    with pytest.raises(ValueError, match="needs a DrafterEvalCallback in trainer.callbacks"):
        fit(world, tmp_path, [TrailingBaselineStop(monitor="ddtree@4/live")], max_steps=1)
    two = [eval_cb(world, tmp_path), eval_cb(world, tmp_path, name="other", scoring={**SCORING, "topk": [2]})]
    with pytest.raises(ValueError, match=r"several DrafterEvalCallbacks \['dflash', 'other'\]; name the one"):
        fit(world, tmp_path, [*two, TrailingBaselineStop(monitor="ddtree@4/live")], max_steps=1)
    with pytest.raises(ValueError, match=r"eval_callback='nope'\): no DrafterEvalCallback of that name"):
        fit(world, tmp_path, [*two, TrailingBaselineStop(monitor="ddtree@4/live", eval_callback="nope")], max_steps=1)
    stop = TrailingBaselineStop(monitor="top@2/live", eval_callback="other", min_ratio=0.01, verbose=False)
    two = [eval_cb(world, tmp_path / "a"), eval_cb(world, tmp_path / "b", name="other", scoring={**SCORING, "topk": [2]})]
    fit(world, tmp_path, [*two, stop], max_steps=4)
    assert stop.source is two[1] and [s for s, _ in stop.history] == [2, 4]


@pytest.mark.parametrize("with_stop", [False, True])
def test_two_eval_callbacks_of_one_name_are_refused_before_training(world, tmp_path, with_stop):
    """Two eval callbacks on two caches, both left at name="dflash": their numbers were logged
    under the same keys (callback_metrics held whichever came last), and a stop told to follow
    "dflash" was told to name the one it follows. The checkpoint key is the name alone (a path
    spelled otherwise on resume lost the state), so Lightning refuses them when the Trainer is
    made, naming the key that must be unique."""
    other = write_cache(world, tmp_path / "other-cache", [("t", 20, 4)])
    counter = CountBatches()
    callbacks = [eval_cb(world, tmp_path), eval_cb(world, tmp_path, cache=other), counter]
    callbacks += [TrailingBaselineStop(monitor="ddtree@4/live", eval_callback="dflash")] if with_stop else []
    with pytest.raises(RuntimeError, match=r"more than one stateful callback of type `DrafterEvalCallback`.*"
                                           r"state_key` must be unique"):
        fit(world, tmp_path, callbacks, max_steps=4)
    assert counter.batches == 0

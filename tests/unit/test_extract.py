"""Extraction from a real (tiny, random) Qwen3ForCausalLM: tokens equal generate(), hidden
states equal a fresh forward, sharded targets, --drafter, a resume with other arguments refused.
(Resuming after a SIGKILL: faults/test_killed_processes.py.)"""

import argparse
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_callbacks.cache.extract import extract_cache
from dflash_callbacks.cache.format import HiddenStateCache
from dflash_callbacks.cache.tasks import Task
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.cli.extract import add_extract_arguments, run_extract
from dflash_callbacks.demos.toy.threads import torch_threads
from dflash_callbacks.demos.toy.world import toy_drafter_config
from dflash_callbacks.model.config import DrafterConfig

from fixtures_cache import save_random_target


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread (and far faster on a busy machine)."""
    with torch_threads(1):
        yield
TASKS = [
    Task("fizz", "Write fizzbuzz in Python."),
    Task("search", "Implement binary search over a sorted list."),
]


def expected_from_fresh_model(target: Path, prompt: str, layer_ids, dtype, max_new_tokens):
    """What the cache must hold, computed independently with stock transformers calls."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        ids = model.generate(prompt_ids, do_sample=False, max_new_tokens=max_new_tokens)
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    return prompt_ids.shape[1], ids[0], torch.cat([states[i + 1][0] for i in layer_ids], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_holds_greedy_completion_and_hidden_states(random_target_dir, tmp_path, dtype):
    layer_ids = [1, 2, 4]
    cache = extract_cache(random_target_dir, tmp_path / "cache", TASKS, layer_ids, max_new_tokens=20, dtype=dtype, progress=False)
    assert cache.task_names == ["fizz", "search"]
    assert cache.target.dtype == str(dtype).removeprefix("torch.")
    assert (cache.target.num_layers, cache.hidden_size, cache.vocab_size) == (6, 64, 300)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["extraction"] == {"max_new_tokens": 20, "chat_template": True, "tasks": ["fizz", "search"]}
    for task in TASKS:
        prompt_len, ids, hidden = expected_from_fresh_model(random_target_dir, task.prompt, layer_ids, dtype, 20)
        cached = cache.task(task.name)
        assert cached.prompt_len == prompt_len and cached.num_tokens == prompt_len + 20
        assert torch.equal(cached.input_ids, ids)
        assert cached.hidden.dtype == dtype
        assert torch.equal(cached.hidden, hidden)


def test_sharded_and_single_file_targets_give_the_same_cache(tmp_path):
    single = save_random_target(tmp_path / "single", num_layers=4, seed=3)
    sharded = save_random_target(tmp_path / "sharded", num_layers=4, seed=3, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    caches = [
        extract_cache(t, tmp_path / f"cache-{t.name}", TASKS[:1], [1, 2], max_new_tokens=12, progress=False)
        for t in (single, sharded)
    ]
    assert caches[0].manifest["tasks"][0]["sha256"] == caches[1].manifest["tasks"][0]["sha256"]
    assert caches[0].fingerprint == caches[1].fingerprint  # the target's path is not part of it
    assert caches[0].target.path != caches[1].target.path


def test_no_chat_template_and_bad_arguments(random_target_dir, tmp_path):
    cache = extract_cache(
        random_target_dir, tmp_path / "raw", [Task("t", "def f(x):")], [0], max_new_tokens=5, chat_template=False, progress=False
    )
    assert cache.task("t").input_ids[:9].tolist() == list(b"def f(x):")
    with pytest.raises(ValueError, match=r"layer ids \[6\] are out of range for a target with 6 decoder layers"):
        extract_cache(random_target_dir, tmp_path / "x", TASKS, [1, 6], progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist .*nothing is downloaded"):
        extract_cache(tmp_path / "no-model", tmp_path / "y", TASKS, [1], progress=False)
    with pytest.raises(ValueError, match="duplicate task names"):
        extract_cache(random_target_dir, tmp_path / "z", TASKS + TASKS[:1], [1], progress=False)
    with pytest.raises(ValueError, match="task name 'mean' is reserved"):  # refused before the target is loaded
        extract_cache(tmp_path / "no-model", tmp_path / "m", [Task("mean", "def f(x):")], [1], progress=False)
    assert not (tmp_path / "m").exists()


def parse(argv):
    parser = argparse.ArgumentParser()
    add_extract_arguments(parser)
    return parser.parse_args(argv)


def test_drafter_option_takes_layer_ids_and_block_size(random_target_dir, zlab_tiny, tmp_path, capsys):
    tasks_file = tmp_path / "tasks.yaml"
    tasks_file.write_text("tasks:\n  - name: one\n    prompt: Write a function.\n")
    out = tmp_path / "cache"
    args = parse(["--target", str(random_target_dir), "--out", str(out), "--tasks", str(tasks_file),
                  "--drafter", str(zlab_tiny), "--max-new-tokens", "6"])
    assert run_extract(args) == 0
    cache = HiddenStateCache(out)
    assert cache.layer_ids == [1, 2, 4] and cache.block_size == 8
    cache.check_compatible(DrafterConfig.from_file(zlab_tiny))
    assert f"fingerprint {cache.fingerprint}" in capsys.readouterr().out

    toy_dir = tmp_path / "toy-drafter"
    toy_dir.mkdir()
    (toy_dir / "config.json").write_text(json.dumps(toy_drafter_config().to_dict()))
    assert cli_main(["extract", "--target", str(random_target_dir), "--out", str(tmp_path / "other"),
                     "--drafter", str(toy_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: target hidden size 64 / vocab size 300 != drafter hidden_size 128 / vocab_size 260")
    assert "Traceback" not in err
    assert not (tmp_path / "other").exists()

    with pytest.raises(SystemExit):
        parse(["--target", "t", "--out", "o", "--layer-ids", "1,2", "--drafter", "d"])  # one or the other


def test_a_resume_with_other_tasks_or_impossible_settings_is_refused_before_the_target_loads(
        random_target_dir, tmp_path, monkeypatch):
    """A cache folder is finished, never mixed: a task list other than the one it was begun with,
    or a task of another prompt, is refused; so are a block size below 2, layer ids the target
    does not have and an --out that is a file; all before the target is loaded."""
    from dflash_callbacks.cache import extract

    out = tmp_path / "cache"
    extract_cache(random_target_dir, out, TASKS, [1], max_new_tokens=3, progress=False)
    before = (out / "manifest.json").read_text()
    monkeypatch.setattr(extract, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    refused = [
        (out, [Task("fizz", "Write fizzbuzz in Rust."), TASKS[1]], [1], {}, r"holds the tasks \['fizz'\] extracted from other prompts"),
        (out, TASKS + [Task("sort", "Sort a list.")], [1], {}, "already holds a cache made differently .*extraction settings"),
        (out, TASKS[:1], [1], {}, "already holds a cache made differently .*extraction settings"),
        (tmp_path / "new", TASKS, [1], {"block_size": 1}, "block_size must be None or an integer >= 2; got 1"),
        (tmp_path / "new", TASKS, [1, 6], {}, r"layer ids \[6\] are out of range for a target with 6 decoder layers"),
        (tmp_path / "manifest.json", TASKS, [1], {}, "is a file: give a folder"),
    ]
    (tmp_path / "manifest.json").write_text("{}")
    for folder, tasks, layer_ids, kw, message in refused:
        with pytest.raises((ValueError, OSError), match=message):
            extract_cache(random_target_dir, folder, tasks, layer_ids, max_new_tokens=3, progress=False, **kw)
    assert (out / "manifest.json").read_text() == before and not (tmp_path / "new").exists()
    assert extract_cache(random_target_dir, out, TASKS, [1], max_new_tokens=3, progress=False).task_names == \
        ["fizz", "search"]  # the same tasks: nothing to do, nothing loaded

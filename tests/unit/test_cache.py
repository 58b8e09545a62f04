"""The cache format: writing, reading, validation errors, compatibility, fingerprint; task sets."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_callbacks.cache.format import (
    CacheError,
    CacheMismatchError,
    HiddenStateCache,
    TargetInfo,
    new_manifest,
    open_for_writing,
    write_task,
)
from dflash_callbacks.cache.tasks import Task, builtin_task_sets, load_tasks
from dflash_callbacks.model.config import DrafterConfig

TARGET = TargetInfo(path="/models/tiny", num_layers=4, hidden_size=8, vocab_size=50, dtype="float32")


def make_cache(folder: Path, *, layer_ids=(1, 2), block_size=None, dtype=torch.float32, seed=0) -> Path:
    """Two tasks of random tokens and hidden states, written by the real writer."""
    target = TargetInfo(**{**TARGET.__dict__, "dtype": str(dtype).removeprefix("torch.")})
    open_for_writing(folder, new_manifest(target, list(layer_ids), block_size=block_size))
    gen = torch.Generator().manual_seed(seed)
    for name, T, P in [("alpha", 12, 5), ("beta", 7, 3)]:
        ids = torch.randint(0, 50, (T,), generator=gen)
        hidden = torch.randn(T, len(layer_ids) * 8, generator=gen).to(dtype)
        write_task(folder, name, ids, hidden, P, prompt=f"prompt of {name}")
    return folder


def edit_manifest(folder: Path, change) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def drafter_config(**overrides) -> DrafterConfig:
    fields = dict(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=4, block_size=4, mask_token_id=49, target_layer_ids=[1, 2], vocab_size=50,
    )
    return DrafterConfig(**{**fields, **overrides})


# ---------------------------------------------------------------- round trip


def test_round_trip_and_manifest(tmp_path):
    folder = make_cache(tmp_path / "c", block_size=4, dtype=torch.bfloat16)
    cache = HiddenStateCache(folder)
    assert cache.task_names == ["alpha", "beta"]
    assert (cache.layer_ids, cache.block_size, cache.hidden_size, cache.vocab_size) == ([1, 2], 4, 8, 50)
    assert cache.dtype == torch.bfloat16
    task = cache.task("alpha")
    assert task.input_ids.dtype == torch.int64 and task.num_tokens == 12 and task.prompt_len == 5
    assert task.hidden.shape == (12, 16) and task.hidden.dtype == torch.bfloat16
    with safe_open(str(folder / "alpha.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("hidden"), task.hidden)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "dflash-hidden-cache" and manifest["version"] == 1
    assert manifest["target"] == {**{k: v for k, v in TARGET.__dict__.items() if v is not None}, "dtype": "bfloat16"}
    entry = manifest["tasks"][1]
    assert (entry["name"], entry["file"], entry["prompt_len"], entry["num_tokens"]) == ("beta", "beta.safetensors", 3, 7)
    assert entry["num_bytes"] == (folder / "beta.safetensors").stat().st_size and len(entry["sha256"]) == 64
    assert sorted(p.name for p in folder.iterdir()) == ["alpha.safetensors", "beta.safetensors", "manifest.json"]


def test_rewriting_a_task_replaces_its_entry(tmp_path):
    folder = make_cache(tmp_path / "c")
    write_task(folder, "alpha", torch.arange(4), torch.zeros(4, 16), 2)
    cache = HiddenStateCache(folder)
    assert cache.task_names == ["alpha", "beta"]
    assert cache.task("alpha").input_ids.tolist() == [0, 1, 2, 3]


def test_writer_refuses_wrong_shapes_and_dtypes(tmp_path):
    folder = make_cache(tmp_path / "c")
    with pytest.raises(ValueError, match=r"hidden must be \[4, 16\]"):
        write_task(folder, "x", torch.arange(4), torch.zeros(4, 8), 2)
    with pytest.raises(ValueError, match="hidden is torch.bfloat16 but the cache holds float32"):
        write_task(folder, "x", torch.arange(4), torch.zeros(4, 16, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError, match="prompt_len 9 does not fit 4 tokens"):
        write_task(folder, "x", torch.arange(4), torch.zeros(4, 16), 9)
    with pytest.raises(ValueError, match="not usable as a file name"):
        write_task(folder, "../x", torch.arange(4), torch.zeros(4, 16), 2)
    assert HiddenStateCache(folder).task_names == ["alpha", "beta"]


def test_the_task_name_mean_is_reserved_by_the_writer_and_the_reader(tmp_path):
    """`mean` names the run-level mean over tasks in logged keys and tables: a task of that
    name would be shadowed by it, so no cache can hold one."""
    folder = make_cache(tmp_path / "c")
    with pytest.raises(ValueError, match="task name 'mean' is reserved for the mean over tasks"):
        write_task(folder, "mean", torch.arange(4), torch.zeros(4, 16), 2)
    assert HiddenStateCache(folder).task_names == ["alpha", "beta"] and not (folder / "mean.safetensors").exists()
    write_task(folder, "means", torch.arange(4), torch.zeros(4, 16), 2)  # only the exact name is reserved
    edit_manifest(folder, lambda m: m["tasks"][0].update(name="mean"))  # a manifest written by another tool
    with pytest.raises(CacheError, match=r"manifest.json: tasks\[0\]: task name 'mean' is reserved"):
        HiddenStateCache(folder)


def test_reopening_for_writing_checks_settings_and_cleans_temp_files(tmp_path):
    folder = make_cache(tmp_path / "c")
    stale = folder / ".gamma.safetensors.tmp-12345"
    stale.write_bytes(b"half a file")
    manifest = open_for_writing(folder, new_manifest(TARGET, [1, 2]))
    assert [t["name"] for t in manifest["tasks"]] == ["alpha", "beta"]
    assert not stale.exists()
    with pytest.raises(CacheError, match=r"made differently .*layer ids \[1, 2\] != \[1, 3\]"):
        open_for_writing(folder, new_manifest(TARGET, [1, 3]))
    with pytest.raises(CacheError, match="block size None != 16"):
        open_for_writing(folder, new_manifest(TARGET, [1, 2], block_size=16))


# ---------------------------------------------------------------- damaged task files


def test_missing_task_file(tmp_path):
    folder = make_cache(tmp_path / "c")
    (folder / "beta.safetensors").unlink()
    cache = HiddenStateCache(folder)  # opening does not read task files
    cache.task("alpha")
    with pytest.raises(CacheError, match=r"task 'beta': file .*beta\.safetensors is missing"):
        cache.task("beta")


def test_truncated_task_file(tmp_path):
    folder = make_cache(tmp_path / "c")
    path = folder / "alpha.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheError, match=rf"alpha\.safetensors is {len(data) // 2} bytes but the manifest says {len(data)}: truncated"):
        HiddenStateCache(folder).task("alpha")


def test_corrupt_task_file_fails_sha_check(tmp_path):
    folder = make_cache(tmp_path / "c")
    path = folder / "beta.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # same size, one byte of hidden state flipped
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"beta\.safetensors has sha256 .* but the manifest says .*corrupt"):
        HiddenStateCache(folder).task("beta")


def test_verify_checks_every_task(tmp_path):
    folder = make_cache(tmp_path / "c")
    HiddenStateCache(folder).verify()
    path = folder / "beta.safetensors"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    with pytest.raises(CacheError, match="beta"):
        HiddenStateCache(folder).verify()


def test_unreadable_file_whose_checksum_matches(tmp_path):
    """A writer bug (or hand edit) can leave a file the manifest vouches for that is not safetensors."""
    import hashlib

    folder = make_cache(tmp_path / "c")
    garbage = b"\xff" * 64
    (folder / "alpha.safetensors").write_bytes(garbage)

    def vouch(m):
        m["tasks"][0].update(num_bytes=len(garbage), sha256=hashlib.sha256(garbage).hexdigest())

    edit_manifest(folder, vouch)
    with pytest.raises(CacheError, match=r"alpha\.safetensors is not a readable safetensors file"):
        HiddenStateCache(folder).task("alpha")


def test_tensor_shapes_must_match_manifest(tmp_path):
    folder = make_cache(tmp_path / "c")
    edit_manifest(folder, lambda m: m.update(layer_ids=[1]))  # hidden width is now wrong
    with pytest.raises(CacheError, match=r"hidden is torch.float32 \[12, 16\], expected torch.float32 \[12, 8\]"):
        HiddenStateCache(folder).task("alpha")


def test_unknown_task_name(tmp_path):
    with pytest.raises(KeyError, match=r"no task 'gamma' .* it holds \['alpha', 'beta'\]"):
        HiddenStateCache(make_cache(tmp_path / "c")).task("gamma")


# ---------------------------------------------------------------- manifest validation


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.update(version=2), "cache format version 2 is not supported"),
        (lambda m: m.update(format="something-else"), "format is 'something-else', expected 'dflash-hidden-cache'"),
        (lambda m: m.pop("layer_ids"), "missing field 'layer_ids'"),
        (lambda m: m.update(layer_ids="1,2"), "field 'layer_ids' must be list, got str"),
        (lambda m: m["target"].pop("hidden_size"), "target: missing field 'hidden_size'"),
        (lambda m: m["target"].update(vocab_size=50.0), "target: field 'vocab_size' must be int, got float"),
        (lambda m: m["target"].update(dtype="int8"), "target.dtype 'int8' is not one of"),
        (lambda m: m.update(layer_ids=[1, 7]), "layer id 7 is outside the target's 4 layers"),
        (lambda m: m.update(layer_ids=[1, True]), r"layer_ids\[1\] must be int, got bool"),
        (lambda m: m.update(block_size="16"), "field 'block_size' must be int or null"),
        (lambda m: m["tasks"][1].update(prompt_len="3"), r"tasks\[1\]: field 'prompt_len' must be int, got str"),
        (lambda m: m["tasks"][0].pop("sha256"), r"tasks\[0\]: missing field 'sha256'"),
        (lambda m: m["tasks"][0].update(sha256="abc"), "sha256 must be 64 lowercase hex digits"),
        (lambda m: m["tasks"][0].update(file="../alpha.safetensors"), "must be a distinct plain file name"),
        (lambda m: m["tasks"][1].update(name="alpha"), "duplicate task name 'alpha'"),
        (lambda m: m["tasks"][0].update(prompt_len=99), "need 0 <= prompt_len <= num_tokens"),
        (lambda m: m.update(tasks={}), "field 'tasks' must be list, got dict"),
    ],
)
def test_invalid_manifest_is_refused_naming_the_field(tmp_path, change, message):
    folder = make_cache(tmp_path / "c")
    edit_manifest(folder, change)
    with pytest.raises(CacheError, match=message) as error:
        HiddenStateCache(folder)
    assert "manifest.json" in str(error.value)


def test_not_a_cache(tmp_path):
    with pytest.raises(FileNotFoundError, match="no cache folder"):
        HiddenStateCache(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="has no manifest.json"):
        HiddenStateCache(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CacheError, match="manifest.json is not valid JSON"):
        HiddenStateCache(tmp_path)
    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe{}")  # not UTF-8: was a bare UnicodeDecodeError
    with pytest.raises(CacheError, match="manifest.json is not valid JSON: 'utf-8' codec"):
        HiddenStateCache(tmp_path)


def test_a_hand_edited_manifest_that_mixes_tasks_up_is_refused(tmp_path):
    """Two entries whose files (with their sizes, sha256s and lengths) were swapped, or a key given twice
    (json keeps the last): each task's numbers would be another's, or tasks would vanish without a word."""
    folder = make_cache(tmp_path / "c")

    def swap(m):
        a, b = m["tasks"]
        for key in ("file", "num_bytes", "sha256", "num_tokens"):
            a[key], b[key] = b[key], a[key]

    edit_manifest(folder, swap)
    cache = HiddenStateCache(folder)
    with pytest.raises(CacheError, match=r"task 'alpha': file .*beta.safetensors was written for task 'beta'"):
        cache.verify()
    text = (folder / "manifest.json").read_text()
    (folder / "manifest.json").write_text(text[:-1] + ', "tasks": []}')
    with pytest.raises(CacheError, match=r"manifest.json is not valid JSON: the key\(s\) \['tasks'\] appear twice"):
        HiddenStateCache(folder)


# ---------------------------------------------------------------- compatibility and fingerprint


def test_check_compatible_names_both_sides(tmp_path):
    cache = HiddenStateCache(make_cache(tmp_path / "c", block_size=4))
    cache.check_compatible(drafter_config())
    with pytest.raises(CacheMismatchError, match=r"cache layer ids \[1, 2\] != drafter target_layer_ids \[1, 3\]"):
        cache.check_compatible(drafter_config(target_layer_ids=[1, 3]))
    with pytest.raises(CacheMismatchError, match="cache hidden size 8 != drafter hidden_size 16"):
        cache.check_compatible(drafter_config(hidden_size=16, head_dim=8))
    with pytest.raises(CacheMismatchError, match="cache vocab size 50 != drafter vocab_size 60"):
        cache.check_compatible(drafter_config(vocab_size=60))
    with pytest.raises(CacheMismatchError, match="cache target has 4 layers != drafter num_target_layers 6"):
        cache.check_compatible(drafter_config(num_target_layers=6))


def test_block_size_mismatch_warns(tmp_path):
    cache = HiddenStateCache(make_cache(tmp_path / "c", block_size=16))
    with pytest.warns(UserWarning, match="made for block size 16 but block size 4 is being scored"):
        cache.check_compatible(drafter_config(block_size=4))
    with pytest.warns(UserWarning, match="block size 8 is being scored"):
        cache.check_compatible(drafter_config(block_size=16), block_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.check_compatible(drafter_config(block_size=4), block_size=16)
        HiddenStateCache(make_cache(tmp_path / "d")).check_compatible(drafter_config())  # made for no block size


def test_fingerprint_is_stable_and_tracks_content(tmp_path):
    folder = make_cache(tmp_path / "c")
    first = HiddenStateCache(folder).fingerprint
    assert len(first) == 16 and first == HiddenStateCache(folder).fingerprint
    assert HiddenStateCache(make_cache(tmp_path / "same")).fingerprint == first  # same content elsewhere
    edit_manifest(folder, lambda m: m["target"].update(path="/moved/tiny"))
    assert HiddenStateCache(folder).fingerprint == first
    write_task(folder, "beta", torch.arange(7), torch.ones(7, 16), 3, prompt="prompt of beta")
    assert HiddenStateCache(folder).fingerprint != first
    assert HiddenStateCache(make_cache(tmp_path / "other", seed=1)).fingerprint != first


# ---------------------------------------------------------------- task sets


def test_coding10():
    assert "coding10" in builtin_task_sets()
    tasks = load_tasks("coding10")
    assert [t.name for t in tasks] == [
        "fizzbuzz", "binary_search", "linked_list_reverse", "json_parser", "graph_bfs",
        "async_rate_limiter", "trie", "lru_cache", "merge_sort", "matrix_multiply",
    ]
    assert all(isinstance(t, Task) and len(t.prompt) > 100 and t.prompt == t.prompt.strip() for t in tasks)
    assert "autocomplete" in next(t.prompt for t in tasks if t.name == "trie")


def test_coding50_spans_languages_and_lengths():
    """coding50: at least 50 requests written as users ask chat models for code, short and long,
    in every language it names (the name's prefix), none of coding10's."""
    tasks = load_tasks("coding50")
    assert "coding50" in builtin_task_sets() and len(tasks) >= 50
    languages = {}
    for task in tasks:
        languages.setdefault(task.name.split("_")[0], []).append(task)
    assert set(languages) == {"py", "cpp", "rust", "go", "js", "ts", "sql", "sh", "java"}
    assert all(len(found) >= 3 for lang, found in languages.items() if lang not in ("js", "ts"))
    assert len(languages["js"] + languages["ts"]) >= 5
    lengths = sorted(len(t.prompt) for t in tasks)
    assert lengths[0] < 40 and lengths[-1] > 800 and sum(n < 120 for n in lengths) >= 10  # one-liners to specifications
    assert not {t.name for t in tasks} & {t.name for t in load_tasks("coding10")}


@pytest.mark.parametrize(
    "text, message",
    [
        ("tasks:\n  - {name: a, prompt: x}\n  - {name: a, prompt: y}\n", r"tasks\[1\]: duplicate task name 'a'"),
        ("tasks:\n  - {name: a, prompt: x}\ntasks:\n  - {name: b, prompt: y}\n", "found the key 'tasks' twice"),
        ("tasks:\n  - {name: a, prompt: x, prompt: y}\n", "found the key 'prompt' twice"),
        ("tasks:\n  - {name: a, prompt: x}\n  - {[1]: x}\n", "(?s)not valid YAML: .*found unhashable key"),
        ("tasks:\n  - {name: a, prompt: '   '}\n", r"tasks\[0\] \(a\) has an empty prompt"),
        ("tasks:\n  - {name: a, prompt: 5}\n", r"tasks\[0\].prompt must be a string, got int"),
        ("tasks:\n  - {name: a}\n", r"tasks\[0\] has no 'prompt'"),
        ("tasks:\n  - {name: a, promt: x}\n", r"unknown keys \['promt'\]"),
        ("tasks:\n  - {name: 'a b', prompt: x}\n", "not usable as a file name"),
        ("tasks:\n  - name: |\n      a\n    prompt: x\n", r"task name 'a\\n' is not usable"),  # a block scalar ends in \n
        ("tasks:\n  - {name: mean, prompt: x}\n", r"tasks\[0\].name: task name 'mean' is reserved"),
        ("tasks:\n  - just a string\n", r"tasks\[0\] must be a mapping"),
        ("tasks: []\n", "the 'tasks' list is empty"),
        ("- {name: a, prompt: x}\n", "expected a mapping with a 'tasks' list"),
        ("tasks: [unclosed\n", "is not valid YAML"),
    ],
)
def test_task_file_validation(tmp_path, text, message):
    path = tmp_path / "tasks.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        load_tasks(path)
    assert str(path) in str(error.value)


def test_task_file_and_unknown_set(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("tasks:\n  - name: hello\n    prompt: |\n      Say hello.\n")
    assert load_tasks(str(path)) == [Task("hello", "Say hello.")]
    with pytest.raises(FileNotFoundError, match=r"unknown task set 'coding11': give a built-in name \(coding10, coding50\)"):
        load_tasks("coding11")


def test_a_cache_made_before_heads_were_fingerprinted_reopens_for_writing(tmp_path):
    """An older cache records no target head: reopening it with one goes on (nothing to hold
    it to); two recorded heads that differ are refused."""
    from dflash_callbacks.cache.format import CacheError, new_manifest, open_for_writing

    with_head = lambda head: TargetInfo(**{**TARGET.__dict__, "head": head})  # noqa: E731
    open_for_writing(tmp_path / "old", new_manifest(TARGET, [0, 2]))
    assert "head" not in open_for_writing(tmp_path / "old", new_manifest(with_head("a" * 16), [0, 2]))["target"]
    open_for_writing(tmp_path / "new", new_manifest(with_head("a" * 16), [0, 2]))
    with pytest.raises(CacheError, match="made differently"):
        open_for_writing(tmp_path / "new", new_manifest(with_head("b" * 16), [0, 2]))

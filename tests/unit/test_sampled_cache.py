"""Sampled caches: the served distribution against a plain reference, answers drawn as a plain
one-row sampler draws them, their log-probabilities, the manifest, reading, resuming, refusals."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_callbacks.cache.extract import extract_cache, stop_token_ids
from dflash_callbacks.cache.format import CacheError, HiddenStateCache
from dflash_callbacks.cache.sampling import Sampling, served_logprobs
from dflash_callbacks.cache.tasks import Task
from dflash_callbacks.cli import main as cli_main
from dflash_callbacks.demos.toy.threads import torch_threads

TASKS = [Task("fizz", "Write fizzbuzz in Python."), Task("search", "Implement binary search over a sorted list.")]
SETTINGS = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "samples": 3, "seed": 5}


@pytest.fixture(autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


def reference_served(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row, written plainly in the serving engine's steps: divide by T; sort ascending; mask what
    lies below the k-th largest; mask the tokens whose ascending cumulative probability is <= 1 - p
    (never the largest); softmax."""
    x = logits.double() / temperature
    values, order = x.sort()
    if top_k:
        values = torch.where(values < values[-top_k], -math.inf, values)
    if top_p < 1:
        cumulative = values.softmax(0).cumsum(0)
        drop = cumulative <= 1 - top_p
        drop[-1] = False
        values = torch.where(drop, -math.inf, values)
    out = torch.empty_like(x)
    out[order] = values
    return out.log_softmax(0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.95), (0.7, 5, 1.0), (1.3, 7, 0.6),
                                                      (0.5, 0, 0.3)])
def test_served_logprobs_match_a_plain_reference(temperature, top_k, top_p):
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(0)) * 3
    served = served_logprobs(logits, Sampling(temperature, top_p, top_k))
    for row, got in zip(logits, served):
        want = reference_served(row, temperature, top_k, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.allclose(got[torch.isfinite(got)].double(), want[torch.isfinite(want)], atol=1e-5)
    kept = torch.isfinite(served).sum(-1)
    assert (kept >= 1).all() and (top_k == 0 or (kept <= top_k).all()) and (top_p == 1 or (kept < 40).any())


def test_served_logprobs_by_hand_and_greedy():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.isfinite(served_logprobs(logits, Sampling(1.0, 0.85))).tolist() == [True, True, True, False]
    assert torch.isfinite(served_logprobs(logits, Sampling(1.0, 0.75))).tolist() == [True, True, False, False]
    assert torch.isfinite(served_logprobs(logits, Sampling(1.0, 1.0, 1))).tolist() == [True, False, False, False]
    assert torch.allclose(served_logprobs(logits, Sampling(1.0, 0.85)).exp(), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    greedy = served_logprobs(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), Sampling())
    assert greedy.tolist() == [[-math.inf, 0.0, -math.inf, -math.inf]]  # the lowest id among ties


def sample_plainly(model, prompt_ids: torch.Tensor, sampling: Sampling, generator, max_new_tokens: int, eos):
    """The reference sampler: one answer, a full forward per token, no KV cache."""
    ids, logprobs = prompt_ids, []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            served = served_logprobs(model(input_ids=ids[None]).logits[0, -1], sampling)
        token = torch.multinomial(served.exp(), 1, generator=generator)
        ids, logprobs = torch.cat([ids, token]), logprobs + [float(served[token])]
        if int(token) in eos:
            break
    return ids, logprobs


def test_sampled_answers_are_drawn_as_a_plain_sampler_draws_them(random_target_dir, tmp_path):
    cache = extract_cache(random_target_dir, tmp_path / "cache", TASKS, [1, 2], max_new_tokens=20, progress=False,
                          **SETTINGS)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["sampling"] == SETTINGS and cache.sampling == Sampling(**SETTINGS)
    assert manifest["extraction"] == {"max_new_tokens": 20, "chat_template": True, "tasks": ["fizz", "search"]}
    assert cache.task_names == ["fizz.s0", "fizz.s1", "fizz.s2", "search.s0", "search.s1", "search.s2"]
    assert [t["sample"] for t in manifest["tasks"]] == [0, 1, 2, 0, 1, 2]

    model = AutoModelForCausalLM.from_pretrained(random_target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(random_target_dir)
    eos, _ = stop_token_ids(model, tokenizer)
    answers = set()
    for task in TASKS:
        for i in range(3):
            cached = cache.task(f"{task.name}.s{i}")
            P, ids = cached.prompt_len, cached.input_ids
            ids_plain, logprobs_plain = sample_plainly(model, ids[:P], cache.sampling,
                                                       cache.sampling.generator(task.name, i), 20, eos)
            assert torch.equal(ids, ids_plain)
            assert cached.target_logprob.dtype == torch.float32 and (cached.target_logprob[:P] == 0).all()
            assert torch.allclose(cached.target_logprob[P:], torch.tensor(logprobs_plain), atol=1e-4)
            with torch.no_grad():  # and they are the served log-probabilities of the cached text under a fresh forward
                fresh = served_logprobs(model(input_ids=ids[None]).logits[0, :-1], cache.sampling)
            assert torch.allclose(cached.target_logprob[P:], fresh.gather(1, ids[1:, None])[P - 1:, 0], atol=1e-4)
            answers.add(tuple(ids[P:].tolist()))
    assert len(answers) == 6  # every answer its own draw

    again = extract_cache(random_target_dir, tmp_path / "again", TASKS, [1, 2], max_new_tokens=20, progress=False,
                          **SETTINGS)
    assert [t["sha256"] for t in again.manifest["tasks"]] == [t["sha256"] for t in manifest["tasks"]]
    other = extract_cache(random_target_dir, tmp_path / "other", TASKS, [1, 2], max_new_tokens=20, progress=False,
                          **{**SETTINGS, "seed": 6})
    assert not torch.equal(other.task("fizz.s0").input_ids, cache.task("fizz.s0").input_ids)


def test_one_sample_keeps_the_task_names_and_a_resume_redraws_only_what_is_missing(random_target_dir, tmp_path):
    settings = {**SETTINGS, "samples": 1}
    out = tmp_path / "cache"
    cache = extract_cache(random_target_dir, out, TASKS, [1], max_new_tokens=8, progress=False, **settings)
    assert cache.task_names == ["fizz", "search"] and cache.task("fizz").target_logprob is not None
    kept, lost = (out / "fizz.safetensors").stat(), (out / "search.safetensors").read_bytes()
    (out / "search.safetensors").unlink()
    extract_cache(random_target_dir, out, TASKS, [1], max_new_tokens=8, progress=False, **settings)
    assert (out / "fizz.safetensors").stat().st_mtime_ns == kept.st_mtime_ns
    assert (out / "search.safetensors").read_bytes() == lost  # the same draw: its own generator
    with pytest.raises(CacheError, match="made differently .*sampling"):
        extract_cache(random_target_dir, out, TASKS, [1], max_new_tokens=8, progress=False, **{**settings, "top_p": 0.5})
    with pytest.raises(CacheError, match="made differently .*sampling"):  # a greedy resume of a sampled cache
        extract_cache(random_target_dir, out, TASKS, [1], max_new_tokens=8, progress=False)


def test_greedy_defaults_write_the_greedy_cache_byte_for_byte(random_target_dir, tmp_path):
    plain = extract_cache(random_target_dir, tmp_path / "plain", TASKS, [1], max_new_tokens=6, progress=False)
    explicit = extract_cache(random_target_dir, tmp_path / "explicit", TASKS, [1], max_new_tokens=6, progress=False,
                             temperature=0.0, top_p=1.0, top_k=0, samples=1, seed=0)
    for cache in (plain, explicit):
        assert cache.sampling is None and "sampling" not in cache.manifest
        assert all("sample" not in t for t in cache.manifest["tasks"]) and cache.task("fizz").target_logprob is None
        with safe_open(str(cache.path / "fizz.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == ["hidden", "input_ids"]
    strip = lambda m: {**m, "target": {k: v for k, v in m["target"].items() if k != "path"}}  # noqa: E731
    assert strip(plain.manifest) == strip(explicit.manifest)
    for file in ("fizz.safetensors", "search.safetensors"):
        assert (plain.path / file).read_bytes() == (explicit.path / file).read_bytes()


def test_bad_settings_are_refused_all_at_once(random_target_dir, tmp_path, capsys):
    with pytest.raises(ValueError) as e:
        extract_cache(random_target_dir, tmp_path / "x", TASKS, [1], temperature=-1, top_p=0.0, top_k=-2, samples=0)
    assert str(e.value).splitlines() == [
        "temperature must be a number >= 0 (0: greedy); got -1",
        "top_p must be a number in (0, 1] (1: off); got 0.0",
        "top_k must be an integer >= 0 (0: off); got -2",
        "samples (answers per prompt) must be an integer >= 1; got 0",
    ]
    with pytest.raises(ValueError, match="apply to sampled answers only: give a temperature > 0"):
        extract_cache(random_target_dir, tmp_path / "x", TASKS, [1], top_p=0.9)
    assert not (tmp_path / "x").exists()
    assert cli_main(["extract", "--target", str(random_target_dir), "--out", str(tmp_path / "y"), "--layer-ids", "1",
                     "--temperature", "0.7", "--top-p", "1.5", "--samples", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: top_p must be a number in (0, 1] (1: off); got 1.5",
        "error: samples (answers per prompt) must be an integer >= 1; got 0",
    ]


def test_the_reader_refuses_a_sampled_cache_that_is_not_one(random_target_dir, tmp_path):
    out = tmp_path / "cache"
    extract_cache(random_target_dir, out, TASKS[:1], [1], max_new_tokens=4, progress=False)  # greedy
    manifest_path = out / "manifest.json"
    greedy = json.loads(manifest_path.read_text())

    def refused(manifest: dict, message: str) -> None:
        manifest_path.write_text(json.dumps(manifest))
        with pytest.raises(CacheError, match=message):
            HiddenStateCache(out).task("fizz")

    sampling = dict(SETTINGS, samples=1)
    with_sample = [{**t, "sample": 0} for t in greedy["tasks"]]
    refused({**greedy, "sampling": {**sampling, "top_p": 2}}, r"sampling: top_p must be a number in \(0, 1\]")
    refused({**greedy, "sampling": {**sampling, "temperature": 0, "top_p": 1.0, "top_k": 0}}, "temperature 0 is greedy")
    refused({**greedy, "sampling": {"temperature": 1.0}}, "sampling: has the fields")
    refused({**greedy, "sampling": sampling}, r"tasks\[0\]: missing field 'sample'")
    refused({**greedy, "sampling": sampling, "tasks": [{**t, "sample": 1} for t in greedy["tasks"]]},
            r"sample 1 is outside 0..0")
    refused({**greedy, "tasks": with_sample}, "a greedy cache .* records sample 0")
    refused({**greedy, "sampling": sampling, "tasks": with_sample}, r"has no tensor\(s\) \['target_logprob'\]")

"""The toy world: the shipped target, its caches, the drafter config that fits, the trainer."""

import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from dflash_callbacks.cache.extract import prompt_token_ids, target_hidden_states
from dflash_callbacks.cache.format import HiddenStateCache
from dflash_callbacks.cache.tasks import load_tasks
from dflash_callbacks.demos.toy.corpus import stdlib_sources
from dflash_callbacks.demos.toy.threads import torch_threads
from dflash_callbacks.demos.toy.tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, MASK_ID, VOCAB_SIZE
from dflash_callbacks.demos.toy.world import TOY_MAX_NEW_TOKENS, toy_drafter_config

from suite_paths import REPO


def test_shipped_target_loads_like_any_target(toy_target):
    tokenizer = AutoTokenizer.from_pretrained(toy_target)
    model = AutoModelForCausalLM.from_pretrained(toy_target)
    assert isinstance(model, Qwen3ForCausalLM)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (4, 128, VOCAB_SIZE)
    assert model.dtype == torch.float32 and not model.config.tie_word_embeddings
    assert (toy_target / "model.safetensors").stat().st_size < 5_000_000
    text = "def héllo():\n\treturn '✓'"
    assert tokenizer(text).input_ids == list(text.encode())
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert len(tokenizer) == VOCAB_SIZE and tokenizer.mask_token_id == MASK_ID and tokenizer.eos_token_id == IM_END_ID
    assert tokenizer.pad_token_id == ENDOFTEXT_ID and model.generation_config.eos_token_id == [IM_END_ID, ENDOFTEXT_ID]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    log = json.loads((toy_target / "train_log.json").read_text())
    assert log["losses"][-1] < 2.0 < log["losses"][0]


def test_greedy_completion_of_a_coding_prompt_is_not_degenerate(toy_target):
    tokenizer = AutoTokenizer.from_pretrained(toy_target)
    model = AutoModelForCausalLM.from_pretrained(toy_target).eval()
    prompt = load_tasks("coding10")[0].prompt
    ids = torch.tensor([prompt_token_ids(tokenizer, prompt, chat_template=True)])
    with torch_threads(1), torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=64)
    completion = out[0, ids.shape[1] :].tolist()
    text = tokenizer.decode(completion)
    assert len(completion) == 64, text
    assert len(set(completion)) >= 8, text
    assert max(completion.count(t) for t in set(completion)) < 32, text  # no single token dominates
    assert sum(ch.isprintable() or ch in "\n\t" for ch in text) >= 0.95 * len(text), text


def test_toy_cache_fits_the_toy_drafter(toy_cache):
    assert toy_cache.task_names == [t.name for t in load_tasks("coding10")]
    assert (toy_cache.layer_ids, toy_cache.hidden_size, toy_cache.vocab_size, toy_cache.block_size) == ([1, 2], 128, 260, None)
    toy_cache.check_compatible(toy_drafter_config())
    for task in toy_cache.tasks():
        completion = task.input_ids[task.prompt_len :]
        assert 1 <= len(completion) <= TOY_MAX_NEW_TOKENS
        assert task.input_ids[task.prompt_len - 1] == ord("\n")  # the prompt ends "<|im_start|>assistant\n"
        assert len(set(completion.tolist())) >= 8, task.name
    assert toy_cache.fingerprint == HiddenStateCache(toy_cache.path).fingerprint


def test_toy_drafter_config():
    cfg = toy_drafter_config(block_size=16, num_layers=2)
    assert (cfg.block_size, cfg.num_hidden_layers, cfg.target_layer_ids, cfg.mask_token_id) == (16, 2, [1, 2], MASK_ID)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers, cfg.num_target_features) == (128, 260, 4, 256)


def test_toy_training_cache(toy_training_cache_dir, toy_target):
    cache = HiddenStateCache(toy_training_cache_dir)
    assert cache.task_names == [f"seq{i:05d}" for i in range(32)] and cache.layer_ids == [1, 2]
    tasks = list(cache.tasks())
    assert all(t.prompt_len == 64 and 64 < t.num_tokens <= 128 for t in tasks)
    assert all(t.input_ids[0] == IM_START_ID and t.input_ids[63] == ord("\n") for t in tasks)  # chat requests
    assert len({tuple(t.input_ids[:64].tolist()) for t in tasks}) == 32  # all different
    assert sum(t.num_tokens == 128 for t in tasks) >= 16  # most answers run to the limit
    assert sum(len(set(t.input_ids[64:].tolist())) >= 8 for t in tasks) >= 24  # mostly not degenerate
    model = AutoModelForCausalLM.from_pretrained(toy_target).eval()
    with torch_threads(1):
        fresh = target_hidden_states(model, tasks[0].input_ids[None], [1, 2])[0]
    torch.testing.assert_close(tasks[0].hidden, fresh, atol=1e-4, rtol=1e-4)


def test_stdlib_split_is_disjoint():
    train, held_out = set(stdlib_sources("train")), set(stdlib_sources("heldout"))
    assert train.isdisjoint(held_out)
    assert 0.05 < len(held_out) / (len(train) + len(held_out)) < 0.2


def test_training_script_short_run(tmp_path):
    out = tmp_path / "target"
    tool = REPO / "tools" / "train_toy_target.py"
    args = ["--out", str(out), "--steps", "12", "--batch-size", "4", "--seq-len", "64", "--max-bytes", "60000"]
    run = subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "trained in" in run.stdout
    log = json.loads((out / "train_log.json").read_text())
    assert len(log["losses"]) == 12 and log["torch_threads"] == 1
    assert sum(log["losses"][-3:]) / 3 < log["losses"][0] - 0.5
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, Qwen3ForCausalLM) and len(AutoTokenizer.from_pretrained(out)) == VOCAB_SIZE

"""Shared fixtures for targets and caches, built once per test session.

conftest.py imports these (`from fixtures_cache import *`), so every test module can ask for:
- `toy_target`: the shipped toy target folder (trained tiny Qwen3ForCausalLM + byte tokenizer);
- `toy_cache_dir` / `toy_cache`: the toy target's coding10 cache (layer ids [1, 2], fp32,
  96 new tokens per task), extracted once;
- `toy_training_cache_dir`: drafter training data, 32 sequences of up to 128 tokens (a 64-token
  chat request, then the toy target's greedy answer);
- `random_target_dir`: a random-init 6-layer, hidden-64, vocab-300 Qwen3ForCausalLM with the
  toy tokenizer, the shape of target that the zlab-tiny-full fixture drafter reads
  (target_layer_ids [1, 2, 4]).
`save_random_target(...)` makes other random targets (dtype, shards, shape).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from dflash_callbacks.cache.format import HiddenStateCache
from dflash_callbacks.demos.toy.tokenizer import ENDOFTEXT_ID, IM_END_ID, build_byte_tokenizer
from dflash_callbacks.demos.toy.world import build_toy_cache, build_toy_training_cache, toy_target_path

__all__ = [
    "save_random_target",
    "toy_target",
    "toy_cache_dir",
    "toy_cache",
    "toy_training_cache_dir",
    "random_target_dir",
]


def save_random_target(
    folder: Path,
    *,
    num_layers: int = 6,
    hidden_size: int = 64,
    vocab_size: int = 300,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    seed: int = 0,
) -> Path:
    """Save a random-init Qwen3ForCausalLM (+ the toy byte tokenizer) as a transformers
    folder, optionally sharded (`max_shard_size` like "100KB"). The vocabulary may be larger
    than the tokenizer's 260 tokens, as Qwen's 151936 rows exceed its tokenizer."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )
    model = Qwen3ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    build_byte_tokenizer().save_pretrained(folder)
    return Path(folder)


@pytest.fixture(scope="session")
def toy_target() -> Path:
    return toy_target_path()


@pytest.fixture(scope="session")
def toy_cache_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy-cache") / "coding10"
    build_toy_cache(out)
    return out


@pytest.fixture(scope="session")
def toy_cache(toy_cache_dir) -> HiddenStateCache:
    return HiddenStateCache(toy_cache_dir)


@pytest.fixture(scope="session")
def toy_training_cache_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy-training-cache") / "train"
    build_toy_training_cache(out, n_sequences=32, seq_len=128, progress=False)
    return out


@pytest.fixture(scope="session")
def random_target_dir(tmp_path_factory) -> Path:
    return save_random_target(tmp_path_factory.mktemp("random-target") / "target")

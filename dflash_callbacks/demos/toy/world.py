"""The toy world: a tiny real target, a drafter config that fits it, and caches built from it.

Everything here runs offline on a CPU in seconds and goes through the same code paths as
a real setup: the target is a `Qwen3ForCausalLM` folder (shipped in `assets/target/`,
made by `python tools/train_toy_target.py`) loaded with AutoModelForCausalLM,
and the caches are written by the extraction code in `dflash_callbacks.cache`.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...cache.extract import (
    check_layer_ids,
    extract_cache,
    greedy_generate,
    load_target,
    prompt_token_ids,
    stop_token_ids,
    target_hidden_states,
    target_info,
)
from ...cache.format import CacheError, HiddenStateCache, check_task_file, new_manifest, open_for_writing, write_task
from ...cache.tasks import Task
from ...model.config import DrafterConfig
from .corpus import module_texts, read_source, stdlib_sources
from .threads import torch_threads
from .tokenizer import MASK_ID

TOY_TARGET_DIR = Path(__file__).resolve().parent / "assets" / "target"
TOY_LAYER_IDS = [1, 2]  # of the toy target's 4 decoder layers
TOY_MAX_NEW_TOKENS = 96
from ..settings import TRAINING_PROMPT_LEN  # noqa: E402  (one value, the demo checks it too)


def toy_target_path() -> Path:
    """The shipped toy target folder (config.json, model.safetensors, tokenizer files)."""
    if not (TOY_TARGET_DIR / "config.json").is_file() or not (TOY_TARGET_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the toy target is missing from {TOY_TARGET_DIR}; recreate it with "
            f"`python tools/train_toy_target.py --out {TOY_TARGET_DIR}` in a source checkout"
        )
    return TOY_TARGET_DIR


def toy_drafter_config(block_size: int = 8, num_layers: int = 1) -> DrafterConfig:
    """A drafter config that fits the toy target: its hidden size, vocabulary and RoPE,
    target layer ids [1, 2], and the tokenizer's reserved <|mask|> as mask token."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    target = json.loads((toy_target_path() / "config.json").read_text())
    return DrafterConfig(
        hidden_size=target["hidden_size"],
        intermediate_size=2 * target["hidden_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=target["num_attention_heads"],
        num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"],
        block_size=block_size,
        mask_token_id=MASK_ID,
        target_layer_ids=list(TOY_LAYER_IDS),
        vocab_size=target["vocab_size"],
        rms_norm_eps=target["rms_norm_eps"],
        max_position_embeddings=target["max_position_embeddings"],
        rope_parameters=dict(target["rope_parameters"]),
        num_target_layers=target["num_hidden_layers"],
    )


def build_toy_cache(
    out: str | os.PathLike,
    tasks: str | os.PathLike | list[Task] = "coding10",
    max_new_tokens: int = TOY_MAX_NEW_TOKENS,
    *,
    block_size: int | None = None,
    progress: bool = False,
) -> HiddenStateCache:
    """The coding cache of the toy target (chat template on, fp32, layer ids [1, 2]),
    extracted with `extract_cache` exactly as a real one is (on one torch thread)."""
    with torch_threads(1):
        return extract_cache(
            toy_target_path(),
            out,
            tasks,
            TOY_LAYER_IDS,
            max_new_tokens=max_new_tokens,
            dtype=torch.float32,
            chat_template=True,
            block_size=block_size,
            progress=progress,
        )


def request_prompts(tokenizer, n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`n` distinct chat prompts of exactly `prompt_len` tokens, in seeded random order: the
    request for a documented public function of a held-out stdlib module (never trained on
    by the toy target, see corpus.py), cut to fit, through the chat template."""
    room = prompt_len - len(prompt_token_ids(tokenizer, "", chat_template=True))
    if room < 8:
        raise ValueError(f"prompt_len {prompt_len} leaves {room} tokens for the request after the chat template; need 8")
    requests = sorted({request for path in stdlib_sources("heldout") for request, _ in module_texts(read_source(path))[1]})
    random.Random(seed).shuffle(requests)
    prompts: dict[tuple[int, ...], None] = {}  # insertion-ordered set
    for request in requests:
        ids = tuple(prompt_token_ids(tokenizer, request.encode()[:room].decode(errors="ignore"), chat_template=True))
        if len(ids) == prompt_len:
            prompts.setdefault(ids)
        if len(prompts) == n:
            return [list(ids) for ids in prompts]
    raise ValueError(f"the held-out stdlib has {len(prompts)} distinct {prompt_len}-token requests; asked for {n}")


@torch.no_grad()
def build_toy_training_cache(
    out: str | os.PathLike,
    n_sequences: int = 64,
    seq_len: int = 128,
    *,
    prompt_len: int = TRAINING_PROMPT_LEN,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> HiddenStateCache:
    """A cache-format folder of drafter training data: `n_sequences` tasks `seq00000`, ...,
    each a `prompt_len`-token chat request for a held-out stdlib function followed by the
    toy target's greedy answer (DFlash drafters train on the target's own responses), up to
    `seq_len` tokens in all (fewer where the target ends its answer with EOS). Prompts are
    all the same length, so answers are generated in batches without padding. Rerunning
    into the same folder keeps the sequences already written."""
    if n_sequences < 1 or not 1 <= prompt_len < seq_len or batch_size < 1:
        raise ValueError(
            f"need n_sequences >= 1, 1 <= prompt_len < seq_len and batch_size >= 1; "
            f"got n_sequences={n_sequences}, prompt_len={prompt_len}, seq_len={seq_len}, batch_size={batch_size}"
        )
    model, tokenizer = load_target(toy_target_path(), dtype=torch.float32)
    layer_ids = check_layer_ids(TOY_LAYER_IDS, model.config.num_hidden_layers)
    extraction = {"kind": "toy-training", "seq_len": seq_len, "prompt_len": prompt_len, "seed": seed}
    manifest = open_for_writing(out, new_manifest(target_info(model.config, model.dtype, toy_target_path()), layer_ids, extraction=extraction))
    done = {entry["name"]: entry for entry in manifest["tasks"]}

    def written(name: str) -> bool:
        if name not in done:
            return False
        try:
            check_task_file(Path(out), done[name])
            return True
        except CacheError:
            return False

    prompts = request_prompts(tokenizer, n_sequences, prompt_len, seed)
    todo = [(f"seq{i:05d}", ids) for i, ids in enumerate(prompts) if not written(f"seq{i:05d}")]
    eos, pad = stop_token_ids(model, tokenizer)
    batches = [todo[i : i + batch_size] for i in range(0, len(todo), batch_size)]
    with torch_threads(1):
        for batch in tqdm(batches, desc="toy training cache", unit="batch", disable=not progress):
            ids = greedy_generate(model, torch.tensor([p for _, p in batch]), seq_len - prompt_len, eos, pad)
            hidden = target_hidden_states(model, ids, layer_ids)  # causal: a row's prefix ignores what follows
            for row, (name, _) in enumerate(batch):
                stops = [t for t in range(prompt_len, ids.shape[1]) if int(ids[row, t]) in eos]
                length = stops[0] + 1 if stops else ids.shape[1]  # keep the target's EOS, drop padding after it
                write_task(out, name, ids[row, :length], hidden[row, :length], prompt_len)
    return HiddenStateCache(out)


TOY_BASELINE_DIR = Path(__file__).resolve().parent / "assets" / "baseline"


def toy_baseline_path() -> Path:
    """The shipped toy baseline drafter folder."""
    if not (TOY_BASELINE_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(f"the toy baseline is missing from {TOY_BASELINE_DIR}; in a source checkout, rebuild "
                                f"it with `python tools/train_toy_baseline.py --out {TOY_BASELINE_DIR}`")
    return TOY_BASELINE_DIR


@dataclass(frozen=True)
class ToyWorld:
    """The folders of the toy world: stand-ins for a real target, cache, baseline and data."""

    target: Path  # the shipped toy target (a transformers model folder)
    baseline: Path  # the shipped toy baseline drafter (published layout)
    cache: Path  # its coding10 cache, for block size `drafter_config.block_size`
    training_data: Path  # drafter training sequences in the cache format
    drafter_config: DrafterConfig  # a drafter that fits the target


def toy_world(folder: str | os.PathLike, block_size: int = 8, sequences: int = 256, seq_len: int = 160) -> ToyWorld:
    """Build (once, under `folder`) the caches of the toy world and return its folders."""
    folder = Path(folder)
    cache = folder / f"coding10-b{block_size}"
    if not (cache / "manifest.json").is_file():
        build_toy_cache(cache, block_size=block_size, progress=True)
    training = folder / f"train-{sequences}x{seq_len}"
    build_toy_training_cache(training, n_sequences=sequences, seq_len=seq_len)
    return ToyWorld(toy_target_path(), toy_baseline_path(), cache, training, toy_drafter_config(block_size=block_size))

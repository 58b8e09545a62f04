"""The families' fixtures (fixtures/families, see its README): their inputs, the blocks decoded by both of
this library's paths (under the drafter's own attention or a rule's), and a one-task cache of their
sequence to score."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_callbacks.cache.format import HiddenStateCache, TargetInfo, new_manifest, open_for_writing, write_task
from dflash_callbacks.model import TargetHead
from dflash_callbacks.model.attention import resolve_attention
from suite_paths import FIXTURES

FAMILIES = FIXTURES / "families"


def case(name: str) -> tuple[dict, dict]:
    """(inputs, expected) of a case folder."""
    return load_file(str(FAMILIES / name / "inputs.safetensors")), load_file(str(FAMILIES / name / "expected.safetensors"))


def head(inputs: dict) -> TargetHead:
    return TargetHead(inputs["target_embed_tokens"], inputs["target_lm_head"])


@torch.no_grad()
def decode(drafter, inputs: dict, anchors: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
           rule: str | None = None):
    """Hidden states [n, B, H] of the blocks at `anchors` (default the fixture's) of the sequence
    `tokens` (default the fixture's): the scorer's path (`decode_blocks`) and the live loop's (`forward`,
    one block at a time), each layer attending as the drafter does (`rule` None) or as `rule` says."""
    attention = None if rule is None else resolve_attention(drafter.config, rule)
    anchors = inputs["anchors"] if anchors is None else anchors
    tokens = inputs["context_input_ids"] if tokens is None else tokens
    hidden, B = inputs["target_hidden"], drafter.block_size
    block = torch.full((anchors.numel(), B), drafter.mask_token_id)
    block[:, 0] = tokens[anchors]
    noise = torch.nn.functional.embedding(block, inputs["target_embed_tokens"])
    C = max(int(anchors.max()), 1)
    batched = drafter.decode_blocks(drafter.encode_context(hidden[:C][None], torch.arange(C)[None]), noise, anchors,
                                    attention)
    alone = torch.cat([drafter(hidden[:a][None], noise[i : i + 1], torch.arange(a + B)[None], attention=attention)
                       for i, a in enumerate(anchors.tolist())])
    return batched, alone


def one_task_cache(root: Path, inputs: dict, tokens: torch.Tensor, prompt_len: int = 3) -> HiddenStateCache:
    """A cache of one task, `tokens` [20] with the fixture's target hidden states (anchors prompt_len .. 18)."""
    return tasks_cache(root, inputs, {"fixture": tokens}, prompt_len)


def tasks_cache(root: Path, inputs: dict, texts: dict[str, torch.Tensor], prompt_len: int = 3) -> HiddenStateCache:
    """A cache of a task per text (name -> tokens [20]), each with the fixture's target hidden states, and the
    fixture's target head in root/target."""
    target, cache = root / "target", root / "cache"
    target.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": inputs["target_embed_tokens"], "lm_head.weight": inputs["target_lm_head"]},
              str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64}))
    open_for_writing(cache, new_manifest(TargetInfo(str(target), 8, 64, 97, "float32"), [1, 3, 5]))
    for name, tokens in texts.items():
        write_task(cache, name, tokens, inputs["target_hidden"], prompt_len)
    return HiddenStateCache(cache)

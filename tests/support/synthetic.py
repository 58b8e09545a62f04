"""A small synthetic world written to real files: a target folder holding only an
embedding and an LM head (safetensors + config.json), a 3-task hidden-state cache,
a drafter config and a baseline drafter folder. The vocabulary is small (16), so
even a random drafter accepts tokens now and then and every streak method is
exercised."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_callbacks import DFlashDrafter, DrafterConfig, TargetHead, save_drafter
from dflash_callbacks.cache.format import HiddenStateCache, TargetInfo, new_manifest, open_for_writing, write_task

V, H = 16, 32
TASKS = [("long", 40, 5), ("short", 25, 3), ("one_anchor", 9, 7)]


@dataclass
class World:
    config: DrafterConfig
    target: Path
    cache: Path
    baseline: Path
    drafter: DFlashDrafter
    head: TargetHead


def drafter_config(**overrides) -> DrafterConfig:
    raw = dict(
        hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, block_size=6, mask_token_id=V - 1, target_layer_ids=[0, 2], vocab_size=V,
        layer_types=["sliding_attention", "full_attention"], sliding_window=7, num_target_layers=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    raw.update(overrides)
    return DrafterConfig(**raw)


@torch.no_grad()
def follow_drafter(drafter, head, T):
    """Tokens that mostly continue with the drafter's own first draft, so that vanilla
    streaks are not all zero: tok[a+1] = argmax at depth 1 of the block at a (context:
    fixed random features), replaced by a random token one time in four."""
    torch.manual_seed(T)
    features = torch.randn(1, T, 2 * H)
    ids = [int(torch.randint(0, V - 1, ()))]
    for a in range(T - 1):
        block = torch.tensor([[ids[-1]] + [V - 1] * 5])
        out = drafter(features[:, :a], head.embed_tokens(block), torch.arange(a + 6)[None])
        guess = int(head.lm_head(out[0, 1]).argmax())
        ids.append(guess if torch.rand(()) < 0.75 else int(torch.randint(0, V - 1, ())))
    return torch.tensor(ids)


def build_world(root: Path) -> World:
    torch.manual_seed(0)
    config = drafter_config()
    drafter = DFlashDrafter(config)
    drafter.reset_parameters(std=0.3)  # sharper distributions than a fresh init
    drafter.eval()
    embed, lm_head = torch.randn(V, H), torch.randn(V, H)
    target = root / "target"
    target.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": torch.ones(H)},
              str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": V, "hidden_size": H}))
    head = TargetHead(embed, lm_head)
    cache = root / "cache"
    open_for_writing(cache, new_manifest(TargetInfo(str(target), 4, H, V, "float32"), [0, 2]))
    for name, T, P in TASKS:
        write_task(cache, name, follow_drafter(drafter, head, T), torch.randn(T, 2 * H), P)
    baseline = save_drafter(root / "baseline", config, drafter.state_dict())
    return World(config, target, cache, baseline, drafter, head)


def open_cache(world: World) -> HiddenStateCache:
    return HiddenStateCache(world.cache)

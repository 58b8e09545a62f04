"""Drafters of every family on the toy world, for the tests that run each family through the entry points.

- `FAMILY_SETTINGS`: a DFlash 2, a DSpark (Markov and confidence heads), a Domino, a JetSpec (as Automodel
  writes it: `dflash_config.causal: true`, top-level `is_causal: false`) and a DFlare drafter on the toy target
  (`family_config`); what each scores (`scoring`: DDTree only where the family scores it) and the stop's
  monitor (`monitor`);
- `train`: a drafter of a config, trained by the one objective (`demos.objective.sequence_loss`) on the toy
  world's training data, one sequence per step;
- `toy_family_baselines` (session fixture): a test-only toy baseline per family, `BASELINE_STEPS` steps of
  `train` saved with `save_drafter` (a few seconds each on one CPU thread);
- `save_checkpoint`: a checkpoint folder as the family's trainer writes it: speculators' (DFlash 2, DSpark:
  `speculators_model_type`, the Qwen3 config nested, aux layer ids + 1, the family's fields flat, on the
  template of the fixture's own speculators folder), SpecForge's export (Domino: the published layout
  with `projector_type: domino`, what `save_drafter` writes), NeMo Automodel's consolidated export (JetSpec:
  one shard and its index, inside the step folder at `model/consolidated/`) or AngelSlim's `save_pretrained`
  folder (DFlare), these two on the template of the fixture's config (the trainer's own fields kept).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_callbacks.demos.objective import CacheSequences, drafter_weights, sequence_loss
from dflash_callbacks.demos.toy import toy_drafter_config, toy_target_path
from dflash_callbacks.model import DrafterConfig, TargetHead, build_drafter, save_drafter
from dflash_callbacks.model.families import dflash2, domino, dspark, jetspec
from dflash_callbacks.model.io import INDEX_FILE
from suite_paths import FIXTURES

__all__ = ["toy_family_baselines"]

FAMILY_SETTINGS = {
    "dflash2": dflash2.Settings(conv_group_size=32, conv_kernel_size=2, selector_rank=8, selector_top_k=4),
    "dspark": dspark.Settings(markov_rank=16, enable_confidence_head=True, confidence_head_with_markov=True),
    "domino": domino.Settings(emb_dim=32, gru_hidden_dim=32, pure_draft_prefix_len=1, shift_label=True),
    "jetspec": jetspec.Settings(causal=True),
    "dflare": None,
}
"""The families beside DFlash, each with settings that fit the toy target (hidden 128, vocabulary 260)."""
BACKBONE_FIELDS = {"jetspec": {"causal": False, "is_causal": False}}
"""What a family's trainer sets of the backbone: Automodel stamps `is_causal: false` on every drafter."""
BASELINE_STEPS = 60
BASELINE_LR = 3e-3
TEMPLATES = FIXTURES / "families"
SPECULATORS_TEMPLATE = {"dflash2": TEMPLATES / "dflash2-full" / "checkpoint" / "config.json",
                        "dspark": TEMPLATES / "dspark" / "checkpoint" / "config.json"}
TRAINER_TEMPLATE = {"jetspec": TEMPLATES / "jetspec" / "checkpoint" / "config.json",
                    "dflare": TEMPLATES / "dflare" / "checkpoint" / "config.json"}
WEIGHTS_FOLDER = {"jetspec": Path("model") / "consolidated"}
"""Where in a step's folder the trainer writes the drafter folder (Automodel's Checkpointer: `model/consolidated/`)."""
STEP_FOLDERS = {"jetspec": "epoch_0_step_{step}"}
"""How the trainer names a step's folder (Automodel's; the others: the transformers Trainer's `checkpoint-N`)."""


def step_folder(family: str, step: int) -> str:
    """The name of the folder a trainer of `family` saves step `step` in."""
    return STEP_FOLDERS.get(family, "checkpoint-{step}").format(step=step)


def family_config(family: str, block_size: int = 8, num_layers: int = 1) -> DrafterConfig:
    """The toy drafter config of `family` ("dflash" too)."""
    config = toy_drafter_config(block_size=block_size, num_layers=num_layers)
    return config if family == "dflash" else dataclasses.replace(config, family=family,
                                                                 family_config=FAMILY_SETTINGS[family],
                                                                 **BACKBONE_FIELDS.get(family, {}))


ATTENTION = {"jetspec": "trained"}
"""The attention rule a test scores a family under where it is not the default: the toy JetSpec drafter is saved as
Automodel saves it (`is_causal: false`), which vLLM serves bidirectionally, after it trained block-causal; scored
as served, the baseline and a fresh drafter alike draft almost nothing and no stop could decide."""


def scoring(family: str, **more) -> dict:
    """What a test scores a drafter of `family` with: vanilla, ddtree@4 where the family scores DDTree, top@2, under
    the family's `ATTENTION` rule."""
    return {"ddtree_budgets": [] if family in ("dspark", "domino") else [4], "topk": [2], "device": "cpu",
            **({"attention": ATTENTION[family]} if family in ATTENTION else {}), **more}


def scoring_flags(family: str) -> list[str]:
    """`scoring(family)` as the CLI's flags."""
    methods = scoring(family)
    flags = ["--budgets", ",".join(map(str, methods["ddtree_budgets"])), "--topk", "2", "--device", "cpu"]
    return flags + (["--attention", methods["attention"]] if "attention" in methods else [])


def monitor(family: str) -> str:
    """The stop's monitor: DDTree where the family scores it, else vanilla (DSpark and Domino refuse DDTree)."""
    return "vanilla/live" if family in ("dspark", "domino") else "ddtree@4/live"


def train(config: DrafterConfig, training_data: Path, steps: int, lr: float = BASELINE_LR, seed: int = 0):
    """A fresh drafter of `config` after `steps` AdamW steps of the objective, one sequence (16 blocks) per step."""
    torch.manual_seed(seed)
    drafter = build_drafter(config).train()
    head = TargetHead.from_pretrained(toy_target_path()).requires_grad_(False)
    data, weights, generator = CacheSequences(training_data), drafter_weights(drafter), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    for step in range(steps):
        s = data[step % len(data)]
        loss = sequence_loss(drafter, head, s["input_ids"], s["hidden"], s["prompt_len"], 16, weights, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="session")
def toy_family_baselines(tmp_path_factory, toy_training_cache_dir) -> dict[str, Path]:
    """A test-only toy baseline per family of FAMILY_SETTINGS: `BASELINE_STEPS` steps on the toy world's
    training data, saved with `save_drafter` in the family's published layout."""
    root = tmp_path_factory.mktemp("toy-family-baselines")
    return {family: save_drafter(root / family, config, train(config, toy_training_cache_dir, BASELINE_STEPS).state_dict())
            for family, config in ((f, family_config(f)) for f in FAMILY_SETTINGS)}


def speculators_config(config: DrafterConfig) -> dict:
    """`config` as speculators 0.9.0 writes a folder of its family (DFlash 2, DSpark)."""
    published = config.to_dict()
    raw = copy.deepcopy(json.loads(SPECULATORS_TEMPLATE[config.family].read_text()))
    layer = raw["transformer_layer_config"]
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "rms_norm_eps", "layer_types", "max_position_embeddings", "rope_parameters"):
        layer[name] = published[name]
    raw.update(aux_hidden_state_layer_ids=[i + 1 for i in config.target_layer_ids], block_size=config.block_size,
               mask_token_id=config.mask_token_id, draft_vocab_size=config.vocab_size,
               **dataclasses.asdict(config.family_config))
    for name in dflash2.SERVING_FIELDS:  # speculators 0.9.0 writes none of them (read as 1.0, None, None)
        raw.pop(name, None)
    return raw


def trainer_config(config: DrafterConfig) -> dict:
    """`config` as Automodel (JetSpec) or AngelSlim (DFlare) writes it: the published layout over the fixture's
    config, whose trainer's own fields stay (AngelSlim's aux layer ids set to the drafter's)."""
    raw = json.loads(TRAINER_TEMPLATE[config.family].read_text())
    published = config.to_dict()
    nested = {**raw["dflash_config"], **published["dflash_config"]}
    if "block_size" in nested:  # Automodel writes it there too
        nested["block_size"] = config.block_size
    raw.update({**published, "dflash_config": nested})
    if "aux_hidden_states_layer_ids" in raw:
        raw["aux_hidden_states_layer_ids"] = list(config.target_layer_ids)
    return raw


def save_checkpoint(folder: Path, config: DrafterConfig, state: dict[str, torch.Tensor]) -> Path:
    """A checkpoint folder of `config`'s family as its trainer writes it: speculators' (DFlash 2, DSpark),
    SpecForge's export (Domino, and DFlash), Automodel's consolidated export at `model/consolidated/` (JetSpec)
    or AngelSlim's `save_pretrained` folder (DFlare). Returns the drafter folder."""
    if config.family not in SPECULATORS_TEMPLATE and config.family not in TRAINER_TEMPLATE:
        return save_drafter(folder, config, state)
    folder = folder / WEIGHTS_FOLDER.get(config.family, "")
    folder.mkdir(parents=True)
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    if config.family in WEIGHTS_FOLDER:  # Automodel: one shard and its index, no metadata in the shard
        shard = "model-00001-of-00001.safetensors"
        save_file(tensors, str(folder / shard))
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {name: shard for name in tensors}}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    else:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = speculators_config(config) if config.family in SPECULATORS_TEMPLATE else trainer_config(config)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return folder

"""Finding the drafter in what a training loop holds, and its DrafterConfig.

Every adapter uses these: the Lightning callback on its LightningModule, the transformers
callback on the Trainer's model, the plain loop on what `attach` is given. A wrapper that
only forwards to the drafter (DDP's `.module`, `torch.compile`'s `._orig_mod`) is looked
through; a wrapper whose `state_dict()` is a collective over unsharded parameters
(FSDP1, DeepSpeed ZeRO-3) is refused, around the drafter or inside it, since rank 0 alone
could not take a snapshot.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from torch import nn

from ..model import DrafterConfig

FORWARDING_WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module", "OptimizedModule": "_orig_mod"}
REFUSED_WRAPPERS = {
    "FullyShardedDataParallel": "FSDP1 (its state_dict() is a collective): use FSDP2 (`fully_shard`), whose "
                                "parameters the snapshot gathers on every rank",
    "DeepSpeedEngine": "DeepSpeed (ZeRO-3 gathers its parameters collectively): evaluate saved checkpoints with "
                       "`dflash-callbacks watch --checkpoints` instead",
}


def unwrap(module: nn.Module) -> nn.Module:
    """`module` without the wrappers that only forward to it; ValueError for one that can not be snapshotted."""
    while True:
        kind = type(module).__name__
        if kind in REFUSED_WRAPPERS:
            raise ValueError(f"the drafter is wrapped in {kind}, which is not supported: {REFUSED_WRAPPERS[kind]}")
        inner = getattr(module, FORWARDING_WRAPPERS[kind], None) if kind in FORWARDING_WRAPPERS else None
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def refuse_collective_wrappers(drafter: nn.Module, root: nn.Module | None = None, owner: str = "the drafter") -> None:
    """Before training (every adapter, once): ValueError when a wrapper of REFUSED_WRAPPERS holds
    the drafter's parameters from further away than `unwrap` looks: around a module of `root`
    that holds the drafter (the transformers Trainer wraps its whole model in FSDP1), inside the
    drafter around a layer, or DeepSpeed ZeRO-3's partitioned parameters (it marks each with
    `ds_id`). A snapshot of such a drafter would be a collective that rank 0 starts alone."""
    for name, outer in (root.named_modules() if root is not None else ()):
        kind = type(outer).__name__
        if kind in REFUSED_WRAPPERS and any(m is drafter for m in outer.modules()):
            where = f"the model's {name}" if name else "the model"
            raise ValueError(f"{owner}: the drafter sits inside {where}, a {kind}, which is not supported: "
                             f"{REFUSED_WRAPPERS[kind]}")
    for name, inner in drafter.named_modules():
        kind = type(inner).__name__
        if kind in REFUSED_WRAPPERS:
            raise ValueError(f"{owner}: the drafter's {name or 'root'} is a {kind}, which is not supported: "
                             f"{REFUSED_WRAPPERS[kind]}")
    partitioned = [name for name, p in drafter.named_parameters() if hasattr(p, "ds_id")]
    if partitioned:
        raise ValueError(f"{owner}: the drafter's parameters are partitioned by DeepSpeed ZeRO-3 ({partitioned[0]}, "
                         f"...), which is not supported: {REFUSED_WRAPPERS['DeepSpeedEngine']}")


def drafters_in(root: nn.Module) -> list[str]:
    """The attribute paths of the submodules that look like a DFlash drafter (a DrafterConfig at
    `.config`, or the published `fc` and `hidden_norm`): what `drafter=` may name."""
    return [name for name, m in root.named_modules() if name and (
        isinstance(getattr(m, "config", None), DrafterConfig)
        or (isinstance(getattr(m, "fc", None), nn.Module) and isinstance(getattr(m, "hidden_norm", None), nn.Module)))]


def resolve_drafter(root: nn.Module, drafter: str | Callable, owner: str) -> nn.Module:
    """The drafter `drafter` names on `root`: an attribute path, or a function root -> drafter.
    `owner` is what errors name (e.g. "DrafterEvalCallback")."""
    if callable(drafter):
        module = drafter(root)
    else:
        module = root
        for part in drafter.split("."):
            module = unwrap(module) if not hasattr(module, part) else module
            if not hasattr(module, part):
                raise AttributeError(
                    f"{owner}(drafter={drafter!r}): {type(module).__name__} has no attribute {part!r}; "
                    f"pass the attribute path of the drafter (drafter-like submodules of {type(root).__name__}: "
                    f"{drafters_in(root)}) or a function module -> drafter"
                )
            module = getattr(module, part)
    if not isinstance(module, nn.Module):
        raise TypeError(f"{owner}(drafter={drafter!r}): the drafter must be an nn.Module; got {type(module).__name__}")
    return unwrap(module)


def check_drafter_config(given: DrafterConfig | str | os.PathLike | None) -> DrafterConfig | str | os.PathLike | None:
    """An adapter's `drafter_config=` argument, checked for its type when the adapter is made."""
    if not (given is None or isinstance(given, (DrafterConfig, str, os.PathLike))):
        raise TypeError(f"drafter_config must be a DrafterConfig, a config.json path or None; got {type(given).__name__}")
    return given


def drafter_config_of(module: nn.Module, given: DrafterConfig | str | os.PathLike | None, owner: str,
                      root: nn.Module | None = None, drafter: str | Callable = "drafter") -> DrafterConfig:
    """`given` (a DrafterConfig or a config.json path), else the drafter's own `.config` (a
    DrafterConfig, or a transformers config of the published model class)."""
    if isinstance(given, DrafterConfig):
        return given
    if given is not None:
        return DrafterConfig.from_file(given)
    config = getattr(module, "config", None)
    if isinstance(config, DrafterConfig):
        return config
    if hasattr(config, "to_dict"):  # a transformers config of the published model class
        return DrafterConfig.from_dict(config.to_dict())
    found = drafters_in(root) if root is not None else []
    raise ValueError(f"{owner}(drafter={drafter!r}) gives a {type(module).__name__} with no DrafterConfig at "
                     ".config: if it is the drafter, pass drafter_config=DrafterConfig or a config.json path; if not, "
                     f"point drafter= at the drafter (drafter-like submodules: {found})")


def optimizer_problems(drafter: nn.Module, optimizers: list, owner: str) -> list[str]:
    """Why `optimizers` can not be the drafter's (a plain loop's `attach`): not optimizers, or one of the
    drafter's trainable parameters that none steps (its snapshot copy would never be waited for before an
    update)."""
    import torch

    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        return [f"{owner}: the optimizer must be a torch.optim.Optimizer (or a list of them) that steps the drafter's "
                "parameters"]
    owned = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    missing = [name for name, p in drafter.named_parameters() if p.requires_grad and id(p) not in owned]
    if not missing:
        return []
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return [f"{owner}: the optimizer does not step {len(missing)} of the drafter's trainable parameters ({shown}): "
            "pass the optimizer (or the list of optimizers) that trains the drafter"]

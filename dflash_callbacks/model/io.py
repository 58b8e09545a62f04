"""Reading and writing drafter folders in the published layout.

A drafter folder is `config.json` + `*.safetensors` (one file, or shards listed in
`model.safetensors.index.json`) with the un-prefixed published keys. Snapshots written
during training are the same layout plus a `snapshot.json`, so any published-format
loader reads them.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import DrafterConfig
from .drafter import DFlashDrafter

INDEX_FILE = "model.safetensors.index.json"


def read_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a shard index (tensor name -> shard file); ValueError naming the file."""
    try:
        raw = json.loads(index.read_text())
    except ValueError as e:
        raise ValueError(f"{index} is not JSON: {e}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no 'weight_map' object of tensor name -> shard file")
    return weight_map


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: the shards named by its index, else model.safetensors,
    else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        files = [folder / name for name in sorted(set(read_weight_map(index).values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


@contextmanager
def open_safetensors(file: Path, device: str = "cpu") -> Iterator:
    """`safe_open` of a weight file; a damaged one (truncated, corrupt, not safetensors at
    all) is a ValueError naming the file, so a CLI prints one `error:` line and a preflight
    lists it."""
    try:
        with safe_open(str(file), framework="pt", device=device) as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from e


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with open_safetensors(file) as f:
            for key in f.keys():
                if key in state:
                    raise ValueError(f"tensor {key!r} appears in more than one file of {folder}")
                state[key] = f.get_tensor(key)
    return state


def read_state_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every stored tensor, from the safetensors headers alone."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(folder):
        with open_safetensors(file) as f:
            shapes.update((key, tuple(f.get_slice(key).get_shape())) for key in f.keys())
    return shapes


SNAPSHOT_META = "snapshot.json"


def read_snapshot_meta(folder: str | os.PathLike) -> dict | None:
    """A snapshot's snapshot.json ({"step", "snapshot_id", "epoch", "wall_time", "config"}),
    None for a drafter folder that is not a snapshot; ValueError if it is unreadable."""
    path = Path(folder) / SNAPSHOT_META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise ValueError(f"{path} is not a snapshot description (no integer 'step')")
    return meta


def read_config(folder: Path) -> DrafterConfig:
    """config.json, or for a snapshot written without one, snapshot.json's 'config'."""
    if (folder / "config.json").is_file():
        return DrafterConfig.from_file(folder / "config.json")
    meta = read_snapshot_meta(folder)
    if meta is not None and isinstance(meta.get("config"), dict):
        return DrafterConfig.from_dict(meta["config"])
    raise FileNotFoundError(
        f"no config.json in {folder}: a drafter folder holds config.json and *.safetensors "
        f"(found: {sorted(p.name for p in folder.iterdir())})"
    )


def load_drafter(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    config: DrafterConfig | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> DFlashDrafter:
    """Load a drafter from a published checkpoint folder, a snapshot folder, or a state
    dict (then `config` is required). `dtype=None` keeps the stored dtype. Returns the
    model in eval mode."""
    if isinstance(source, Mapping):
        if config is None:
            raise ValueError("loading a drafter from a state dict needs its DrafterConfig (config=...)")
        return DFlashDrafter.from_state_dict(config, dict(source), dtype=dtype, device=device)
    folder = Path(source)
    if not folder.is_dir():
        raise FileNotFoundError(f"drafter folder {folder} does not exist")
    config = config or read_config(folder)
    try:
        return DFlashDrafter.from_state_dict(config, read_state_dict(folder), dtype=dtype, device=device)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None


def save_drafter(
    folder: str | os.PathLike,
    config: DrafterConfig,
    state_dict: Mapping[str, torch.Tensor],
    *,
    extra_files: Mapping[str, dict] | None = None,
) -> Path:
    """Write config.json + model.safetensors (+ extra JSON files) to `folder`, atomically:
    everything goes to a temporary sibling that is renamed into place, so a reader never
    sees half a folder. An existing folder of that name is replaced."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        for name, payload in (extra_files or {}).items():
            (tmp / name).write_text(json.dumps(payload, indent=2) + "\n")
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
            folder.rename(old)
            tmp.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder

"""Reading and writing drafter folders in the published layout, and trainers' checkpoints.

A drafter folder is `config.json` + `*.safetensors` (one file, or shards listed in
`model.safetensors.index.json`) with the un-prefixed published keys. Snapshots written
during training are the same layout plus a `snapshot.json`, so any published-format
loader reads them. A speculators folder is one too (its config is mapped, see
`DrafterConfig.from_dict`; the target's embedding and LM head it stores are checked
against the target's when scored). A trainer's torch checkpoint (SpecForge's
`training_state.pt`, weights under `draft_state_dict`) is read by `read_checkpoint`, with
`weights_only=True`; its config comes from the file it was trained with.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import DrafterConfig
from .drafter import DFlashDrafter, drafter_class, split_stored_head

INDEX_FILE = "model.safetensors.index.json"
WRAPPER_PREFIXES = ("module.", "draft_model.", "_orig_mod.")
"""Prefixes wrappers put before every tensor name: DDP and FSDP1 (`module.`), SpecForge's
training model (`draft_model.`), torch.compile (`_orig_mod.`)."""


class UnreadableFile(ValueError):
    """A weight or checkpoint file that can not be read as its format at all (truncated, corrupt,
    not that format): the file's fault, whatever the caller asked of it. Worded naming the file."""


def say(line: str) -> None:
    """Where the loaders say what they did to a checkpoint: one line on stderr."""
    print(line, file=sys.stderr, flush=True)


def strip_wrapper_prefixes(state: dict, source: object, log: Callable[[str], None] | None = say) -> dict:
    """`state` with the WRAPPER_PREFIXES taken off its keys while every key carries one
    (nested ones too: `module._orig_mod.`); `log` gets one line naming what was stripped."""
    stripped = []
    while state and (prefix := next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)):
        state = {k[len(prefix):]: v for k, v in state.items()}
        stripped.append(prefix)
    if stripped and log is not None:
        log(f"{source}: stripped the wrapper prefix '{''.join(stripped)}' from its {len(state)} tensor names")
    return state


def read_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a shard index (tensor name -> shard file); ValueError naming the file."""
    try:
        raw = json.loads(index.read_text())
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply for the parser
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
        raise UnreadableFile(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from e


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a drafter folder, wrapper prefixes stripped (and said)."""
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with open_safetensors(file) as f:
            for key in f.keys():
                if key in state:
                    raise ValueError(f"tensor {key!r} appears in more than one file of {folder}")
                state[key] = f.get_tensor(key)
    return strip_wrapper_prefixes(state, folder)


def read_state_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the drafter's own (not the target head a speculators
    folder stores), from the safetensors headers alone, wrapper prefixes stripped."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(folder):
        with open_safetensors(file) as f:
            shapes.update((key, tuple(f.get_slice(key).get_shape())) for key in f.keys())
    return split_stored_head(strip_wrapper_prefixes(shapes, folder, log=None))[0]


def read_checkpoint(path: str | os.PathLike, state_key: str | None = None, *,
                    log: Callable[[str], None] | None = say) -> dict[str, torch.Tensor]:
    """The drafter's tensors in a trainer's torch checkpoint file (`torch.load(...,
    weights_only=True)`, so no code in it runs): the object under `state_key` (SpecForge:
    "draft_state_dict"), or the whole file when None, with the wrapper prefixes stripped
    (`log` gets one line saying so). ValueError naming the file for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError) as e:
        raise UnreadableFile(f"{path} is not a torch checkpoint that loads with weights_only=True: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    what = str(path) if state_key is None else f"{path}[{state_key!r}]"
    if state_key is not None:
        if not isinstance(obj, Mapping) or state_key not in obj:
            held = sorted(map(str, obj))[:12] if isinstance(obj, Mapping) else type(obj).__name__
            raise ValueError(f"{path} has no {state_key!r}; its keys are {held}: give the key of the drafter's state "
                             "dict (--state-key; SpecForge's training_state.pt: 'draft_state_dict')")
        obj = obj[state_key]
    if not isinstance(obj, Mapping) or not obj or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        held = sorted(map(str, obj))[:12] if isinstance(obj, Mapping) else type(obj).__name__
        raise ValueError(f"{what} is not a state dict (tensor name -> tensor); it holds {held}: name the entry that "
                         "is, e.g. state_key 'draft_state_dict' (--state-key) for a SpecForge training_state.pt")
    return strip_wrapper_prefixes(dict(obj), what, log)


SNAPSHOT_META = "snapshot.json"


def read_snapshot_meta(folder: str | os.PathLike) -> dict | None:
    """A snapshot's snapshot.json ({"step", "snapshot_id", "epoch", "wall_time", "config"}),
    None for a drafter folder that is not a snapshot; ValueError if it is unreadable."""
    path = Path(folder) / SNAPSHOT_META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deeply for the parser
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
    config: DrafterConfig | str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    state_key: str | None = None,
) -> DFlashDrafter:
    """Load a drafter from a published checkpoint folder (z-lab, SpecForge's export, a
    speculators folder), a snapshot folder, a trainer's torch checkpoint file
    (`read_checkpoint(source, state_key)`, e.g. SpecForge's training_state.pt with
    state_key="draft_state_dict"), or a state dict. `config` (a DrafterConfig, or the path
    of its config.json) is required for a file or a state dict, and replaces a folder's
    own. `dtype=None` keeps the stored dtype. Returns the model in eval mode."""
    if config is not None and not isinstance(config, DrafterConfig):
        config = DrafterConfig.from_file(config)
    if isinstance(source, Mapping):
        if config is None:
            raise ValueError("loading a drafter from a state dict needs its DrafterConfig (config=...)")
        return drafter_class(config).from_state_dict(config, dict(source), dtype=dtype, device=device)
    path = Path(source)
    if path.is_file():
        if config is None:
            raise ValueError(f"{path} is a checkpoint file, which holds no drafter config: pass config= (a DrafterConfig "
                             "or the config.json it was trained with, e.g. SpecForge's draft config)")
        state = read_checkpoint(path, state_key)
    elif not path.is_dir():
        raise FileNotFoundError(f"drafter folder {path} does not exist")
    elif state_key is not None:
        raise ValueError(f"{path} is a folder: state_key={state_key!r} names an entry of a torch checkpoint file")
    else:
        config = config or read_config(path)
        state = read_state_dict(path)
    try:
        return drafter_class(config).from_state_dict(config, state, dtype=dtype, device=device)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


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

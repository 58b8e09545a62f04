"""What a trainer's checkpoint is, read from the files alone, with no watcher state: where an HF-format
folder is inside a step's folder, whether a safetensors or torch file is whole yet, a symbolic link that
never resolves, the shapes of a drafter, how two configs differ, and reading a torch checkpoint file
(its notes said through the `say` given, once per kind). `checkpoint_folder.Checkpoints` applies them to
a trainer's folder; `checkpoint_watcher.CheckpointWatcher` polls it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..model import DrafterConfig, build_drafter
from ..model.io import read_checkpoint as load_checkpoint

MARKER = "trainer_state.json"
"""The transformers Trainer's `_save_checkpoint` writes it after the model files (and after the
optimizer, scheduler and RNG states): a checkpoint folder holding it is complete."""
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
LEGACY_TORCH_MAGIC = torch.serialization.MAGIC_NUMBER.to_bytes(10, "little")
"""In the first bytes of a torch file in the legacy format (`_use_new_zipfile_serialization=False`):
its first pickle holds this number."""
SAFETENSORS_HEADER_LIMIT = 100_000_000
"""The longest header the safetensors format reads (its own limit): a longer length is no header."""
LAST_INTEGER = re.compile(r"(\d+)(?!.*\d)")
SHARD_NAME = re.compile(r"-(\d+)-of-(\d+)\.safetensors\Z")
NESTED_HF_FOLDERS = (Path("model") / "consolidated",)
"""Where inside a step's folder a trainer writes the HF-format drafter folder: NeMo Automodel's Checkpointer
(`epoch_E_step_S/model/consolidated/`)."""


def hf_folder(entry: Path) -> Path:
    """The HF-format folder of a step's folder: a nested one where a trainer writes it there, else itself."""
    return next((entry / nested for nested in NESTED_HF_FOLDERS if (entry / nested).is_dir()), entry)


def once_per_kind(say: Callable[[str], None]) -> Callable[[str], None]:
    """`say`, each kind of line once (the text after its first ':': every checkpoint of a run has the same
    wrapper prefixes); the lines said are the returned function's own, no process-wide set."""
    said: set[str] = set()

    def say_once(line: str) -> None:
        kind = line.split(":", 1)[-1]
        if kind not in said:
            said.add(kind)
            say(line)

    return say_once


def read_checkpoint(path: Path, state_key: str, config: DrafterConfig,
                    say: Callable[[str], None]) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The drafter in a torch checkpoint file, read by the library's one reader of them
    (`model.io.read_checkpoint`: weights_only=True, the state dict under `state_key`, wrapper
    prefixes stripped, said through `say`); `config` is the drafter's (the file holds none)."""
    return config, load_checkpoint(path, state_key, log=say)


def safetensors_missing(file: Path) -> str | None:
    """Why a safetensors file is not whole yet (shorter than its header says), None when it is, and
    when it never will be: a header that is not one (too long, not a JSON object of entries with
    data_offsets) or a symlink loop; reading the file then names what is wrong."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                return f"{file.name} has no header yet"
            (length,) = struct.unpack("<Q", head)
            if length > SAFETENSORS_HEADER_LIMIT:
                return None
            if 8 + length > size:
                return f"{file.name} holds {size} of the {8 + length} bytes of its header"
            header = json.loads(f.read(length))
    except OSError as e:
        return None if e.errno == errno.ELOOP else f"{file.name} can not be read yet ({e.strerror})"
    except (ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    ends = [v.get("data_offsets") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if not all(isinstance(end, list) and len(end) == 2 and isinstance(end[1], int) for end in ends):
        return None
    expected = 8 + length + max((end[1] for end in ends), default=0)
    return None if size >= expected else f"{file.name} holds {size} of its {expected} bytes"


def symlink_loop(path: Path) -> str | None:
    """How `path` is a symbolic link that never resolves (it leads back to itself), None when it is not."""
    try:
        path.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            return (f"{path} is a symbolic link that leads back to itself (it never resolves): remove it, or point "
                    "it at the file it stands for")
    return None


def failure(source: Path, error: Exception) -> str:
    """What reading a checkpoint raised, as one line naming it."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text if str(source) in text else f"{source}: {type(error).__name__}: {text}"


def drafter_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a drafter of `config` holds (nothing is allocated)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in build_drafter(config).state_dict().items()}


def config_differences(reference: DrafterConfig, config: DrafterConfig) -> list[str]:
    """The fields (all but `extra`) where `config` differs from `reference`."""
    names = [f.name for f in fields(DrafterConfig) if f.name != "extra"]
    return [f"{name} {getattr(config, name)!r} (the run's: {getattr(reference, name)!r})" for name in names
            if getattr(config, name) != getattr(reference, name)]


@dataclass
class Drafter:
    """The run's drafter: every checkpoint must be this one's shape."""

    config: DrafterConfig
    shapes: dict[str, tuple[int, ...]]
    source: str  # where it was read: --drafter-config, or the first checkpoint's config.json

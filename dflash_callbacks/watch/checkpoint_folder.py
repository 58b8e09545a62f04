"""A trainer's checkpoint folder (`Checkpoints`): the entries that name a step, what each one's files are
and their fingerprint, whether the trainer marked it complete, whether it is whole yet, its drafter's
shapes, how it is not the run's drafter, and reading it (`checkpoint_files` has the pieces)."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import zipfile
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import torch

from ..engine.run_folder import is_run_folder
from ..model import DFlashDrafter, DrafterConfig, load_drafter
from ..model.drafter import check_state_dict
from ..model.io import INDEX_FILE, UnreadableFile, read_config, read_state_shapes, safetensors_files
from .checkpoint_files import (
    LAST_INTEGER, LEGACY_TORCH_MAGIC, MARKER, SHARD_NAME, TORCH_SUFFIXES, Drafter, config_differences, failure,
    hf_folder, once_per_kind, read_checkpoint, safetensors_missing, symlink_loop,
)


class Checkpoints:
    """A trainer's checkpoint folder, read the one way `--state-key` says: HF-format drafter folders
    (None), or torch checkpoint files (and the `state_file` of a checkpoint folder)."""

    def __init__(self, root: Path, step_pattern: re.Pattern | None, state_key: str | None, state_file: str,
                 config: DrafterConfig | None, exclude: Path, say: Callable[[str], None]):
        """`say`: where the notes on reading torch files go (each kind once)."""
        self.say = once_per_kind(say)
        self.root, self.step_pattern, self.state_key, self.state_file = root, step_pattern, state_key, state_file
        self.config, self.exclude = config, exclude.resolve()
        self.drafter: Drafter | None = None  # set once known
        self.duplicates: dict[int, list[str]] = {}  # step -> every entry naming it, when more than one does
        self.unread: list[str] = []  # torch files naming a step, not read without --state-key

    def know(self, drafter: Drafter) -> None:
        """The run's drafter, once known: every checkpoint must be its shape."""
        self.drafter = drafter

    def step_of(self, name: str) -> int | None:
        if self.step_pattern is None:
            found = LAST_INTEGER.search(name)
            return int(found.group(1)) if found else None
        found = self.step_pattern.search(name)
        text = (found.group(1) if self.step_pattern.groups else found.group(0)) if found else None
        return int(text) if text is not None and text.isdigit() else None

    def find(self) -> dict[int, Path]:
        """step -> what is read (a folder, or a torch file), for every entry of the folder that names
        a step; of two naming one step, the first by name (`duplicates` says which). A symlink loop
        naming a step is one too (its read says what it is); one naming none is passed over."""
        found: dict[int, list[Path]] = {}
        self.unread = []
        try:
            entries = sorted(self.root.iterdir())
        except FileNotFoundError:
            return {}
        for entry in entries:
            loop = symlink_loop(entry) is not None
            if entry.name.startswith(".") or (not loop and entry.resolve() == self.exclude) or is_run_folder(entry):
                continue  # a writer's temporary, this watcher's own --out, a run folder of the engine
            if loop:
                source, name = entry, entry.stem if entry.suffix in TORCH_SUFFIXES else entry.name
            elif self.state_key is None:
                source = hf_folder(entry) if entry.is_dir() else None
                name = entry.name
                if source is None and entry.suffix in TORCH_SUFFIXES and self.step_of(entry.stem) is not None:
                    self.unread.append(entry.name)
            elif entry.is_dir():
                source, name = entry / self.state_file, entry.name
            else:
                source = entry if entry.suffix in TORCH_SUFFIXES else None
                name = entry.stem
            step = self.step_of(name) if source is not None else None
            if step is not None:
                found.setdefault(step, []).append(source)
        self.duplicates = {step: [str(p) for p in paths] for step, paths in found.items() if len(paths) > 1}
        return {step: paths[0] for step, paths in found.items()}

    def loop(self, source: Path) -> str | None:
        """How what is read of the checkpoint is a symlink loop (itself; an HF folder's config.json,
        index or weights), None when none is: such a file never reads."""
        read = [source]
        if self.state_key is None and source.is_dir():
            read += [source / "config.json", source / INDEX_FILE, *source.glob("*.safetensors")]
        return next((why for file in read if (why := symlink_loop(file))), None)

    def files(self, source: Path) -> list[Path]:
        """Every file of the checkpoint (what settles): the HF folder's, the checkpoint folder's that holds
        the state file, or the torch file in DIR itself."""
        if symlink_loop(source):
            return [source]
        if self.state_key is not None and source.parent == self.root:
            return [source] if source.is_file() else []
        folder = source if self.state_key is None else source.parent
        return sorted(p for p in folder.rglob("*") if p.is_file())

    def fingerprint(self, source: Path) -> str | None:
        """Names, sizes and mtimes of the checkpoint's files (None when it has none)."""
        stats = []
        for file in self.files(source):
            try:
                st = file.stat()
            except OSError as e:  # gone since it was listed, or a symlink loop (its link is what settles)
                if e.errno != errno.ELOOP:
                    continue
                st = file.lstat()
            stats.append((str(file.relative_to(self.root)), st.st_size, st.st_mtime_ns))
        return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16] if stats else None

    def marked(self, source: Path) -> bool:
        """The trainer's completion marker is there, newer than every weight file (HF folders)."""
        if self.state_key is not None:
            return False
        try:
            marker = (source / MARKER).stat().st_mtime_ns
            return all(marker >= f.stat().st_mtime_ns for f in source.glob("*.safetensors"))
        except OSError:
            return False

    def unfinished(self, source: Path) -> str | None:
        """Why the checkpoint is not whole yet (a file it announces is missing, or shorter than it says),
        None when nothing more is waited for: it is whole, or damaged for good (reading it says how).
        A torch file in the legacy format has no end to test: whole once it has settled."""
        if self.loop(source):
            return None
        if self.state_key is not None:
            if not source.is_file():
                return f"no {source.name} yet"
            try:
                with open(source, "rb") as f:
                    legacy = LEGACY_TORCH_MAGIC in f.read(64)
                whole = legacy or zipfile.is_zipfile(source)
            except OSError as e:
                return f"{source.name} can not be read yet ({e.strerror})"
            return None if whole else f"{source.name} is not a whole torch zip archive yet"
        if not (source / "config.json").is_file():
            held = f" (it holds {self.state_file}: torch checkpoints are read with --state-key)" \
                if (source / self.state_file).is_file() else ""
            return f"no config.json yet{held}"
        try:
            files = safetensors_files(source)
        except OSError as e:  # a shard its index names, or any weights, not there yet
            return str(e)
        except ValueError:  # an index that is not one: the read names it
            return None
        shards = [(int(m.group(1)), int(m.group(2))) for f in files if (m := SHARD_NAME.search(f.name))]
        if shards and not (source / INDEX_FILE).is_file():
            return f"shards {sorted(n for n, _ in shards)} of {shards[0][1]} and no {INDEX_FILE} yet"
        return next((why for f in files if (why := safetensors_missing(f))), None)

    def shapes(self, source: Path) -> tuple[DrafterConfig, dict[str, tuple[int, ...]], Path]:
        """The checkpoint's config, its tensors' shapes and the file they are in (HF: from the
        safetensors headers alone)."""
        if why := self.loop(source):
            raise UnreadableFile(why)
        if self.state_key is None:
            files = safetensors_files(source)
            return read_config(source), read_state_shapes(source), files[0] if len(files) == 1 else source
        config, state = read_checkpoint(source, self.state_key, self.config, self.say)
        return config, {k: tuple(v.shape) for k, v in state.items()}, source

    def problems(self, source: Path, config: DrafterConfig, shapes: Mapping[str, tuple], weights: Path) -> list[str]:
        """How a checkpoint is not the run's drafter, naming its file (empty: it is)."""
        drafter = self.drafter
        fix = f"; move it out of {self.root} (a watcher scores one drafter)"
        differ = config_differences(drafter.config, config)
        if differ:
            return [f"{source / 'config.json'}: a drafter of another shape than the run's ({drafter.source}): "
                    + ", ".join(differ) + fix]
        meta = partial(torch.empty, device="meta")
        try:
            check_state_dict({k: meta(s) for k, s in drafter.shapes.items()}, {k: meta(s) for k, s in shapes.items()})
        except ValueError as e:
            return [f"{weights}: its tensors are not the run's drafter ({drafter.source}): "
                    + "; ".join(line.strip() for line in str(e).splitlines()[1:]) + fix]
        return []

    def read(self, source: Path, step: int) -> DFlashDrafter:
        """The checkpoint's drafter, as `load_drafter` reads it (a speculators folder's stored head and
        pruned vocabulary kept; the runner's thread calls it when the job runs). Raises for a checkpoint
        deleted before it was read, and one that is not the run's drafter."""
        gone = (f"the checkpoint of step {step}, {source}, was deleted before it was scored (the trainer's checkpoint "
                "rotation?): keep more checkpoints (e.g. save_total_limit) or start the watcher with the training")
        if why := self.loop(source):
            raise ValueError(why)
        if not source.exists():
            raise FileNotFoundError(gone)
        try:
            if self.state_key is None:
                drafter = load_drafter(source)
            else:
                drafter = load_drafter(read_checkpoint(source, self.state_key, self.config, self.say)[1], config=self.config)
            problems = self.problems(source, drafter.config, {k: tuple(v.shape) for k, v in drafter.state_dict().items()},
                                     source)
        except Exception as e:  # whatever a damaged file raises: one line naming it
            if not source.exists():
                raise FileNotFoundError(gone) from None
            raise ValueError(failure(source, e)) from e
        if problems:
            raise ValueError("; ".join(problems))
        return drafter

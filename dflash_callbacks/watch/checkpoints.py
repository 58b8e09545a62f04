"""`dflash-callbacks watch --checkpoints DIR`: score the checkpoints a trainer saves, with no change
to its code.

Point it at the folder the trainer saves into. Each poll lists DIR's entries whose name holds a
step (the last integer in the name, or the first group of --step-pattern), and scores each new
checkpoint once, in step order, as soon as it is complete:
- an HF-format drafter folder: `config.json` and safetensors (one file, or shards and their
  index), as `save_pretrained` and `dflash_callbacks.save_drafter` write it (`checkpoint-500/`,
  `step_500/`), or at `model/consolidated/` inside the step's folder, as NeMo Automodel writes it
  (`epoch_0_step_500/model/consolidated/`);
- with --state-key KEY, a torch checkpoint file (`*.pt`, `*.pth`, `*.bin`, `*.ckpt`), or the
  --state-file in a checkpoint folder (SpecForge: `run-step500/training_state.pt`), holding the
  drafter's state dict under KEY; read with `weights_only=True` (no code is unpickled), wrapper
  prefixes (`module.`, `draft_model.`, `_orig_mod.`) stripped, with the config of --drafter-config.
  Without --state-key, torch files naming a step are not read, and a line says so.
Complete means the trainer's own marker is there (the transformers Trainer writes
`trainer_state.json` after the model files), or the checkpoint's files (names, sizes, mtimes)
have not changed for --settle-seconds as this watcher saw them, by its own clock; an HF folder
must also be whole (config.json, every shard its index or names announce, each safetensors file
as long as its header says), a torch file a whole zip archive, or in the legacy format
(`_use_new_zipfile_serialization=False`, which has no end to test: settled is whole). A checkpoint
is never read before that.

Step order: a complete checkpoint is not scored while an earlier one is still being written (no
marker, and its files changed within --settle-seconds), so a later save that completes first (the
Trainer's marker, an atomic save, a busy watcher that saw the earlier one's last write late) waits
for it. An earlier one that has settled and is still not whole (a save that died) holds nothing
back: it is waited for, said once, and scored whenever it completes, after the later ones.

A damaged checkpoint (a safetensors header that is none, a config.json that does not parse, a
symlink loop; anything its reading raises) is one error line naming its file, and the watcher goes
on; there at start, it is no reason to refuse the run (see `check`). A symlink loop that names no
step (`latest -> latest`) is passed over like any entry without a step.

Scoring and publishing go through the evaluation engine every adapter uses, into one run folder,
--out (default DIR/dflash-eval): results.jsonl first, then W&B (--wandb-project: the `dflash/`
keys against `dflash/step`, each row at the checkpoint's step), then the stop (with --baseline:
TrailingBaselineStop's settings as flags), whose decision is printed and written to --out/STOP.json
for a training loop to poll. A restart, after a SIGKILL too, reopens --out: a step with a report
or an error line in results.jsonl is never scored again, and every other one is. A checkpoint
seen and then deleted before it was scored (the trainer's rotation) is an error line naming its
step. A checkpoint of another drafter shape than the run's is refused naming its file: for those
present at start, before anything is scored; for a later one, as its error line.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import struct
import sys
import time
import uuid
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..engine.evaluator import EvalEngine
from ..engine.front import CheckpointFront
from ..engine.host import Host, Logger
from ..engine.session import basis_changes
from ..engine.run_folder import RunFolder, RunFolderBusy, is_run_folder
from ..engine.runners import Job
from ..engine.stop import StopPolicy
from ..files import atomic_write_json
from ..model import DFlashDrafter, DrafterConfig, build_drafter, load_drafter
from ..model.drafter import check_state_dict
from ..model.io import INDEX_FILE, UnreadableFile, read_config, read_state_shapes, safetensors_files
from ..model.io import read_checkpoint as load_checkpoint
from ..scoring.config import ScoringConfig
from ..scoring.service import ServiceSpec, preflight
from ..settings import EvalSettings

MARKER = "trainer_state.json"
"""The transformers Trainer's `_save_checkpoint` writes it after the model files (and after the
optimizer, scheduler and RNG states): a checkpoint folder holding it is complete."""
STOP_FILE = "STOP.json"
WANDB_HELD_SECONDS = 60.0
"""How long a restarted watcher waits for the W&B run a killed one held (its service outlives it a while)."""
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

# ---------------------------------------------------------------- reading a checkpoint


def read_checkpoint(path: Path, state_key: str, config: DrafterConfig) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The drafter in a torch checkpoint file, read by the library's one reader of them
    (`model.io.read_checkpoint`: weights_only=True, the state dict under `state_key`, wrapper
    prefixes stripped, said once); `config` is the drafter's (the file holds none)."""
    return config, load_checkpoint(path, state_key, log=_say_once)


_said: set[str] = set()


def _say_once(line: str) -> None:
    """The prefix note, once per kind of prefix (every checkpoint of a run has the same ones)."""
    kind = line.split(":", 1)[-1]
    if kind not in _said:
        _said.add(kind)
        print(line, file=sys.stderr, flush=True)


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


class Checkpoints:
    """A trainer's checkpoint folder, read the one way `--state-key` says: HF-format drafter folders
    (None), or torch checkpoint files (and the `state_file` of a checkpoint folder)."""

    def __init__(self, root: Path, step_pattern: re.Pattern | None, state_key: str | None, state_file: str,
                 config: DrafterConfig | None, exclude: Path):
        self.root, self.step_pattern, self.state_key, self.state_file = root, step_pattern, state_key, state_file
        self.config, self.exclude = config, exclude.resolve()
        self.drafter: Drafter | None = None  # set once known
        self.duplicates: dict[int, list[str]] = {}  # step -> every entry naming it, when more than one does
        self.unread: list[str] = []  # torch files naming a step, not read without --state-key

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
        config, state = read_checkpoint(source, self.state_key, self.config)
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
                drafter = load_drafter(read_checkpoint(source, self.state_key, self.config)[1], config=self.config)
            problems = self.problems(source, drafter.config, {k: tuple(v.shape) for k, v in drafter.state_dict().items()},
                                     source)
        except Exception as e:  # whatever a damaged file raises: one line naming it
            if not source.exists():
                raise FileNotFoundError(gone) from None
            raise ValueError(failure(source, e)) from e
        if problems:
            raise ValueError("; ".join(problems))
        return drafter


# ---------------------------------------------------------------- the watcher


class WatchHost(Host):
    """The watcher as the engine's host: one process, lines on stdout and stderr, its W&B run, and the
    last step it has seen (a stop decided on a report at or beyond --max-steps only warns)."""

    def __init__(self, max_steps: int | None):
        self.max_steps, self.latest = max_steps, 0
        self.wandb_run = None

    def loggers(self) -> list[Logger]:
        return []

    def wandb_runs(self) -> list:
        return [] if self.wandb_run is None else [("wandb", self.wandb_run, self.log_row)]

    def log_row(self, payload: dict, step: int) -> None:
        """One committed row per report, at the checkpoint's step; a step below W&B's counter (a
        checkpoint completed late) goes in the next row, `dflash/step` still placing it."""
        run = self.wandb_run
        if step >= run.step:
            run.log(payload, step=step, commit=True)
        else:
            run.log(payload, commit=True)

    def horizon(self) -> int | None:
        return self.max_steps

    def ending(self) -> str | None:
        if self.max_steps is not None and self.latest >= self.max_steps:
            return f"the checkpoint of step {self.latest} is at --max-steps {self.max_steps}"
        return None

    def info(self, text: str) -> None:
        print(text, flush=True)

    def warn(self, text: str) -> None:
        print(f"warning: {text}", file=sys.stderr, flush=True)


@dataclass
class Seen:
    source: Path
    fingerprint: str
    since: float  # monotonic time it was first seen with this fingerprint


class CheckpointWatcher:
    def __init__(self, args: argparse.Namespace, settings: dict[str, Any], scoring: ScoringConfig):
        self.settings = s = settings
        self.root, self.out, self.settle = args.checkpoints, s["out"], s["settle_seconds"]
        self.poll_seconds, self.idle_exit, self.once = args.poll_seconds, args.idle_exit, args.once
        self.spec = ServiceSpec(
            cache=str(args.cache), target=str(args.target),
            baseline=None if args.baseline is None else str(args.baseline),
            scoring=scoring,
            baseline_cache_dir=None if args.baseline_cache_dir is None else str(args.baseline_cache_dir),
        )
        self.checkpoints = Checkpoints(self.root, s["step_pattern"], s["state_key"], s["state_file"], s["config"],
                                       self.out)
        self.host = WatchHost(s["max_steps"])
        self.engine = EvalEngine(EvalSettings(args.cache, args.target, args.baseline, scoring=self.spec.scoring,
                                              runner="thread", keep_last=0, dirpath=self.out.parent,
                                              baseline_cache_dir=args.baseline_cache_dir))
        self.front = CheckpointFront(self.engine)
        if s["stop"] is not None:
            self.engine.add_stop(StopPolicy(s["stop"]))
        self.started = False
        self.done: set[int] = set(self.results_steps())  # steps with a report or an error line, or submitted
        self.seen: dict[int, Seen] = {}
        self._said: dict[object, str] = {}

    def say_once(self, key: object, line: str) -> None:
        if self._said.get(key) != line:
            self._said[key] = line
            print(line, flush=True)

    def results_steps(self) -> list[int]:
        if not is_run_folder(self.out):
            return []
        results = RunFolder(self.out).read_results()
        return [r.step for r in results.reports] + [e["step"] for e in results.errors if isinstance(e.get("step"), int)]

    # ---- before any scoring
    def check(self) -> None:
        """The checkpoints there now, whole and not scored yet, are all the run's drafter (that of
        --drafter-config, else of the first one there), and the drafter, cache, target, baseline and
        scoring config fit together; else ValueError (or PreflightError) listing every problem.
        Without any checkpoint or --drafter-config yet, what needs no drafter is checked now and the
        rest with the first checkpoint. A damaged checkpoint (a file that does not read) is no
        reason to refuse: it is an error line naming it when its turn comes; a torch file that reads
        but holds no state dict under --state-key is (the flag is wrong)."""
        c = self.checkpoints
        if c.config is not None:
            given = f"--drafter-config {self.settings['drafter_config']}"
            c.drafter = Drafter(c.config, drafter_shapes(c.config), given)
        problems = []
        for step, source in sorted(c.find().items()):
            if c.unfinished(source) or (step in self.done and c.drafter is not None):
                continue  # still being written (checked once it is whole), or scored before a restart
            try:
                config, shapes, weights = c.shapes(source)
            except Exception as e:
                if c.state_key is not None and isinstance(e, ValueError) and not isinstance(e, UnreadableFile):
                    problems.append(str(e))
                continue
            if c.drafter is None:
                c.drafter = Drafter(config, dict(shapes), str(source / "config.json"))
            problems += c.problems(source, config, shapes, weights)
        if problems:
            raise ValueError("checkpoints the watcher can not score:\n  " + "\n  ".join(problems))
        if c.drafter is None:
            preflight(self.spec, None)
        else:
            self.begin()

    def begin(self) -> None:
        """Check the run's drafter against everything, then open --out (fresh, or reopened) and start scoring."""
        drafter = self.checkpoints.drafter
        self.engine.check(self.host, None, drafter.config, shapes=drafter.shapes)
        if is_run_folder(self.out):
            changed = basis_changes(self.engine.basis, RunFolder(self.out))
            if changed:
                raise ValueError(f"--out {self.out} holds reports scored with {'; '.join(changed)}: watch with its "
                                 "settings, or give another --out")
        elif self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()  # an empty folder made beforehand: the run folder takes its place
        if is_run_folder(self.out):
            self.engine.load_state_dict({"run_id": self.out.name})  # a restart: reopened, results.jsonl read back
        try:
            self.engine.start(self.host, None, run_id=self.out.name)
        except RunFolderBusy as e:
            raise ValueError(f"--out {self.out}: {e}; another watcher writes there: stop it or give another "
                             "--out") from None
        self.started = True
        try:
            self.engine.run.update_about({"checkpoints": str(self.root.resolve()),
                                          "state_key": self.checkpoints.state_key})
            if self.settings["wandb_project"] is not None:
                self.host.wandb_run = self.start_wandb()
        except BaseException:
            self.close(ok=False)
            raise

    def start_wandb(self):
        """The W&B run the reports go to, resumed after a restart (its id is in run.json)."""
        import wandb

        s, about = self.settings, self.engine.run.about()
        run_id = about.get("wandb_id") or uuid.uuid4().hex[:12]
        # a W&B service of its own, which dies with this process: one inherited from the process that started
        # the watcher (WANDB_SERVICE) would keep a killed watcher's run open, and refuse the restart its id
        os.environ.pop("WANDB_SERVICE", None)
        deadline = time.monotonic() + WANDB_HELD_SECONDS
        while True:
            try:
                run = wandb.init(project=s["wandb_project"], name=s["wandb_name"], group=s["wandb_group"], id=run_id,
                                 resume="allow", dir=str(self.out), job_type="dflash-eval",
                                 config={"dflash_watch": {"checkpoints": str(self.root.resolve()), "out": str(self.out)}})
                break
            except Exception as e:
                if "in use" in str(e) and time.monotonic() < deadline:  # a killed watcher's W&B service still holds it
                    print(f"watch: W&B run {run_id} is still held (a killed watcher's service?); trying again",
                          flush=True)
                    time.sleep(2.0)
                    continue
                raise ValueError(f"W&B could not start a run: {type(e).__name__}: {e} (run `wandb login`, or set "
                                 "WANDB_MODE=offline)") from None
        self.engine.run.update_about({"wandb_id": run_id})
        return run

    # ---- polling
    def scan(self) -> int:
        """Submit every complete checkpoint not scored yet, in step order (one still being written holds
        back the later ones: see the module doc), and an error for each one seen and then deleted
        before it was scored. Returns how many were submitted."""
        c, now = self.checkpoints, time.monotonic()
        found = c.find()
        for step, names in c.duplicates.items():
            self.say_once(("duplicate", step), f"watch: {', '.join(names)} all name step {step}: scoring {names[0]}")
        if c.unread:
            shown = ", ".join(c.unread[:4]) + (f" and {len(c.unread) - 4} more" if len(c.unread) > 4 else "")
            self.say_once("unread", f"watch: {shown} in {self.root}: torch checkpoint files are read only with "
                                    "--state-key KEY (the key of the drafter's state dict in them, SpecForge: "
                                    "draft_state_dict) and --drafter-config CONFIG; without them, HF-format folders")
        ready, writing = [], None  # writing: the first step still being written
        for step, source in sorted(found.items()):
            if step in self.done:
                continue
            fingerprint = c.fingerprint(source)
            if fingerprint is None:
                continue  # no file yet
            seen = self.seen.get(step)
            if seen is None or (seen.source, seen.fingerprint) != (source, fingerprint):
                self.seen[step] = seen = Seen(source, fingerprint, now)
            marked = c.marked(source)  # the trainer says it is complete: read it, whatever it holds
            if not marked and now - seen.since < self.settle:
                writing = step if writing is None else writing  # still changing: the later steps wait for it
                continue
            why = None if marked else c.unfinished(source)
            if why is not None:  # settled and not whole (a save that died?): it holds back no later step
                self.say_once(step, f"watch: step {step}: waiting for {source}: {why}")
            elif writing is None:
                ready.append(step)
            else:
                self.say_once(("behind", step), f"watch: step {step} is complete: scored after step {writing}, "
                                                "which is still being written (step order)")
        deleted = [step for step in self.seen if step not in found and step not in self.done]
        if not self.started:
            if not ready or not self.start_with([self.seen[step].source for step in ready]):
                return 0  # a checkpoint deleted before then is recorded once there is a run folder
        submitted = sorted(ready + deleted)
        for step in submitted:
            seen = self.seen[step]
            self.host.latest = max(self.host.latest, step)
            self.front.submit(Job(step, seen.fingerprint, folder=seen.source, read=partial(self.read, seen.source, step)))
            self.done.add(step)
        return len(submitted)

    def read(self, source: Path, step: int):
        """The checkpoint's drafter, read when its scoring starts (on the runner's thread), which it says."""
        print(f"watch: step {step}: scoring {source}", flush=True)
        return self.checkpoints.read(source, step)

    def summary(self) -> str:
        """What it did, said at exit: steps scored and errors, the last report's monitored number (every
        method's live tau without a stop) and the stop's state."""
        reports, errors = self.engine.reports.reports, self.engine.errors
        said = f"watch: exiting: {len(reports)} step(s) scored, {errors} error(s)"
        policy = self.engine.stops.policies[0] if self.engine.stops.policies else None
        if reports:
            last = max(reports, key=lambda r: r.step)
            if policy is not None:
                base = self.engine.baseline_report
                against = f" (the baseline's {base.value(policy.monitor):.2f})" if base is not None else ""
                said += f"; the last report, step {last.step}: {policy.monitor} {last.value(policy.monitor):.2f}{against}"
            else:
                said += f"; the last report, step {last.step}: live tau " + ", ".join(
                    f"{m} {last.value(f'{m}/live'):.2f}" for m in last.methods)
        if policy is not None:
            decision = policy.last_decision
            said += (f"; the stop: {policy.stop_reason}" if policy.stop_reason else
                     f"; the stop: {decision.reason}" if decision is not None else "; the stop: no report judged yet")
        return said

    def start_with(self, sources: list[Path]) -> bool:
        """The first of `sources` that reads, when no checkpoint was there at start: it is the run's
        drafter. False while none reads (each says why, once); they are scored, as error lines naming
        them, once one does."""
        c = self.checkpoints
        if c.drafter is None:
            for source in sources:
                try:
                    config, shapes, _ = c.shapes(source)
                except Exception as e:
                    self.say_once(("unreadable", source), f"watch: {failure(source, e)}")
                    continue
                c.drafter = Drafter(config, dict(shapes), str(source / "config.json"))
                break
            else:
                return False
        self.begin()
        return True

    def publish(self) -> None:
        """Publish what is finished. A stop decided is written to --out/STOP.json for the training loop
        to poll, unless one is there: the first stop stands until someone removes the file."""
        reason = self.front.poll()
        if reason is not None and not (self.out / STOP_FILE).exists():
            atomic_write_json(self.out / STOP_FILE, {"stop": True, "reason": reason, "time": time.time(),
                                                     "monitor": self.engine.stops.policies[0].monitor})
            print(f"watch: STOP: {reason} (written to {self.out / STOP_FILE})", flush=True)

    def run(self) -> int:
        mode = f"--state-key {self.checkpoints.state_key!r}" if self.checkpoints.state_key else "HF drafter folders"
        every = "once" if self.once else f"every {self.poll_seconds:g} s"
        print(f"watch: scoring the checkpoints in {self.root} ({mode}) into {self.out} ({every}, complete after "
              f"{self.settle:g} s unchanged{'' if self.once else '; Ctrl-C stops'})", flush=True)
        last_work = time.monotonic()
        if self.once:
            self.scan()
            if self.settle > 0 and set(self.seen) - self.done:
                time.sleep(self.settle)  # what is there now, once it has settled
                self.scan()
            for step in sorted(set(self.seen) - self.done):
                print(f"watch: step {step} ({self.seen[step].source}) is not complete: left for the next run",
                      flush=True)
            if not self.started:
                print(f"watch: no complete checkpoint in {self.root}", flush=True)
        while True:
            if not self.once and self.scan():
                last_work = time.monotonic()
            self.publish()
            if self.engine.pending:
                last_work = time.monotonic()
            elif self.once or (self.idle_exit is not None and time.monotonic() - last_work > self.idle_exit):
                return 0
            time.sleep(min(self.poll_seconds, 0.2) if self.engine.pending else self.poll_seconds)

    def close(self, ok: bool) -> None:
        """The last reports (when `ok`: all pending are scored first; else what is running is left
        for the next start), the run folder released, the W&B run finished."""
        try:
            if self.started:
                self.started = False
                if ok:
                    self.engine.close(wait=True, reason="the watcher is exiting")
                else:
                    self.engine.close(wait=False, reason="the watcher stopped", publish=False)
        finally:
            if self.host.wandb_run is not None:
                self.host.wandb_run.finish(exit_code=0 if ok else 1)
                self.host.wandb_run = None


def run_watch_checkpoints(args: argparse.Namespace, settings: dict[str, Any], scoring: ScoringConfig) -> int:
    """`watch --checkpoints` with its flags (`cli.watch.checkpoint_settings`) and scoring config."""
    watcher = CheckpointWatcher(args, settings, scoring)
    watcher.check()
    ok = False
    try:
        watcher.run()
        ok = True
    finally:
        try:
            watcher.close(ok)
        finally:  # also on Ctrl-C
            print(watcher.summary(), flush=True)
    return 0

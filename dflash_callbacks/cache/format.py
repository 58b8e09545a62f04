"""The hidden-state cache: a folder of one safetensors file per task plus `manifest.json`.

    manifest.json
      {"format": "dflash-hidden-cache", "version": 1,
       "target": {"path": ..., "num_layers": 4, "hidden_size": 128, "vocab_size": 260,
                  "dtype": "float32"},
       "layer_ids": [1, 2],            # layer id i = hidden_states[i + 1] of the target
       "block_size": 16 | null,        # the block size it was made for, if any
       "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "samples": 4, "seed": 0},
                                       # only in a cache of sampled answers (absent: greedy)
       "extraction": {...},            # optional: settings the extractor used
       "tasks": [{"name": "fizzbuzz", "file": "fizzbuzz.safetensors", "prompt_len": 52,
                  "num_tokens": 180, "num_bytes": 92312, "sha256": "<64 hex>",
                  "prompt": "...",     # "prompt" optional
                  "sample": 0}]}       # sampled caches: which answer of its prompt (0..samples-1)
    <task>.safetensors: input_ids [T] int64 (prompt then completion),
                        hidden [T, len(layer_ids) * hidden_size] in the target's dtype,
                        target_logprob [T] float32 (sampled caches only): the log-probability
                        of each completion token under the served distribution it was drawn
                        from (`sampling.served_logprobs`); 0 at prompt positions
                        support_ids [T, S] int32, support_probs [T, S] float32 (sampled caches
                        from scorer version 6 on): the served distribution each completion token
                        was drawn from, its S most probable tokens (`sampling.served_support`,
                        S = SUPPORT_SIZE), -1 and 0 past its support and in the prompt; the
                        manifest entry's "support": {"size": S, "dropped": the largest mass past
                        the bound at any position}

A sampled cache holds `samples` answers per prompt, each a task: the prompt's name for one
answer, else `name.s0`, `name.s1`, ... (`Sampling.answer_names`).

Writers never leave half a file visible: each task file and every manifest update is
written under a hidden temporary name and renamed into place. Readers validate the
manifest on open and check a task file's size and sha256 the first time it is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from ..checks import DTYPES
from ..files import atomic_write, atomic_write_json
from .sampling import SAMPLING_KEYS, Sampling, sampling_problems
from .tasks import task_name_problem

FORMAT_NAME = "dflash-hidden-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHA256 = re.compile(r"^[0-9a-f]{64}\Z")


class CacheError(ValueError):
    """A cache folder that cannot be read as it is: bad manifest, missing or damaged file."""


class CacheMismatchError(ValueError):
    """A valid cache that does not fit the drafter (layer ids, hidden size, vocabulary)."""


@dataclass(frozen=True)
class TargetInfo:
    """What a cache records about the target it was extracted from."""

    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str  # a key of DTYPES
    head: str | None = None  # model.target_head.head_fingerprint of its embedding and LM head (older caches: None)


@dataclass
class CacheTask:
    """One task of a cache: `input_ids` [T] int64 = prompt (first `prompt_len`) then the
    target's completion (greedy, or sampled); `hidden` [T, n_layers * H], the target's hidden
    states; `target_logprob` [T] float32 in a sampled cache (else None): each completion
    token's log-probability under the served distribution it was drawn from, 0 in the prompt."""

    name: str
    prompt_len: int
    input_ids: torch.Tensor
    hidden: torch.Tensor
    target_logprob: torch.Tensor | None = None
    support_ids: torch.Tensor | None = None
    """int32 [T, S] (a sampled cache that keeps the served support, else None): the served distribution's
    most probable tokens at each position, -1 past its support and in the prompt."""
    support_probs: torch.Tensor | None = None
    """float32 [T, S]: their probabilities, 0 where the id is -1."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


# ---------------------------------------------------------------- manifest validation


def _kind_ok(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "int or null":
        return value is None or _kind_ok(value, "int")
    return isinstance(value, {"str": str, "list": list, "object": dict}[kind])


def _field(obj: dict, key: str, kind: str, where: str, *, required: bool = True) -> Any:
    """obj[key], checked to be of `kind`; errors name the field as `where.key`."""
    if key not in obj:
        if required:
            raise CacheError(f"{where}: missing field {key!r}")
        return None
    value = obj[key]
    if not _kind_ok(value, kind):
        raise CacheError(f"{where}: field {key!r} must be {kind}, got {type(value).__name__} ({value!r:.60})")
    return value


def validate_manifest(raw: Any, where: str) -> dict:
    """Checks every field of a parsed manifest; returns it unchanged. `where` (usually the
    manifest's path) starts every error message."""
    if not isinstance(raw, dict):
        raise CacheError(f"{where}: the manifest must be a JSON object, got {type(raw).__name__}")
    fmt = _field(raw, "format", "str", where)
    if fmt != FORMAT_NAME:
        raise CacheError(f"{where}: format is {fmt!r}, expected {FORMAT_NAME!r} (is this a hidden-state cache?)")
    version = _field(raw, "version", "int", where)
    if version != FORMAT_VERSION:
        raise CacheError(
            f"{where}: cache format version {version} is not supported (this reader knows version "
            f"{FORMAT_VERSION}); re-extract the cache or use a matching dflash_callbacks"
        )

    target = _field(raw, "target", "object", where)
    _field(target, "path", "str", f"{where}: target")
    for key in ("num_layers", "hidden_size", "vocab_size"):
        if _field(target, key, "int", f"{where}: target") < 1:
            raise CacheError(f"{where}: target.{key} must be positive, got {target[key]}")
    _field(target, "head", "str", f"{where}: target", required=False)
    if _field(target, "dtype", "str", f"{where}: target") not in DTYPES:
        raise CacheError(f"{where}: target.dtype {target['dtype']!r} is not one of {list(DTYPES)}")

    layer_ids = _field(raw, "layer_ids", "list", where)
    if not layer_ids:
        raise CacheError(f"{where}: layer_ids is empty")
    for i, layer in enumerate(layer_ids):
        if not _kind_ok(layer, "int"):
            raise CacheError(f"{where}: layer_ids[{i}] must be int, got {type(layer).__name__} ({layer!r})")
        if not 0 <= layer < target["num_layers"]:
            raise CacheError(f"{where}: layer id {layer} is outside the target's {target['num_layers']} layers")
    if len(set(layer_ids)) != len(layer_ids):
        raise CacheError(f"{where}: layer_ids {layer_ids} has duplicates")
    block_size = _field(raw, "block_size", "int or null", where, required=False)
    if block_size is not None and block_size < 2:
        raise CacheError(f"{where}: block_size must be at least 2 or null, got {block_size}")
    _field(raw, "extraction", "object", where, required=False)
    sampling = _field(raw, "sampling", "object", where, required=False)
    if sampling is not None:
        keys = sorted(set(sampling) ^ set(SAMPLING_KEYS))
        problems = [f"has the fields {sorted(sampling)}, expected {list(SAMPLING_KEYS)}"] if keys else sampling_problems(
            *(sampling[k] for k in SAMPLING_KEYS))
        if not problems and sampling["temperature"] == 0:
            problems = ["temperature 0 is greedy: a greedy cache records no sampling"]
        if problems:
            raise CacheError(f"{where}: sampling: " + "; ".join(problems) + " (re-extract the cache)")

    names: set[str] = set()
    files: set[str] = set()
    for i, task in enumerate(_field(raw, "tasks", "list", where)):
        at = f"{where}: tasks[{i}]"
        if not isinstance(task, dict):
            raise CacheError(f"{at} must be an object, got {type(task).__name__}")
        name = _field(task, "name", "str", at)
        file = _field(task, "file", "str", at)
        prompt_len = _field(task, "prompt_len", "int", at)
        num_tokens = _field(task, "num_tokens", "int", at)
        num_bytes = _field(task, "num_bytes", "int", at)
        sha = _field(task, "sha256", "str", at)
        _field(task, "prompt", "str", at, required=False)
        support = task.get("support")
        if support is not None and (sampling is None or not isinstance(support, dict) or not isinstance(
                support.get("size"), int) or support["size"] < 1 or not isinstance(support.get("dropped"), (int, float))
                or not 0 <= support["dropped"] <= 1):
            raise CacheError(f"{at}: 'support' must be {{\"size\": S >= 1, \"dropped\": a mass 0..1}} in a sampled "
                             f"cache; got {support!r}")
        sample = _field(task, "sample", "int", at, required=sampling is not None)
        if sampling is None and sample is not None:
            raise CacheError(f"{at}: a greedy cache (no 'sampling') has no sampled answers, but the task records "
                             f"sample {sample}")
        if sample is not None and not 0 <= sample < sampling["samples"]:
            raise CacheError(f"{at}: sample {sample} is outside 0..{sampling['samples'] - 1} (sampling.samples)")
        problem = task_name_problem(name)
        if problem:
            raise CacheError(f"{at}: {problem}")
        if name in names:
            raise CacheError(f"{at}: duplicate task name {name!r}")
        if Path(file).name != file or file.startswith(".") or file in files:
            raise CacheError(f"{at}: file {file!r} must be a distinct plain file name inside the cache folder")
        if num_tokens < 1 or not 0 <= prompt_len <= num_tokens or num_bytes < 0:
            raise CacheError(
                f"{at} ({name}): need 0 <= prompt_len <= num_tokens, num_tokens >= 1 and num_bytes >= 0; "
                f"got prompt_len={prompt_len}, num_tokens={num_tokens}, num_bytes={num_bytes}"
            )
        if not SHA256.match(sha):
            raise CacheError(f"{at} ({name}): sha256 must be 64 lowercase hex digits, got {sha!r:.80}")
        names.add(name)
        files.add(file)
    return raw


def read_manifest(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    path = folder / MANIFEST
    if folder.is_file():
        raise FileNotFoundError(f"cache {folder} is a file: give the cache's folder (e.g. {folder.parent})")
    if not folder.is_dir():
        raise FileNotFoundError(f"no cache folder at {folder}")
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} has no {MANIFEST}, so it is not a hidden-state cache (make one with `dflash-callbacks extract`)"
        )
    try:
        raw = json.loads(path.read_text(), object_pairs_hook=_unique_keys)
    except ValueError as e:  # not JSON, not UTF-8, or a key given twice
        raise CacheError(f"{path} is not valid JSON: {e}") from e
    return validate_manifest(raw, str(path))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object whose keys are distinct (json.loads otherwise keeps the last of a key given twice)."""
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"the key(s) {twice} appear twice in one object")
    return dict(pairs)


def fingerprint(manifest: dict) -> str:
    """16 hex digits identifying a cache's content: every manifest field (the per-task
    sha256s included) except target.path, so moving the target folder does not change it."""
    content = json.loads(json.dumps(manifest))
    content["target"].pop("path", None)
    blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ---------------------------------------------------------------- writing


def write_manifest(folder: str | os.PathLike, manifest: dict) -> None:
    path = Path(folder) / MANIFEST
    validate_manifest(manifest, str(path))
    atomic_write_json(path, manifest)


def new_manifest(
    target: TargetInfo,
    layer_ids: list[int],
    *,
    block_size: int | None = None,
    extraction: dict | None = None,
    sampling: Sampling | None = None,
) -> dict:
    """The manifest of an empty cache; `extraction` records the extractor's settings, `sampling`
    those its answers were sampled at (None or greedy: none recorded, a greedy cache)."""
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "target": {k: v for k, v in asdict(target).items() if v is not None},
        "layer_ids": [int(i) for i in layer_ids],
        "block_size": block_size,
    }
    if sampling is not None and not sampling.greedy:
        manifest["sampling"] = sampling.to_dict()
    if extraction is not None:
        manifest["extraction"] = dict(extraction)
    manifest["tasks"] = []
    return manifest


def open_for_writing(folder: str | os.PathLike, header: dict) -> dict:
    """Create the cache folder with an empty manifest, or reopen an existing cache to add
    tasks, provided it was made the same way (`header` is a `new_manifest(...)`: same target
    shape and dtype, layer ids, block size and extraction settings). Removes temporary files
    a killed writer left behind. Returns the manifest on disk."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".*.tmp-*"):
        stale.unlink()
    if not (folder / MANIFEST).exists():
        write_manifest(folder, header)
        return header
    manifest = read_manifest(folder)
    # the path may move; a cache made before heads were fingerprinted records none
    skip = {"path"} | ({"head"} if "head" not in manifest["target"] else set())
    extraction = header.get("extraction")
    if isinstance(extraction, dict) and "tasks" not in (manifest.get("extraction") or {}):  # begun before task lists
        extraction = {k: v for k, v in extraction.items() if k != "tasks"} or None          # were recorded
    old_target = {k: v for k, v in manifest["target"].items() if k not in skip}
    new_target = {k: v for k, v in header["target"].items() if k not in skip}
    differences = [
        f"{key} {theirs} != {mine}"
        for key, theirs, mine in [
            ("target", old_target, new_target),
            ("layer ids", manifest["layer_ids"], header["layer_ids"]),
            ("block size", manifest.get("block_size"), header.get("block_size")),
            ("extraction settings", manifest.get("extraction"), extraction),
            ("sampling", manifest.get("sampling"), header.get("sampling")),
        ]
        if theirs != mine
    ]
    if differences:
        raise CacheError(
            f"{folder} already holds a cache made differently (cache vs this run: {'; '.join(differences)}); "
            f"write to another folder or delete this one"
        )
    return manifest


def write_task(
    folder: str | os.PathLike,
    name: str,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    prompt_len: int,
    *,
    prompt: str | None = None,
    target_logprob: torch.Tensor | None = None,
    sample: int | None = None,
    support: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict:
    """Store one task in a cache opened with `open_for_writing`: the file first (atomic),
    then the manifest entry (replacing one of the same name; atomic). Returns the entry.
    A sampled cache's task also takes its `target_logprob` [T] and which `sample` of its prompt it is, and may
    take the served distribution's `support` (ids int32 [T, S], probs float32 [T, S])."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    target = manifest["target"]
    width = len(manifest["layer_ids"]) * target["hidden_size"]
    problem = task_name_problem(name)
    if problem:
        raise ValueError(problem)
    if input_ids.ndim != 1 or input_ids.dtype.is_floating_point:
        raise ValueError(f"{name}: input_ids must be a 1-D integer tensor, got {input_ids.dtype} {list(input_ids.shape)}")
    num_tokens = input_ids.shape[0]
    if tuple(hidden.shape) != (num_tokens, width):
        raise ValueError(f"{name}: hidden must be [{num_tokens}, {width}] (tokens, layers * hidden), got {list(hidden.shape)}")
    if hidden.dtype != DTYPES[target["dtype"]]:
        raise ValueError(f"{name}: hidden is {hidden.dtype} but the cache holds {target['dtype']}")
    if not 0 <= prompt_len <= num_tokens or num_tokens < 1:
        raise ValueError(f"{name}: prompt_len {prompt_len} does not fit {num_tokens} tokens")
    sampled = "sampling" in manifest
    if sampled != (target_logprob is not None) or sampled != (sample is not None):
        raise ValueError(f"{name}: a {'sampled' if sampled else 'greedy'} cache's task "
                         f"{'needs' if sampled else 'takes no'} target_logprob and sample")
    if target_logprob is not None and (target_logprob.dtype != torch.float32 or tuple(target_logprob.shape) != (num_tokens,)):
        raise ValueError(f"{name}: target_logprob must be float32 [{num_tokens}], got {target_logprob.dtype} "
                         f"{list(target_logprob.shape)}")

    if support is not None and not sampled:
        raise ValueError(f"{name}: a greedy cache's task takes no support")
    if support is not None:
        ids, probs = support
        if ids.dtype != torch.int32 or probs.dtype != torch.float32 or ids.ndim != 2 or ids.shape != probs.shape \
                or ids.shape[0] != num_tokens:
            raise ValueError(f"{name}: support must be (int32 [{num_tokens}, S], float32 [{num_tokens}, S]), got "
                             f"({ids.dtype} {list(ids.shape)}, {probs.dtype} {list(probs.shape)})")
    tensors = {"input_ids": input_ids.to(torch.int64).cpu().contiguous(), "hidden": hidden.cpu().contiguous()}
    if target_logprob is not None:
        tensors["target_logprob"] = target_logprob.cpu().contiguous()
    if support is not None:
        tensors["support_ids"], tensors["support_probs"] = (t.cpu().contiguous() for t in support)
    data = safetensors_bytes(tensors, metadata={"task": name})  # one key: byte-identical on every write
    file = f"{name}.safetensors"
    atomic_write(folder / file, data)

    entry = {
        "name": name,
        "file": file,
        "prompt_len": int(prompt_len),
        "num_tokens": int(num_tokens),
        "num_bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    if prompt is not None:
        entry["prompt"] = prompt
    if sample is not None:
        entry["sample"] = int(sample)
    if support is not None:
        dropped = (1 - support[1][prompt_len:].double().sum(-1)).clamp(min=0)
        entry["support"] = {"size": int(support[0].shape[1]), "dropped": float(dropped.max()) if len(dropped) else 0.0}
    others = [t for t in manifest["tasks"] if t["name"] != name]
    if len(others) == len(manifest["tasks"]):
        manifest["tasks"].append(entry)
    else:
        manifest["tasks"] = [entry if t["name"] == name else t for t in manifest["tasks"]]
    write_manifest(folder, manifest)
    return entry


# ---------------------------------------------------------------- reading


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_task_file(folder: Path, entry: dict, digest: bool = True) -> Path:
    """The task's file, after checking it exists, has the recorded size and (with `digest`) sha256."""
    path = folder / entry["file"]
    if not path.is_file():
        raise CacheError(f"task {entry['name']!r}: file {path} is missing (the manifest lists it)")
    size = path.stat().st_size
    if size != entry["num_bytes"]:
        raise CacheError(
            f"task {entry['name']!r}: file {path} is {size} bytes but the manifest says {entry['num_bytes']}: "
            f"truncated or overwritten; re-extract this task"
        )
    found = sha256_file(path) if digest else entry["sha256"]
    if found != entry["sha256"]:
        raise CacheError(
            f"task {entry['name']!r}: file {path} has sha256 {found[:12]}… but the manifest says "
            f"{entry['sha256'][:12]}…: the file is corrupt or was changed after extraction; re-extract this task"
        )
    return path


class HiddenStateCache:
    """A cache folder opened for reading. The manifest is validated here; task files are
    opened only when a task is asked for (read with safetensors' memory-mapped `safe_open`),
    and each file's size and sha256 are checked on its first read (or all at once by
    `verify()`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.target = TargetInfo(**{f.name: self.manifest["target"][f.name] for f in fields(TargetInfo)
                                    if f.name in self.manifest["target"]})
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.block_size: int | None = self.manifest.get("block_size")
        sampling = self.manifest.get("sampling")
        # the settings its answers were sampled at; None: a greedy cache
        self.sampling: Sampling | None = None if sampling is None else Sampling(**sampling)
        self._entries = {entry["name"]: entry for entry in self.manifest["tasks"]}
        self._verified: set[str] = set()

    def __repr__(self) -> str:
        return f"HiddenStateCache({str(self.path)!r}, tasks={len(self)}, layer_ids={self.layer_ids})"

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def task_names(self) -> list[str]:
        return list(self._entries)

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.target.dtype]

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.manifest)

    def entry(self, name: str) -> dict:
        if name not in self._entries:
            raise KeyError(f"no task {name!r} in the cache at {self.path}; it holds {self.task_names}")
        return self._entries[name]

    def task(self, name: str) -> CacheTask:
        """The task's tokens and hidden states, checked against the manifest. The first read
        of a task also checks its file's size and sha256 and that its hidden states are finite."""
        entry = self.entry(name)
        first_read = name not in self._verified
        path = check_task_file(self.path, entry) if first_read else self.path / entry["file"]
        try:
            with safe_open(str(path), framework="pt") as f:
                missing = {"input_ids", "hidden", *(["target_logprob"] if self.sampling else [])} - set(f.keys())
                if missing:
                    raise CacheError(f"task {name!r}: file {path} has no tensor(s) {sorted(missing)}")
                written_for = (f.metadata() or {}).get("task", name)  # write_task records it
                if written_for != name:
                    raise CacheError(f"task {name!r}: file {path} was written for task {written_for!r}: the manifest "
                                     "was edited or files were swapped; re-extract these tasks")
                input_ids, hidden = f.get_tensor("input_ids"), f.get_tensor("hidden")
                logprob = f.get_tensor("target_logprob") if self.sampling else None
                support = (f.get_tensor("support_ids"), f.get_tensor("support_probs")) if "support" in entry else None
        except SafetensorError as e:
            raise CacheError(f"task {name!r}: file {path} is not a readable safetensors file (truncated or corrupt?): {e}") from e
        width = len(self.layer_ids) * self.hidden_size
        T = entry["num_tokens"]
        if input_ids.dtype != torch.int64 or tuple(input_ids.shape) != (T,):
            raise CacheError(f"task {name!r}: {path} input_ids is {input_ids.dtype} {list(input_ids.shape)}, expected int64 [{T}]")
        if hidden.dtype != self.dtype or tuple(hidden.shape) != (T, width):
            raise CacheError(
                f"task {name!r}: {path} hidden is {hidden.dtype} {list(hidden.shape)}, expected {self.dtype} [{T}, {width}]"
            )
        if T and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < self.vocab_size:
            raise CacheError(f"task {name!r}: {path} holds token ids outside the vocabulary [0, {self.vocab_size})")
        if logprob is not None and (logprob.dtype != torch.float32 or tuple(logprob.shape) != (T,)):
            raise CacheError(f"task {name!r}: {path} target_logprob is {logprob.dtype} {list(logprob.shape)}, "
                             f"expected float32 [{T}]")
        if support is not None:
            ids, probs = support
            S = entry["support"]["size"]
            if ids.dtype != torch.int32 or probs.dtype != torch.float32 or tuple(ids.shape) != (T, S) \
                    or tuple(probs.shape) != (T, S):
                raise CacheError(f"task {name!r}: {path} support is {ids.dtype} {list(ids.shape)}, {probs.dtype} "
                                 f"{list(probs.shape)}, expected int32 and float32 [{T}, {S}]")
            if first_read and not (bool(((ids >= -1) & (ids < self.vocab_size)).all())
                                   and bool(((probs >= 0) & (probs <= 1) & ((ids >= 0) | (probs == 0))).all())
                                   and bool((probs.double().sum(-1) <= 1 + 1e-4).all())):
                raise CacheError(f"task {name!r}: {path} support holds ids outside [-1, {self.vocab_size}) or "
                                 "probabilities that are not a distribution's; re-extract this task")
        if first_read:
            bad = int((~torch.isfinite(hidden)).any(dim=-1).sum())
            if bad:
                raise CacheError(f"task {name!r}: {path} holds NaN or Inf hidden states at {bad} of {T} positions; "
                                 "re-extract this task")
            if logprob is not None and not bool((torch.isfinite(logprob) & (logprob <= 0)).all()):
                raise CacheError(f"task {name!r}: {path} target_logprob holds values that are not finite log-probabilities "
                                 "(<= 0); re-extract this task")
            self._verified.add(name)
        return CacheTask(name=name, prompt_len=entry["prompt_len"], input_ids=input_ids, hidden=hidden,
                         target_logprob=logprob, support_ids=None if support is None else support[0],
                         support_probs=None if support is None else support[1])

    def tasks(self):
        """Every task, in manifest order (one at a time, so memory holds one task)."""
        for name in self.task_names:
            yield self.task(name)

    def verify(self, names: list[str] | None = None) -> None:
        """Check task files now (existence, size, sha256, tensors, finite hidden states);
        raises CacheError naming the first bad one."""
        for name in names or self.task_names:
            self.task(name)

    def check_sizes(self, names: list[str] | None = None) -> None:
        """The cheap part of `verify`: every task file exists and has its recorded size."""
        for name in names or self.task_names:
            check_task_file(self.path, self.entry(name), digest=False)

    def check_compatible(self, drafter_config, block_size: int | None = None, warn: bool = True) -> None:
        """Refuse a drafter this cache cannot feed: different layer ids, hidden size, vocabulary
        (or target layer count, where the drafter config records one). Warn (`warn`) when the
        cache was made for another block size than the one scored (`block_size`, default the
        drafter's); the scorer warns, the preflight before it does not say it twice."""
        cfg = drafter_config
        problems = []
        if list(cfg.target_layer_ids) != self.layer_ids:
            problems.append(f"cache layer ids {self.layer_ids} != drafter target_layer_ids {list(cfg.target_layer_ids)}")
        if cfg.hidden_size != self.hidden_size:
            problems.append(f"cache hidden size {self.hidden_size} != drafter hidden_size {cfg.hidden_size}")
        if cfg.vocab_size != self.vocab_size:
            problems.append(f"cache vocab size {self.vocab_size} != drafter vocab_size {cfg.vocab_size}")
        num_target_layers = getattr(cfg, "num_target_layers", None)
        if num_target_layers is not None and num_target_layers != self.target.num_layers:
            problems.append(
                f"cache target has {self.target.num_layers} layers != drafter num_target_layers {num_target_layers}"
            )
        if problems:
            raise CacheMismatchError(f"the cache at {self.path} does not fit the drafter: " + "; ".join(problems))
        scored = block_size if block_size is not None else cfg.block_size
        if warn and self.block_size is not None and scored != self.block_size:
            warnings.warn(
                f"the cache at {self.path} was made for block size {self.block_size} but block size {scored} "
                f"is being scored",
                stacklevel=2,
            )

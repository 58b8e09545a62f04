"""The one way to score: a drafter (weights in memory, a published folder or a snapshot)
against a cache with a target's head, and the baseline once. No Lightning here.

Every entry point uses it: the callback's thread runner, the process runner's worker,
`dflash-callbacks watch` and `dflash-callbacks score`.

    spec = ServiceSpec(cache=..., target=..., baseline=..., scoring=ScoringConfig(...))
    preflight(spec, drafter_config)        # before any work: raises PreflightError listing every problem
    service = ScoringService(spec)         # loads the target's embedding and LM head (owns_process=True: see the class)
    report = service.score(config, state, step=400, snapshot_id="...")
    report = service.score_folder("runs/x/snapshots/step-00000400")
    baseline = service.baseline()          # scored once per (weights, cache, target head, scoring config), cached on disk

Nothing that is not a finite number is ever reported: NaN or Inf weights, hidden states
or logits raise NonFiniteError for that report.

Scoring reads the process it runs in and never writes to it: the numbers do not depend
on the default dtype (every tensor that holds numbers is built with its dtype and device)
or on a caller's autocast; nothing draws from the global RNGs; grad mode and autocast are
set for the calling thread while it scores, and restored; no thread count, backends flag,
current device or stream is changed; the peak-memory counter and the allocator's cache
are touched only by a service that owns its process.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..cache.format import CacheError, HiddenStateCache
from ..checks import check_device
from ..model import DFlashDrafter, DrafterConfig, TargetHead, build_drafter, drafter_class, load_drafter
from ..model.attention import attention_note, resolve_attention
from ..model.drafter import check_state_dict
from ..model.geometry import anchor_range
from ..model.io import read_config, read_snapshot_meta, read_state_shapes, safetensors_files
from ..model.target_head import head_fingerprint, head_shapes, target_model_window
from .basis import Basis
from .config import ScoringConfig
from .report import SCORER_VERSION, EvalReport
from .scorer import NonFiniteError, block_problems, memory_plan, score_drafter
from .acceptance import draft_rule_problems, engine_settings_warning, served_problems

VERIFY_BYTES = 4 << 30
"""Preflight reads every cache file (sha256, finite hidden states) when they total at most this;
above it, sizes are checked up front and each file's contents on its first read."""


class PreflightError(ValueError):
    """The inputs do not fit together; the message lists every problem found."""


@dataclass(frozen=True)
class ServiceSpec:
    """What a ScoringService is built from. It crosses to the `process` runner's worker as one JSON object
    (`to_dict`), rebuilt there once (`from_dict`); `scoring` is a ScoringConfig (a dict of its fields is
    taken and made one, once)."""

    cache: str
    target: str
    baseline: str | None = None
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    baseline_cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.scoring, ScoringConfig):
            object.__setattr__(self, "scoring", ScoringConfig.from_dict(dict(self.scoring)))

    def to_dict(self) -> dict:
        return {**asdict(self), "scoring": self.scoring.to_dict()}

    @classmethod
    def from_dict(cls, raw: dict) -> ServiceSpec:
        return cls(**raw)


def default_baseline_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "dflash_callbacks" / "baselines"


def weights_fingerprint(folder: str | os.PathLike) -> str:
    """sha256 over config.json and every weight file of a drafter folder (full contents)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for file in [folder / "config.json", *safetensors_files(folder)]:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def cached_baseline(source: str | os.PathLike, cache: str, target: str, config: ScoringConfig,
                    cache_dir: str | os.PathLike | None = None) -> tuple[dict, Path]:
    """(the key, the file) of the cached report of the baseline drafter folder `source` (its weights'
    fingerprint and its family), scored on the cache and target head of these fingerprints with `config`:
    what `ScoringService.baseline` writes, and `dflash-callbacks plot` reads back."""
    drafter = read_config(source)  # read as its family: one read as another is scored again
    key = {"weights": weights_fingerprint(source), "cache": cache, "target": target,
           "scoring": config.fingerprint_fields(), "scorer": SCORER_VERSION,  # a fix to the definitions scores it again
           "family": drafter.family, "family_config": _plain(drafter.family_config)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return key, Path(cache_dir or default_baseline_cache_dir()) / f"baseline-{digest}.json"


def recorded_weights(report) -> str | None:
    """The baseline weights' fingerprint a baseline report records (`extra.baseline_key.weights`,
    set when `ScoringService.baseline` scored a drafter folder), None if it records none."""
    key = report.extra.get("baseline_key") if isinstance(report, EvalReport) else None
    weights = key.get("weights") if isinstance(key, dict) else None
    return weights if isinstance(weights, str) else None


def _plain(settings) -> dict | None:
    """A family's settings (a frozen dataclass, or None) as JSON values."""
    return None if settings is None else asdict(settings)


def check_finite_weights(state: Mapping[str, torch.Tensor], what: str) -> None:
    bad = [name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteError(f"{what} holds NaN or Inf weights in {shown}; not scored")


# ---------------------------------------------------------------- preflight


def preflight(spec: ServiceSpec, drafter: DrafterConfig | None, drafter_shapes: Mapping[str, tuple] | None = None,
              warn: Callable[[str], None] | None = None) -> Basis:
    """Check, before any work, that the drafter (its config, and its tensor shapes when
    given), the cache, the target, the scoring config, the device and the baseline fit
    together. Without a drafter (`watch`, before it has seen a snapshot), the checks that
    need one are left out and the target is held against the cache. Raises PreflightError
    with one line per problem; else tells `warn` (default `warnings.warn`) what the drafter's and a
    baseline folder's family say of how their checkpoints will be served (`model.attention.attention_note`,
    one line each; with a drafter only) and returns the run's basis (`scoring.basis`), from the cache and the head
    fingerprint it has just read."""
    config = spec.scoring
    problems: list[str] = []
    problems += _device_problems(config)
    if drafter is not None and drafter_shapes is not None:
        problems += _shape_problems(drafter, drafter_shapes, "the drafter")
    if drafter is not None:
        problems += block_problems(drafter, config)
    block = config.block_size or (drafter.block_size if drafter is not None else None)
    try:
        cache = HiddenStateCache(spec.cache)
    except (OSError, CacheError) as e:
        cache = None
        problems.append(f"cache: {e}")
    if cache is not None:
        problems += _cache_problems(cache, drafter, config, block)
        problems += served_problems(config, cache.sampling, drafter.family if drafter is not None else None,
                                    f"the cache {cache.path}")
    vocab = drafter.vocab_size if drafter is not None else cache.vocab_size if cache is not None else None
    hidden = drafter.hidden_size if drafter is not None else cache.hidden_size if cache is not None else None
    target_problems, head = _target_problems(spec.target, vocab, hidden,
                                             "the drafter's" if drafter is not None else "the cache's",
                                             cache.target.head if cache is not None else None)
    problems += target_problems
    if drafter is not None and cache is not None and config.max_memory_gib is not None:
        with torch.device("meta"):
            sized = build_drafter(drafter)
        longest = max(cache.entry(n)["num_tokens"] for n in cache.task_names)
        try:
            memory_plan(config, sized, drafter.vocab_size, longest, block)
        except ValueError as e:
            problems.append(str(e))
    window = target_model_window(spec.target)  # the engine's window for a drafter layer declaring none
    if spec.baseline is not None and cache is not None:
        problems += _baseline_problems(Path(spec.baseline), cache, config, block, head, window)
    elif spec.baseline is not None and not Path(spec.baseline).exists():  # what can be checked without the cache
        problems.append(f"baseline {spec.baseline} does not exist (give a drafter folder or a saved report JSON)")
    if problems:
        raise PreflightError("the scoring inputs do not fit together:\n  " + "\n  ".join(problems))
    engine = engine_settings_warning(config.served_engine_settings)
    added = ("vllm-as-written" in config.rules(window) and "vllm-as-written" not in config.attentions
             and drafter is not None and resolve_attention(drafter, "vllm", window) != resolve_attention(drafter, "vllm"))
    both = (f"attention vllm: the target's model-level window ({window}) reaches the drafter's layers that declare "
            "none, so every method is also scored as the config is written (METHOD:vllm-as-written), the window's "
            "cost in each report's line; scoring.score_as_written: false scores the served rule alone")
    for line in [*_attention_notes(config, drafter, spec.baseline), *([engine] if engine else []),
                 *([both] if added else [])]:
        (warn or (lambda text: warnings.warn(text, UserWarning, stacklevel=3)))(line)
    return Basis.of_run(config, cache, block, head, window)


def _attention_notes(config: ScoringConfig, drafter: DrafterConfig | None, baseline: str | None) -> list[str]:
    """The drafter's and a baseline folder's `attention_note`, the baseline's naming it; none without a drafter
    (a watcher's check before its first checkpoint: the preflight with the drafter says them)."""
    if drafter is None:
        return []
    rules = [config.attention, *config.attentions]
    notes = [attention_note(drafter, rules)]
    if baseline is not None and Path(baseline).is_dir():  # read without error: preflight has checked it
        note = attention_note(read_config(Path(baseline)), rules)
        notes.append(note and f"baseline {baseline}: {note}")
    return [note for note in notes if note]


def _device_problems(config: ScoringConfig) -> list[str]:
    try:
        device = check_device("scoring.device", config.device)
    except ValueError as e:
        return [str(e)]
    if config.backend == "triton":
        from ..kernels import triton_head_stats as th

        if not th.is_available():
            return ["scoring.backend='triton' needs the triton package; install it or use backend 'auto' or 'torch'"]
        if device.type != "cuda" and not th.is_interpreted():
            return ["scoring.backend='triton' runs on CUDA devices only (or on the CPU under TRITON_INTERPRET=1); "
                    "use backend 'auto' or 'torch' on the CPU"]
    return []


def _shape_problems(config: DrafterConfig, shapes: Mapping[str, tuple], what: str) -> list[str]:
    with torch.device("meta"):
        expected = build_drafter(config).state_dict()
    try:
        check_state_dict(expected, {k: torch.empty(s, device="meta") for k, s in shapes.items()})
    except ValueError as e:
        return [f"{what}: {e}"]
    return []


def _cache_problems(cache: HiddenStateCache, drafter: DrafterConfig | None, config: ScoringConfig,
                    block: int | None) -> list[str]:
    problems = []
    if drafter is not None:
        try:
            cache.check_compatible(drafter, block_size=block, warn=False)
        except ValueError as e:
            problems.append(str(e))
    unknown = sorted(set(config.tasks or []) - set(cache.task_names))
    if unknown:
        problems.append(f"scoring.tasks {unknown} are not in the cache {cache.path}; it holds {cache.task_names}")
    names = [n for n in config.tasks or cache.task_names if n in cache.task_names]
    if not names:
        return problems + ([] if unknown else [f"the cache {cache.path} holds no task to score"])
    entries = [cache.entry(n) for n in names]
    for e in entries:
        if not anchor_range(e["prompt_len"], e["num_tokens"], config.window):
            problems.append(f"cache task {e['name']!r} has no anchor to score: {e['prompt_len']} prompt tokens and "
                            f"{e['num_tokens']} in all (a completion of at least 2 tokens is needed)")
    completion = {e["name"]: e["num_tokens"] - e["prompt_len"] for e in entries}
    longest = max(completion, key=completion.get)
    if block is not None and block > completion[longest]:
        problems.append(
            f"block size {block} is larger than the cache {cache.path} allows: a block drafts {block - 1} tokens, "
            f"but the longest completion ({longest!r}, {completion[longest]} tokens) has labels for at most "
            f"{completion[longest] - 1}; use a block size <= {completion[longest]} or a cache with longer completions"
        )
    try:
        cache.check_sizes(names)
        if sum(e["num_bytes"] for e in entries) <= VERIFY_BYTES:
            cache.verify(names)
    except CacheError as e:
        problems.append(str(e))
    return problems


def _target_problems(target: str, vocab: int | None, hidden: int | None, whose: str,
                     cache_head: str | None) -> tuple[list[str], str | None]:
    """The target's problems, and its head's fingerprint (None when it can not be read)."""
    try:
        shapes = head_shapes(target)
        head = head_fingerprint(target)
    except (OSError, ValueError) as e:
        return [f"target: {e}"], None
    problems = []
    if cache_head is not None and head != cache_head:
        problems.append(f"the target {target} has head {head}, but the cache was extracted from a target with head "
                        f"{cache_head}: give the target the cache was made from, or extract a cache from this one")
    for name, (rows, width) in shapes.items():
        if vocab is not None and rows != vocab:
            problems.append(f"the target's {name} has {rows} rows but {whose} vocabulary is {vocab}")
        if hidden is not None and width != hidden:
            problems.append(f"the target's {name} is {width} wide but {whose} hidden size is {hidden}")
    return problems, head


def _baseline_problems(source: Path, cache: HiddenStateCache, config: ScoringConfig, block: int | None,
                       head: str | None, target_window: int | None) -> list[str]:
    if not source.exists():
        return [f"baseline {source} does not exist (give a drafter folder or a saved report JSON)"]
    if source.is_file():
        try:
            report = EvalReport.load(source)
        except ValueError as e:
            return [f"baseline: {e}"]
        return Basis.of_run(config, cache, block, head, target_window).mismatches(  # head None: unread
            report, f"baseline {source}")
    try:
        drafter = read_config(source)
        problems = _shape_problems(drafter, read_state_shapes(source), f"baseline {source}")
        cache.check_compatible(drafter, block_size=block, warn=False)
    except (OSError, ValueError) as e:
        return [f"baseline {source}: {e}"]
    problems += [f"baseline {source}: {p}" for p in block_problems(drafter, config, run_block=block is None)]
    problems += [f"baseline {source}: {p}" for p in draft_rule_problems(config, cache.sampling, drafter.family)]
    scored_at = config.block_size or drafter.block_size  # the block size the baseline's report will have
    if block is not None and scored_at != block:
        problems.append(f"baseline {source} is a drafter of block size {drafter.block_size}, this run scores block "
                        f"size {block}: their numbers do not compare; set scoring.block_size to score both at one")
    return problems


# ---------------------------------------------------------------- scoring


class ScoringService:
    """`owns_process`: nothing else in this process uses the accelerator (the `process` runner's
    worker, `watch`, `score`). Only such a service resets torch's process-wide peak-memory
    counter (its reports record their peak) and empties the allocator's cache when it gives
    memory back. In a training process (the `thread` runner, a plain loop calling it) it does
    neither: those belong to training, and freed blocks are reused by training there anyway."""

    def __init__(self, spec: ServiceSpec, *, owns_process: bool = False):
        self.spec = spec
        self.owns_process = owns_process
        self.config = spec.scoring
        self.cache = HiddenStateCache(spec.cache)
        self.head = TargetHead.from_pretrained(spec.target)
        check_finite_weights(self.head.state_dict(), f"the target head of {spec.target}")
        self._baseline: EvalReport | None = None

    def basis(self, block_size: int | None) -> Basis:
        """What this service's reports stand on, for a drafter of `block_size` (None: not known)."""
        return Basis.of_run(self.config, self.cache, self.config.block_size or block_size, self.head.fingerprint,
                            self.head.model_window)

    def score(
        self, config: DrafterConfig, state: Mapping[str, torch.Tensor], *, step: int | None = None,
        snapshot_id: str | None = None, name: str | None = None, cancel: threading.Event | None = None,
        progress: bool = False,
    ) -> EvalReport:
        """Score weights held in memory (a snapshot not yet written, or being written)."""
        name = name or (f"step {step}" if step is not None else "drafter")
        check_finite_weights(state, name)
        drafter = drafter_class(config).from_state_dict(config, dict(state))
        return self._score(drafter, step=step, snapshot_id=snapshot_id, name=name, cancel=cancel, progress=progress)

    def score_loaded(
        self, drafter: DFlashDrafter, *, step: int | None = None, snapshot_id: str | None = None, name: str,
        cancel: threading.Event | None = None, progress: bool = False,
    ) -> EvalReport:
        """Score a drafter `load_drafter` made (a trainer's checkpoint: its stored head and pruned
        vocabulary kept), reported as `step` and `snapshot_id`."""
        check_finite_weights(drafter.state_dict(), name)
        return self._score(drafter, step=step, snapshot_id=snapshot_id, name=name, cancel=cancel, progress=progress)

    def score_folder(
        self, folder: str | os.PathLike, *, cancel: threading.Event | None = None, progress: bool = False
    ) -> EvalReport:
        """Score a published drafter folder or a snapshot; a snapshot's report carries the step
        and snapshot id its own snapshot.json records, so it names exactly what was scored."""
        meta = read_snapshot_meta(folder) or {}
        drafter = load_drafter(folder)
        check_finite_weights(drafter.state_dict(), str(folder))
        return self._score(drafter, step=meta.get("step"), snapshot_id=meta.get("snapshot_id"), name=str(folder),
                           cancel=cancel, progress=progress)

    def _score(self, drafter: DFlashDrafter, **kwargs) -> EvalReport:
        """`score_drafter` with this service's cache, head and config; with scoring.release_memory
        the accelerator memory goes back after it, scored or failed (every runner and `watch`)."""
        try:
            return score_drafter(drafter, self.cache, self.head, self.config, owns_process=self.owns_process, **kwargs)
        finally:
            if self.config.release_memory:
                self.release()

    def release(self) -> None:
        """Give the accelerator memory back (scoring.release_memory): the head returns to the
        CPU until the next report moves it again, and a service that owns its process empties
        the allocator's cache (in a training process the cached blocks are training's too, and
        its allocator reuses the freed ones). A failure here (a device in a bad state) is a
        warning: it never costs a finished report, or a job's own error, its answer."""
        try:
            if self.head.lm_head.weight.is_cuda:
                self.head.to("cpu")
                if self.owns_process:
                    torch.cuda.empty_cache()
        except Exception as e:
            warnings.warn(f"giving the scorer's accelerator memory back failed: {type(e).__name__}: {e}", stacklevel=2)

    def baseline(self, *, cancel: threading.Event | None = None, progress: bool = False) -> EvalReport | None:
        """The baseline's report: from a saved report JSON, from the on-disk cache of
        earlier runs (keyed by the baseline's weights, the cache, the target head's
        fingerprint, the scoring config and SCORER_VERSION), or scored now (and cached)."""
        if self._baseline is not None or self.spec.baseline is None:
            return self._baseline
        source = Path(self.spec.baseline)
        if source.is_file():
            report = EvalReport.load(source)
        else:
            key, cached = cached_baseline(source, self.cache.fingerprint, self.head.fingerprint, self.config,
                                          self.spec.baseline_cache_dir)
            if cached.is_file():
                report = EvalReport.load(cached)
            else:
                report = self.score_folder(source, cancel=cancel, progress=progress)
                report.extra["baseline_key"] = key
                cached.parent.mkdir(parents=True, exist_ok=True)
                report.to_json(cached)
        problems = self.basis(self.config.block_size).mismatches(report, f"baseline {source}")
        if problems:
            raise ValueError("; ".join(problems))
        self._baseline = report
        return report

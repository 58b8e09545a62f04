"""Which checkpoints one poll of a trainer's folder scores, decided from what it finds: pure, the folder's
reads given as functions (`plan_scan`), so that step order, settling and the lines it says can be checked
without files.

A complete checkpoint is not scored while an earlier one is still being written (no marker, and its files
changed within `settle` seconds); an earlier one that has settled and is still not whole (a save that
died) holds nothing back: it is waited for, said once, and scored whenever it completes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Seen:
    source: Path
    fingerprint: str
    since: float  # monotonic time it was first seen with this fingerprint


@dataclass(frozen=True)
class ScanPlan:
    """What one poll does: submit `ready` (complete, step order) and `deleted` (seen, then gone before it was
    scored: an error line each), remember `seen`, and say each `(key, line)` of `said` once per key."""

    ready: list[int]
    deleted: list[int]
    seen: dict[int, Seen]
    said: list[tuple[object, str]] = field(default_factory=list)


def plan_scan(found: Mapping[int, Path], done: set[int], seen: Mapping[int, Seen], now: float, settle: float,
              fingerprint: Callable[[Path], str | None], marked: Callable[[Path], bool],
              unfinished: Callable[[Path], str | None]) -> ScanPlan:
    """The plan for the checkpoints `found` (step -> what is read), given the steps `done` (scored, or an error
    line), those `seen` before, the time `now`, and the folder's reads: a checkpoint's `fingerprint` (None: no
    file yet), whether the trainer `marked` it complete, and why it is `unfinished` (None: whole)."""
    seen, ready, said, writing = dict(seen), [], [], None  # writing: the first step still being written
    for step, source in sorted(found.items()):
        if step in done:
            continue
        stamp = fingerprint(source)
        if stamp is None:
            continue  # no file yet
        before = seen.get(step)
        if before is None or (before.source, before.fingerprint) != (source, stamp):
            seen[step] = before = Seen(source, stamp, now)
        complete = marked(source)  # the trainer says it is complete: read it, whatever it holds
        if not complete and now - before.since < settle:
            writing = step if writing is None else writing  # still changing: the later steps wait for it
            continue
        why = None if complete else unfinished(source)
        if why is not None:  # settled and not whole (a save that died?): it holds back no later step
            said.append((step, f"watch: step {step}: waiting for {source}: {why}"))
        elif writing is None:
            ready.append(step)
        else:
            said.append((("behind", step), f"watch: step {step} is complete: scored after step {writing}, which is "
                                           "still being written (step order)"))
    deleted = [step for step in seen if step not in found and step not in done]
    return ScanPlan(ready, deleted, seen, said)

"""The run folder: everything one training run writes, and the one owner of its layout.

    <dirpath>/<run_id>/
      run.json                         who the folder belongs to: {"run_id", "created", "host", "pid",
                                       "runner", "basis" (what its reports stand on), "baseline" (the source expected)}
      .lock                            held (flock) by the one process writing here; a kill releases it
      results.jsonl                    one JSON object per line: a report, or {"step", "snapshot_id", "error"}
      snapshots/step-00000400/         model.safetensors, config.json, snapshot.json (step, snapshot_id, ...)
      reports/step-00000400.json       external runner: written by `dflash-callbacks watch`
      reports/baseline.json            ditto, the baseline's report
      watcher.json                     heartbeat of `dflash-callbacks watch` (also accepted in <dirpath>)

A fresh run gets a fresh folder (`create`); only a resume of the same run (its run_id
comes back from the checkpoint) reopens one (`reopen`). Two processes never write one
folder: the lock refuses the second. Snapshots and watcher reports are written under a
temporary name and renamed. Lines of results.jsonl are appended whole or not at all: a
failed append is cut back to the previous end, so no torn line is left behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..files import atomic_write_json
from ..model import save_drafter
from ..model.io import SNAPSHOT_META, read_snapshot_meta
from ..scoring.report import EvalReport, Results, read_results
from .snapshot import Snapshot

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
RESULTS_FILE = "results.jsonl"
HEARTBEAT_FILE = "watcher.json"
SNAPSHOT_NAME = re.compile(r"^step-([0-9]{8})\Z")
REPORT_NAME = re.compile(r"^step-([0-9]{8})\.json\Z")


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder's lock."""


class ResultsWriteError(OSError):
    """A line could not be appended to results.jsonl (nothing of it was left behind)."""


class ResultsRecordError(ValueError):
    """A record that strict JSON can not hold (NaN, Inf, an object of another type): it is
    never written, and writing it again would fail the same way."""


@dataclass
class Recovery:
    """What a killed run left in its folder (`RunFolder.recover`)."""

    results: Results  # results.jsonl, after its torn last line was cut
    torn_bytes: int  # the size of that torn line
    unread_reports: list[EvalReport]  # watcher reports of this run that never reached results.jsonl
    unscored_snapshots: list[tuple[int, str, Path]]  # (step, snapshot_id, folder) with no report or error


@dataclass
class WatcherError:
    """A watcher report file that holds no report: the watcher's error, or why it is unreadable."""

    message: str
    snapshot_id: str | None = None


def new_run_id() -> str:
    """Sortable by start time and unique: 20261130-142501-3fa9c1."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def write_heartbeat(folder: Path) -> None:
    """`dflash-callbacks watch` says it is alive, in a run folder it scores (`RunFolder.last_heartbeat`)."""
    atomic_write_json(Path(folder) / HEARTBEAT_FILE, {"time": time.time(), "host": socket.gethostname(),
                                                      "pid": os.getpid()})


def is_run_folder(path: Path) -> bool:
    return (Path(path) / RUN_FILE).is_file()


class RunFolder:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.snapshots_dir = self.path / "snapshots"
        self.reports_dir = self.path / "reports"
        self.results_path = self.path / RESULTS_FILE
        self._lock_fd: int | None = None

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    # ------------------------------------------------------------ identity and lock
    @classmethod
    def create(cls, root: str | os.PathLike, run_id: str, about: dict | None = None) -> RunFolder:
        """A fresh folder root/run_id for a new run, locked; `about` goes into run.json too
        (the callback's: the basis its reports stand on, the baseline it expects)."""
        folder = cls(Path(root) / run_id)
        folder.path.mkdir(parents=True, exist_ok=False)
        folder.lock()
        atomic_write_json(folder.path / RUN_FILE, {"run_id": run_id, "created": time.time(),
                                                   "host": socket.gethostname(), "pid": os.getpid(), **(about or {})})
        return folder

    def about(self) -> dict:
        """run.json ({} when unreadable)."""
        try:
            raw = json.loads((self.path / RUN_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return raw if isinstance(raw, dict) else {}

    def update_about(self, about: dict) -> None:
        """A resume: run.json with `about` (the runner, basis and baseline it runs with now) and
        this process as the writer; its run id and creation time are kept."""
        current = self.about()
        updated = {"run_id": self.path.name, **current, "host": socket.gethostname(), "pid": os.getpid(), **about}
        if updated != current:
            atomic_write_json(self.path / RUN_FILE, updated)

    @classmethod
    def reopen(cls, root: str | os.PathLike, run_id: str, about: dict | None = None) -> RunFolder:
        """The folder of run `run_id` (a resume), locked; recreated (with `about`) if it vanished."""
        folder = cls(Path(root) / run_id)
        if not is_run_folder(folder.path):
            if folder.path.exists() and any(folder.path.iterdir()):
                raise RunFolderBusy(f"{folder.path} holds files but no {RUN_FILE}: it is not run {run_id}'s folder")
            return cls.create(root, run_id, about)
        owner = folder.about().get("run_id", run_id)  # a damaged run.json is this folder's: the resume rewrites it
        if owner != run_id:
            raise RunFolderBusy(f"{folder.path} belongs to run {owner}, not {run_id}")
        folder.lock()
        return folder

    def lock(self) -> None:
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunFolderBusy(f"{self.path} is in use by {holder}; two runs can not write one folder") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    # ------------------------------------------------------------ snapshots
    def snapshot_path(self, step: int) -> Path:
        return self.snapshots_dir / f"step-{step:08d}"

    def write_snapshot(self, snapshot: Snapshot) -> Path:
        """Write the snapshot (after its copy completed); a stale watcher report for the same
        step (from before a resume) is removed first, so it can never be taken for this one."""
        snapshot.wait()
        self.report_path(snapshot.step).unlink(missing_ok=True)
        return save_drafter(self.snapshot_path(snapshot.step), snapshot.config, snapshot.state,
                            extra_files={SNAPSHOT_META: snapshot.metadata()})

    def list_snapshots(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete snapshot, oldest first."""
        if not self.snapshots_dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.snapshots_dir.iterdir()
                 if (m := SNAPSHOT_NAME.match(p.name)) and p.is_dir()]
        return sorted(found)

    @staticmethod
    def snapshot_id(folder: Path) -> str | None:
        try:
            return (read_snapshot_meta(folder) or {}).get("snapshot_id")
        except (OSError, ValueError):
            return None

    def prune(self, keep_last: int, unscored: Iterable[Path] = ()) -> list[Path]:
        """Delete the oldest snapshots until at most `keep_last` are on disk, and temporaries a killed
        writer left. The `unscored` ones (still to be scored) are never deleted, and count."""
        unscored = {Path(p) for p in unscored}
        snapshots = self.list_snapshots()
        stale = sorted(self.snapshots_dir.glob(".step-*.tmp-*")) + sorted(self.snapshots_dir.glob(".step-*.old-*"))
        scored = [f for _, f in snapshots if f not in unscored]
        removed = scored[: max(0, len(snapshots) - keep_last)] + stale
        for folder in removed:
            shutil.rmtree(folder, ignore_errors=True)
        return removed

    # ------------------------------------------------------------ watcher reports (external runner)
    def report_path(self, step: int | None) -> Path:
        """reports/step-XXXXXXXX.json, or reports/baseline.json for step None."""
        return self.reports_dir / ("baseline.json" if step is None else f"step-{step:08d}.json")

    def list_reports(self) -> list[tuple[int, Path]]:
        if not self.reports_dir.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.reports_dir.iterdir() if (m := REPORT_NAME.match(p.name)))

    def write_report(self, step: int | None, payload: dict) -> None:
        self.reports_dir.mkdir(exist_ok=True)  # not parents: a run folder removed is not made again
        atomic_write_json(self.report_path(step), payload)

    def read_report(self, path: Path) -> EvalReport | WatcherError:
        """A watcher's report file: the report, or a WatcherError (the watcher's own
        `{"error", "snapshot_id"}`, or why the file is not a report). Never raises on bad content."""
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested beyond the parser's depth
            return WatcherError(f"unreadable report {path}: {type(e).__name__}: {e}")
        if isinstance(raw, dict) and isinstance(raw.get("error"), str):
            return WatcherError(raw["error"], raw.get("snapshot_id"))
        try:
            return EvalReport.from_dict(raw)
        except (ValueError, TypeError) as e:
            return WatcherError(f"{path}: {e}", raw.get("snapshot_id") if isinstance(raw, dict) else None)

    def last_heartbeat(self) -> float | None:
        """When a watcher last wrote its heartbeat here or in the parent folder it watches."""
        times = []
        for path in (self.path / HEARTBEAT_FILE, self.path.parent / HEARTBEAT_FILE):
            try:
                times.append(float(json.loads(path.read_text())["time"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return max(times, default=None)

    # ------------------------------------------------------------ results.jsonl
    def append(self, record: dict) -> None:
        """Append one line, whole or not at all; ResultsWriteError says why the file did not
        take it, ResultsRecordError why the record is not a line at all."""
        try:
            line = (json.dumps(record, allow_nan=False) + "\n").encode()
        except (TypeError, ValueError) as e:
            step = record.get("step") if isinstance(record, dict) else None
            raise ResultsRecordError(f"the results.jsonl line of step {step} is not strict JSON ({e}); "
                                     f"it is not written") from None
        try:
            fd = os.open(self.results_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise ResultsWriteError(e.errno, f"can not open {self.results_path} for appending: {e.strerror}") from e
        try:
            start = os.fstat(fd).st_size
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise ResultsWriteError(e.errno, f"appending to {self.results_path} failed: {e.strerror}") from e
        finally:
            os.close(fd)

    def repair(self) -> int:
        """Cut a torn last line (a crash in the middle of an append); returns the bytes dropped."""
        if not self.results_path.is_file():
            return 0
        data = self.results_path.read_bytes()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        with open(self.results_path, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())
        return len(data) - keep

    def read_results(self) -> Results:
        return read_results(self.results_path)

    # ------------------------------------------------------------ a resume
    def recover(self) -> Recovery:
        """Everything a killed run finished or left unscored: results.jsonl (torn tail cut),
        each valid watcher report of a snapshot whose evaluation never reached results.jsonl,
        and each snapshot on disk whose evaluation never ended (no report, no error line)."""
        torn = self.repair()
        results = self.read_results()
        ended = {r.snapshot_id for r in results.reports} | {e.get("snapshot_id") for e in results.errors}
        steps = {r.step for r in results.reports}
        unread = []
        for step, path in self.list_reports():
            found = self.read_report(path)
            if (isinstance(found, EvalReport) and found.step == step and found.snapshot_id is not None
                    and found.snapshot_id not in ended and step not in steps):
                unread.append(found)
                ended.add(found.snapshot_id)
                steps.add(step)
        unscored = []
        for step, folder in self.list_snapshots():
            snapshot_id = self.snapshot_id(folder)
            if snapshot_id is not None and snapshot_id not in ended and step not in steps:
                unscored.append((step, snapshot_id, folder))
        return Recovery(results, torn, unread, unscored)

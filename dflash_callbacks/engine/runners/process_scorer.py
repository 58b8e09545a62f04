"""The "process" runner's scorer: a worker process (`python -m dflash_callbacks.engine.runners.process_worker`,
a fresh Python that never imports the training script; its own CUDA context, e.g. on a spare GPU) scores
the written snapshot. A worker that dies fails that job and is replaced for the next; a worker whose
training process dies exits too (never an orphan). Jobs go to its stdin, one JSON line each; answers come
back on a pipe of their own."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading

import torch

from ...scoring.report import EvalReport
from ...scoring.scorer import Cancelled
from ...scoring.service import ServiceSpec
from ..run_folder import RunFolder
from .jobs import Job, ScorerError

POLL_SECONDS = 0.2
WORKER = "dflash_callbacks.engine.runners.process_worker"


def import_path() -> list[str]:
    """The training process's sys.path as the worker takes it: its strings (imports skip
    anything else, such as a pathlib.Path a script put there)."""
    return [entry for entry in sys.path if isinstance(entry, str)]


class ProcessScorer:
    """A worker process (`process_worker`), replaced when it dies."""

    def __init__(self, spec: ServiceSpec, run: RunFolder, cancel: threading.Event, closing: threading.Event):
        self.spec, self.cancel = spec, cancel
        self.process: subprocess.Popen | None = None
        self.answers: int | None = None  # the read end of the worker's answer pipe
        self.restarts = -1
        self._unread = b""  # the worker's answer line read so far

    def _ensure_worker(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self._stop_worker()  # one that died between jobs: its pipes are closed
        read_end, write_end = os.pipe()
        path = import_path()
        try:  # the worker's own environment finds this package where this process does
            self.process = subprocess.Popen(
                [sys.executable, "-m", WORKER, json.dumps(path), json.dumps(self.spec.to_dict()),
                 str(os.getpid()), str(write_end), str(torch.get_num_threads())], stdin=subprocess.PIPE,
                pass_fds=(write_end,), env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the worker's alone: its exit ends the pipe
        self.answers, self._unread = read_end, b""
        self.restarts += 1

    def _answer(self) -> bytes | None:
        """The worker's next answer line, None when none came within POLL_SECONDS."""
        while b"\n" not in self._unread:
            if not select.select([self.answers], [], [], POLL_SECONDS)[0]:
                return None
            chunk = os.read(self.answers, 1 << 20)
            if not chunk:  # the worker is gone (or going): its exit code tells
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                return None
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return line

    def _run(self, job: str) -> EvalReport | None:
        self._ensure_worker()
        try:
            self.process.stdin.write((json.dumps(job) + "\n").encode())
            self.process.stdin.flush()
        except OSError:  # a worker that died since it was started: its exit code is read below
            pass
        while True:
            line = self._answer()
            if line is None:
                if self.process.poll() is not None:
                    code = self.process.returncode
                    self._stop_worker()
                    raise RuntimeError(f"the scoring worker died (exit code {code})") from None
                if self.cancel.is_set():
                    self._stop_worker()
                    raise Cancelled("scoring was cancelled") from None
                continue
            raw, error = json.loads(line)
            if error is not None:
                raise ScorerError(error)
            return None if raw is None else EvalReport.from_dict(raw)

    def baseline(self) -> EvalReport | None:
        return self._run("baseline") if self.spec.baseline is not None else None

    def score(self, job: Job) -> EvalReport:
        return self._run(str(job.folder))

    def _stop_worker(self) -> None:
        if self.process is not None:
            self.process.kill()  # no-op once it exited
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass  # unkillable for now (a device in a bad state): not waited on again
            try:
                self.process.stdin.close()
            except OSError:  # a job still buffered for a worker that is gone
                pass
            os.close(self.answers)
        self.process, self.answers = None, None

    def late_baseline(self) -> EvalReport | None:
        return None  # its baseline failed in the worker: trying again fails again

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.stdin.close()  # end of jobs: the worker exits
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._stop_worker()

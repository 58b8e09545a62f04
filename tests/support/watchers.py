"""A watcher that misbehaves: the external runner's tests play `dflash-callbacks watch` badly with it."""

from __future__ import annotations

import threading
from pathlib import Path

from dflash_callbacks.engine.run_folder import RunFolder, write_heartbeat
from dflash_callbacks.files import atomic_write_json


class HostileWatcher(threading.Thread):
    """Plays `dflash-callbacks watch` badly: for each new snapshot of the run it writes the
    next of `payloads` (a function of (step, snapshot_id) -> JSON value) as its report."""

    def __init__(self, dirpath: Path, payloads):
        super().__init__(daemon=True)
        self.dirpath, self.payloads, self.done, self.stop = dirpath, list(payloads), set(), threading.Event()

    def run(self):
        while not self.stop.wait(0.05):  # a watcher polls: every 50 ms, until the test stops it
            if self.dirpath.is_dir():
                write_heartbeat(self.dirpath)
                for folder in [p for p in self.dirpath.iterdir() if (p / "run.json").is_file()]:
                    run = RunFolder(folder)
                    for step, snap in run.list_snapshots():
                        if step in self.done or not self.payloads:
                            continue
                        self.done.add(step)
                        payload = self.payloads.pop(0)(step, run.snapshot_id(snap))
                        run.reports_dir.mkdir(exist_ok=True)
                        atomic_write_json(run.report_path(step), payload)

    def __enter__(self):  # with HostileWatcher(...): the fit; it stops (and is joined) however the fit ends
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()

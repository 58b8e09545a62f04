"""The "process" runner's worker: a fresh Python that imports only this package (a multiprocessing spawn
would import the training script again, and run all of it where it lacks an `if __name__ == "__main__":`
guard: a second training run in the worker). It never outlives the training process, also when that one
is SIGKILLed (`die_with_parent`, before torch loads: its import takes seconds under load), and ignores
SIGINT and SIGTERM: a Ctrl-C in the terminal (sent to the whole process group) or a preemption's SIGTERM
(sent to every process of the job) is the training process's to handle; the worker ends when the training
process closes its jobs, kills it, or dies."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback


def die_with_parent(parent_pid: int) -> None:
    """In the worker: exit when the training process is gone, even if it was SIGKILLed."""
    try:  # Linux: the kernel signals us when the thread that started us exits
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:  # everywhere: re-parented means the parent died
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="dflash-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:
        os._exit(1)


def main() -> None:
    """`python -m dflash_callbacks.engine.runners.process_worker SYS_PATH SPEC_JSON PARENT_PID ANSWER_FD
    THREADS`, SYS_PATH the training process's import path (JSON, as a multiprocessing spawn would pass it):
    one job per stdin line ("baseline" or a snapshot folder, JSON),
    one `[report dict | null, error | null]` line per job on ANSWER_FD, a pipe nothing else writes to (what
    prints, at start-up too, goes to the stdout and stderr the training process has)."""
    from ...scoring.service import ScoringService, ServiceSpec
    from .jobs import describe

    spec = json.loads(sys.argv[2])  # argv[3], the training process's pid: die_with_parent has it
    answers = os.fdopen(int(sys.argv[4]), "w")
    import torch

    # the cores the training process does not use (its intra-op threads): never a contest for the same ones
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - int(sys.argv[5])))
    service = None
    for line in sys.stdin:  # EOF: the training process closed it, or died
        job = json.loads(line)
        try:
            service = service or ScoringService(ServiceSpec.from_dict(spec), owns_process=True)
            report = service.baseline() if job == "baseline" else service.score_folder(job)
            answer = [None if report is None else report.to_dict(), None]
        except Exception as e:  # reported to the training process, which decides
            answer = [None, describe(e) + "\n" + traceback.format_exc(limit=3)]
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    sys.path[:] = json.loads(sys.argv[1])
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent(int(sys.argv[3]))
    main()

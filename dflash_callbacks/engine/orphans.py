"""A worker process that never outlives the process that started it, also when that one is SIGKILLed.
Imported first in the worker, before torch (whose import takes seconds under load: a parent killed
meanwhile must take the worker with it all the same)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time


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

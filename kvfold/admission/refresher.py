"""The thread that refreshes an AdmissionController's view in the background.

    start_refresher(controller, stop, interval_s, name)   a daemon thread calling
                                   controller.refresh(force=True) every interval until
                                   `stop` is set or the controller is collected

A refresher still running when the interpreter exits (its controller never closed) is
stopped, and waited for up to EXIT_WAIT_S, before any exit handler runs: Ray's shut the
driver's connection and its cluster's processes down, and a read on its way through Ray
meanwhile could crash the process instead of ending it. The hook is the one
concurrent.futures uses (threading's, called before the interpreter joins its threads and
runs atexit's handlers, whenever those were registered), set when this module is imported.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Protocol

# longer than a read of KVFoldClient's (5 s a call), so that one in flight can end
EXIT_WAIT_S = 6.0

log = logging.getLogger("kvfold")


class Refreshable(Protocol):
    def refresh(self, force: bool = False) -> None: ...


_running: dict[threading.Thread, threading.Event] = {}
_running_lock = threading.Lock()


def start_refresher(
    controller: Refreshable, stop: threading.Event, interval_s: float, name: str
) -> threading.Thread:
    """Start `controller`'s refresher: a daemon thread holding it weakly, stopped by
    `stop`, and at the interpreter's exit."""
    thread = threading.Thread(
        target=_refresh_every_interval,
        args=(weakref.ref(controller), stop, interval_s),
        name=name,
        daemon=True,
    )
    thread.start()
    with _running_lock:
        if thread.is_alive():  # one already ended has nothing to stop
            _running[thread] = stop
    return thread


def _stop_at_exit() -> None:
    """Stop every refresher of this process; wait EXIT_WAIT_S at most for them all, and
    say which were still in a refresh then (a source stuck on the network)."""
    with _running_lock:
        running = list(_running.items())
    for _, stop in running:
        stop.set()
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread, _ in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread, _ in running if thread.is_alive()]
    if stuck:
        log.warning("kvfold: refreshers still reading at exit, left to end on their own: %s", stuck)


def _refresh_every_interval(
    controller: weakref.ref[Refreshable], stop: threading.Event, interval_s: float
) -> None:
    """The loop. It holds its controller weakly: a controller dropped without close() is
    collected, and its thread ends at its next interval."""
    try:
        while not stop.is_set():
            started = time.monotonic()
            ctl = controller()
            if ctl is None:
                return
            ctl.refresh(force=True)
            del ctl
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))
    finally:
        with _running_lock:
            _running.pop(threading.current_thread(), None)


# CPython's since 3.9 (not in the type stubs); atexit's, run in the reverse order of
# registration, only where it is missing
getattr(threading, "_register_atexit", atexit.register)(_stop_at_exit)

__all__ = ["EXIT_WAIT_S", "start_refresher"]

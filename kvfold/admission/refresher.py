"""The thread that refreshes an AdmissionController's view in the background.

    start_refresher(controller, stop, interval_s, name)   a daemon thread calling
                                   controller.refresh(force=True) every interval until
                                   `stop` is set or the controller is collected

A refresher still running when the interpreter exits (its controller never closed) is
stopped first, before the exit handlers registered earlier run: Ray's own shuts the
driver's connection down, and a fetch on its way through Ray meanwhile could crash the
process instead of ending it. Each start moves kvfold's handler to the front of the line
(atexit runs the newest first), so it precedes Ray's however the modules were imported.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Protocol

EXIT_JOIN_S = 2.0  # how long the interpreter's exit waits for each refresh in flight


class Refreshable(Protocol):
    def refresh(self, force: bool = False) -> None: ...


_running: dict[threading.Thread, threading.Event] = {}
_running_lock = threading.Lock()


def start_refresher(
    controller: Refreshable, stop: threading.Event, interval_s: float, name: str
) -> threading.Thread:
    thread = threading.Thread(
        target=_refresh_every_interval,
        args=(weakref.ref(controller), stop, interval_s),
        name=name,
        daemon=True,
    )
    with _running_lock:
        _running[thread] = stop
    atexit.unregister(stop_refreshers)
    atexit.register(stop_refreshers)
    thread.start()
    return thread


def stop_refreshers(timeout_s: float = EXIT_JOIN_S) -> list[str]:
    """Stop every refresher of this process; the names of those still in a refresh after
    `timeout_s` each (a source stuck on the network), left to end on their own."""
    with _running_lock:
        running = list(_running.items())
    for _, stop in running:
        stop.set()
    stuck = []
    for thread, _ in running:
        thread.join(timeout_s)
        if thread.is_alive():
            stuck.append(thread.name)
    return stuck


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


__all__ = ["start_refresher", "stop_refreshers"]

"""StandInProcess: one stand-in script in a process of its own, spoken to through its
stdin and read line by line from its stdout; every wait has a deadline, and it is
stopped by its pid (never by name)."""

from __future__ import annotations

import selectors
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


class StandInProcess:
    def __init__(self, script: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def line(self, timeout_s: float = 10.0) -> str:
        """Its next line of output; fails if it says nothing within `timeout_s`."""
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=timeout_s):
            raise AssertionError(f"the stand-in {self.proc.args[1]} said nothing")
        return self.proc.stdout.readline().strip()

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close its stdin (it ends), killing it by its pid if it does not in time."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_pipes()

    def kill(self) -> None:
        """End it at once (a crash, as far as anything reading it can tell)."""
        if self.proc.poll() is None:
            self.proc.kill()  # this process, by its pid
        self.proc.wait(timeout=10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()

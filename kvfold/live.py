"""The cluster view, live: a rich table redrawn in place on a terminal; plain lines, at
most every `every_s`, anywhere else (logs, pipes, CI)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvfold.display import render_table, table_cells
from kvfold.view import ClusterView


def rich_table(view: ClusterView, title: str = "") -> Group:
    head, rows, summary = table_cells(view)
    table = Table(title=title or None, box=None, header_style="bold")
    for h in head:
        table.add_column(h, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row, style=None if row[1] == "fresh" else "yellow")
    return Group(table, Text(summary))


class LiveView:
    def __init__(
        self, every_s: float = 3.0, plain_table: bool = False, console: Any = None
    ) -> None:
        self.console = console or Console()
        self.every_s = every_s
        self.plain_table = plain_table  # off a terminal: print the table too, not only progress
        self._live: Live | None = None
        self._last = float("-inf")

    def show(self, view: ClusterView, progress: str, title: str = "") -> None:
        if self.console.is_terminal:
            body = Group(rich_table(view, title), Text(progress))
            if self._live is None:
                self._live = Live(body, console=self.console, auto_refresh=False)
                self._live.start()
            self._live.update(body, refresh=True)
            return
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        text = (render_table(view, title) + "\n" if self.plain_table else "") + progress
        self.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

"""The live progress bar of a map: done/total, rate, ETA and failures.

The executors only bump counters (`done`, `failed`); a background refresher copies them into a
`rich` bar ten times a second. That keeps the per-item cost at one attribute increment whether or
not a bar is shown, and rich's import off the path of `import hardy`.
"""

from __future__ import annotations

import os
import sys
import threading
from types import TracebackType


def progress_wanted(explicit: bool | None) -> bool:
    """On in terminals and notebooks, off otherwise (CI logs, pipes), unless the caller says."""
    if explicit is not None:
        return explicit
    if os.environ.get("HARDY_PROGRESS", "").lower() in ("0", "false", "no"):
        return False
    if "ipykernel" in sys.modules:
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class MapProgress:
    """Counts items; when shown, renders the counts as a rich progress bar. A total of None (a
    streamed map over a generator) shows done and rate without an ETA."""

    def __init__(self, total: int | None, label: str, show: bool):
        self.total = total
        self.label = label
        self.show = show and total != 0
        self.done = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "MapProgress":
        if self.show:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[failures]}"), transient=False,
                                 console=Console(stderr=True),
                                 refresh_per_second=10)
            self._task = self._bar.add_task(self.label, total=self.total, rate="", failures="")
            self._bar.start()
            self._thread = threading.Thread(target=self._refresh, name="hardy-progress", daemon=True)
            self._thread.start()
        return self

    def _update(self) -> None:
        task = self._bar.tasks[0]
        elapsed = task.elapsed or 0.0
        rate = f"{(self.done + self.failed) / elapsed:,.0f} items/s" if elapsed > 0 else ""
        failures = f"[red]{self.failed} failed" if self.failed else ""
        self._bar.update(self._task, completed=self.done + self.failed, rate=rate, failures=failures)

    def _refresh(self) -> None:
        while not self._stop.wait(0.1):
            self._update()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.show:
            self._stop.set()
            if self._thread:
                self._thread.join()
            self._update()
            self._bar.stop()

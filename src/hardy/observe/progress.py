"""The live progress bar of a map: done/total, rate, ETA, failures and cache hits.

The executors only bump counters (`done`, `failed`, `cached`); a background refresher copies them
into a view ten times a second. That keeps the per-item cost at one attribute increment whether
or not a bar is shown, and rich's import off the path of `import hardy`.

Views: in a terminal a `rich` Progress; in a Jupyter kernel an HTML `<progress>` table updated in
place through IPython's display handle, which needs nothing beyond the kernel itself (rich's own
notebook display needs ipywidgets, and warns without it). A map that starts while another map's bar
is shown in this process (a nested pipeline's map) becomes a row under it, indented, and leaves
when it ends: one display however deep the nesting.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
from types import TracebackType
from typing import Any


def progress_wanted(explicit: bool | None) -> bool:
    """On in terminals and notebooks, off otherwise (CI logs, pipes), unless the caller says."""
    if explicit is not None:
        return explicit
    if os.environ.get("HARDY_PROGRESS", "").lower() in ("0", "false", "no"):
        return False
    if _in_notebook():
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def nested_progress() -> bool:
    """Whether a nested map should draw: only as a row under a bar already shown in this process."""
    return _shown is not None


def count_cached() -> None:
    """A node call was answered from the cache: counted on the innermost bar of this context."""
    bar = _current.get() or _shown
    if bar is not None:
        bar.cached += 1


def _in_notebook() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class MapProgress:
    """Counts items; when shown, renders the counts (see the module docstring)."""

    def __init__(self, total: int | None, label: str, show: bool):
        self.total = total  # None: a streamed map over inputs of unknown length (no ETA)
        self.label = label
        self.show = show and total != 0
        self.done = 0
        self.failed = 0
        self.cached = 0
        self.batches: dict[str, list[float]] = {}  # batched node -> [calls, items, seconds]
        self.depth = 0
        self.started = 0.0
        self._view: _View | None = None
        self._owner = False
        self._token: contextvars.Token[MapProgress | None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MapProgress:
        global _shown
        outer = _current.get()
        self._token = _current.set(self)
        if not self.show:
            return self
        self.started = time.perf_counter()
        with _lock:
            parent = _shown
            if parent is not None and parent._view is not None:
                inner = outer is not None and outer.show and outer._view is parent._view
                self.depth = 1 + (outer.depth if inner and outer is not None else 0)
                self._view = parent._view
            else:
                self._view = _NotebookView() if _in_notebook() else _TerminalView()
                self._owner = True
                _shown = self
        self._view.add(self)
        if self._owner:
            self._thread = threading.Thread(target=self._refresh, name="hardy-progress", daemon=True)
            self._thread.start()
        return self

    def batch(self, name: str, size: int, duration: float) -> None:
        """A call of batched node `name` on `size` items took `duration` s (from any thread: the
        counts are a few additions, read approximately by the refresher)."""
        counts = self.batches.get(name)
        if counts is None:
            counts = self.batches.setdefault(name, [0, 0, 0.0])
        counts[0] += 1
        counts[1] += size
        counts[2] += duration

    def _refresh(self) -> None:
        while not self._stop.wait(0.1):
            assert self._view is not None
            self._view.update()

    def status(self) -> str:
        """"1,234 items/s · 3 failed · 10 cache hits" (what follows the bar)."""
        elapsed = time.perf_counter() - self.started
        n = self.done + self.failed
        parts = [f"{n / elapsed:,.0f} items/s"] if elapsed > 0 and n else []
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.cached:
            parts.append(f"{self.cached} cache hits")
        for name, (calls, items, seconds) in list(self.batches.items()):
            parts.append(f"{name}: {calls:,.0f} batches of {items / calls:,.1f}, {seconds / calls * 1e3:,.1f} ms each")
        return " · ".join(parts)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        global _shown
        if self._token is not None:
            _current.reset(self._token)
        if self._view is None:
            return
        if not self._owner:
            self._view.remove(self)
            return
        self._stop.set()
        if self._thread:
            self._thread.join()
        self._view.update()
        self._view.close()
        with _lock:
            _shown = None


_current: contextvars.ContextVar[MapProgress | None] = contextvars.ContextVar("hardy_progress", default=None)
_shown: MapProgress | None = None  # the outermost bar shown in this process
_lock = threading.Lock()


class _View:
    def add(self, bar: MapProgress) -> None: ...
    def remove(self, bar: MapProgress) -> None: ...
    def update(self) -> None: ...
    def close(self) -> None: ...


class _TerminalView(_View):
    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.fields[eta]}"), TimeRemainingColumn(),
                                  TextColumn("{task.fields[status]}"), transient=False,
                                  console=Console(stderr=True), refresh_per_second=10)
        self._tasks: dict[MapProgress, Any] = {}
        before = (sys.stdout, sys.stderr)
        self._progress.start()
        drawer = getattr(self._progress.live, "_refresh_thread", None)  # rich's: hardy's own to a fork check
        if drawer is not None:
            drawer.name = "hardy-progress-draw"
        self._handlers = _above_the_bar(before, (sys.stdout, sys.stderr))

    def add(self, bar: MapProgress) -> None:
        from rich.markup import escape
        self._tasks[bar] = self._progress.add_task("  " * bar.depth + escape(bar.label), total=bar.total, status="",
                                                 eta="" if bar.total is None else "ETA")  # unknown length: none

    def remove(self, bar: MapProgress) -> None:
        task = self._tasks.pop(bar, None)
        if task is not None:
            self._progress.remove_task(task)

    def update(self) -> None:
        for bar, task in list(self._tasks.items()):
            status = bar.status().replace(f"{bar.failed} failed", f"[red]{bar.failed} failed[/red]")
            self._progress.update(task, completed=bar.done + bar.failed, status=status)

    def close(self) -> None:
        self._progress.stop()
        for handler, stream, during in self._handlers:
            if handler.stream is during:  # (unless set again meanwhile)
                handler.setStream(stream)


def _above_the_bar(before: tuple[Any, Any], during: tuple[Any, Any]) -> list[tuple[Any, Any, Any]]:
    """Logging's stream handlers pointed, while the bar is live, at what rich put in place of
    standard output and error (`during`, from `before`), which prints each line above the bar:
    `logging.basicConfig` keeps the stream it found, so a node's log line (in this process, or a
    worker's, which this process's loggers handle) was written past rich, glued to the bar's
    frame. Only a stream on the terminal: a log on standard output sent to a file stays there.
    Returns each handler moved, with the stream it goes back to and the one it was given."""
    import logging
    moved = {id(old): new for old, new in zip(before, during) if new is not old and _terminal(old)}
    if not moved:
        return []
    loggers = [logging.getLogger(), *(lg for lg in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(lg, logging.Logger))]
    handlers = {id(h): h for lg in loggers for h in lg.handlers if isinstance(h, logging.StreamHandler)}
    given = [(h, moved[id(h.stream)]) for h in handlers.values() if id(h.stream) in moved]
    return [(h, h.setStream(stream), stream) for h, stream in given]


def _terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # (no file, or a closed one)
        return False


class _NotebookView(_View):
    def __init__(self) -> None:
        from IPython.display import HTML, display
        self._html = HTML
        self._bars: list[MapProgress] = []
        self._handle = display(HTML(""), display_id=True)

    def add(self, bar: MapProgress) -> None:
        self._bars.append(bar)

    def remove(self, bar: MapProgress) -> None:
        if bar in self._bars:
            self._bars.remove(bar)

    def update(self) -> None:
        import html
        rows = []
        for bar in list(self._bars):
            n = bar.done + bar.failed
            elapsed = time.perf_counter() - bar.started
            known = bar.total is not None
            eta = f"ETA {(bar.total - n) * elapsed / n:,.1f} s" if bar.total is not None and n and n < bar.total else ""
            rate = f"{n / elapsed:,.0f} items/s" if not known and elapsed > 0 else ""
            limit, total = (f' max="{bar.total}"', f"{bar.total:,}") if known else ("", "?")
            rows.append(f"<tr><td style=\"padding-left:{12 * bar.depth}px\">{html.escape(bar.label)}</td>"
                        f"<td><progress value=\"{n}\"{limit}></progress></td>"
                        f"<td>{n:,}/{total}</td><td>{elapsed:,.1f} s</td>"
                        f"<td>{eta or rate}</td>"
                        f"<td>{html.escape(bar.status())}</td></tr>")
        self._handle.update(self._html(f"<table class=\"hardy-progress\">{''.join(rows)}</table>"))

    def close(self) -> None:
        pass

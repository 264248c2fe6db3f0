"""Streaming maps (`Pipeline.imap`): inputs pulled lazily, a bounded number of items in flight.

Every executor (in-process, worker processes, Dask, Ray, Daft) already runs a list of items into
a `Results` sink, so a stream cuts the inputs into windows of `window` items and runs the windows
one after another on a runner thread, the next window queued while one runs: the executor never
idles at a window's edge, and no more than three windows of items and results are alive. The
caller's thread is the only one that pulls the inputs (a generator is never touched by another
thread) and it pulls a window only when it has consumed one: a consumer that stops asking stops
the producers. The sequential executor needs no thread: items run one by one as they are asked for.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..errors import Failed, MapError
from .core import Results
from .executors import SequentialExecutor, run_chunk

if TYPE_CHECKING:
    from ..plan import Plan
    from .core import Engine

Outcome = Any  # a result dict, or a Failed
MakeResults = Callable[[int, list, type], Results]  # (first item's index, the items, the sink's class)


class _Streamed(Results):
    """A window's sink that also announces each finished item (for `ordered=False`); a subclass so
    that ordinary maps pay nothing for it."""

    finished: queue.SimpleQueue

    def ok(self, i: int, out: dict[str, Any]) -> None:
        super().ok(i, out)
        self.finished.put((self, i))

    def fail(self, i: int, err: Any) -> None:
        super().fail(i, err)
        self.finished.put((self, i))


def stream(engine: "Engine", plan: "Plan", items: Iterator[dict[str, Any]], window: int, ordered: bool,
           raise_on_error: bool, make_results: MakeResults) -> Iterator[Outcome]:
    """Outcomes of `items`, in input order or (ordered=False) as they finish.

    With `raise_on_error`, the first failure reached raises MapError; its `.results` are the
    outcomes of that failure's window, whose first item is `.offset`."""
    if isinstance(engine.map_executor, SequentialExecutor):
        outcomes = _inline(plan, items, window, make_results)
    else:
        outcomes = _windows(engine, plan, items, window, ordered, make_results)
    try:
        for results, j in outcomes:
            value = results.values[j]
            if raise_on_error and type(value) is Failed:
                raise MapError(results.values, {results.offset + j: value.error}, offset=results.offset)
            yield value
    finally:
        outcomes.close()


def _inline(plan: "Plan", items: Iterator[dict[str, Any]], window: int,
            make_results: MakeResults) -> Iterator[tuple[Results, int]]:
    start = 0
    while chunk := list(itertools.islice(items, window)):
        results = make_results(start, chunk, Results)
        for j in range(len(chunk)):
            run_chunk(plan, chunk, range(j, j + 1), results)
            yield results, j
        start += len(chunk)


def _windows(engine: "Engine", plan: "Plan", items: Iterator[dict[str, Any]], window: int, ordered: bool,
             make_results: MakeResults) -> Iterator[tuple[Results, int]]:
    runner = _Runner(engine, plan)
    start = 0

    def submit() -> bool:
        nonlocal start
        chunk = list(itertools.islice(items, window))
        if not chunk:
            return False
        if ordered:
            results = make_results(start, chunk, Results)
        else:
            results = make_results(start, chunk, _Streamed)
            results.finished = runner.finished
        runner.todo.put((chunk, results))
        start += len(chunk)
        return True

    try:
        pending = submit() + submit()
        while pending:
            message = runner.finished.get()
            if isinstance(message, BaseException):
                raise message
            results, j = message
            if j is not None:  # one item finished (ordered=False)
                yield results, j
                continue
            pending -= 1
            pending += submit()  # a window is done: let the next one in before handing this one out
            if ordered:
                for k in range(len(results.values)):
                    yield results, k
    finally:
        runner.close()


class _Runner:
    """The thread that feeds windows to the engine's executor, one after another."""

    def __init__(self, engine: "Engine", plan: "Plan"):
        self.engine, self.plan = engine, plan
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self.current: Results | None = None
        self.thread = threading.Thread(target=self._loop, name="hardy-imap", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.todo.get()
            if job is None or self.closed:
                return
            chunk, results = job
            self.current = results
            try:
                self.engine.run_items(self.plan, chunk, results)
            except BaseException as err:  # the executor itself failed: the caller raises it
                self.finished.put(err)
                return
            self.finished.put((results, None))

    def close(self) -> None:
        """Stop after the window in progress (its executor stops at its next chunk boundary)."""
        self.closed = True
        if self.current is not None:
            self.current.stop = True
        self.todo.put(None)
        self.thread.join()

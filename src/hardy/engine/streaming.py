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
import threading
import time
import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..crash.signals import reported_crashes
from ..errors import EngineClosed, Failed, MapError, NodeError
from ..parts.batching import batched
from ..tracebacks import at_user_frames
from .in_process import SequentialExecutor, delivered
from .results import Results

if TYPE_CHECKING:
    import queue

    from ..observe.nodelog import NodeLogBatch
    from ..plan.compiled import Plan
    from .core import Engine

Outcome = Any  # a result dict, or a Failed
R = TypeVar("R", bound=Results)


class MakeResults(Protocol):
    """(first item's index, the items, the sink's class) -> a window's sink of that class."""

    def __call__(self, start: int, chunk: list[dict[str, Any]], cls: type[R]) -> R: ...


class Shifted(Sequence[dict[str, Any]]):
    """A window's items read by the map's index (what `Results` hands to a window's `Events`)."""

    def __init__(self, items: list[dict[str, Any]], start: int):
        self.items, self.start = items, start

    def __getitem__(self, i: Any) -> Any:
        return self.items[i - self.start]

    def __len__(self) -> int:
        return len(self.items)


class _Streamed(Results):
    """A window's sink that also announces each finished item (for `ordered=False`); a subclass so
    that ordinary maps pay nothing for it."""

    finished: queue.SimpleQueue[Any]

    ok_per_item = True

    def ok(self, i: int, out: dict[str, Any], records: Sequence[NodeLogBatch] = ()) -> None:
        super().ok(i, out, records)
        self.finished.put((self, i))

    def fail(self, i: int, err: NodeError, records: Sequence[NodeLogBatch] = (), worker: int | None = None) -> None:
        super().fail(i, err, records, worker)
        if i in self.failures:  # (an error that ends the call instead, a node's KeyboardInterrupt, records none)
            self.finished.put((self, i))


def stream(engine: Engine, plan: Plan, items: Iterator[dict[str, Any]], window: int | None, ordered: bool,
           raise_on_error: bool, make_results: MakeResults, indexed: bool = False) -> Iterator[Any]:
    """Outcomes of `items`, in input order or (ordered=False) as they finish; `indexed`: as
    (item index, outcome) pairs. `window` defaults to 1,024 items, 64 on the sequential executor.

    With `raise_on_error`, the first failure reached raises MapError; its `.results` are the
    outcomes of that failure's window, whose first item is `.offset`."""
    if isinstance(engine.executor, SequentialExecutor):
        outcomes = _inline(plan, items, window or 64, make_results)
    else:
        outcomes = _windows(engine, plan, items, window or 1024, ordered, make_results)
    try:
        for results, j in outcomes:
            value = results.values[j]
            if raise_on_error and (type(value) is Failed or value is None and results.failures):
                # a failure, or an item its window's failure stopped before it ran (in flight on
                # another worker: on_error="raise" does not wait for it), which has no result to hand out
                failures = {results.offset + i: err for i, err in results.failures.items()}
                raise at_user_frames(MapError(results.values, failures, offset=results.offset))
            yield (results.offset + j, value) if indexed else value
    finally:
        outcomes.close()


class _Pulled:
    """The caller's inputs, pulled a window at a time. An input iterator that raises (a generator
    reading a file that turns out bad at line 300) ends the stream there: the items read before
    it run and are handed out first, whatever the executor and the window, and then its exception
    is raised, as a `for` loop over it would.

    `wait` (a batched node's `batch_wait`): a window is cut short once its first item has waited
    that long for more, so a slow source's items reach their batch call and come out without
    waiting for a full window. The caller's thread alone reads the inputs, so the wait is checked
    as each item arrives: an input blocked inside `next()` holds the items before it until it
    yields (or ends)."""

    def __init__(self, items: Iterator[dict[str, Any]], wait: float | None = None):
        self.items = items
        self.wait = wait
        self.error: BaseException | None = None

    def next(self, window: int) -> list[dict[str, Any]]:
        chunk: list[dict[str, Any]] = []
        if self.error is None:
            try:
                if self.wait is None:
                    chunk.extend(itertools.islice(self.items, window))
                else:
                    self._until(chunk, window, self.wait)
            except Exception as exc:
                self.error = exc
        return chunk

    def _until(self, chunk: list[dict[str, Any]], window: int, wait: float) -> None:
        """Items into `chunk` until it holds `window`, or its first has waited `wait` seconds."""
        deadline = None
        for item in self.items:
            chunk.append(item)
            now = time.monotonic()
            if deadline is None:
                deadline = now + wait
            if len(chunk) >= window or now >= deadline:
                return

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def _inline(plan: Plan, items: Iterator[dict[str, Any]], window: int,
            make_results: MakeResults) -> Generator[tuple[Results, int], None, None]:
    """The items run here, one at a time, each handed out as it is done; a crash of this process
    meanwhile names node and item as it dies, as an in-process map's does (`reported_crashes`)."""
    with reported_crashes("sequential"):
        yield from _run_inline(plan, items, window, make_results)


def _run_inline(plan: Plan, items: Iterator[dict[str, Any]], window: int,
                make_results: MakeResults) -> Generator[tuple[Results, int], None, None]:
    group = batched(plan)
    start, pulled = 0, _Pulled(items, group.wait if group is not None else None)
    while chunk := pulled.next(window):
        results = make_results(start, chunk, Results)
        if group is not None:  # batched nodes: a group of items per call (hardy.parts.batching)
            for j in delivered(group, chunk, range(len(chunk)), results):
                yield results, j
            start += len(chunk)
            continue
        run, ok, fail = results.runner(plan), results.ok, results.fail
        for j, item in enumerate(chunk):  # run_chunk's loop, handing out each item as it is done
            try:
                out = run(item, j)
            except NodeError as err:
                fail(j, err)
            else:
                ok(j, out)
            yield results, j
        start += len(chunk)
    pulled.raise_error()


def _windows(engine: Engine, plan: Plan, items: Iterator[dict[str, Any]], window: int, ordered: bool,
             make_results: MakeResults) -> Generator[tuple[Results, int], None, None]:
    runner, stream, group = engine.window_runner(), _Stream(plan), batched(plan)
    start, pulled = 0, _Pulled(items, group.wait if group is not None else None)
    running: list[Results] = []  # (ordered) the windows submitted and not handed out yet, oldest first

    def submit() -> bool:
        nonlocal start
        chunk = pulled.next(window)
        if not chunk:
            return False
        results: Results
        if ordered:
            results = make_results(start, chunk, Results)
            running.append(results)
        else:
            results = streamed = make_results(start, chunk, _Streamed)
            streamed.finished = stream.finished
        runner.submit(stream, chunk, results)
        start += len(chunk)
        return True

    try:
        pending = submit() + submit()
        while pending:
            try:
                message = stream.finished.get()
            except KeyboardInterrupt:  # Ctrl-C as it waits for a window: what finished in order is handed
                if ordered and running:  # out first (the sequential executor would have yielded it), then raised
                    runner.cancel(stream)
                    for results in running:  # (a window all done, its message not read yet: then the next's)
                        yield from _finished_prefix(results)
                        if None in results.values:
                            break
                raise
            if isinstance(message, BaseException):
                raise message
            results, j = message
            if isinstance(j, BaseException):  # the executor raised (a node's KeyboardInterrupt, say)
                if ordered:  # what finished before it first, as the sequential executor yields it
                    yield from _finished_prefix(results)
                raise j
            if j is not None:  # one item finished (ordered=False)
                yield results, j
                continue
            pending -= 1
            pending += submit()  # a window is done: let the next one in before handing this one out
            if ordered:
                running.remove(results)
                for k in range(len(results.values)):
                    yield results, k
        pulled.raise_error()
    finally:
        runner.cancel(stream)


def _finished_prefix(results: Results) -> Iterator[tuple[Results, int]]:
    """A window's items from its first to the last one finished in a row."""
    for k, value in enumerate(results.values):
        if value is None:
            return
        yield results, k


class _Stream:
    """One streamed map's side of the runner: its plan, where its windows report, whether it ended."""

    def __init__(self, plan: Plan):
        import queue  # (here and in `WindowRunner`: `import hardy` stays light)
        self.plan = plan
        self.finished: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.closed = False


class WindowRunner:
    """The thread that feeds streamed windows to an engine's executor, one after another.

    One per engine, living as long as the engine, because what an executor starts from this
    thread may be tied to it: Ray's node processes (and any child made with PR_SET_PDEATHSIG) are
    killed when the thread that started them ends, so a thread per stream would kill them.

    A stream may be finalised at any time: its consumer left a `for` loop by raising, after the
    engine closed (`with Engine() as e:` ended), or by the garbage collector on any thread, this
    one included. Ending it never waits for a runner that is gone or for itself, and closing the
    runner ends every stream still waiting for a window, with an error that says so."""

    def __init__(self, engine: Engine):
        import queue
        self.engine = engine
        self.todo: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.current: tuple[_Stream, Results] | None = None
        self.closed = False
        self.streams: weakref.WeakSet[_Stream] = weakref.WeakSet()  # streams with windows queued or running
        self.thread = threading.Thread(target=self._loop, name="hardy-imap", daemon=True)
        self.thread.start()

    def submit(self, stream: _Stream, chunk: list[dict[str, Any]], results: Results) -> None:
        if self.closed:
            raise EngineClosed("the engine running this imap was closed (Engine.close(), or its `with` block "
                               "ended); iterate an imap while its engine is open")
        self.streams.add(stream)
        self.todo.put((stream, chunk, results))

    def _loop(self) -> None:
        while (job := self.todo.get()) is not None:
            stream, chunk, results = job
            if isinstance(chunk, threading.Event):  # a stream waits for its windows to be over
                chunk.set()
                continue
            if stream.closed:
                continue
            self.current = stream, results
            try:
                self.engine.run_items(stream.plan, chunk, results)
            except BaseException as err:  # the executor itself failed: that stream raises it
                stream.closed = True
                stream.finished.put((results, err))
            else:
                stream.finished.put((results, None))
            self.current = None

    def cancel(self, stream: _Stream) -> None:
        """End `stream`: its queued windows are skipped and the one running stops at its executor's
        next chunk boundary; returns when none of its windows runs any more (at once when the
        runner is closed, or when this is the runner's own thread, finalising a stream)."""
        stream.closed = True
        self.streams.discard(stream)
        current = self.current
        if current is not None and current[0] is stream:
            current[1].stop = True
        if self.closed or threading.current_thread() is self.thread:
            return
        over = threading.Event()
        self.todo.put((stream, over, None))
        while not over.wait(0.1):
            if not self.thread.is_alive():
                return

    def close(self) -> None:
        """Stop: the window running stops at its next chunk boundary, and every stream still
        waiting for a window is told the engine closed (`EngineClosed`), instead of waiting forever."""
        self.closed = True
        current = self.current
        if current is not None:
            current[1].stop = True
        for stream in list(self.streams):
            stream.closed = True
            stream.finished.put(EngineClosed("the engine running this imap was closed (Engine.close(), or its "
                                             "`with` block ended) before the imap ended"))
        self.todo.put(None)

    def join(self) -> None:
        """Wait for the thread to end (after `close`, and after the engine stopped its workers: the
        window running then ends at once)."""
        if threading.current_thread() is not self.thread:
            self.thread.join()

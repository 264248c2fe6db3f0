"""In-process map executors: where the items of a map run.

An executor receives the compiled Plan, the list of item inputs and a map's `Results`, and runs
chunks of items through `plan.run`, as the results observe them (`whole`). It never interprets the
pipeline itself, so run/map/nesting/errors exist once (plan/compiled.py, engine/core.py) and executors
differ only in *where* a chunk runs. Executors that run elsewhere (worker processes, Dask, Ray)
keep the same contract (`hardy.model.executor`).
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from ..crash.signals import reported_crashes
from ..errors import NodeError
from ..model.executor import Executor, MapResults, ResultsSink
from ..parts.batching import Batched, batched
from ..plan.compiled import Plan, run_sync


def run_chunk(plan: Plan, items: Sequence[dict[str, Any]], indices: range, results: MapResults) -> None:
    """The one loop that runs items in this process: results and failures go to the sink."""
    group = batched(plan)
    if group is not None:
        _run_batched(group, items, indices, results)
        return
    run = results.runner(plan)
    ok, fail = results.ok, results.fail
    ahead = _reading_ahead(plan, items, indices)
    for i in indices:
        if results.stop:
            return
        if ahead is not None and (i - indices.start) % AHEAD == 0:
            ahead(i)
        try:
            out = run(items[i], i)
        except NodeError as err:
            fail(i, err)
        else:
            ok(i, out)


AHEAD = 256  # items whose cache entries a map over a shared store fetches at once, a window ahead


def _reading_ahead(plan: Plan, items: Sequence[dict[str, Any]], indices: range) -> Callable[[int], None] | None:
    """For a map whose cache is shared (an object store): what to call at the start of each window
    of AHEAD items. It waits for that window's entries (fetched concurrently while the previous
    window ran) and starts fetching the next window's, so lookups are served from memory instead
    of each waiting for a request of its own. After a window the local cache had whole, the next
    one is read ahead only if its first item is missing locally: a warm local cache pays one
    probe per window, not a key derivation per item. None when the cache has no read-ahead."""
    if len(indices) < 2 or not getattr(plan.cache, "reads_ahead", False):
        return None
    prefetch = plan.cache.prefetch  # type: ignore[union-attr]
    pending: dict[int, Callable[[], None] | None] = {}
    fetching = [True]  # whether the last window had anything to fetch

    def keys(start: int, stop: int) -> list[bytes]:
        found = []
        for j in range(start, min(stop, indices.stop)):
            try:
                found += plan.ahead_keys(items[j])
            except Exception:  # an input that cannot be hashed: its item fails when it runs, and says why
                continue
        return found

    def start(at: int) -> None:
        if not fetching[0] and prefetch(keys(at, at + 1)) is None:
            pending[at] = None  # its first item is local: so, most likely, is the rest
            return
        wanted = keys(at, at + AHEAD)
        pending[at] = prefetch(wanted) if wanted else None
        fetching[0] = pending[at] is not None

    def window(at: int) -> None:
        if at not in pending:
            start(at)
        if at + AHEAD < indices.stop:
            start(at + AHEAD)
        ready = pending.pop(at)
        if ready is not None:
            ready()
    return window


def _run_batched(group: Batched, items: Sequence[dict[str, Any]], indices: range, results: MapResults) -> None:
    """`run_chunk` for a plan with batched nodes: items a group at a time (`hardy.parts.batching`)."""
    for _ in delivered(group, items, indices, results):
        if results.stop:
            return


def delivered(group: Batched, items: Sequence[dict[str, Any]], indices: Sequence[int],
              results: MapResults) -> Iterator[int]:
    """Each item of a batched plan's chunk handed to the sink as its group finishes; yields its index."""
    events, offset, seen, names = results.events, results.offset, set(), group.names

    def at(i: int, span: object = None) -> None:  # node events that follow belong to item i; its start the first time
        if i in seen:
            events.in_item(offset + i)  # type: ignore[union-attr]  # `at` is given only with events
        else:
            seen.add(i)
            results.started(i)

    def called(k: int, size: int, start: float, end: float) -> None:
        results.batch_called(names[k], size, end - start)
    ok, fail = results.ok, results.fail
    crashed = results.crashed()  # a nested map run again: its items that crashed fail as they did
    for i in indices:
        if i in crashed:
            fail(i, crashed[i])
            yield i
    size = 1 if None in crashed else 0  # a batch call crashed: each item alone, so that a crash names it
    for i, done, value in group.run([(i, items[i]) for i in indices if i not in crashed], at if events else None,
                                    offset=offset, size=size, called=called):
        if done:
            ok(i, value)
        else:
            fail(i, value)
        yield i


def chunk_size(plan: Plan, size: int) -> int:
    """`size` items per chunk, made a whole number of a batched plan's groups so that its
    batches are full."""
    group = batched(plan)
    if group is None:
        return size
    return max(1, -(-size // group.group)) * group.group


def whole(results: ResultsSink) -> MapResults:
    """The map's own results, which items run in this process go through (`MapResults.runner`
    numbers and observes each as the map's). One stage's view of them (`stages`) is handed to
    worker pools only, which deliver rows; an executor here cannot run a stage."""
    if callable(getattr(results, "runner", None)):  # the protocol's own member, asked cheaply (an
        return cast(MapResults, results)  # isinstance of a runtime protocol costs microseconds a map)
    raise TypeError(f"{type(results).__name__} is not a map's Results: an in-process executor runs whole "
                    f"maps only, not a stage of one (stages run on worker pools)")


class SequentialExecutor(Executor):
    """Every item in turn, in this process."""

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        with reported_crashes("sequential"):
            run_chunk(plan, items, range(len(items)), whole(results))


class ThreadedExecutor(Executor):
    """Chunks of items on a thread pool: for I/O-bound nodes and native code that releases the GIL."""

    def __init__(self, workers: int | None = None):
        self.workers = workers or min(32, (os.cpu_count() or 1) + 4)
        self._pool: Any = None
        self._here = threading.local()  # `running`: this thread is one of the pool's, running a chunk

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], sink: ResultsSink) -> None:
        n, results = len(items), whole(sink)
        if getattr(self._here, "running", False):
            # a nested map, from an item this pool runs: its chunks would wait for threads that all
            # wait for them. Its items run here, in the outer item's thread, as a worker runs them
            run_chunk(plan, items, range(n), results)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="hardy-map")
        from ..shipping.context import thread_modes  # (here: the shipping package is not `import hardy`'s)
        size = chunk_size(plan, max(1, n // (self.workers * 4)))
        modes = thread_modes()
        with reported_crashes("threaded"):
            # each chunk in a copy of the caller's context variables (decimal's context, numpy's
            # error state, a ContextVar the caller set) and with its thread's modes (torch's, sklearn's
            # configuration): as in-process
            futures = [self._pool.submit(contextvars.copy_context().run, self._chunk, modes, plan, items,
                                         range(s, min(n, s + size)), results) for s in range(0, n, size)]
            try:
                for f in futures:
                    f.result()
            except BaseException:  # interrupted (Ctrl-C, a node's KeyboardInterrupt): no item starts after
                results.stop = True  # (those running end theirs; a thread cannot be stopped mid-item)
                for f in futures:
                    f.cancel()
                raise

    def _chunk(self, modes: Callable[[], Any], plan: Plan, items: Sequence[dict[str, Any]], indices: range,
               results: MapResults) -> None:
        self._here.running = True
        try:
            modes()
            run_chunk(plan, items, indices, results)
        except BaseException:  # a node's KeyboardInterrupt: this thread starts no other chunk's item
            results.stop = True
            raise
        finally:
            self._here.running = False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class AsyncExecutor(Executor):
    """All items as coroutines on one event loop, at most `workers` at a time."""

    mode = "async"

    def __init__(self, workers: int | None = None):
        self.workers = workers or 1024

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        with reported_crashes("async"):
            run_sync(self._run_all(plan, items, whole(results)))

    async def _run_all(self, plan: Plan, items: Sequence[dict[str, Any]], results: MapResults) -> None:
        import asyncio
        gate = asyncio.Semaphore(self.workers)
        arun = results.async_runner(plan)

        async def one(i: int) -> None:
            async with gate:
                if results.stop:
                    return
                try:
                    out = await arun(items[i], i)
                except NodeError as err:
                    results.fail(i, err)
                else:
                    results.ok(i, out)

        await asyncio.gather(*(one(i) for i in range(len(items))))

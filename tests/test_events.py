"""Node events reach the parent's callbacks from every executor: in order per item, between the
item's start and end, with the worker's pid and durations; cache hits and crashes included.
Real threads, an event loop, real worker processes and a real segfault."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from conftest import Unloadable
from hardy import DiskCache, Engine, Pipeline, PipelineCallback, node


@node(output_name="a")
def add_one(x: int) -> int:
    return x + 1


@node(output_name="b")
def double_or_crash(a: int) -> int:
    if a == 8:  # item 7
        os.kill(os.getpid(), signal.SIGSEGV)
    return 2 * a


@node(output_name="c")
async def total(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


NODES = ["add_one", "double_or_crash", "total"]


class Log(PipelineCallback):
    """Every event, with the item and worker hardy attributes it to."""

    def __init__(self):
        self.events: list[tuple] = []

    def _add(self, *event, ctx):
        self.events.append((*event, ctx.get("hardy.item"), ctx.get("hardy.worker_pid") or os.getpid()))

    def on_map_item_start(self, item_index, ctx):
        self._add("item_start", item_index, ctx=ctx)

    def on_map_item_end(self, item_index, duration, ctx):
        self._add("item_end", item_index, ctx=ctx)

    def on_map_item_error(self, item_index, error, ctx):
        self._add("item_error", item_index, ctx=ctx)

    def on_node_start(self, node_id, inputs, ctx):
        self._add("start", node_id, ctx=ctx)

    def on_node_end(self, node_id, outputs, duration, ctx):
        assert duration > 0
        self._add("end", node_id, ctx=ctx)

    def on_node_cached(self, node_id, signature, ctx):
        self._add("cached", node_id, ctx=ctx)

    def on_error(self, node_id, error, ctx):
        self._add("error", node_id, type(error).__name__, getattr(error, "signal", None), ctx=ctx)

    def of_item(self, i: int) -> list[tuple]:
        """Item i's events, in the order they were seen: they must sit between its start and end."""
        mine = [e for e in self.events if (e[1] == i if e[0].startswith("item") else e[-2] == i)]
        assert mine[0][0] == "item_start" and mine[-1][0] in ("item_end", "item_error"), mine
        return [e[:-2] for e in mine[1:-1]]


def _map(executor: str, n: int = 6, cache=None) -> Log:
    log = Log()
    with Engine(map_executor=executor, workers=2) as engine:
        p = Pipeline([add_one, double_or_crash, total], engine=engine, callbacks=[log], cache=cache)
        out = p.map(inputs={"x": [x for x in range(n) if executor == "process" or x != 7]}, map_over="x",
                    on_error="continue")
        assert [o["c"] for i, o in enumerate(out) if i != 7] == [3 * (x + 1) for x in range(n) if x != 7]
    return log


@pytest.mark.parametrize("executor", ["sequential", "threaded", "async", "process"])
def test_every_node_event_of_every_item_in_order(executor):
    log = _map(executor)
    expected = [(kind, name) for name in NODES for kind in ("start", "end")]
    pids = set()
    for i in range(6):
        assert log.of_item(i) == expected
        pids |= {e[-1] for e in log.events if e[-2] == i and e[0] in ("start", "end")}
    if executor == "process":
        assert os.getpid() not in pids and len(pids) >= 1
    else:
        assert pids == {os.getpid()}


def test_cache_hits_and_a_crash_from_worker_processes(tmp_path):
    cache = DiskCache(tmp_path / "c")
    _map("process", n=10, cache=cache)
    log = _map("process", n=10, cache=cache)
    assert log.of_item(3) == [("cached", name) for name in NODES]
    # the crashed item's own log died with its worker: the parent reports the node that killed it
    assert log.of_item(7) == [("error", "double_or_crash", "NodeCrashed", "SIGSEGV")]


@node(output_name="q")
def twice(x: int) -> int:
    return 2 * x


@node(output_name="r")
def then_one_more(q: int) -> int:
    return q + 1


def test_cache_hits_name_their_node_whichever_plans_the_worker_ran_before(tmp_path):
    """One worker runs several plans of one pipeline, and a node is a different step in each."""
    log = Log()
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline([add_one, twice, then_one_more], engine=engine, cache=DiskCache(tmp_path / "c"),
                     callbacks=[log])
        p.map(inputs={"x": [1]}, map_over="x")  # steps: add_one, twice, then_one_more
        p.map(inputs={"x": [1]}, map_over="x", output_name="r")  # steps: twice, then_one_more
        log.events.clear()
        p.map(inputs={"x": [1]}, map_over="x")
    assert log.of_item(0) == [("cached", name) for name in ("add_one", "twice", "then_one_more")]


@node(output_name="a")
def crash_on_five(x: int) -> int:
    if x == 5:
        os.kill(os.getpid(), signal.SIGSEGV)
    return x


def test_items_handed_again_after_a_crash_start_once():
    """The items of a dead worker's chunk that had not run go to the next worker: they started
    when they were first handed out."""
    log = Log()
    with Engine(map_executor="process", workers=1) as engine:
        Pipeline([crash_on_five], engine=engine, callbacks=[log]).map(inputs={"x": list(range(100))}, map_over="x",
                                                                     on_error="continue")
    assert sorted(e[1] for e in log.events if e[0] == "item_start") == list(range(100))
    assert all(log.of_item(i) == [("start", "crash_on_five"), ("end", "crash_on_five")] for i in range(100) if i != 5)


@node(output_name="a")
def ghost_on_five(x: int):
    return Unloadable() if x == 5 else x


def test_a_batch_sent_again_item_by_item_keeps_each_items_node_events():
    """The parent cannot unpickle one result: the worker sends its batch again, each item alone."""
    log = Log()
    with Engine(map_executor="process", workers=1) as engine:
        Pipeline([ghost_on_five], engine=engine, callbacks=[log]).map(inputs={"x": list(range(40))}, map_over="x",
                                                                     on_error="continue")
    ran = [("start", "ghost_on_five"), ("end", "ghost_on_five")]
    assert all(log.of_item(i) == ran for i in range(40))  # item 5's node ran; then it failed, unreadable
    assert [e[1] for e in log.events if e[0] == "item_error"] == [5]


def test_no_listener_for_node_events_means_no_node_events_logged():
    class ItemsOnly(PipelineCallback):
        def __init__(self):
            self.items = 0

        def on_map_item_end(self, item_index, duration, ctx):
            self.items += 1

    from hardy.engine.results import Results
    from hardy.observe.events import Events
    from hardy.observe.progress import MapProgress
    from hardy.observe.watch import Watch
    assert not Results(1, "raise", Watch(MapProgress(1, "", False), Events([ItemsOnly()]))).log_nodes
    assert Results(1, "raise", Watch(MapProgress(1, "", False), Events([Log()]))).log_nodes
    only = ItemsOnly()
    with Engine(map_executor="process", workers=2) as engine:
        Pipeline([add_one], engine=engine, callbacks=[only]).map(inputs={"x": list(range(5))}, map_over="x")
    assert only.items == 5


@pytest.mark.parametrize("executor,call", [("sequential", "map"), ("threaded", "map"), ("process", "map"),
                                           ("sequential", "imap"), ("process", "imap")])
def test_item_events_name_their_item_in_the_context(executor, call):
    """A map delivers a worker's batch at once; an unordered imap delivers its items one by one."""
    class Items(PipelineCallback):
        def __init__(self):
            self.seen: list[tuple] = []

        def on_map_item_start(self, item_index, ctx):
            self.seen.append(("start", item_index, ctx.get("hardy.item")))

        def on_pipeline_end(self, pipeline_id, outputs, duration, ctx):
            self.seen.append(("pipeline_end", outputs["a"] - 1, ctx.get("hardy.item")))

        def on_map_item_end(self, item_index, duration, ctx):
            self.seen.append(("end", item_index, ctx.get("hardy.item")))

    items = Items()
    with Engine(map_executor=executor, workers=2) as engine:
        p = Pipeline([add_one], engine=engine, callbacks=[items])
        if call == "map":
            p.map(inputs={"x": list(range(40))}, map_over="x")
        else:
            list(p.imap(inputs={"x": list(range(40))}, map_over="x", ordered=False))
    assert len(items.seen) == 120
    assert all(i == in_ctx for _, i, in_ctx in items.seen), [e for e in items.seen if e[1] != e[2]]


_attempts_dir = "HARDY_TEST_ATTEMPTS"


@node(output_name="m")
def flaky(x: int) -> int:
    """Raises once for items 2 and 4 (counted in a file: each attempt may run in another worker)."""
    marker = os.path.join(os.environ[_attempts_dir], f"{x}")
    if x in (2, 4) and not os.path.exists(marker):
        open(marker, "w").close()
        raise TimeoutError("first attempt")
    return x


@node(output_name="n")
def strict(m: int) -> int:
    if m == 4:
        raise ValueError("four")
    return m


@node(output_name="o")
def last(n: int) -> int:
    return n


def test_sync_nodes_in_workers_failures_and_retries_in_order(tmp_path, monkeypatch):
    """The common case (every item runs every node, decoded by slicing) beside an item whose node
    raises and one whose node is retried (decoded entry by entry), in one map."""
    monkeypatch.setenv(_attempts_dir, str(tmp_path))
    flaky_retried = node(output_name="m", retries=1, retry_on=TimeoutError)(flaky.func)

    class Timed(Log):
        def on_node_end(self, node_id, outputs, duration, ctx):
            start, end = ctx.get("hardy.event_ns")
            assert duration > 0 and abs((end - start) / 1e9 - duration) < 1e-6
            super().on_node_end(node_id, outputs, duration, ctx)

        def on_error(self, node_id, error, ctx):
            self._add("error", node_id, type(error).__name__, str(error), ctx=ctx)

    log = Timed()
    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline([flaky_retried, strict, last], engine=engine, callbacks=[log])
        out = p.map(inputs={"x": list(range(300))}, map_over="x", on_error="continue")
    assert [o["o"] for i, o in enumerate(out) if i != 4] == [x for x in range(300) if x != 4]
    every = [(kind, name) for name in ("flaky", "strict", "last") for kind in ("start", "end")]
    assert all(log.of_item(i) == every for i in range(300) if i not in (2, 4))
    # item 4's retried attempt reports what it raised, not what failed the item later
    assert log.of_item(4) == [("start", "flaky"), ("error", "flaky", "TimeoutError", "first attempt"),
                              ("start", "flaky"), ("end", "flaky"), ("start", "strict"),
                              ("error", "strict", "ValueError", "four")]
    assert log.of_item(2) == [("start", "flaky"), ("error", "flaky", "TimeoutError", "first attempt"), *every]
    workers = {e[-1] for e in log.events if e[0] in ("start", "end")}
    assert os.getpid() not in workers


def test_a_log_decodes_alike_by_slicing_and_entry_by_entry():
    """The parent cuts a regular batch by slicing; the general decoder must read it the same."""
    from array import array

    from hardy.observe.nodelog import PAUSE, NodeLogBatch, _decoded, _regular

    for steps in (1, 3):
        data, t = [], 10**12
        for _ in range(3):
            data += [t + 10 * k for k in range(steps)]  # an item begins with its first node's start
            t += 100
        data += (PAUSE, t)
        log = NodeLogBatch(tuple(f"n{k}" for k in range(steps)), array("d", data), [], 0, 1)
        fast, slow = _regular(log.data, 3, steps), _decoded(data, [], steps)
        assert log.events().regular
        for field in ("items", "steps", "starts", "ends", "bounds"):
            assert list(getattr(fast, field)) == list(getattr(slow, field)), field
        assert list(fast.items) == [r for r in range(3) for _ in range(steps)]
        assert list(fast.bounds) == [10**12, 10**12 + 100, 10**12 + 200, t]
        assert [list(one.events().bounds) for one in log.split()] == [list(fast.bounds[r:r + 2]) for r in range(3)]


def test_a_bare_log_tells_its_items_apart_without_naming_them():
    """Items begin with their first node call; a retry is the same step again; a failed item
    ends at FAILED, one that called no node is written whole."""
    from array import array

    from hardy.observe.nodelog import END, ERROR, FAILED, ITEM, PAUSE, RAISED, NodeLogBatch

    data = [100, 110,  # item 0: both steps
            200, RAISED, 205, 0, 206, 210,  # item 1: step 0 raised and was retried, then step 1
            300, FAILED, 305,  # item 2: failed after step 0 (its output was wrong)
            ITEM, 400, FAILED, 401,  # item 3: failed before any node call
            500, 510, RAISED, 515, 1, FAILED, 516,  # item 4: step 1 raised, the item failed
            600, 610, PAUSE, 700]  # item 5
    log = NodeLogBatch(("a", "b"), array("d", data), [ValueError("x"), ValueError("y")], 0, 1)
    events = log.events()
    assert not events.regular
    assert list(events.bounds) == [100, 200, 300, 400, 500, 600, 700]
    got = [(i, k, c, s, e) for i, k, c, s, e in zip(events.items, events.steps, events.codes, events.starts,
                                                     events.ends)]
    assert got == [(0, 0, END, 100, 110), (0, 1, END, 110, 200), (1, 0, ERROR, 200, 205), (1, 0, END, 206, 210),
                   (1, 1, END, 210, 300), (2, 0, END, 300, 305), (4, 0, END, 500, 510), (4, 1, ERROR, 510, 515),
                   (5, 0, END, 600, 610), (5, 1, END, 610, 700)]
    parts = log.split()  # each item until it ended: a failed one at FAILED, others where the next began
    assert [list(one.events().bounds) for one in parts] == [[100, 200], [200, 300], [300, 305], [400, 401],
                                                            [500, 516], [600, 700]]
    assert [len(one.events().starts) for one in parts] == [2, 3, 1, 0, 2, 2]


@node(output_name=("p", "q"))
def pair(a: int) -> tuple[int, ...]:
    return (a,) if a == 3 else (a, a)  # item 2: one value for two outputs


@node(output_name="r", timeout=0.3)
async def hangs(a: int) -> int:
    if a == 5:  # item 4
        await asyncio.sleep(5)
    return a


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_an_error_after_a_nodes_call_is_not_that_nodes_error(executor):
    """A wrong output count is found once the node's call returned: the node ended (as in-process);
    the item's error names its item in the context, from a worker too."""
    class Errors(Log):
        def on_map_item_error(self, item_index, error, ctx):
            assert ctx.get("hardy.item") == item_index
            super().on_map_item_error(item_index, error, ctx)

    log = Errors()
    with Engine(map_executor=executor, workers=2) as engine:
        p = Pipeline([add_one, pair], engine=engine, callbacks=[log])
        p.map(inputs={"x": list(range(5))}, map_over="x", on_error="continue")
    every = [(kind, name) for name in ("add_one", "pair") for kind in ("start", "end")]
    assert all(log.of_item(i) == every for i in range(5))
    assert [e[1] for e in log.events if e[0] == "item_error"] == [2]


def test_an_async_node_cancelled_at_its_timeout_in_a_worker_reports_its_own_error():
    log = Log()
    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline([add_one, hangs], engine=engine, callbacks=[log])
        p.map(inputs={"x": list(range(6))}, map_over="x", on_error="continue")
    assert log.of_item(4) == [("start", "add_one"), ("end", "add_one"), ("start", "hangs"),
                              ("error", "hangs", "NodeTimeout", None)]
    every = [(kind, name) for name in ("add_one", "hangs") for kind in ("start", "end")]
    assert all(log.of_item(i) == every for i in range(6) if i != 4)


def test_a_dying_workers_log_keeps_exactly_the_items_that_ended():
    """Last words come mid-item (its entries died with it) or between items (none did)."""
    from hardy.observe.nodelog import NodeLog

    for ended in (2, 3):
        log = NodeLog()
        for t in (100, 200, 300):
            log.data += (t, t + 10)  # an item begins with its first node call, then its second
        if ended == 2:
            log.data.pop()  # the third item died in its first node
        events = log.take(("a", "b"), ended=ended).events()
        assert len(events.bounds) - 1 == ended and list(events.items) == [r for r in range(ended) for _ in "ab"]
        # the third item, running, ends the second where it began; ended, it ran until now
        assert (events.bounds[-1] == 300) == (ended == 2)



class SlowToShip:
    """An input whose pickling, in the parent, takes 0.3 s: in the call's time as the parent sees
    it, never in the node's time in the worker."""

    def __reduce__(self):
        time.sleep(0.3)
        return SlowToShip, ()


@node(output_name="slept", isolate=True)
def isolated_sleep(x: int, payload: SlowToShip) -> int:
    if x == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(0.02)
    return x


@node(output_name="slept", isolate=True)
async def isolated_async(x: int, payload: SlowToShip) -> int:
    await asyncio.sleep(0.02)
    return x


class WhereAndHowLong(PipelineCallback):
    def __init__(self):
        self.ends, self.errors = [], []

    def on_node_end(self, node_id, outputs, duration, ctx):
        self.ends.append((ctx.get("hardy.worker_pid"), duration))

    def on_error(self, node_id, error, ctx):
        self.errors.append((ctx.get("hardy.worker_pid"), getattr(error, "signal", None)))


@pytest.mark.parametrize("isolated", [isolated_sleep, isolated_async], ids=["sync", "async"])
def test_an_isolated_nodes_events_name_its_worker_and_its_time_there(isolated):
    seen = WhereAndHowLong()
    p = Pipeline([isolated], callbacks=[seen])
    p.map(inputs={"x": [0, 1, 3], "payload": SlowToShip()}, map_over="x")
    assert len(seen.ends) == 3 and all(pid not in (None, os.getpid()) for pid, _ in seen.ends), seen.ends
    assert all(0.02 <= duration < 0.3 for _, duration in seen.ends), seen.ends  # the worker's measure
    if isolated is isolated_sleep:
        p.map(inputs={"x": [2], "payload": SlowToShip()}, map_over="x", on_error="continue")
        [(dead, signal_name)] = seen.errors
        assert signal_name == "SIGSEGV" and dead not in (None, os.getpid())


def test_a_node_that_runs_an_isolated_node_inside_reports_as_itself():
    inner = Pipeline([isolated_sleep], name="inner")

    @node(output_name="z")
    def outer(x: int) -> int:
        out = inner.run(inputs={"x": x, "payload": None})["slept"]
        time.sleep(0.1)
        return out

    seen = WhereAndHowLong()
    Pipeline([outer], callbacks=[seen], engine=Engine(map_executor="sequential")).run(inputs={"x": 1})
    [(pid, duration)] = seen.ends
    assert pid is None and duration >= 0.1  # this process, its own time: not the inner call's


class Raises(PipelineCallback):
    """An observer with a bug: its third node end and its second item start raise."""

    def __init__(self):
        self.ends = self.starts = 0

    def on_node_end(self, node_id, outputs, duration, ctx):
        self.ends += 1
        if self.ends == 3:
            raise RuntimeError("observer bug")

    def on_map_item_start(self, item_index, ctx):
        self.starts += 1
        if self.starts == 2:
            raise KeyError("observer bug")


@pytest.mark.parametrize("executor", ["sequential", "threaded", "async", "process"])
def test_a_callback_that_raises_costs_no_result_and_blames_no_node(executor):
    observer = Raises()
    with Engine(map_executor=executor, workers=2, report=True) as engine:
        p = Pipeline([add_one], engine=engine, callbacks=[observer])
        with pytest.warns(RuntimeWarning) as warned:
            out = p.map(inputs={"x": list(range(10))}, map_over="x")
        assert [o["a"] for o in out] == list(range(1, 11))
        assert (observer.ends, observer.starts) == (10, 10)  # it keeps getting events
        assert p.report().to_dict()["nodes"][0]["calls"] == 10  # and so do the other callbacks
    said = sorted(str(w.message) for w in warned if "observer bug" in str(w.message))
    assert len(said) == 2 and "Raises.on_map_item_start raised KeyError" in said[0], said
    assert "Raises.on_node_end raised RuntimeError: observer bug at " in said[1] and "test_events.py" in said[1]


@node(output_name="y", retries=1)
def crash_first_time(x: int, marker: str) -> int:
    if x == 2 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    if x == 3:
        os.kill(os.getpid(), signal.SIGSEGV)  # every time: it fails once its retry crashed too
    return x


class ItemRetries(PipelineCallback):
    def __init__(self):
        self.ended, self.failed, self.errors = {}, {}, []

    def on_error(self, node_id, error, ctx):
        self.errors.append((ctx.get("hardy.item"), ctx.get("hardy.retry"), error.signal, ctx.get("hardy.worker_pid")))

    def on_map_item_end(self, item_index, duration, ctx):
        self.ended[item_index] = ctx.get("hardy.retry")

    def on_map_item_error(self, item_index, error, ctx):
        self.failed[item_index] = ctx.get("hardy.retry")


def test_item_events_say_how_often_the_item_ran_before(tmp_path):
    seen = ItemRetries()
    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline([crash_first_time], engine=engine, callbacks=[seen])
        p.map(inputs={"x": [0, 1, 2, 3], "marker": str(tmp_path / "crashed")}, map_over="x", on_error="continue")
    assert seen.ended == {0: 0, 1: 0, 2: 1} and seen.failed == {3: 1}
    # every attempt that died says so, the retried ones too
    assert sorted(e[:3] for e in seen.errors) == [(2, 0, "SIGSEGV"), (3, 0, "SIGSEGV"), (3, 1, "SIGSEGV")]
    assert all(pid not in (0, None, os.getpid()) for *_, pid in seen.errors)

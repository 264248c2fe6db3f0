"""One outcome per failure on every executor (docs/failures.md): the same map of every case, on
the three in-process executors, hardy's worker processes, Dask, Ray and Daft, gives the same
results, the same failures with the same messages and causes, and leaves the engine working."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import traceback

import pytest

from conftest import engine_named, executors
from hardy import Engine, Failed, MapInterrupted, Pipeline, node
from hardy.errors import LazyOutputError, RemoteError

pytestmark = pytest.mark.timeout(600)  # Ray and Daft start their own processes: slow on a loaded machine


class DiskFull(OSError):
    """Its constructor takes two arguments and gives Exception one: pickle cannot rebuild it."""

    def __init__(self, path: str, detail: str):
        super().__init__(f"disk {path} is full: {detail}")
        self.path = path


class HoldsLock(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()  # pickle refuses it
        self.code = 507


class ApiError(Exception):
    """Its constructor makes its message: pickle, calling it with that message, would make another."""

    def __init__(self, status: int):
        super().__init__(f"API returned HTTP {status}")
        self.status = status


class NotFound(KeyError):
    """Its message shows an object's default repr: an address, other in every copy."""


class Thing:
    pass


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


def _local_class() -> type[Exception]:
    class Local(KeyError):  # no module attribute names it: the caller cannot import it
        def __init__(self, a: str, b: str):
            super().__init__(f"{a} and {b}")
    return Local


@node(output_name="y")
def misbehave(case: str) -> object:
    if case == "generator":
        return (c for c in case)
    if case == "exit":
        sys.exit(3)
    if case == "two arguments":
        raise DiskFull("/data", "no space left on device")
    if case == "unpicklable attribute":
        raise HoldsLock("the lock is held")
    if case == "local class":
        raise _local_class()("this", "that")
    if case == "str raises":
        raise BadStr("boom")
    if case == "message made":
        raise ApiError(503)
    if case == "address in message":
        raise NotFound(Thing())
    if case == "unpicklable argument":
        raise Exception("the lock", threading.Lock())
    return case.upper()


@node(output_name="z")
async def exits_async(n: int) -> int:
    await asyncio.sleep(0)
    if n == 3:
        sys.exit(n)
    return n


@node(output_name="w")
def plus_one(n: int) -> int:
    return n + 1


def _raising_at(k: int):
    for n in range(2 * k):
        if n == k:
            raise ValueError(f"input line {k} is broken")
        yield n


CASES = ["ok", "generator", "exit", "two arguments", "unpicklable attribute", "local class", "str raises",
         "message made", "unpicklable argument", "address in message", "fine"]


@pytest.mark.parametrize("name", executors("sequential", "threaded", "async", "process", "dask", "ray", "daft"))
def test_one_outcome_per_failure_on_every_executor(name):
    with engine_named(name) as engine:
        out = Pipeline(nodes=[misbehave], engine=engine).map(inputs={"case": CASES}, map_over="case",
                                                               on_error="continue")
        assert out[0] == {"y": "OK"} and out[-1] == {"y": "FINE"}
        failed = {case: row.error for case, row in zip(CASES, out) if isinstance(row, Failed)}
        assert list(failed) == CASES[1:-1]
        assert all(err.node == "misbehave" and err.item == CASES.index(case) for case, err in failed.items())

        lazy = failed["generator"]
        assert isinstance(lazy.__cause__, LazyOutputError) and "its output 'y' is a generator" in str(lazy)

        exited = failed["exit"]
        assert isinstance(exited.__cause__, SystemExit) and exited.__cause__.code == 3
        assert "called sys.exit(3); a node cannot end the process that runs it" in str(exited)

        full = failed["two arguments"].__cause__  # its own class, message and attribute
        assert type(full) is DiskFull and str(full) == "disk /data is full: no space left on device"
        assert full.path == "/data"

        held = failed["unpicklable attribute"].__cause__
        assert type(held) is HoldsLock and str(held) == "the lock is held" and held.code == 507

        local = failed["local class"].__cause__  # a class the caller cannot import: a stand-in of that name
        assert type(local).__name__ == "Local" and isinstance(local, KeyError) and str(local) == "'this and that'"
        assert isinstance(local, RemoteError) == (name not in ("sequential", "threaded", "async"))

        made = failed["message made"].__cause__  # said once, not "API returned HTTP API returned HTTP 503"
        assert type(made) is ApiError and str(made) == "API returned HTTP 503" and made.status == 503
        assert "ApiError: API returned HTTP 503" in str(failed["message made"])

        lock_arg = failed["unpicklable argument"].__cause__  # each argument kept (the lock as its repr)
        assert lock_arg.args[0] == "the lock" and str(lock_arg).startswith("('the lock', <unlocked _thread.lock")

        found = failed["address in message"].__cause__  # its own class still (not a stand-in, as its text differs)
        assert type(found) is NotFound and type(found.args[0]) is Thing

        unprintable = failed["str raises"]  # reported as Python's traceback reports it; the map goes on
        assert str(unprintable).endswith("BadStr: <exception str() failed>")
        assert type(unprintable.__cause__).__name__ == "BadStr"

        # sys.exit in an async node: one Failed, and nothing left behind for the next map
        asynchronous = Pipeline(nodes=[exits_async], engine=engine)
        rows = asynchronous.map(inputs={"n": [1, 3, 5]}, map_over="n", on_error="continue")
        assert rows[0] == {"z": 1} and rows[2] == {"z": 5} and isinstance(rows[1].error.__cause__, SystemExit)
        assert Pipeline(nodes=[plus_one], engine=engine).map(inputs={"n": [1, 2]}, map_over="n") == [{"w": 2},
                                                                                                     {"w": 3}]

        # imap over inputs that raise at item 40 (windows of 16 and of the default size): the 40 first, then the error
        for window in (16, None):
            got = []
            with pytest.raises(ValueError, match="input line 40 is broken"):
                for row in Pipeline(nodes=[plus_one], engine=engine).imap(inputs={"n": _raising_at(40)},
                                                                          map_over="n", window=window):
                    got.append(row["w"])
            assert got == list(range(1, 41))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["sequential", "process"])
def test_the_same_outcomes_with_a_run_report(name, tmp_path):
    """With a report, each failure also travels in the node log: an exception that pickle cannot
    rebuild there made the parent ask for the chunk's results again, for ever."""
    with Engine(map_executor=name, workers=2, report_dir=tmp_path) as engine:
        p = Pipeline(nodes=[misbehave], engine=engine)
        out = p.map(inputs={"case": CASES}, map_over="case", on_error="continue")
        assert out[0] == {"y": "OK"} and out[-1] == {"y": "FINE"}
        full = out[CASES.index("two arguments")].error.__cause__
        assert type(full) is DiskFull and str(full) == "disk /data is full: no space left on device"
        with pytest.raises(Exception, match="disk /data is full"):
            p.run(inputs={"case": "two arguments"})


@node(output_name="v")
def interrupts(n: int) -> int:
    if n == 3:
        raise KeyboardInterrupt("stop here")
    return n


@node(output_name="v", batch_size=4)
def interrupts_batch(n: list[int]) -> list[int]:
    if 3 in n:
        raise KeyboardInterrupt("stop here")
    return n


@node(output_name="v")
def logs_then_interrupts(n: int, ran: str) -> int:
    """Notes each item as it starts, and whether item 0 had interrupted the map by then. The others
    take a little time, as real items do (a sleep lets the GIL go): items that take none could
    all run in the other thread while this one, holding the marker written but not yet raised,
    waits its turn for the GIL (up to its 5 ms switch interval), before any executor could know."""
    with open(ran, "a") as f:
        f.write(f"{n} {'after' if os.path.exists(ran + '.interrupted') else 'before'}\n")
    if n == 0:
        open(ran + ".interrupted", "w").close()
        raise KeyboardInterrupt("stop here")
    time.sleep(0.001)
    return n


@pytest.mark.parametrize("name", executors("sequential", "threaded", "async", "process", "dask", "ray", "daft"))
def test_a_nodes_keyboard_interrupt_interrupts_the_call_on_every_executor(name):
    """A node that raises KeyboardInterrupt interrupts the call, as Ctrl-C does: `run()` raises it,
    a map raises MapInterrupted with the results so far (on_error="continue" too), imap raises it,
    and the engine works after. In a worker process it counted as one crashed item; the async
    executor's loop ran the interrupted map's items on into the next map; a worker's came back as
    a MapInterrupted with no cause, its "stop here" lost."""
    with engine_named(name) as engine:
        p = Pipeline(nodes=[interrupts], engine=engine)
        try:
            with pytest.raises(KeyboardInterrupt, match="stop here"):
                p.run(inputs={"n": 3})
            for on_error in ("raise", "continue"):
                with pytest.raises(MapInterrupted) as info:
                    p.map(inputs={"n": list(range(8))}, map_over="n", on_error=on_error)
                results = info.value.results
                assert results[3] is None and not info.value.failures
                assert repr(info.value.__cause__) == "KeyboardInterrupt('stop here')", repr(info.value.__cause__)
                assert all(r is None or r == {"v": n} for n, r in enumerate(results))
            got: list = []
            with pytest.raises(KeyboardInterrupt, match="stop here"):  # what finished before it, first
                got.extend(p.imap(inputs={"n": list(range(8))}, map_over="n"))
            assert got == [{"v": n} for n in range(len(got))] and len(got) == 3 or name != "sequential", got
            got.clear()
            with pytest.raises(KeyboardInterrupt, match="stop here"):
                got.extend(p.imap(inputs={"n": list(range(8))}, map_over="n", ordered=False, indexed=True))
            assert all(row == {"v": i} for i, row in got) and 3 not in dict(got), got
            with pytest.raises(MapInterrupted) as info:  # a batched node's (batches as each executor makes them)
                Pipeline(nodes=[interrupts_batch], engine=engine).map(inputs={"n": list(range(8))}, map_over="n")
            results = info.value.results
            assert results[3] is None and all(r in (None, {"v": n}) for n, r in enumerate(results))
            assert not info.value.failures
            assert p.map(inputs={"n": [1, 2]}, map_over="n") == [{"v": 1}, {"v": 2}]
        except KeyboardInterrupt as exc:  # (escaping, it would end the test session)
            pytest.fail(f"{exc!r} escaped")


class StopHere(KeyboardInterrupt):
    """A node's own interrupt, of its own class."""


def hidden_stop(code: int) -> KeyboardInterrupt:
    """An interrupt of a class the caller cannot make again: defined in a function, and its
    constructor takes other arguments than it passes on (it comes back as a copy that rebuilds it)."""
    class Hidden(KeyboardInterrupt):
        def __init__(self, code: int):
            super().__init__(f"hidden {code}")
    return Hidden(code)


@node(output_name="v")
def stops(n: int) -> int:
    if n == 1:
        raise StopHere("stop here")
    if n == 2:
        raise hidden_stop(9)
    return n


def _node_lines(exc: BaseException) -> list[str | None]:
    return [f.line for f in traceback.extract_tb(exc.__traceback__) if f.name == "stops"]


@pytest.mark.parametrize("name", ["sequential", "process"])
def test_a_nodes_keyboard_interrupt_comes_back_itself_with_its_frames(name):
    """A node's own KeyboardInterrupt is the cause of the map's MapInterrupted and what `run()`
    raises, of its class, with its message and the node's frames, as in-process. A worker sent only
    its text: the caller raised a plain KeyboardInterrupt saying it, with no frame of the node's."""
    with Engine(map_executor=name, workers=1) as engine:
        p = Pipeline(nodes=[stops], engine=engine)
        try:
            with pytest.raises(MapInterrupted) as info:
                p.map(inputs={"n": [0, 1, 3]}, map_over="n")
            with pytest.raises(KeyboardInterrupt) as ran:
                p.run(inputs={"n": 1})
            with pytest.raises(MapInterrupted) as hidden:
                p.map(inputs={"n": [0, 2]}, map_over="n")
        except KeyboardInterrupt as exc:  # (escaping, it would end the test session)
            pytest.fail(f"{exc!r} escaped")
    for exc in (info.value.__cause__, ran.value):
        assert type(exc) is StopHere and str(exc) == "stop here", repr(exc)
        assert _node_lines(exc) == ['raise StopHere("stop here")'], traceback.format_exception(exc)
    cause = hidden.value.__cause__  # its class, or where the caller cannot make it, a KeyboardInterrupt from its stand-in
    assert isinstance(cause, KeyboardInterrupt) and str(cause) == "hidden 9", repr(cause)
    node = cause if name == "sequential" else cause.__cause__
    assert type(node).__qualname__ == "hidden_stop.<locals>.Hidden" and str(node) == "hidden 9", repr(node)
    assert _node_lines(node) == ["raise hidden_stop(9)"], traceback.format_exception(node)


def test_no_item_starts_on_the_threaded_executor_once_a_map_is_interrupted(tmp_path):
    """Its threads cannot be stopped mid-item, but the chunks not started are cancelled and those
    running stop at their next item: the interrupted map's items ran on into whatever came next
    (all 199 others, before; here at most the few another thread began as item 0 raised)."""
    ran = tmp_path / "ran"
    with Engine(map_executor="threaded", workers=2) as engine:
        with pytest.raises(MapInterrupted):
            Pipeline(nodes=[logs_then_interrupts], engine=engine).map(
                inputs={"n": list(range(200)), "ran": str(ran)}, map_over="n")
    after = [line for line in ran.read_text().splitlines() if line.endswith("after")]
    assert len(after) <= 5, after

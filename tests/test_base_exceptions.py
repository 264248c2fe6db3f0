"""A node that raises a BaseException other than KeyboardInterrupt (GeneratorExit, asyncio's
CancelledError, a library's `class Stop(BaseException)`) fails its item as an exception does, the
same on every executor (docs/failures.md). Before, it escaped the in-process executors' maps with
the results so far lost, and in a worker process it ended the worker's loop: a NodeCrashed with
no cause. asyncio's own cancellations (a node's timeout, an interrupted map) still pass through."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import traceback

import pytest

from conftest import engine_named, executors
from hardy import Engine, Failed, MapError, MapInterrupted, NodeError, NodeTimeout, Pipeline, node

pytestmark = pytest.mark.timeout(600)  # Ray and Daft start their own processes: slow on a loaded machine


class Stop(BaseException):
    """A library's way out of a loop: a BaseException, not an Exception."""


RAISED = {"generator exit": GeneratorExit, "cancelled": asyncio.CancelledError, "stop": Stop}
SAID = {"generator exit": "closed by a library", "cancelled": "cancelled by a library", "stop": "stopped by a library"}
CASES = ["ok", "generator exit", "cancelled", "stop", "fine"]


def _escape(case: str) -> str:
    if case == "generator exit":
        raise GeneratorExit(SAID[case])
    if case == "cancelled":
        raise asyncio.CancelledError(SAID[case])
    if case == "stop":
        raise Stop(SAID[case])
    return case.upper()


@node(output_name="y")
def escapes(case: str) -> str:
    return _escape(case)


@node(output_name="y")
async def escapes_async(case: str) -> str:
    await asyncio.sleep(0)
    return _escape(case)


@node(output_name="z")
async def beside(case: str) -> int:
    """Independent of `escapes_async`: the async plan gathers the two."""
    await asyncio.sleep(0)
    return len(case)


@node(output_name="y", batch_size=4)
def escapes_batch(case: list[str]) -> list[str]:
    return [_escape(c) for c in case]


def _check_failures(rows: list, node_name: str) -> None:
    """The map's rows: the three cases failed, each a NodeError caused by what the node raised,
    with the node's frames; the others computed."""
    assert rows[0]["y"] == "OK" and rows[-1]["y"] == "FINE", rows
    for case, exc_type in RAISED.items():
        row = rows[CASES.index(case)]
        assert isinstance(row, Failed), (case, row)
        err = row.error
        assert type(err) is NodeError and err.node == node_name and err.item == CASES.index(case), repr(err)
        cause = err.__cause__
        assert type(cause) is exc_type and str(cause) == SAID[case], repr(cause)
        assert str(err).endswith(f"{exc_type.__name__}: {SAID[case]}"), str(err)
        frames = [f.name for f in traceback.extract_tb(cause.__traceback__)]
        assert frames[0] == node_name and frames[-1] == "_escape", frames


@pytest.mark.parametrize("name", executors("sequential", "threaded", "async", "process", "dask", "ray", "daft"))
def test_a_base_exception_fails_its_item_on_every_executor(name):
    with engine_named(name) as engine:
        p = Pipeline(nodes=[escapes], engine=engine)
        _check_failures(p.map(inputs={"case": CASES}, map_over="case", on_error="continue"), "escapes")

        with pytest.raises(MapError) as info:
            p.map(inputs={"case": CASES}, map_over="case")
        assert all(type(err.__cause__) in RAISED.values() for err in info.value.failures.values())
        assert all(r is None or isinstance(r, Failed) or r == {"y": c.upper()}
                   for c, r in zip(CASES, info.value.results, strict=True)), info.value.results
        if name in ("sequential", "async"):  # (items in order: the first one finished before the failure)
            assert info.value.results[0] == {"y": "OK"}

        with pytest.raises(NodeError) as raised:
            p.run(inputs={"case": "stop"})
        assert type(raised.value.__cause__) is Stop

        asynchronous = Pipeline(nodes=[escapes_async, beside], engine=engine)  # gathered on the async executor
        _check_failures(asynchronous.map(inputs={"case": CASES}, map_over="case", on_error="continue"),
                        "escapes_async")

        batch = Pipeline(nodes=[escapes_batch], engine=engine).map(inputs={"case": CASES}, map_over="case",
                                                                   on_error="continue")
        assert [type(r.error.__cause__) if isinstance(r, Failed) else r for r in batch] == [
            {"y": "OK"}, GeneratorExit, asyncio.CancelledError, Stop, {"y": "FINE"}]
        assert p.map(inputs={"case": ["a", "b"]}, map_over="case") == [{"y": "A"}, {"y": "B"}]  # the engine works


@node(output_name="t", timeout=0.5)
async def slow_or_cancels(case: str) -> str:
    if case == "slow":
        await asyncio.sleep(60)  # cancelled at its timeout, by hardy
    if case == "cancelled":
        raise asyncio.CancelledError("cancelled by a library")
    return case


@pytest.mark.parametrize("name", ["sequential", "threaded", "async"])
def test_an_async_nodes_own_cancelled_error_fails_it_and_its_timeout_still_cancels_it(name):
    """The timeout cancels the node's task: that CancelledError is hardy's, and ends as a
    NodeTimeout; the one the node raises itself is the node's failure."""
    with Engine(map_executor=name, workers=2) as engine:
        rows = Pipeline(nodes=[slow_or_cancels], engine=engine).map(
            inputs={"case": ["ok", "slow", "cancelled"]}, map_over="case", on_error="continue")
    assert rows[0] == {"t": "ok"}
    assert isinstance(rows[1].error, NodeTimeout), rows[1].error
    err = rows[2].error
    assert type(err) is NodeError and type(err.__cause__) is asyncio.CancelledError, repr(err)


@node(output_name="v")
async def interrupts_or_cancels(n: int) -> int:
    if n == 0:
        await asyncio.sleep(0.2)
        raise KeyboardInterrupt("stop here")
    if n == 1:
        raise asyncio.CancelledError("cancelled by a library")
    await asyncio.sleep(60)  # cancelled when item 0 interrupts the map
    return n


def test_the_async_executors_own_cancellations_are_no_items_failures():
    """Item 1's CancelledError is its own: a Failed. Items 2 to 5 are cancelled by the interrupt
    item 0 raises: not run, and no failure of theirs."""
    with Engine(map_executor="async") as engine:
        p = Pipeline(nodes=[interrupts_or_cancels], engine=engine)
        try:
            with pytest.raises(MapInterrupted) as info:
                p.map(inputs={"n": list(range(6))}, map_over="n", on_error="continue")
        except KeyboardInterrupt as exc:  # (escaping, it would end the test session)
            pytest.fail(f"{exc!r} escaped")
        assert list(info.value.failures) == [1], info.value.failures
        assert type(info.value.failures[1].__cause__) is asyncio.CancelledError
        assert info.value.results[0] is None and info.value.results[2:] == [None] * 4, info.value.results


SCRIPT = """
from hardy import Pipeline, node

class Stop(BaseException):
    pass

@node(output_name="y")
def stops(x):
    if x == 1:
        raise Stop("stopped by a library")
    return x * 2

pipeline = Pipeline([stops])
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_hardy_run_goes_on_past_a_base_exception(tmp_path, executor):
    (tmp_path / "stops.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "run", "stops:pipeline", "--set", "x=[0, 1, 2]",
                          "--map-over", "x", "--executor", executor], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr
    lines = sorted(map(json.loads, out.stdout.splitlines()), key=lambda line: line["item"])
    assert [line["ok"] for line in lines] == [True, False, True], out.stdout + out.stderr
    assert lines[2]["outputs"] == {"y": 4} and lines[1]["error"] == "Stop", lines[1]


class _Pending:
    def __await__(self):
        yield  # suspends the coroutine awaiting it, as a future not done yet does


def test_a_coroutine_closed_while_it_waits_is_closed_not_failed():
    """A node's coroutine closed while it waits (a task destroyed pending, a loop shut down) gets
    GeneratorExit at its await, which it must let through: taken for the node's failure, close()
    raised and the collector printed 'Exception ignored' (a review found it)."""
    from hardy.model.policy import _contained
    from hardy.plan.compiled import _mark_step

    async def node_call():
        await _Pending()

    for wrapped in (_contained(node_call()), _mark_step(0, node_call())):
        wrapped.send(None)
        wrapped.close()  # (raised Escaped before)

"""`run()` on a warm worker goes the short way (hardy/workers/calls.py): one message each way, no
map loop. Every outcome other than a plain result is the map loop's, taken over where the call
stands: these cases make each one happen on a warm worker, with real processes and real signals,
and check that the call ends as a map's item would, and that the engine serves the next call.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from hardy import Engine, NodeCrashed, NodeError, Pipeline, node
from hardy.workers import scheduling, status


@node(output_name="out")
def act(x: int, how: str = "plain") -> object:
    if how == "raise":
        raise ValueError(f"bad x={x}")
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "log":
        logging.getLogger("hardy.tests.calls").warning("item %s says hello", x)
    if how == "sleep":
        time.sleep(30)
    if how == "big":
        return np.full(1 << 18, x, dtype=np.float64)  # 2 MiB: through shared memory
    if how == "env":
        return os.environ.get("HARDY_TEST_CALLS")
    return (x + 1, os.getpid())


class _Loops:
    """Counts the map loops made (the spy lets the real class run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.made = 0
        real = scheduling.MapRun.__init__

        def init(run: scheduling.MapRun, *args: object, **kwargs: object) -> None:
            self.made += 1
            real(run, *args, **kwargs)
        monkeypatch.setattr(scheduling.MapRun, "__init__", init)


@pytest.fixture
def warm():
    """A pipeline on its own engine of 2 workers, both warm: each has run the plan once."""
    engine = Engine(workers=2)
    p = Pipeline([act], engine=engine)
    started = threading.Barrier(2)

    def both() -> None:
        p.run(inputs={"x": 0, "how": "plain"})
        started.wait(30)
    threads = [threading.Thread(target=both) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield p
    engine.close()


def test_a_warm_run_makes_no_map_loop(warm, monkeypatch):
    loops = _Loops(monkeypatch)
    outs = [warm.run(inputs={"x": k, "how": "plain"})["out"] for k in range(20)]
    assert [o[0] for o in outs] == list(range(1, 21))
    assert all(pid != os.getpid() for _, pid in outs)
    assert loops.made == 0


def test_a_node_error_is_raised_as_the_maps_and_the_worker_serves_on(warm, monkeypatch):
    loops = _Loops(monkeypatch)
    with pytest.raises(NodeError, match=r"bad x=3") as info:
        warm.run(inputs={"x": 3, "how": "raise"})
    assert info.value.node == "act" and info.value.item is None
    assert loops.made == 1  # the failure was classified by the map loop
    assert warm.run(inputs={"x": 4, "how": "plain"})["out"][0] == 5
    assert warm.engine.worker_counts(peaks=False).died == 0


def test_a_crash_costs_the_call_only(warm):
    with pytest.raises(NodeCrashed) as info:
        warm.run(inputs={"x": 5, "how": "segv"})
    assert info.value.signal == "SIGSEGV" and "(inputs: x=5, how='segv')" in str(info.value)
    assert warm.run(inputs={"x": 6, "how": "plain"})["out"][0] == 7
    assert warm.engine.worker_counts(peaks=False).died == 1


def test_a_worker_that_died_idle_is_replaced_and_the_call_runs(warm, caplog):
    first = warm.engine.process_pool().pids()[0]  # the idle worker a call takes first
    os.kill(first, signal.SIGKILL)
    time.sleep(0.2)
    with caplog.at_level(logging.WARNING, logger="hardy.workers"):
        out = warm.run(inputs={"x": 7, "how": "plain"})["out"]
    assert out[0] == 8 and out[1] != first
    assert "died while idle" in caplog.text and "no item in flight" not in caplog.text, caplog.text
    assert warm.engine.worker_counts(peaks=False).died == 1


def test_a_worker_killed_before_it_marked_itself_idle_is_not_charged_with_the_next_call(warm, caplog):
    """A worker writes its answer, then marks itself idle; one preempted in between (a loaded
    machine: the caller it woke takes the core) and killed there still says SENDING. The next call
    handed to it is not charged with its death: it runs on the worker that replaces it."""
    pool = warm.engine.process_pool()
    first = pool.pids()[0]  # the idle worker a call takes first
    worker = next(w for w in pool.workers if w is not None and w.process.pid == first)
    worker.status.item, worker.status.step = status.SENDING, 1.0  # its words as the preempted worker left them
    os.kill(first, signal.SIGKILL)
    time.sleep(0.2)
    with caplog.at_level(logging.WARNING, logger="hardy.workers"):
        out = warm.run(inputs={"x": 7, "how": "plain"})["out"]
    assert out[0] == 8 and out[1] != first
    assert "died while idle" in caplog.text, caplog.text


def test_log_records_reach_the_callers_handlers(warm, caplog):
    with caplog.at_level(logging.WARNING, logger="hardy.tests.calls"):
        warm.run(inputs={"x": 8, "how": "log"})
    record = next(r for r in caplog.records if r.name == "hardy.tests.calls")
    assert record.getMessage() == "item 8 says hello" and record.hardy_worker != os.getpid()


def test_big_outputs_and_inputs_travel_through_shared_memory(warm):
    assert warm.run(inputs={"x": 9, "how": "big"})["out"].sum() == 9 * (1 << 18)
    big = np.arange(1 << 18, dtype=np.float64)

    @node(output_name="total")
    def add_up(a: np.ndarray) -> float:
        return float(a.sum())
    p = Pipeline([add_up], engine=warm.engine)
    for _ in range(3):  # the second and third calls go the short way, the array in a memfd segment
        assert p.run(inputs={"a": big})["total"] == big.sum()


def test_the_callers_environment_at_each_call(warm, monkeypatch):
    monkeypatch.setenv("HARDY_TEST_CALLS", "first")
    assert warm.run(inputs={"x": 0, "how": "env"})["out"] == "first"
    monkeypatch.setenv("HARDY_TEST_CALLS", "second")
    assert warm.run(inputs={"x": 0, "how": "env"})["out"] == "second"


class _Interrupting:
    """An input whose pickling is interrupted: a Ctrl-C as the call packs its item, after it took a worker."""

    def __reduce__(self) -> tuple[object, ...]:
        raise KeyboardInterrupt


def test_a_call_interrupted_before_it_sends_gives_its_worker_back():
    """Interrupted after it took an idle worker and before it sent anything, a call gives the
    worker back: the next calls run on it (with one worker, they waited for it forever)."""
    with Engine(workers=1) as engine:
        p = Pipeline([act], engine=engine)
        first = p.run(inputs={"x": 0, "how": "plain"})["out"][1]
        with pytest.raises(KeyboardInterrupt):
            p.run(inputs={"x": _Interrupting(), "how": "plain"})
        assert engine.process_pool().owners == [None]
        assert p.run(inputs={"x": 1, "how": "plain"})["out"] == (2, first)  # the same worker, not replaced


def _cpu_ticks(pid: int) -> int:
    """The process's user and system time so far, in clock ticks (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_worker_waits_awake_for_the_next_call_only_briefly(warm, monkeypatch):
    """After answering a call, a worker waits for the next on the CPU (`transport.spin_for`), then
    sleeps: idle for half a second after a burst of calls (the short way), it uses next to no CPU
    (a wait of 50 ms instead of 50 µs would show as 5 ticks)."""
    pids = warm.engine.process_pool().pids()
    loops = _Loops(monkeypatch)
    for k in range(50):
        warm.run(inputs={"x": k, "how": "plain"})
    assert loops.made == 0
    before = {pid: _cpu_ticks(pid) for pid in pids}
    time.sleep(0.5)
    used = {pid: _cpu_ticks(pid) - before[pid] for pid in pids}
    assert all(ticks <= 2 for ticks in used.values()), f"clock ticks used idle, by worker: {used}"


def test_a_caller_waits_awake_for_an_answer_only_briefly(warm, monkeypatch):
    """The caller, too, waits for a call's answer on the CPU only at first: through a node that
    sleeps half a second, the calling thread sleeps too."""
    @node(output_name="slept")
    def nap(x: int) -> int:
        time.sleep(0.5)
        return x
    p = Pipeline([nap], engine=warm.engine)
    p.run(inputs={"x": 0})  # (the plan shipped: the next calls go the short way)
    loops = _Loops(monkeypatch)
    t = time.thread_time()
    assert [p.run(inputs={"x": k})["slept"] for k in range(2)] == [0, 1]
    assert time.thread_time() - t < 0.05  # (spinning through both naps: a second; a 50 ms wait: 0.1 s)
    assert loops.made == 0


def test_recycled_after_max_tasks_through_the_short_way():
    with Engine(workers=1, max_tasks_per_worker=2) as engine:
        p = Pipeline([act], engine=engine)
        pids = [p.run(inputs={"x": k, "how": "plain"})["out"][1] for k in range(6)]
    assert len(set(pids)) == 3 and pids[0] == pids[1] and pids[2] == pids[3] and pids[4] == pids[5]


def test_an_interrupted_call_replaces_its_worker_and_the_engine_serves_on(warm):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT is delivered to the main thread")
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))  # as a Ctrl-C: to the process
    timer.start()
    t = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        warm.run(inputs={"x": 1, "how": "sleep"})
    assert time.perf_counter() - t < 10  # not the node's 30 s
    assert warm.run(inputs={"x": 2, "how": "plain"})["out"][0] == 3
    assert warm.engine.worker_counts(peaks=False).died == 1


def test_calls_from_threads_each_take_an_idle_worker(warm):
    outs: list[tuple[int, int]] = []

    def calls(first: int) -> None:
        for k in range(first, first + 50):
            outs.append((k, warm.run(inputs={"x": k, "how": "plain"})["out"][0]))
    threads = [threading.Thread(target=calls, args=(k * 100,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outs) == sorted((k, k + 1) for first in range(0, 400, 100) for k in range(first, first + 50))


@node(output_name="y")
def scaled(x: int, weights: np.ndarray) -> float:
    return float(x * weights[0])


def test_a_map_over_one_list_with_constants_sees_both(warm):
    weights = np.full(1 << 18, 2.0)  # a constant of 2 MiB: one shared segment for the map
    p = Pipeline([scaled], engine=warm.engine)
    for n in (7, 300, 5000):
        out = p.map(inputs={"x": list(range(n)), "weights": weights}, map_over="x")
        assert [o["y"] for o in out] == [2.0 * x for x in range(n)]


def test_a_map_over_a_tuple_or_range_keeps_its_order_and_failures(warm):
    for column in (tuple(range(200)), range(200)):
        out = warm.map(inputs={"x": column, "how": "plain"}, map_over="x")
        assert [o["out"][0] for o in out] == [x + 1 for x in range(200)]
    hows = ["raise" if x % 50 == 7 else "plain" for x in range(200)]
    out = warm.map(inputs={"x": list(range(200)), "how": hows}, map_over=["x", "how"], on_error="continue")
    failed = [x for x, o in enumerate(out) if not isinstance(o, dict)]
    assert failed == [7, 57, 107, 157]
    assert all(out[x]["out"][0] == x + 1 for x in range(200) if x not in failed)


if sys.platform != "linux":  # pragma: no cover
    pytest.skip("worker processes are tested on Linux", allow_module_level=True)

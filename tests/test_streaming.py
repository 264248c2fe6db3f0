"""Streaming maps (`Pipeline.imap`): lazy inputs, bounded items in flight, every executor.

Laziness and back-pressure are checked on endless generators: an implementation that read its
inputs up front or kept producing without a consumer would never return (the test's timeout).
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest

from hardy import DiskCache, Engine, Failed, MapError, NodeError, Pipeline, node
from hardy.errors import InvalidArgument, MapInputError
from hardy.observe.callbacks import PipelineCallback

pytestmark = pytest.mark.timeout(120)

EXECUTORS = ["sequential", "threaded", "async", "process"]
CALLS = {"n": 0}
RELEASE = threading.Event()


@node(output_name="y")
def triple_or_fail(x: int) -> int:
    CALLS["n"] += 1
    if x == 13:
        raise ValueError("thirteen")
    return 3 * x


@node(output_name="y")
def first_waits(x: int) -> int:
    if x == 0:
        RELEASE.wait(30)  # held until the consumer has a later item: only possible unordered
    return x


@pytest.fixture(scope="module")
def engines():
    made = {name: Engine(map_executor=name, workers=2) for name in EXECUTORS}
    yield made
    for e in made.values():
        e.close()


@pytest.mark.parametrize("name", EXECUTORS)
def test_generator_inputs_stream_in_order_with_failures_in_place(name, engines):
    p = Pipeline(nodes=[triple_or_fail], engine=engines[name])
    out = list(p.imap(inputs={"x": (x for x in range(500))}, map_over="x", on_error="continue", window=32))
    assert len(out) == 500 and isinstance(out[13], Failed) and out[13].error.item == 13
    assert [o for i, o in enumerate(out) if i != 13] == [{"y": 3 * x} for x in range(500) if x != 13]
    assert repr(out) == repr(p.map(inputs={"x": list(range(500))}, map_over="x", on_error="continue"))


@pytest.mark.parametrize("name", EXECUTORS)
def test_unordered_yields_every_item_once(name, engines):
    p = Pipeline(nodes=[triple_or_fail], engine=engines[name])
    out = list(p.imap(inputs={"x": iter(range(300))}, map_over="x", on_error="continue", ordered=False,
                      window=16))
    assert sorted(o["y"] for o in out if not isinstance(o, Failed)) == [3 * x for x in range(300) if x != 13]
    assert [o.error.item for o in out if isinstance(o, Failed)] == [13]


def test_unordered_hands_out_items_before_a_slow_earlier_one():
    RELEASE.clear()
    p = Pipeline(nodes=[first_waits], engine=Engine(map_executor="threaded", workers=4))
    stream = p.imap(inputs={"x": range(8)}, map_over="x", ordered=False, window=8)
    first = next(stream)
    RELEASE.set()
    rest = list(stream)
    assert first != {"y": 0} and sorted(o["y"] for o in [first, *rest]) == list(range(8))
    p.engine.close()


@pytest.mark.parametrize("name", EXECUTORS)
def test_endless_generator_is_read_lazily_and_a_slow_consumer_stops_the_producers(name, engines):
    pulled = [0]

    def endless():
        for x in itertools.count():
            pulled[0] = x + 1
            yield x

    p = Pipeline(nodes=[triple_or_fail], engine=engines[name])
    stream = p.imap(inputs={"x": endless()}, map_over="x", window=10)
    assert [next(stream)["y"] for _ in range(5)] == [0, 3, 6, 9, 12]
    seen = -1
    while seen != pulled[0]:  # wait until the producers stop (they must)
        seen = pulled[0]
        time.sleep(0.05)
    assert seen <= 3 * 10  # the window being consumed, one running, one queued: never more
    stream.close()
    assert pulled[0] == seen  # closing read nothing more
    assert p.map(inputs={"x": [1, 2]}, map_over="x") == [{"y": 3}, {"y": 6}]  # the engine still serves


@pytest.mark.parametrize("name", EXECUTORS)
def test_on_error_raise_stops_at_the_failure_after_yielding_what_precedes_it(name, engines):
    p = Pipeline(nodes=[triple_or_fail], engine=engines[name])
    got = []
    with pytest.raises(MapError) as info:
        for out in p.imap(inputs={"x": (x for x in range(100))}, map_over="x", window=5):
            got.append(out["y"])
    # in order up to the failure: all 13 in-process; in workers, an item in flight on the other
    # worker when 13 failed is not run (on_error="raise" does not wait for it), and ends the yield
    assert got == [3 * x for x in range(len(got))] and (len(got) == 13 or name == "process" and len(got) >= 10)
    err = info.value
    assert list(err.failures) == [13] and err.offset == 10 and isinstance(err.results[3], Failed)
    assert err.results[:len(got) - 10] == [{"y": 3 * x} for x in range(10, len(got))]
    assert isinstance(err.__cause__, NodeError) and "item 13" in str(err)


@node(output_name="y")
def slow_before_thirteen(x: int) -> int:
    if x == 13:
        raise ValueError("thirteen")
    if 10 <= x < 13:
        time.sleep(0.5)
    return 3 * x


def test_on_error_raise_never_hands_out_an_item_its_windows_failure_stopped(engines):
    """Items 10 to 12 in flight on the other worker as 13 fails at once: on_error="raise" stops
    the window without them. The stream yielded None for each (a result the caller never had); it
    raises at the first of them instead, having yielded what finished before it."""
    got = []
    p = Pipeline(nodes=[slow_before_thirteen], engine=engines["process"])
    with pytest.raises(MapError) as info:
        for out in p.imap(inputs={"x": (x for x in range(100))}, map_over="x", window=5):
            got.append(out["y"])
    assert got == [3 * x for x in range(len(got))] and 10 <= len(got) < 13
    assert list(info.value.failures) == [13] and info.value.results[len(got) - 10] is None


def test_unequal_generators_are_named():
    @node(output_name="s")
    def add(a: int, b: int) -> int:
        return a + b

    p = Pipeline(nodes=[add])
    stream = p.imap(inputs={"a": iter(range(5)), "b": iter(range(3))}, map_over=["a", "b"])
    with pytest.raises(MapInputError, match=r"\['b'\] ended after 3 items while \['a'\] went on"):
        list(stream)
    with pytest.raises(MapInputError, match="equally long"):  # known lengths: before anything runs
        p.imap(inputs={"a": [1, 2], "b": [1]}, map_over=["a", "b"])
    product = p.imap(inputs={"a": iter([1, 2]), "b": (10, 20)}, map_over=["a", "b"], map_mode="product")
    assert [o["s"] for o in product] == [11, 21, 12, 22]


def test_progress_of_a_generator_of_unknown_length_shows_done_and_rate(capsys):
    p = Pipeline(nodes=[triple_or_fail], name="stream")
    for _ in p.imap(inputs={"x": (x for x in range(200))}, map_over="x", progress=True, on_error="continue"):
        pass
    err = capsys.readouterr().err
    assert "200/?" in err and "items/s" in err and "1 failed" in err


def test_callbacks_see_every_item_with_its_index_across_windows():
    class Record(PipelineCallback):
        def __init__(self):
            self.events = []

        def on_map_start(self, total_items, ctx):
            self.events.append(("start", total_items))

        def on_map_item_end(self, item_index, duration, ctx):
            self.events.append(("end", item_index))

        def on_map_item_error(self, item_index, error, ctx):
            self.events.append(("error", item_index))

        def on_map_end(self, total_duration, ctx):
            self.events.append(("done",))

    rec = Record()
    p = Pipeline(nodes=[triple_or_fail], callbacks=[rec], engine=Engine(map_executor="threaded", workers=2))
    list(p.imap(inputs={"x": iter(range(20))}, map_over="x", on_error="continue", window=4))
    ends = sorted(e[1] for e in rec.events if e[0] == "end")
    assert rec.events[0] == ("start", None) and rec.events[-1] == ("done",)
    assert ends == [i for i in range(20) if i != 13] and ("error", 13) in rec.events
    p.engine.close()


@node(output_name="y")
def dies_at_five(x: int) -> int:
    if x == 5:
        os._exit(3)
    return 3 * x


def test_unordered_process_map_takes_node_records_and_worker_deaths():
    class Nodes(PipelineCallback):
        def __init__(self):
            self.ended = 0

        def on_node_end(self, node_id, outputs, duration, ctx):
            self.ended += 1

    rec = Nodes()  # node events are logged in the workers and sent back with each item
    p = Pipeline(nodes=[dies_at_five], callbacks=[rec], engine=Engine(map_executor="process", workers=2))
    try:
        out = list(p.imap(inputs={"x": iter(range(20))}, map_over="x", on_error="continue", ordered=False,
                          window=8))
    finally:
        p.engine.close()
    failed = [o for o in out if isinstance(o, Failed)]
    assert len(out) == 20 and len(failed) == 1 and failed[0].error.item == 5
    assert sorted(o["y"] for o in out if not isinstance(o, Failed)) == [3 * x for x in range(20) if x != 5]
    assert rec.ended >= 19


def test_streamed_items_are_cached(tmp_path):
    cache = DiskCache(tmp_path / "c")
    p = Pipeline(nodes=[triple_or_fail], cache=cache, engine=Engine(map_executor="sequential"))  # counters here
    CALLS["n"] = 0
    first = list(p.imap(inputs={"x": iter(range(40))}, map_over="x", on_error="continue", window=8))
    assert CALLS["n"] == 40
    again = list(p.imap(inputs={"x": iter(range(40))}, map_over="x", on_error="continue", window=8))
    assert CALLS["n"] == 41  # only the failed item runs again
    assert [o for o in again if not isinstance(o, Failed)] == [o for o in first if not isinstance(o, Failed)]


def test_bad_window_is_refused():
    with pytest.raises(InvalidArgument, match="window"):
        Pipeline(nodes=[triple_or_fail]).imap(inputs={"x": [1]}, map_over="x", window=0)


FINALISED = """
import gc, sys, threading, time
from hardy import Engine, Pipeline, node
from hardy.errors import EngineClosed

@node(output_name="y")
def slowish(x):
    time.sleep(0.05)
    return x

p = Pipeline([slowish])
with Engine(map_executor=sys.argv[1], workers=2) as engine:  # a consumer that raises inside the block
    try:
        for out in p.imap(inputs={"x": range(50)}, map_over="x", engine=engine, window=4):
            raise ValueError("the consumer's bug")
    except ValueError:
        print("caught:", flush=True)
print("after the block", flush=True)  # the stream is finalised here or later, its engine closed

engine = Engine(map_executor=sys.argv[1], workers=2)
stream = p.imap(inputs={"x": range(50)}, map_over="x", engine=engine, window=4)
next(stream)
engine.close()  # closed under a stream still running: it ends, saying why
try:
    list(stream)
except EngineClosed as exc:
    print("EngineClosed:", exc)
engine = Engine(map_executor=sys.argv[1], workers=2)
stream = p.imap(inputs={"x": range(50)}, map_over="x", engine=engine, window=4)
next(stream)
del stream  # finalised by the garbage collector
gc.collect()
engine.close()
import psutil
print("left:", sorted(t.name for t in threading.enumerate() if t.name.startswith("hardy")),
      psutil.Process().children(recursive=True), flush=True)
"""


@pytest.mark.parametrize("name", ["threaded", "process"])
def test_an_imap_finalised_at_any_time_returns_and_leaves_nothing(name, tmp_path):
    """The consumer raises inside `with Engine()`, the engine closes under a running stream, a stream is
    garbage-collected: each returns (the test's timeout would catch a hang)."""
    import subprocess
    import sys
    (tmp_path / "finalised.py").write_text(FINALISED)
    done = subprocess.run([sys.executable, "finalised.py", name], cwd=tmp_path, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["caught:", "after the block"], done.stdout
    assert lines[2].startswith("EngineClosed: the engine running this imap was closed"), done.stdout
    assert lines[3] == "left: [] []", done.stdout  # no thread, no worker process

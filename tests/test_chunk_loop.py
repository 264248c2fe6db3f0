"""A plain plan runs a chunk's items in a loop of its own, generated with it (`Plan.each`), in real
worker processes: the same outputs and failures as the sequential executor for every shape of
pipeline and map, the status words naming the item a SIGKILL hit, the outputs computed before a
segfault delivered as its last words (no finished item runs twice), a result that cannot be read
in the parent failing alone, and slow items' results sent one by one. In the parent, a map's run
(its items, its results) is freed when the map returns, not at the collector's next full pass.

A node reports which function called it (`_each`, the plan's loop, or `_run`, one call), so these
tests fail if the loop is not the one that ran."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from pathlib import Path

import pytest

from hardy import Engine, Failed, NodeCrashed, Pipeline, PipelineCallback, node
from hardy.workers.replies import Replies

if sys.platform != "linux":  # pragma: no cover
    pytest.skip("worker processes are tested on Linux", allow_module_level=True)

N = 3000  # items per map: after the first map's probes, chunks of hundreds


def caller() -> str:
    return sys._getframe(2).f_code.co_name  # (1: the node; 2: what called it)


@node(output_name="a")
def inc(x: int) -> int:
    if x % 7 == 3 or x in (10, 11, 12) or x == N - 1:
        raise ValueError(f"bad {x}")
    if x == 500:
        sys.exit(2)
    return x + 1


@node(output_name=("lo", "hi"))
def split(a: int, k: int) -> tuple[int, int]:
    return a - k, a + k


@node(output_name="n words")
def words(lo: int, hi: int) -> int:
    return hi - lo


@node(output_name="via")
def via(x: int) -> str:
    return caller()


@node(output_name="lazy")
def maybe_lazy(x: int):
    return (i for i in range(x)) if x == 20 else x


@node(output_name="s")
def add(x: int, y: int) -> int:
    if x == y:
        raise ValueError("equal")
    return x + y


SHAPES = {
    "one output": ([inc], {"x": list(range(N))}, "x", "zip", None),
    "several outputs, a constant, a tuple node, a name with a space": (
        [inc, split, words], {"x": list(range(N)), "k": 3}, "x", "zip", None),
    "some outputs only": ([inc, split, words], {"x": list(range(N)), "k": 3}, "x", "zip", ["n words", "a"]),
    "inputs as outputs": ([inc, split], {"x": list(range(N)), "k": 3}, "x", "zip", ["x", "k", "hi"]),
    "a generator output": ([maybe_lazy], {"x": list(range(N))}, "x", "zip", None),
    "two inputs zipped": ([add], {"x": list(range(N)), "y": list(range(N, 0, -1))}, ["x", "y"], "zip", None),
    "a product": ([add], {"x": list(range(60)), "y": list(range(50))}, ["x", "y"], "product", None),
    "a tuple column": ([inc, via], {"x": tuple(range(N))}, "x", "zip", ["a"]),
}


def _outcome(o):
    if isinstance(o, Failed):
        err = o.error
        return ("failed", type(err).__name__, err.node, err.item, str(err).splitlines()[0])
    return o


@pytest.fixture(scope="module")
def engines():
    with Engine(map_executor="process", workers=2) as default, Engine(map_executor="sequential") as sequential:
        yield default, sequential


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_plans_loop_gives_what_the_sequential_executor_gives(shape, engines):
    nodes, inputs, over, mode, outputs = SHAPES[shape]
    default, sequential = engines
    expected = Pipeline(nodes, engine=sequential).map(inputs=inputs, map_over=over, map_mode=mode,
                                                      output_name=outputs, on_error="continue")
    p = Pipeline(nodes, engine=default)
    for _ in range(2):  # the first map learns the time per item with small chunks
        got = p.map(inputs=inputs, map_over=over, map_mode=mode, output_name=outputs, on_error="continue")
        assert [_outcome(o) for o in got] == [_outcome(o) for o in expected]
    assert sum(isinstance(o, Failed) for o in got) == sum(isinstance(o, Failed) for o in expected)


def test_a_map_of_plain_items_runs_in_the_plans_own_loop(engines):
    p = Pipeline([via], engine=engines[0])
    p.map(inputs={"x": list(range(N))}, map_over="x")
    calls = Counter(o["via"] for o in p.map(inputs={"x": list(range(N))}, map_over="x"))
    assert calls["_each"] == N, calls


@node(output_name="y")
def counted(x: int, runs: str, how: str) -> int:
    with open(runs, "a") as f:  # a side effect: once per item
        f.write(f"{x}\n")
    if x == 1337:
        os.kill(os.getpid(), signal.SIGKILL if how == "sigkill" else signal.SIGSEGV)
    return 2 * x


@pytest.mark.parametrize("how", ["segv", "sigkill"])
def test_a_crash_in_the_plans_loop_costs_its_item_only(how, tmp_path):
    """A segfault's handler sends the outputs of the chunk's items before it (no item runs twice);
    a SIGKILL leaves no last words: the status words name the item and its node, and the chunk's
    other items run again."""
    runs = tmp_path / "runs"
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline([counted], engine=engine)
        p.map(inputs={"x": list(range(64)), "runs": str(tmp_path / "warm"), "how": how}, map_over="x")
        out = p.map(inputs={"x": list(range(N)), "runs": str(runs), "how": how}, map_over="x", on_error="continue")
    failed = {i: o.error for i, o in enumerate(out) if isinstance(o, Failed)}
    assert list(failed) == [1337]
    err = failed[1337]
    assert type(err) is NodeCrashed and err.node == "counted" and err.item == 1337, err
    assert err.signal == ("SIGKILL" if how == "sigkill" else "SIGSEGV")
    assert all(out[x] == {"y": 2 * x} for x in range(N) if x != 1337)
    ran = Counter(int(line) for line in runs.read_text().split())
    assert set(ran) == set(range(N))
    if how == "segv":
        assert [x for x, n in ran.items() if n > 1] == [], "a finished item ran twice"


class Ghost:
    """Pickled in the worker; unpickling it in the parent raises."""

    def __reduce__(self):
        return (_refuse_outside_workers, ())


def _refuse_outside_workers():
    if os.environ.get("HARDY_WORKER_TEST") != "worker":
        raise RuntimeError("not here")
    return Ghost()


@node(output_name="y")
def ghost_at(x: int, ghost: int, pause: float):
    os.environ["HARDY_WORKER_TEST"] = "worker"
    time.sleep(pause)
    return Ghost() if x == ghost else x


def test_a_result_the_parent_cannot_read_fails_alone(engines):
    p = Pipeline([ghost_at], engine=engines[0])
    for _ in range(2):
        out = p.map(inputs={"x": list(range(N)), "ghost": 1500, "pause": 0.0}, map_over="x", on_error="continue")
        assert isinstance(out[1500], Failed) and "cannot be unpickled in this process" in str(out[1500].error)
        assert [o["y"] for i, o in enumerate(out) if i != 1500] == [x for x in range(N) if x != 1500]


@node(output_name="y", timeout=60)
def ghost_at_timed(x: int, ghost: int, pause: float):
    """`ghost_at` with a deadline: its calls are dated, so a chunk runs in `run_chunk`'s loop."""
    return ghost_at.func(x, ghost, pause)


@pytest.mark.parametrize("loop", ["the plan's own", "run_chunk's"])
def test_batches_after_one_the_parent_cannot_read_go_to_their_own_items(loop):
    """Slow items: each result its own batch of outputs only, the second one unreadable here; the
    batches after it say which items they are (`Header.first`), so none is taken for another's."""
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline([ghost_at if loop == "the plan's own" else ghost_at_timed], engine=engine)
        p.map(inputs={"x": list(range(10, 510)), "ghost": -1, "pause": 0.0}, map_over="x")
        out = p.map(inputs={"x": list(range(6)), "ghost": 1, "pause": 0.02}, map_over="x", on_error="continue")
    assert isinstance(out[1], Failed) and "cannot be unpickled in this process" in str(out[1].error)
    assert [o["y"] for i, o in enumerate(out) if i != 1] == [0, 2, 3, 4, 5]


@node(output_name="t")
def slow(x: int, pause: float) -> float:
    time.sleep(pause)
    return time.monotonic()


class Arrivals(PipelineCallback):
    """When each item's end reached the parent (an item event: the nodes' calls are not logged)."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}

    def on_map_item_end(self, i, duration, ctx):
        self.at[i] = time.monotonic()


def test_slow_items_results_come_one_by_one():
    """Each result reaches the parent before the next item is done: the loop comes back to send
    once a batch is due (every 5 ms), however many items its chunk holds (five here: the map
    before taught the pool that this plan's items are fast)."""
    arrivals = Arrivals()
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline([slow, via], engine=engine, callbacks=[arrivals])
        p.map(inputs={"x": list(range(500)), "pause": 0.0}, map_over="x")
        out = p.map(inputs={"x": list(range(5)), "pause": 0.3}, map_over="x")
    assert [o["via"] for o in out] == ["_each"] * 5
    for i in range(4):
        assert arrivals.at[i] < out[i + 1]["t"]


@node(output_name="t")
def fast_then_slow(x: int, slow_from: int, pause: float) -> float:
    if x >= slow_from:
        time.sleep(pause)
    return time.monotonic()


def test_slow_items_after_fast_ones_are_sent_at_most_15_items_late():
    """The plan's loop reads the clock after its 1st, 2nd, 4th, 8th item, then every 16th
    (`source._CLOCK_READ`): in one call of the loop, a run of slow items after fast ones is sent
    at the next read, then, the loop called again, one by one."""
    arrivals = Arrivals()
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline([fast_then_slow, via], engine=engine, callbacks=[arrivals])
        p.map(inputs={"x": list(range(2000)), "slow_from": 10**9, "pause": 0.0}, map_over="x")
        out = p.map(inputs={"x": list(range(300)), "slow_from": 200, "pause": 0.01}, map_over="x")
    assert [o["via"] for o in out] == ["_each"] * 300
    late = [i for i in range(200, 284) if arrivals.at[i] > out[i + 16]["t"]]
    assert late == [], late
    one_by_one = [i for i in range(230, 299) if arrivals.at[i] > out[i + 1]["t"]]
    assert one_by_one == [], one_by_one


def test_a_maps_run_is_freed_as_it_returns(engines):
    """No reference cycle keeps a map's run, its items or its results (a million of them, say)
    alive until the collector's next full pass: reference counting frees them. (A failure's
    error holds its exception and the exception its traceback: cycles, as anywhere in Python.)"""
    p = Pipeline([via], engine=engines[0])
    p.map(inputs={"x": list(range(N))}, map_over="x")
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        out = p.map(inputs={"x": list(range(N))}, map_over="x")
        del out
        gc.collect()
        left = sorted({type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("hardy")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == [], left


@node(output_name="lo")
def fail_slowly(x: int, pause: float, ends: str) -> int:
    time.sleep(pause)
    with open(ends, "a") as f:
        f.write(f"{x} {time.monotonic()}\n")
    if pause and x < 4:
        raise ValueError(f"slow failure {x}")
    return x


class Failures(Arrivals):
    def on_map_item_error(self, i, error, ctx):
        self.at[i] = time.monotonic()


def test_failures_are_sent_as_they_come(tmp_path):
    """A failure goes back once its batch is due, as a result does, not with the next success:
    each reaches the parent before the next item ends."""
    failures, ends = Failures(), tmp_path / "ends"
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline([fail_slowly, via], engine=engine, callbacks=[failures])
        p.map(inputs={"x": list(range(100, 600)), "pause": 0.0, "ends": str(tmp_path / "warm")}, map_over="x")
        out = p.map(inputs={"x": list(range(6)), "pause": 0.2, "ends": str(ends)}, map_over="x", on_error="continue")
    assert [isinstance(o, Failed) for o in out] == [True] * 4 + [False] * 2
    assert [o["via"] for o in out[4:]] == ["_each"] * 2
    ended = {int(x): float(t) for x, t in (line.split() for line in ends.read_text().splitlines())}
    for i in range(4):
        assert failures.at[i] < ended[i + 1]


@node(output_name="v")
def inner_v(item: int) -> int:
    if item >= 1000:
        os.kill(os.getpid(), signal.SIGSEGV)
    return 3 * item


INNER = Pipeline([inner_v], name="inner").as_node(name="im", map_over="xs", input_mapping={"xs": "item"},
                                                  output_mapping={"v": "vs"}, on_error="continue")


def test_a_nested_maps_crash_costs_its_inner_item_only(engines):
    """Two items of the plan's loop each map a nested pipeline whose third item segfaults: each
    runs again without its own inner item (`crash.containment.nesting` reads `_item` in the
    loop's frame, as in `_run`'s), and nothing else fails."""
    p = Pipeline([INNER], engine=engines[0])
    p.map(inputs={"xs": [[k] for k in range(300)]}, map_over="xs")
    xs = [[k, k, 1000 + k] if k in (0, 150) else [k] for k in range(300)]
    out = p.map(inputs={"xs": xs}, map_over="xs", on_error="continue")
    for k in (0, 150):
        assert out[k]["vs"][:2] == [3 * k, 3 * k] and isinstance(out[k]["vs"][2], Failed), out[k]
    assert all(out[k] == {"vs": [3 * k]} for k in range(300) if k not in (0, 150))


HELD: list[weakref.ref] = []  # the intermediates made so far, in the process that runs the nodes


class Held:
    pass


@node(output_name="held")
def hold(x: int) -> Held:
    alive = sum(r() is not None for r in HELD)
    HELD[:] = [weakref.ref(h := Held())]
    h.before = alive
    return h


@node(output_name="earlier")
def earlier_alive(held: Held) -> int:
    return held.before


def test_an_items_intermediates_are_freed_before_the_next_item(engines):
    """As `_run`'s return frees its locals: an intermediate (not an output) of one item is gone
    before the next item begins (a second copy of a big array or a GPU buffer otherwise, or a
    file closed an item late)."""
    p = Pipeline([hold, earlier_alive], engine=engines[0])
    for _ in range(2):
        out = p.map(inputs={"x": list(range(N))}, map_over="x", output_name="earlier")
        assert sum(o["earlier"] for o in out) == 0


class Bomb:
    def __repr__(self) -> str:  # a native object whose text crashes, say: read as a failure is written down
        if os.environ.get("HARDY_WORKER_TEST") == "worker":
            os.kill(os.getpid(), signal.SIGSEGV)
        return "Bomb()"


@node(output_name="y")
def fails_with_a_bomb(x: int, runs: str) -> int:
    os.environ["HARDY_WORKER_TEST"] = "worker"
    bomb = Bomb()  # noqa: F841  # (a local: the failure's frames are written down with it)
    if x == 150:
        with open(runs, "a") as f:
            f.write("150\n")
        raise ValueError("bad item")
    return x


def test_a_crash_while_a_failure_is_written_down_is_its_items(tmp_path):
    """The status words still name the failed item while its error is made ready to travel (its
    frames' locals written as text: user code): a crash there is charged to it, once."""
    runs = tmp_path / "runs"
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline([fails_with_a_bomb], engine=engine)
        p.map(inputs={"x": list(range(1000, 1500)), "runs": str(runs)}, map_over="x")
        out = p.map(inputs={"x": list(range(300)), "runs": str(runs)}, map_over="x", on_error="continue")
    assert [(i, type(o.error)) for i, o in enumerate(out) if isinstance(o, Failed)] == [(150, NodeCrashed)]
    assert runs.read_text().split() == ["150"]


def test_last_words_between_an_items_stores_keep_its_outputs_together():
    """Last words (a signal's handler, between any two bytecodes) can come while an item's
    outputs are being appended, one list each: only the items stored whole become rows; the
    half-stored item's outputs stay, and its next appends complete it."""
    replies = Replies()
    a, b = replies.start_outs(10, ("a", "b"))
    a += [1, 2, 3]
    b += [-1, -2]  # item 12: "a" stored, "b" not yet
    replies.to_rows()
    assert replies.unsent == [(10, True, {"a": 1, "b": -1}), (11, True, {"a": 2, "b": -2})]
    assert (replies.first, a, b) == (12, [3], [])
    b.append(-3)
    replies.unsent.clear()
    replies.to_rows()
    assert replies.unsent == [(12, True, {"a": 3, "b": -3})]


PAUSES = """
import gc, sys
from hardy import Pipeline, node

@node(output_name="y")
def inc(x):
    return x + 1

p = Pipeline([inc])
p.map(inputs={"x": list(range(3000))}, map_over="x")
switched = []

def watch(frame, event, arg):
    if event == "c_call" and arg in (gc.disable, gc.enable):
        switched.append(arg.__name__)

sys.setprofile(watch)
p.map(inputs={"x": list(range(3000))}, map_over="x")
sys.setprofile(None)
print(sorted(set(switched)))
"""


def test_the_collector_is_left_as_the_user_set_it(engines):
    """The parent pauses the collector while it makes result dicts only when it is on and this is
    the process's one thread (a user's script, `python -`: it does); a collector a user switched
    off stays off, and no other thread can find its switch undone (the map's calls of gc.disable
    and gc.enable are watched)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    alone = subprocess.run([sys.executable, "-"], input=PAUSES, capture_output=True, text=True, env=env, timeout=120)
    assert alone.stdout.split("\n")[-2:] == ["['disable', 'enable']", ""], alone.stdout + alone.stderr
    p = Pipeline([via], engine=engines[0])  # (no failure: every batch is columns)
    switched: list[str] = []

    def watch(frame, event, arg):
        if event == "c_call" and arg in (gc.disable, gc.enable):
            switched.append(arg.__name__)

    def mapped():
        p.map(inputs={"x": list(range(N))}, map_over="x")

    gc.disable()
    try:
        mapped()
        assert not gc.isenabled()
    finally:
        gc.enable()
    threading.setprofile(watch)
    try:
        thread = threading.Thread(target=mapped)
        thread.start()
        thread.join()
    finally:
        threading.setprofile(None)
    assert switched == []


class Switches(PipelineCallback):
    """Item events: whether the collector is on as each item's end is delivered, and, at one item,
    the user's code switching it off."""

    def __init__(self) -> None:
        self.on: set[bool] = set()

    def on_map_item_end(self, i, duration, ctx):
        self.on.add(gc.isenabled())
        if i == N // 2:
            gc.disable()


def test_callbacks_run_with_the_collector_as_the_user_set_it(engines):
    """The collector's pause covers the making of the result dicts, not their delivery: a callback
    runs with it on, and one that switches it off finds it off after the map."""
    callback = Switches()
    p = Pipeline([via], engine=engines[0], callbacks=[callback])
    p.map(inputs={"x": list(range(N))}, map_over="x")
    try:
        assert callback.on == {True, False} and not gc.isenabled()
    finally:
        gc.enable()


class Flaky:
    """A lazy proxy's kind of value (lazy_object_proxy): its class is resolved on first use, and
    the first resolution fails."""

    def __init__(self) -> None:
        self.tries = 0

    @property  # type: ignore[misc]
    def __class__(self):
        self.tries += 1
        if self.tries == 1:
            raise RuntimeError("backing store unavailable")
        return int


@node(output_name="y")
def flaky_at(x: int):
    return Flaky() if x == N - 10 else x + 1


@node(output_name="z")
def doubled(x: int) -> int:
    return 2 * x


def test_an_outputs_class_read_is_its_nodes(engines):
    """Reading an output's class (for the generator test) is its node's: a failure there names
    the node that made it, as the sequential executor does, not the step that ran last."""
    default, sequential = engines
    inputs = {"x": list(range(N))}
    expected = Pipeline([flaky_at, doubled], engine=sequential).map(inputs=inputs, map_over="x", on_error="continue")
    p = Pipeline([flaky_at, doubled], engine=default)
    p.map(inputs=inputs, map_over="x", on_error="continue")
    got = p.map(inputs=inputs, map_over="x", on_error="continue")
    assert [_outcome(o) for o in got] == [_outcome(o) for o in expected]
    assert [i for i, o in enumerate(got) if isinstance(o, Failed)] == [N - 10]
    assert got[N - 10].error.node == "flaky_at"


class Fragile:
    """An intermediate whose destructor crashes (a native handle freed twice, say) for one item."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __del__(self) -> None:
        if self.x == 1500:
            os.kill(os.getpid(), signal.SIGSEGV)


@node(output_name="fragile")
def fragile(x: int) -> Fragile:
    return Fragile(x)


@node(output_name="y")
def use(fragile: Fragile) -> int:
    return 2 * fragile.x


def test_a_crash_as_an_items_intermediates_are_freed_is_its(engines):
    """Freed at the end of its pass while the status words still name it, as `_run`'s return
    frees them: the crash fails that item, it does not come back as a success."""
    p = Pipeline([fragile, use], engine=engines[0])
    p.map(inputs={"x": list(range(2000, 2000 + N))}, map_over="x", output_name="y")
    out = p.map(inputs={"x": list(range(N))}, map_over="x", output_name="y", on_error="continue")
    assert [(i, type(o.error)) for i, o in enumerate(out) if isinstance(o, Failed)] == [(1500, NodeCrashed)]
    assert all(out[x] == {"y": 2 * x} for x in range(N) if x != 1500)

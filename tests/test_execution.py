"""Executors, async nodes, callbacks, progress, HyperNodes compatibility and random DAGs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hardy import Engine, Node, Pipeline, PipelineCallback, node
from hardy.observe.callbacks import in_call


@node(output_name="slow_a")
async def wait_a(x):
    await asyncio.sleep(0.05)
    return x + 1


@node(output_name="slow_b")
async def wait_b(x):
    await asyncio.sleep(0.05)
    return x + 2


@node(output_name="sum")
def add(slow_a, slow_b):
    return slow_a + slow_b


def test_async_nodes_work_with_the_sequential_executor():
    assert Pipeline(nodes=[wait_a, wait_b, add]).run(inputs={"x": 1}) == {"slow_a": 2, "slow_b": 3, "sum": 5}


class Overlap:
    """Counts how many awaits are in flight at once: concurrency observed, not inferred from timing."""

    def __init__(self) -> None:
        self.now = self.most = 0

    async def wait(self, seconds: float) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(seconds)
        self.now -= 1


def test_async_map_runs_40_waits_concurrently():
    overlap = Overlap()

    @node(output_name="slow_a")
    async def wait_counted(x):
        await overlap.wait(0.05)
        return x + 1

    p = Pipeline(nodes=[wait_counted], engine=Engine(map_executor="async"))
    out = p.map(inputs={"x": list(range(40))}, map_over="x")
    assert [o["slow_a"] for o in out] == list(range(1, 41))
    assert overlap.most == 40


def test_async_node_executor_gathers_independent_nodes():
    overlap = Overlap()

    @node(output_name="slow_a")
    async def a(x):
        await overlap.wait(0.05)
        return x + 1

    @node(output_name="slow_b")
    async def b(x):
        await overlap.wait(0.05)
        return x + 2

    p = Pipeline(nodes=[a, b, add], engine=Engine(node_executor="async"))
    assert p.run(inputs={"x": 1})["sum"] == 5
    assert overlap.most == 2
    overlap.most = 0
    Pipeline(nodes=[a, b, add], engine=Engine(map_executor="sequential")).run(inputs={"x": 1})
    assert overlap.most == 1  # the same nodes under the sequential node executor run one after the other


def test_async_works_inside_a_running_event_loop():
    p = Pipeline(nodes=[wait_a])

    async def caller():
        return p.run(inputs={"x": 1})

    assert asyncio.run(caller()) == {"slow_a": 2}


def test_threaded_node_executor_runs_independent_nodes_concurrently():
    barrier = threading.Barrier(2, timeout=5)  # deadlocks (BrokenBarrierError) unless both run at once

    @node(output_name="l")
    def left(x):
        barrier.wait()
        return x

    @node(output_name="r")
    def right(x):
        barrier.wait()
        return -x

    @node(output_name="both")
    def join(l, r):  # noqa: E741 - parameter names are the inputs' names
        return (l, r)

    p = Pipeline(nodes=[left, right, join], engine=Engine(node_executor="threaded", workers=2))
    assert p.run(inputs={"x": 3}) == {"l": 3, "r": -3, "both": (3, -3)}


def test_threaded_map_uses_several_threads():
    seen = set()

    @node(output_name="y")
    def record(x):
        seen.add(threading.get_ident())
        time.sleep(0.01)
        return x

    p = Pipeline(nodes=[record], engine=Engine(map_executor="threaded", workers=4))
    out = p.map(inputs={"x": list(range(40))}, map_over="x")
    assert [o["y"] for o in out] == list(range(40))
    assert len(seen) > 1


class Recorder(PipelineCallback):
    def __init__(self):
        self.events = []

    def on_pipeline_start(self, pipeline_id, inputs, ctx):
        self.events.append(("pipeline_start", pipeline_id))

    def on_pipeline_end(self, pipeline_id, outputs, duration, ctx):
        self.events.append(("pipeline_end", pipeline_id))

    def on_node_start(self, node_id, inputs, ctx):
        self.events.append(("node_start", node_id, dict(inputs)))

    def on_node_end(self, node_id, outputs, duration, ctx):
        self.events.append(("node_end", node_id, dict(outputs)))

    def on_error(self, node_id, error, ctx):
        self.events.append(("error", node_id, type(error).__name__))

    def on_map_start(self, total_items, ctx):
        self.events.append(("map_start", total_items))

    def on_map_item_start(self, item_index, ctx):
        self.events.append(("item_start", item_index))

    def on_map_item_end(self, item_index, duration, ctx):
        self.events.append(("item_end", item_index))

    def on_map_item_error(self, item_index, error, ctx):
        self.events.append(("item_error", item_index))

    def on_map_end(self, total_duration, ctx):
        self.events.append(("map_end",))


def test_callbacks_receive_pipeline_node_and_item_events():
    @node(output_name="y")
    def inv(x):
        return 1 / x

    rec = Recorder()
    p = Pipeline(nodes=[inv], callbacks=[rec], name="cb", engine=Engine(map_executor="sequential"))  # in-process: events carry inputs
    p.run(inputs={"x": 2})
    assert rec.events == [("pipeline_start", "cb"), ("node_start", "inv", {"x": 2}),
                          ("node_end", "inv", {"y": 0.5}), ("pipeline_end", "cb")]
    rec.events.clear()
    p.map(inputs={"x": [1, 0]}, map_over="x", on_error="continue")
    kinds = [e[0] for e in rec.events]  # HyperNodes' shape: each item is a run of the pipeline
    assert kinds[:4] == ["map_start", "item_start", "pipeline_start", "node_start"]
    assert kinds[4:6] == ["node_end", "pipeline_end"]
    assert ("item_end", 0) in rec.events and ("item_error", 1) in rec.events
    assert ("error", "inv", "ZeroDivisionError") in rec.events
    assert kinds[-1] == "map_end"


class Silent(PipelineCallback):
    """Overrides no event (a base class of a user's callbacks, or one whose methods are commented out)."""


@pytest.mark.parametrize("callbacks", [[], [Silent()]], ids=["none", "one-overriding-nothing"])
def test_no_listening_callback_means_uninstrumented_plans(callbacks):
    p = Pipeline(nodes=[add], callbacks=callbacks, engine=Engine(map_executor="sequential"))
    p.run(inputs={"slow_a": 1, "slow_b": 2})
    plan = next(iter(p._plans.values()))
    assert "sum_ = f_add(slow_a, slow_b)  # node 'add'" in plan.source
    assert plan.run.__globals__["f_add"] is add.func  # the node function itself, no wrapper in between
    seen = []

    @node(output_name="y")
    def probe(x: int) -> int:
        seen.append(in_call())
        return x

    probing = Pipeline([probe], callbacks=callbacks, engine=Engine(map_executor="sequential"))
    probing.map(inputs={"x": [1, 2]}, map_over="x")
    probing.run(inputs={"x": 3})
    assert seen == [False, False, False]  # nor is an event context opened around a map's items or a run


def test_progress_bar_renders_counts(capsys):
    @node(output_name="y")
    def slow(x):
        time.sleep(0.002)
        if x == 3:
            raise ValueError("bad")
        return x

    p = Pipeline(nodes=[slow], name="bar")
    p.map(inputs={"x": list(range(100))}, map_over="x", progress=True, on_error="continue")
    err = capsys.readouterr().err
    assert "100/100" in err and "1 failed" in err and "items/s" in err


def test_progress_is_off_when_not_a_terminal(capsys):
    p = Pipeline(nodes=[add])
    p.map(inputs={"slow_a": [1, 2], "slow_b": 1}, map_over="slow_a")
    assert capsys.readouterr().err == ""


def test_hypernodes_compat_names():
    from hardy.compat import hypernodes as hn

    @hn.node(output_name="doubled")
    def dbl(x: int) -> int:
        return x * 2

    p = hn.Pipeline(nodes=[dbl], engine=hn.HypernodesEngine(node_executor="threaded", map_executor="threaded"))
    assert p.run(inputs={"x": 5}) == {"doubled": 10}
    assert p.map(inputs={"x": [1, 2]}, map_over="x") == [{"doubled": 2}, {"doubled": 4}]
    assert hn.SeqEngine().map_executor == "sequential"
    assert hn.HypernodesEngine(map_executor="parallel").map_executor == "process"
    assert issubclass(hn.CycleError, hn.HyperNodesError)
    try:
        hn.Pipeline(nodes=[dbl]).run(inputs={})
    except ValueError as exc:  # HyperNodes 0.4.8 raises ValueError("Missing required input(s): ...")
        assert str(exc).startswith("Missing required input(s): ['x']")
    else:
        raise AssertionError("missing input not reported")
    assert dbl.root_args == ("x",) and dbl.output_name == "doubled"
    assert hn.PipelineCallback is PipelineCallback and hn.CallbackContext().depth == 0  # one class, both names


def test_import_hardy_stays_light():
    import subprocess
    import sys
    code = ("import sys, hardy; heavy = {'rich', 'typer', 'asyncio', 'multiprocessing', 'cloudpickle', "
            "'concurrent.futures', 'numpy'} & set(sys.modules); print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    # nor does building a pipeline: what only a worker's call needs (shipping, cloudpickle) loads then
    code = ("import sys; from hardy import Pipeline, node; heavy = {'cloudpickle', 'ctypes', 'hardy.shipping', "
            "'multiprocessing', 'numpy'} & set(sys.modules); print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- property-based: random DAGs ------------------------------------------------------------------

@st.composite
def dags(draw):
    """A random DAG: node k may consume any earlier node's output and the root input 'x0'."""
    n = draw(st.integers(1, 8))
    deps = [draw(st.lists(st.sampled_from(["x0"] + [f"o{j}" for j in range(k)]), min_size=1, max_size=3,
                          unique=True)) for k in range(n)]
    order = draw(st.permutations(range(n)))
    return deps, order


def _make_nodes(deps, order, log):
    nodes = []
    for k in order:
        names = deps[k]

        def fn(*args, _k=k):
            log.append(_k)
            return _k + sum(args)
        src = f"def n{k}({', '.join(names)}):\n    return _fn({', '.join(names)})\n"
        ns = {"_fn": fn}
        exec(src, ns)
        nodes.append(Node(ns[f"n{k}"], f"o{k}"))
    return nodes


def _expected(deps, x0):
    vals = {"x0": x0}
    for k, names in enumerate(deps):
        vals[f"o{k}"] = k + sum(vals[n] for n in names)
    return {k: v for k, v in vals.items() if k != "x0"}


@settings(max_examples=60, deadline=None)
@given(dags(), st.integers(-5, 5))
def test_random_dags_run_in_dependency_order(dag, x0):
    deps, order = dag
    log = []
    p = Pipeline(nodes=_make_nodes(deps, order, log), engine=Engine(map_executor="sequential"))  # `log` is this process's list
    assert p.run(inputs={"x0": x0}) == _expected(deps, x0)
    done = set()
    for k in log:  # every node ran after everything it consumes
        assert all(d == "x0" or int(d[1:]) in done for d in deps[k])
        done.add(k)
    assert sorted(log) == list(range(len(deps)))


@pytest.mark.slow  # thirty generated graphs, each mapped in worker processes
@settings(max_examples=30, deadline=None)
@given(dags(), st.lists(st.integers(-5, 5), max_size=6))
def test_map_equals_list_of_runs(dag, xs):
    deps, order = dag
    p = Pipeline(nodes=_make_nodes(deps, order, []))
    assert p.map(inputs={"x0": xs}, map_over="x0") == [p.run(inputs={"x0": x}) for x in xs]
    threaded = Pipeline(nodes=_make_nodes(deps, order, []), engine=Engine(node_executor="threaded", workers=3))
    assert [threaded.run(inputs={"x0": x}) for x in xs] == [p.run(inputs={"x0": x}) for x in xs]

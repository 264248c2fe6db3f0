"""The same answer as your own process (docs/same-answer.md): each case of a worker computing
something other than the caller's own code, state or environment, as a user meets it. Real
scripts run with `python -` (no `__main__` guard), modules edited on disk, real worker processes,
real crashes; every answer is compared with the sequential executor's in the same script."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import needs_torch

SRC = str(Path(__file__).resolve().parent.parent / "src")

STEPS = """
from hardy import node

FACTOR = 10
STATE = {}

@node(output_name="y")
def transform(x):
    return x * FACTOR + STATE.get("add", 0)
"""


def script(tmp_path: Path, body: str, *args: str, edits: bool = False) -> list[str]:
    """Run `body` as a user's script (`python -`, the folder of its modules first on sys.path;
    `edits`: with `edit(old, new)`, which edits its steps.py); the lines it printed."""
    prelude = EDIT.format(folder=str(tmp_path)) if edits else ""
    source = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n{prelude}" + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-", *args], input=source, text=True, capture_output=True,
                         timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


EDIT = """
def edit(old, new):
    path = {folder!r} + "/steps.py"
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace(old, new))
"""


@pytest.mark.parametrize("cached", [False, True])
def test_the_nodes_own_module_reloaded_between_two_calls_on_one_engine(tmp_path, cached):
    """Case 1: the node's module edited and `importlib.reload`ed; the same engine (its workers
    imported the old file) runs the new code, for map and run, with and without a cache."""
    (tmp_path / "steps.py").write_text(STEPS)
    lines = script(tmp_path, edits=True, body=f"""
        import importlib
        import steps
        from hardy import DiskCache, Engine, Pipeline
        engine = Engine(map_executor="process", workers=2)
        cache = DiskCache({str(tmp_path / 'c')!r}) if {cached} else None
        first = Pipeline([steps.transform], engine=engine, cache=cache).map(inputs={{"x": [1, 2]}}, map_over="x")
        edit("x * FACTOR", "x + 100")
        importlib.reload(steps)
        p = Pipeline([steps.transform], engine=engine, cache=cache)
        here = Pipeline([steps.transform], engine=Engine(map_executor="sequential"))
        print(first, p.map(inputs={{"x": [1, 2]}}, map_over="x"), p.run(inputs={{"x": 4}}))
        print(first, here.map(inputs={{"x": [1, 2]}}, map_over="x"), here.run(inputs={{"x": 4}}))
    """)
    assert lines[0] == lines[1] == "[{'y': 10}, {'y': 20}] [{'y': 101}, {'y': 102}] {'y': 104}"


def test_an_edit_without_reload_never_mixes_two_versions_in_one_map(tmp_path):
    """Case 2: the file is edited but not reloaded, then a crash replaces a worker mid-map: the
    replacement imports the edited file, and is given the code the caller loaded, so every item
    but the crashed one gets the caller's answer."""
    (tmp_path / "steps.py").write_text(STEPS + textwrap.dedent("""
        import ctypes

        @node(output_name="z")
        def fragile(y):
            if y == 30:
                ctypes.string_at(0)
            return y + 1
    """))
    lines = script(tmp_path, edits=True, body="""
        import steps
        from hardy import Engine, Failed, Pipeline
        edit("x * FACTOR", "x + 100")
        edit("y + 1", "y + 1000")
        xs = [1, 2, 3, 4, 5, 6]
        out = Pipeline([steps.transform, steps.fragile], engine=Engine(workers=2)).map(
            inputs={"x": xs}, map_over="x", on_error="continue")
        here = Pipeline([steps.transform, steps.fragile], engine=Engine(map_executor="sequential"))
        print([type(r).__name__ if isinstance(r, Failed) else r["z"] for r in out])
        print([here.run(inputs={"x": x})["z"] if x != 3 else "Failed" for x in xs])
    """)
    assert lines[0] == lines[1] == "[11, 21, 'Failed', 41, 51, 61]"


def test_module_state_set_at_run_time_reaches_the_workers_and_the_cache(tmp_path):
    """Case 3: a module-level dict filled from sys.argv and an array set at run time, then one
    changed in place between two maps: the workers compute with the caller's values, and a
    cache keys and stores what the caller would compute."""
    (tmp_path / "weights.py").write_text(textwrap.dedent("""
        import numpy as np
        from hardy import node

        CONFIG = {}
        WEIGHTS = np.ones(3)

        @node(output_name="y")
        def scaled(x):
            return x * CONFIG.get("factor", 1)

        @node(output_name="z")
        def weighted(y):
            return float(WEIGHTS.sum()) * y
    """))
    lines = script(tmp_path, f"""
        import numpy as np
        import weights
        from hardy import DiskCache, Engine, Pipeline
        weights.CONFIG["factor"] = int(sys.argv[1])
        weights.WEIGHTS = np.full(3, 5.0)
        nodes = [weights.scaled, weights.weighted]
        for executor in ("process", "sequential"):
            p = Pipeline(nodes, engine=Engine(map_executor=executor), cache=DiskCache({str(tmp_path)!r} + "/" + executor))
            first = p.map(inputs={{"x": [1, 2]}}, map_over="x")
            weights.WEIGHTS[0] = 10.0
            second = p.map(inputs={{"x": [1, 2]}}, map_over="x")
            weights.WEIGHTS[0] = 5.0
            third = p.map(inputs={{"x": [1, 2]}}, map_over="x")  # back to the first state: the first entries
            print(first, second, third)
    """, "10")
    assert lines[0] == lines[1]
    assert lines[0] == ("[{'y': 10, 'z': 150.0}, {'y': 20, 'z': 300.0}] [{'y': 10, 'z': 200.0}, {'y': 20, 'z': 400.0}]"
                        " [{'y': 10, 'z': 150.0}, {'y': 20, 'z': 300.0}]")


def test_a_big_value_set_at_run_time_travels_when_a_worker_asks(tmp_path):
    """A value too big to travel with the plan is sent, through shared memory, to the workers
    whose own copy differs; written in place in the caller, it travels again."""
    (tmp_path / "big.py").write_text(textwrap.dedent("""
        from hardy import node
        WEIGHTS = None

        @node(output_name="z")
        def weigh(x):
            return float(WEIGHTS.sum()) * x
    """))
    lines = script(tmp_path, """
        import numpy as np
        import big
        from hardy import Engine, Pipeline
        from hardy.shipping.replica import SMALL
        big.WEIGHTS = np.full(SMALL, 5.0)  # eight times SMALL bytes
        for executor in ("process", "sequential"):
            p = Pipeline([big.weigh], engine=Engine(map_executor=executor, workers=2))
            first = p.map(inputs={"x": [1, 2, 3]}, map_over="x")
            big.WEIGHTS[:] = 1.0
            print(first, p.run(inputs={"x": 3}))
            big.WEIGHTS[:] = 5.0
    """)
    assert lines[0] == lines[1] == "[{'z': 327680.0}, {'z': 655360.0}, {'z': 983040.0}] {'z': 196608.0}"


def test_a_value_that_can_neither_be_compared_nor_sent_is_refused_by_name(tmp_path):
    """A lock set at run time where the module's import leaves None: no worker can hold the
    caller's, so the call is refused with one ReplicaError, before any node runs, naming the
    module and the name; on_error="continue" does not turn it into failed items."""
    (tmp_path / "guarded.py").write_text(textwrap.dedent("""
        from hardy import node
        LOCK = None
        RAN = []

        @node(output_name="y")
        def locked(x):
            RAN.append(x)
            with LOCK:
                return x
    """))
    lines = script(tmp_path, """
        import threading
        import guarded
        from hardy import Pipeline
        from hardy.errors import ReplicaError
        guarded.LOCK = threading.Lock()
        for call in (lambda p: p.map(inputs={"x": [1, 2]}, map_over="x", on_error="continue"),
                     lambda p: p.run(inputs={"x": 1})):
            try:
                call(Pipeline([guarded.locked]))
            except ReplicaError as exc:
                print(type(exc).__name__, "guarded.LOCK" in str(exc), "input" in str(exc))
    """)
    assert lines == ["ReplicaError True True"] * 2


def test_environment_working_directory_and_argv_follow_each_call_on_the_shared_pool(tmp_path):
    """Case 4: the default pool serves every pipeline of the process; variables set and removed,
    the working directory changed and argv extended between calls are what each call's nodes see."""
    for name in ("dA", "dB"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.txt").write_text(name[-1])
    lines = script(tmp_path, f"""
        import os
        from hardy import Engine, Pipeline, node

        @node(output_name="seen")
        def read(x):
            with open("f.txt") as f:
                return os.environ.get("MODE"), f.read(), sys.argv[-1], os.path.basename(os.getcwd())

        def calls():
            return [Pipeline([read]).map(inputs={{"x": [1]}}, map_over="x")[0]["seen"], Pipeline([read]).run(
                inputs={{"x": 1}})["seen"], Pipeline([read], engine=Engine(map_executor="sequential")).run(
                inputs={{"x": 1}})["seen"]]

        os.environ["MODE"] = "first"
        os.chdir({str(tmp_path / 'dA')!r})
        sys.argv.append("a1")
        print(calls())
        os.environ["MODE"] = "second"
        os.chdir({str(tmp_path / 'dB')!r})
        sys.argv.append("b1")
        print(calls())
        del os.environ["MODE"]
        print(calls())
    """)
    assert lines == ["[('first', 'A', 'a1', 'dA'), ('first', 'A', 'a1', 'dA'), ('first', 'A', 'a1', 'dA')]",
                     "[('second', 'B', 'b1', 'dB'), ('second', 'B', 'b1', 'dB'), ('second', 'B', 'b1', 'dB')]",
                     "[(None, 'B', 'b1', 'dB'), (None, 'B', 'b1', 'dB'), (None, 'B', 'b1', 'dB')]"]


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_a_script_nodes_own_process_pool_over_a_helper_of_the_script(tmp_path, context):
    """Case 5: a node hands a helper defined in the script (run as `python -`) to a process pool
    of its own; its answer is the sequential executor's, whatever the pool's start method (an
    in-process spawn pool of a `python -` script cannot even start, so fork stands in for it)."""
    lines = script(tmp_path, f"""
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        from hardy import Engine, Pipeline, node

        def square(v):
            return v * v

        @node(output_name="y")
        def pooled(x, method={context!r}):
            with mp.get_context(method).Pool(2) as pool:
                a = sum(pool.map(square, range(x)))
            with ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
                b = sum(ex.map(square, range(x)))
            return a + b

        print(Pipeline([pooled]).map(inputs={{"x": [3, 4]}}, map_over="x"))
        print(Pipeline([pooled], engine=Engine(map_executor="sequential")).map(
            inputs={{"x": [3, 4], "method": "fork"}}, map_over="x"))
    """)
    assert lines[0] == lines[1] == "[{'y': 10}, {'y': 28}]"


def test_an_isolated_node_follows_a_reload_on_an_in_process_executor(tmp_path):
    """`@node(isolate=True)` runs each call in a worker, also under the sequential executor: its
    one-node plan is checked for changes as a pipeline's is."""
    (tmp_path / "steps.py").write_text(STEPS.replace("@node(output_name=\"y\")", "@node(output_name=\"y\", isolate=True)"))
    lines = script(tmp_path, edits=True, body="""
        import importlib
        import steps
        from hardy import Engine, Pipeline
        engine = Engine(map_executor="sequential")
        first = Pipeline([steps.transform], engine=engine).run(inputs={"x": 1})
        steps.STATE["add"] = 5
        second = Pipeline([steps.transform], engine=engine).run(inputs={"x": 1})
        edit("x * FACTOR", "x + 100")
        importlib.reload(steps)
        print(first, second, Pipeline([steps.transform], engine=engine).run(inputs={"x": 1}))
    """)
    assert lines == ["{'y': 10} {'y': 15} {'y': 101}"]


def test_an_error_callback_that_cannot_be_sent_fails_with_the_fix_not_without_it(tmp_path):
    """`np.seterr(divide="call")` with an `np.seterrcall` function that does not pickle (it holds
    a lock): a worker cannot call it. Where numpy reaches for it, the node fails with a
    `ReplicaError` that names the callback and the fix (a worker had the mode without the
    function: numpy's own "no function found" on every item); an item that divides by nothing
    computes what it computes in the caller; once the callback pickles, it is the caller's."""
    lines = script(tmp_path, """
        import threading
        import numpy as np
        from hardy import Engine, Failed, Pipeline, node

        LOCK = threading.Lock()

        def guarded(kind, flag):
            with LOCK:
                raise FloatingPointError(f"guarded: {kind}")

        @node(output_name="y")
        def ratio(x):
            try:
                return float(np.float64(1) / np.float64(x))
            except FloatingPointError as exc:
                return str(exc)

        np.seterr(divide="call")
        np.seterrcall(guarded)
        engine = Engine(map_executor="process", workers=2)
        for name, e in (("sequential", Engine(map_executor="sequential")), ("process", engine)):
            out = Pipeline([ratio], engine=e).map(inputs={"x": [0, 2]}, map_over="x", on_error="continue")
            print(name, " | ".join(f"{type(o.error.__cause__ or o.error).__name__}: {o.error}"
                                   if isinstance(o, Failed) else str(o["y"]) for o in out))
        np.seterrcall(lambda kind, flag: (_ for _ in ()).throw(FloatingPointError(f"lambda: {kind}")))
        print("lambda", Pipeline([ratio], engine=engine).map(inputs={"x": [0, 2]}, map_over="x"))
        engine.close()
    """)
    assert lines[0] == "sequential guarded: divide by zero | 0.5"
    process = lines[1]
    assert process.startswith("process ReplicaError: node 'ratio' failed on item 0") and process.endswith(
        " | 0.5"), process
    for part in ("numpy's floating-point error callback in the calling process (guarded of __main__, set with "
                 "np.seterrcall and used by np.seterr's 'call' mode) cannot be sent to a worker",
                 "cannot pickle '_thread.lock' object", "set it inside the node", 'map_executor="sequential"'):
        assert part in process, (part, process)
    assert lines[2] == "lambda [{'y': 'lambda: divide by zero'}, {'y': 0.5}]"


LOCAL_DAYS = """
import datetime, os, sys, time
from hardy import DiskCache, Engine, Pipeline, node

COUNT = {count!r}
TS = [1700000000, 1700040000]

@node(output_name="day")
def local_day(ts):
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")

@node(output_name="doubled")
def double(ts):
    with open(COUNT, "a") as f:
        f.write("computed\\n")
    return 2 * ts

executor, zones = sys.argv[1], sys.argv[2:]
engine = Engine(workers=2) if executor == "default" else Engine(map_executor=executor, workers=2)
pipeline = Pipeline([local_day, double], engine=engine, cache=DiskCache({cache!r}))
for zone in zones:
    if zone != "as-started":
        os.environ["TZ"] = zone
        time.tzset()
    got = pipeline.map(inputs={{"ts": TS}}, map_over="ts")
    with open(COUNT) as f:
        computed = len(f.readlines())
    print(zone, [o["day"] for o in got] == [local_day.func(t) for t in TS], computed)
"""


@pytest.mark.parametrize("executor", ["sequential", "default"])
def test_a_cached_node_using_local_time_follows_the_zone_and_the_others_keep_their_entries(tmp_path, executor):
    """A node formatting `datetime.fromtimestamp(ts)` with a DiskCache served the UTC strings after
    `os.environ["TZ"] = "Asia/Tokyo"; time.tzset()`, and to a process started in another zone
    sharing the cache. It computes again in each zone; a node that never touches local time hits."""
    count = tmp_path / "count.txt"
    count.write_text("")
    body = LOCAL_DAYS.format(count=str(count), cache=str(tmp_path / "cache"))
    assert script(tmp_path, body, executor, "UTC", "Asia/Tokyo", "UTC") == [
        "UTC True 2", "Asia/Tokyo True 2", "UTC True 2"]
    source = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n" + textwrap.dedent(body)
    elsewhere = subprocess.run([sys.executable, "-", executor, "as-started"], input=source, text=True,
                               capture_output=True, timeout=60, cwd=tmp_path,
                               env={**os.environ, "PYTHONPATH": SRC, "TZ": "America/Sao_Paulo"})
    assert elsewhere.returncode == 0, elsewhere.stderr[-3000:]
    assert elsewhere.stdout.split() == ["as-started", "True", "2"]


THREAD_LOCAL_LIBRARIES = """
import numpy as np, sklearn, torch
from sklearn.preprocessing import StandardScaler
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="kind")
def scale(k):
    return type(StandardScaler().fit_transform(np.arange(6.0).reshape(3, 2) + k)).__name__

@node(output_name="device")
def make(k):
    return str(torch.zeros(2).device)

engines = {{name: Engine(map_executor=name, workers=2) for name in ("sequential", "threaded", "process")}}
cached = Pipeline([scale, make], engine=engines["process"], cache=DiskCache({cache!r}))

def show(label):
    direct = [(scale.func(k), make.func(k)) for k in (0, 1)]
    for name, engine in engines.items():
        got = Pipeline([scale, make], engine=engine).map(inputs={{"k": [0, 1]}}, map_over="k")
        print(label, name, [(o["kind"], o["device"]) for o in got] == direct, got[0]["kind"], got[0]["device"])
    got = cached.map(inputs={{"k": [0, 1]}}, map_over="k")
    print(label, "cached", [(o["kind"], o["device"]) for o in got] == direct)

show("defaults")
sklearn.set_config(transform_output="pandas")
torch.set_default_device("meta")
show("set")
sklearn.set_config(transform_output="default")
torch.set_default_device(None)
show("reset")
with sklearn.config_context(transform_output="pandas"), torch.device("meta"):
    show("within")
"""


@pytest.mark.slow  # torch and scikit-learn imported
def test_library_settings_kept_per_thread_reach_every_executor_and_the_cache_key(tmp_path):
    """`sklearn.set_config(transform_output="pandas")` and `torch.set_default_device("meta")` are
    kept per thread: the threaded executor's threads and the worker processes computed ndarrays and
    CPU tensors where the caller gets DataFrames and meta tensors. Every executor now computes the
    caller's, a thread of the pool that took them gives them back, and a cached result follows them."""
    needs_torch()
    pytest.importorskip("sklearn")
    lines = script(tmp_path, THREAD_LOCAL_LIBRARIES.format(cache=str(tmp_path / "cache")))
    assert [line for line in lines if " True" not in line] == [], lines
    assert "set threaded True DataFrame meta" in lines and "reset threaded True ndarray cpu" in lines


SENTINEL_STEPS = """
from hardy import node

MISSING = object()
DEFAULTS = {"lr": 0.1, "wd": MISSING}
WEIGHTS = []

class Settings:
    wd = MISSING

class Box:
    def __init__(self, **kw):
        self.__dict__.update(kw)

PARENT = Box(name="parent")
CHILD = Box(name="child", parent=PARENT)

def get(table, key, default=MISSING):
    v = table.get(key, default)
    if v is MISSING:
        return "unset"
    return v

@node(output_name="y")
def resolve(name):
    value = DEFAULTS[name]
    return ["unset" if value is MISSING else value, getattr(Settings, name) is MISSING,
            get({"lr": 0.1}, name), CHILD.parent.kids[0].name, len(WEIGHTS)]
"""


@pytest.mark.parametrize("big", [False, True])
def test_a_sentinel_held_by_module_state_that_travels_is_the_workers_own(tmp_path, big):
    """`MISSING = object()` held by a dict and a class attribute changed at run time, and by a
    function's default after an edit of its file without reload: the changed values travel by
    value, and `v is MISSING` must still hold in the worker (a copy of MISSING made the node return
    the raw object). Two objects that refer to each other keep their values. `big`: a value too big
    for the plan is set too, so the changed values travel when the worker asks, in one pickle."""
    (tmp_path / "steps.py").write_text(SENTINEL_STEPS)
    lines = script(tmp_path, edits=True, body=f"""
        import steps
        from hardy import Engine, Pipeline
        from hardy.shipping.replica import SMALL
        edit('return "unset"', 'return "<unset>"')
        steps.DEFAULTS["lr"] = 0.01
        steps.Settings.lr = 0.01
        steps.PARENT.kids = [steps.CHILD]
        if {big}:
            steps.WEIGHTS = list(range(SMALL))
        for engine in (Engine(workers=2), Engine(map_executor="sequential")):
            print(Pipeline([steps.resolve], engine=engine).map(inputs={{"name": ["lr", "wd"]}}, map_over="name"))
    """)
    n = 65536 if big else 0
    assert lines[0] == lines[1] == (f"[{{'y': [0.01, False, 0.1, 'child', {n}]}}, "
                                    f"{{'y': ['unset', True, 'unset', 'child', {n}]}}]")


def test_an_attribute_set_on_a_helper_with_a_sentinel_default_reaches_the_worker(tmp_path):
    """A helper's stamp hashed its defaults and attributes as one tuple, by the tuple's type once one
    part had no content (a sentinel `object()` default): `get.calls = 5` set at run time left the
    stamp as it was, and a worker computed with the import's `calls = 0`, silently."""
    (tmp_path / "lookup.py").write_text(textwrap.dedent("""
        from hardy import node
        MISSING = object()

        def get(table, key, default=MISSING):
            return table.get(key, get.calls)
        get.calls = 0

        @node(output_name="y")
        def resolve(x):
            return get({}, "wd") + x
    """))
    lines = script(tmp_path, """
        from hardy import Engine, Pipeline
        import lookup
        lookup.get.calls = 5
        for executor in ("sequential", "process"):
            print(executor, Pipeline([lookup.resolve], engine=Engine(map_executor=executor)).run(inputs={"x": 1}))
    """)
    assert lines == ["sequential {'y': 6}", "process {'y': 6}"]


def test_a_lock_a_node_reads_does_not_hide_the_modules_it_reads_after_it(tmp_path):
    """A node's globals are walked in name order; the walk stopped at the first that cannot be
    hashed (`_LOCK = threading.Lock()`), so `settings`, read after it, was never part of the
    replica: a worker computed with its import-time `CFG.lr` where the script had set 0.9."""
    (tmp_path / "settings.py").write_text("class CFG:\n    lr = 0.1\n")
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import threading
        import settings
        _LOCK = threading.Lock()

        def step(x):
            with _LOCK:
                return settings.CFG.lr * x
    """))
    lines = script(tmp_path, """
        from hardy import Engine, Pipeline, node
        import settings, train
        settings.CFG.lr = 0.9
        p = Pipeline([node(output_name="y")(train.step)])
        for executor in ("sequential", "process"):
            print(executor, p.run(inputs={"x": 2}, engine=Engine(map_executor=executor)))
    """)
    assert lines == ["sequential {'y': 1.8}", "process {'y': 1.8}"]


def test_a_dict_on_a_helper_that_holds_a_sentinel_is_seen_when_changed_in_place(tmp_path):
    """A function attribute that is a dict holding a sentinel was stamped and keyed as one value
    without content: `get.opts["k"] = 6` reached neither a worker (it computed with 5) nor the
    key (a cache served the entry made with 6 after `k` became 7)."""
    (tmp_path / "helpers.py").write_text(textwrap.dedent("""
        from hardy import node
        MISSING = object()

        def get(table, key):
            return table.get(key, get.opts["k"])
        get.opts = {"fallback": MISSING, "k": 5}

        @node(output_name="y")
        def step(x):
            return get({}, "wd") + x
    """))
    lines = script(tmp_path, """
        from hardy import DiskCache, Engine, Pipeline
        import helpers
        helpers.get.opts["k"] = 6
        for executor in ("sequential", "process"):
            print(executor, Pipeline([helpers.step], engine=Engine(map_executor=executor)).run(inputs={"x": 0}))
        cached = Pipeline([helpers.step], engine=Engine(cache=DiskCache("cache")))
        print("cached", cached.run(inputs={"x": 0}))
        helpers.get.opts["k"] = 7
        print("cached", cached.run(inputs={"x": 0}))
    """)
    assert lines == ["sequential {'y': 6}", "process {'y': 6}", "cached {'y': 6}", "cached {'y': 7}"]


WRAPPED_STEPS = """
import wrapt
from hardy import node

FACTOR = 2

@wrapt.decorator
def scaled(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * FACTOR

@scaled
def add_one(x):
    return x + 1

class Model:
    def __init__(self, k):
        self.k = k

    @scaled
    def predict(self, x):
        return x * self.k
"""


def test_a_proxy_posing_as_the_function_it_wraps_runs_whole_in_a_worker(tmp_path):
    """A wrapt decorator's wrapper poses as the function it wraps (`__class__`): cloudpickle sent
    the function alone, and a worker ran the node without its wrapper (3 where your process
    computes 6). It travels whole: a script's node, a module's, a bound method, a module's name
    rebound to another wrapper at run time, and a proxy of the script's own. One that cannot be
    pickled is refused before any node runs, naming the node and the fix."""
    pytest.importorskip("wrapt")
    (tmp_path / "wrapped.py").write_text(WRAPPED_STEPS)
    lines = script(tmp_path, f"""
        import os
        import wrapt
        import wrapped
        from hardy import Engine, Pipeline, node
        from hardy.errors import PicklingError

        @wrapped.scaled
        def minus_one(x):
            return x - 1

        class Traced:
            def __init__(self, func, k):
                self.func, self.k = func, k

            @property
            def __class__(self):
                return type(self.func)

            def __getattr__(self, name):
                return getattr(self.func, name)

            def __call__(self, *args, **kwargs):
                return self.func(*args, **kwargs) * self.k

        class Opaque(wrapt.ObjectProxy):
            def __call__(self, *args, **kwargs):
                return self.__wrapped__(*args, **kwargs) * 1000

        def reads_module(x):
            return wrapped.add_one(x)

        def plus(x):
            return x + 1

        def reads_opaque(x):
            open({str(tmp_path / "ran")!r}, "a").close()
            return OPAQUE(x)

        OPAQUE = Opaque(plus)
        nodes = [node(minus_one, output_name="y"), node(wrapped.add_one, output_name="y"),
                 node(wrapped.Model(3).predict, output_name="y"), node(Traced(plus, 100), output_name="y")]
        for executor in ("process", "sequential"):
            engine = Engine(map_executor=executor)
            got = [Pipeline([n], engine=engine).map(inputs={{"x": [1, 2]}}, map_over="x") for n in nodes]
            wrapped.add_one = wrapped.scaled(lambda x: x * 10)  # rebound at run time: installed in the workers
            got.append(Pipeline([node(reads_module, output_name="y")], engine=engine).run(inputs={{"x": 1}}))
            wrapped.add_one = vars(wrapped)["scaled"](lambda x: x + 1)
            print(got)
            try:
                print(Pipeline([node(reads_opaque, output_name="y")], engine=engine).run(inputs={{"x": 1}}))
            except PicklingError as exc:
                print(str(exc).split(":")[0], "__reduce__" in str(exc), "sequential" in str(exc),
                      os.path.exists({str(tmp_path / "ran")!r}))
    """)
    assert lines[0] == lines[2] == ("[[{'y': 0}, {'y': 2}], [{'y': 4}, {'y': 6}], [{'y': 6}, {'y': 12}], "
                                    "[{'y': 200}, {'y': 300}], {'y': 20}]")
    assert lines[1] == "node 'reads_opaque' cannot be sent to a worker process True True False"
    assert lines[3] == "{'y': 2000}"


def test_an_lru_cache_function_of_the_script_is_a_node_in_a_worker(tmp_path):
    """An `lru_cache` (or `functools.cache`) function of a script, used as a node, was sent by its
    name (`__main__.load_vocab`), which no worker has: the pipeline could not be loaded there. It
    travels as its function, with an empty cache of its own in each worker; a module's, rebound
    at run time, is the caller's there too."""
    (tmp_path / "tables.py").write_text("import functools\n\n@functools.cache\ndef table(n):\n    return n * 100\n")
    lines = script(tmp_path, """
        import functools
        import tables
        from hardy import Engine, Pipeline, node

        @functools.lru_cache(maxsize=None)
        def load_vocab(size):
            return list(range(size))

        @functools.cache
        def square(size):
            return size * size

        def reads_table(size):
            return tables.table(size)

        for executor in ("process", "sequential"):
            engine = Engine(map_executor=executor)
            got = [Pipeline([node(f, output_name="y")], engine=engine).map(inputs={"size": [1, 2]}, map_over="size")
                   for f in (load_vocab, square)]
            tables.table = functools.lru_cache(maxsize=4)(lambda n: n * 7)
            got.append(Pipeline([node(reads_table, output_name="y")], engine=engine).run(inputs={"size": 3}))
            tables.table = functools.cache(lambda n: n * 100)
            print(got)
    """)
    assert lines[0] == lines[1] == "[[{'y': [0]}, {'y': [0, 1]}], [{'y': 1}, {'y': 4}], {'y': 21}]"


def test_a_singledispatch_function_of_the_script_runs_in_a_worker_with_its_registrations(tmp_path):
    """A `functools.singledispatch` function of a script (or a notebook), read by a node or used as
    one, stopped the default executor: by value, its closure held its dispatch cache, which does
    not pickle. It travels as its function and registrations, one added between two maps too."""
    lines = script(tmp_path, """
        import functools
        from hardy import Engine, Pipeline, node

        @functools.singledispatch
        def convert(v):
            return "base"

        @convert.register
        def _(v: int):
            return f"int{v}"

        def reads(v):
            return convert(v)

        for executor in ("process", "sequential"):
            engine = Engine(map_executor=executor)
            got = [Pipeline([node(f, output_name="y")], engine=engine).map(inputs={"v": [1, "a"]}, map_over="v")
                   for f in (reads, convert)]
            convert.register(str, lambda v: f"str{v}")
            got.append(Pipeline([node(reads, output_name="y")], engine=engine).map(inputs={"v": [1, "a"]},
                                                                                  map_over="v"))
            print(got)
            convert = functools.singledispatch(convert.__wrapped__)  # (a registration cannot be taken back)
            convert.register(int, lambda v: f"int{v}")
    """)
    assert lines[0] == lines[1] == ("[[{'y': 'int1'}, {'y': 'base'}], [{'y': 'int1'}, {'y': 'base'}], "
                                    "[{'y': 'int1'}, {'y': 'stra'}]]")


def test_an_enum_members_attribute_set_at_run_time_reaches_the_workers(tmp_path):
    """An attribute set on an Enum member at the top of a script (`Unit.KG.scale = 2`) was
    missing in the workers (AttributeError): cloudpickle rebuilds a script's Enum from its
    members' values alone. It travels, changed between two maps of one pipeline too; an
    importable module's Enum keeps its members, which other modules hold (`DEFAULT is Unit.KG`)."""
    (tmp_path / "units.py").write_text("import enum\n\nclass Unit(enum.Enum):\n    KG = 1\n    G = 2\n")
    (tmp_path / "defaults.py").write_text("from units import Unit\n\nDEFAULT = Unit.KG\n")
    lines = script(tmp_path, """
        import enum
        import defaults
        import units
        from hardy import Engine, Pipeline, node

        class Grade(enum.Enum):
            LOW = 1
            HIGH = 2

        Grade.HIGH.weight = 3
        units.Unit.KG.scale = 1000

        def graded(x):
            return [x * Grade.HIGH.weight, Grade(2) is Grade.HIGH, getattr(Grade.LOW, "weight", None)]

        def grams(x):
            return [x * units.Unit.KG.scale, defaults.DEFAULT is units.Unit.KG, defaults.DEFAULT.scale]

        for executor in ("process", "sequential"):
            pipeline = Pipeline([node(graded, output_name="y"), node(grams, output_name="g")],
                                engine=Engine(map_executor=executor))
            first = pipeline.run(inputs={"x": 2})
            Grade.HIGH.weight, Grade.LOW.weight, units.Unit.KG.scale = 5, 1, 10
            print(first, pipeline.run(inputs={"x": 2}))
            Grade.HIGH.weight, units.Unit.KG.scale = 3, 1000
            del Grade.LOW.weight
    """)
    assert lines[0] == lines[1] == ("{'y': [6, True, None], 'g': [2000, True, 1000]} "
                                    "{'y': [10, True, 1], 'g': [20, True, 10]}")


def test_a_name_put_into_builtins_reaches_the_workers_or_is_refused(tmp_path):
    """A name the script puts into `builtins` (`builtins.THRESHOLD = 0.5`, a notebook's "global
    config"), read by a node as a name or as `builtins.THRESHOLD`: a worker raised NameError (or
    AttributeError, or kept what an earlier call installed) where your process computes. It travels
    (rebound, changed in place or deleted between two calls of one pipeline too); one that does
    not pickle (a lock) is refused before any node runs, naming it."""
    lines = script(tmp_path, f"""
        import builtins
        import os
        import threading
        from hardy import Engine, Pipeline, node
        from hardy.errors import ReplicaError

        def flag(x):
            try:
                extra = EXTRA
            except NameError:
                extra = None
            import builtins as b  # (read as the module's attributes too, here and at the top)
            return [x > THRESHOLD, CONFIG["label"], extra, builtins.THRESHOLD, b.CONFIG["label"]]

        def guarded(x):
            open({str(tmp_path / "ran")!r}, "a").close()
            with GUARD:
                return x

        for executor in ("process", "sequential"):
            builtins.THRESHOLD, builtins.CONFIG, builtins.EXTRA = 0.5, {{"label": "a"}}, 1
            pipeline = Pipeline([node(flag, output_name="y")], engine=Engine(map_executor=executor))
            got = [pipeline.map(inputs={{"x": [0.7]}}, map_over="x")]
            builtins.THRESHOLD = 0.9
            builtins.CONFIG["label"] = "b"
            del builtins.EXTRA
            got.append(pipeline.map(inputs={{"x": [0.7]}}, map_over="x"))
            builtins.GUARD = threading.Lock()
            try:
                got.append(Pipeline([node(guarded, output_name="y")], engine=Engine(map_executor=executor)).run(
                    inputs={{"x": 1}}))
            except ReplicaError as exc:
                got.append(["builtins.GUARD" in str(exc), os.path.exists({str(tmp_path / "ran")!r})])
            print(got)
    """)
    assert lines[0] == "[[{'y': [True, 'a', 1, 0.5, 'a']}], [{'y': [False, 'b', None, 0.9, 'b']}], [True, False]]"
    assert lines[1] == "[[{'y': [True, 'a', 1, 0.5, 'a']}], [{'y': [False, 'b', None, 0.9, 'b']}], {'y': 1}]"


def test_an_instance_of_a_slotted_class_of_the_script_comes_back_from_a_worker(tmp_path):
    """A node returning an instance of a script's class with `__slots__` (`@dataclass(slots=True)`,
    a `__slots__` tuple) failed on every worker: cloudpickle made the class anew without its slots,
    its instances held a `__dict__`, and the caller's own class, slotted, could not take that state
    ("its result was computed but cannot be unpickled"). The class is made with its slots."""
    lines = script(tmp_path, """
        import dataclasses
        from hardy import Engine, Pipeline, node

        @dataclasses.dataclass(slots=True)
        class Config:
            value: int = 1

        class Point:
            __slots__ = ("x", "y")

            def __init__(self, x, y):
                self.x, self.y = x, y

        @node(output_name="made")
        def make(v):
            return Config(v), Point(v, -v), hasattr(Config(v), "__dict__")

        for executor in ("process", "sequential"):
            [out] = Pipeline([make], engine=Engine(map_executor=executor, workers=1)).map(inputs={"v": [3]},
                                                                                          map_over="v")
            config, point, has_dict = out["made"]
            print(executor, config, type(config) is Config, (point.x, point.y), type(point) is Point, has_dict)
    """)
    assert lines == [f"{e} Config(value=3) True (3, -3) True False" for e in ("process", "sequential")]


def test_a_wrapt_decorator_class_of_the_script_is_refused_saying_where_to_put_it(tmp_path):
    """wrapt's decorator as a class instance (`@wrapt.decorator def __call__(self, ...)`) defined in
    the script holds wrapt's own adapter, which cannot be sent: it was refused with advice no user
    can follow ("give its class a __reduce__": the class is wrapt's). The refusal, before any node
    runs, says where the decorator works (a module the script imports) and the in-process way."""
    pytest.importorskip("wrapt")
    lines = script(tmp_path, f"""
        import os
        import wrapt
        from hardy import Engine, Pipeline, node
        from hardy.errors import PicklingError

        class Scale:
            def __init__(self, k):
                self.k = k

            @wrapt.decorator
            def __call__(self, wrapped, instance, args, kwargs):
                open({str(tmp_path / "ran")!r}, "a").close()
                return wrapped(*args, **kwargs) * self.k

        @Scale(7)
        def seven_times(x):
            return x

        print(Pipeline([node(seven_times, output_name="y")], engine=Engine(map_executor="sequential")).run(
            inputs={{"x": 2}}))
        os.remove({str(tmp_path / "ran")!r})
        try:
            Pipeline([node(seven_times, output_name="y")]).run(inputs={{"x": 2}})
        except PicklingError as exc:
            print("module your script imports" in str(exc), "__reduce__" in str(exc), "sequential" in str(exc),
                  os.path.exists({str(tmp_path / "ran")!r}))
    """)
    assert lines == ["{'y': 14}", "True False True False"]

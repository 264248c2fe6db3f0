"""Maps on real distributed engines, on loopback: Dask (LocalCluster, and a scheduler and worker
started from the command line) and a local Ray instance. Every cluster is torn down by process id."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest

import hardy
from conftest import Unloadable
from hardy import DiskCache, Engine, Failed, NodeCrashed, Pipeline, node, stateful
from hardy.errors import PicklingError, ShippingError, WorkerImportError

IN_PROCESS = Engine(map_executor="sequential")  # the cache's counters and the reference results, here

pytest.importorskip("distributed")
pytest.importorskip("ray")

from hardy.integrations.dask import DaskExecutor  # noqa: E402
from hardy.integrations.ray import RayExecutor  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # Dask, Ray and Daft clusters on loopback
HARDY_ROOT = os.path.dirname(os.path.dirname(hardy.__file__))  # hardy itself is installed on every worker


@node(output_name="a")
def add_one(x: int) -> int:
    return x + 1


@node(output_name="b")
def double_or_crash(a: int) -> int:
    if a == 8:  # item 7
        os.kill(os.getpid(), signal.SIGSEGV)
    return 2 * a


@node(output_name="c")
def total(a: int, b: int) -> int:
    return a + b


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


INSTALLED = """
import os, signal
from hardy import node

@node(output_name="y")
def cube_or_crash(x: int) -> int:
    if x == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    return x ** 3
"""


@pytest.fixture(scope="module")
def installed_dir(tmp_path_factory):
    """A module installed on the command-line worker (its PYTHONPATH), not in this process."""
    folder = tmp_path_factory.mktemp("site")
    (folder / "hardy_installed_mod.py").write_text(INSTALLED)
    return folder


@pytest.fixture(scope="module")
def dask_cli(tmp_path_factory, installed_dir):
    """`dask scheduler` + `dask worker` from the command line: the same transport as a real cluster,
    and a worker that does not share this process's sys.path."""
    port = _free_port()
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
    bin_dir = os.path.dirname(sys.executable)
    dask = os.path.join(bin_dir, "dask") if os.path.exists(os.path.join(bin_dir, "dask")) else "dask"
    sched = subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
                              "--dashboard-address", "127.0.0.1:0"],
                             env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([dask, "worker", f"tcp://127.0.0.1:{port}", "--nworkers", "2", "--nthreads", "1",
                               "--no-dashboard", "--host", "127.0.0.1"],
                              env={**env, "PYTHONPATH": os.pathsep.join([str(installed_dir), HARDY_ROOT])},
                              start_new_session=True,
                              cwd=str(tmp_path_factory.mktemp("worker-cwd")),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from distributed import Client
    client = Client(f"tcp://127.0.0.1:{port}", timeout="30s")
    client.wait_for_workers(2, timeout=60)
    yield client
    client.close()
    for p in (worker, sched):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


@pytest.fixture(scope="module")
def executors(dask_cli):
    # The command-line worker does not see this test directory: this module's nodes travel by value.
    made = {"dask-local": DaskExecutor(workers=2), "dask-cli": DaskExecutor(dask_cli, ship_modules=[__name__]),
            "ray": RayExecutor(workers=2)}
    yield made
    for ex in made.values():
        ex.close()


ENGINES = ["dask-local", "dask-cli", "ray"]


@pytest.mark.parametrize("name", ENGINES)
def test_same_results_and_one_crash_costs_one_item(name, executors):
    p = Pipeline(nodes=[add_one, double_or_crash, total], engine=Engine(map_executor=executors[name], report=True))
    out = p.map(inputs={"x": list(range(20))}, map_over="x", on_error="continue")
    workers = p.report().to_dict()["workers"]  # hardy's worker processes on the engine's workers
    assert workers["died"] == 1 and workers["started"] >= 1 and workers["peak_rss"], workers
    local = Pipeline(nodes=[add_one, double_or_crash, total], engine=IN_PROCESS)
    expected = [local.run(inputs={"x": x}) for x in range(20) if x != 7]
    assert [o for i, o in enumerate(out) if i != 7] == expected
    err = out[7].error
    assert isinstance(out[7], Failed) and isinstance(err, NodeCrashed)
    assert err.node == "double_or_crash" and err.item == 7 and "died" in str(err)
    # the engine keeps working
    assert [o["c"] for o in p.map(inputs={"x": [1, 2]}, map_over="x")] == [6, 9]


@pytest.mark.parametrize("name", ENGINES)
def test_per_item_errors_and_unpicklable_inputs(name, executors):
    @node(output_name="y")
    def inverse(x, lock=None):
        return 1 / x

    p = Pipeline(nodes=[inverse], engine=Engine(map_executor=executors[name]))
    out = p.map(inputs={"x": [1, 0, 2]}, map_over="x", on_error="continue")
    assert out[0] == {"y": 1.0} and out[2] == {"y": 0.5}
    assert isinstance(out[1].error.__cause__, ZeroDivisionError) and out[1].error.item == 1
    with pytest.raises(PicklingError, match="input 'lock' \\(_thread.lock, given to every item\\)"):
        p.map(inputs={"x": [1], "lock": threading.Lock()}, map_over="x")


def _divide(x: int) -> float:
    scale = 1
    return scale / x


@node(output_name="y")
def inverse_via_helper(x: int) -> float:
    return _divide(x) * 2


def _traceback_of_item_1(engine: Engine) -> str:
    import traceback
    out = Pipeline([inverse_via_helper], engine=engine).map(inputs={"x": [1, 0]}, map_over="x", on_error="continue")
    return "".join(traceback.format_exception(out[1].error.__cause__))


@pytest.mark.parametrize("name", ENGINES)
def test_a_remote_exception_has_the_workers_frames_as_in_process(name, executors):
    """The worker's frames travel with its exception: the same text as in this process."""
    here = _traceback_of_item_1(IN_PROCESS)
    assert "in _divide\n    scale = 1\n" not in here and "in _divide\n    return scale / x\n" in here
    assert _traceback_of_item_1(Engine(map_executor=executors[name])) == here


def test_daft_engine_a_remote_exception_has_the_workers_frames_as_in_process():
    pytest.importorskip("daft")
    from hardy.integrations.daft import daft_engine
    assert _traceback_of_item_1(daft_engine()) == _traceback_of_item_1(IN_PROCESS)


class SegfaultsWhenUnpickled:
    def __reduce__(self):
        import ctypes
        return ctypes.string_at, (0,)  # a null-pointer read wherever it is unpickled


@node(output_name="y")
def plus_one(x):
    return x + 1


@pytest.mark.parametrize("name", ENGINES)
def test_a_poison_input_costs_its_item(name, executors):
    items: list = list(range(12))
    items[3], items[5], items[9] = threading.Lock(), Unloadable(), SegfaultsWhenUnpickled()
    out = Pipeline(nodes=[plus_one], engine=Engine(map_executor=executors[name])).map(
        inputs={"x": items}, map_over="x", on_error="continue")
    assert [o for i, o in enumerate(out) if i not in (3, 5, 9)] == [{"y": x + 1} for x in range(12) if x not in (3, 5, 9)]
    lock, unloadable, crash = out[3].error, out[5].error, out[9].error
    assert isinstance(lock, ShippingError) and lock.item == 3 and "input 'x' (_thread.lock)" in str(lock)
    assert isinstance(unloadable, ShippingError) and unloadable.item == 5 and unloadable.node == "plus_one"
    assert "conftest._refuse_outside" in str(unloadable)  # the type, as its pickle names it
    # the caller's sys.path travels (docs/same-answer.md): even the command-line worker imports the
    # test's conftest, and unpickling the object there raises
    assert "this object only exists" in str(unloadable)
    assert isinstance(crash, NodeCrashed) and crash.item == 9 and crash.signal == "SIGSEGV"
    assert "while unpickling its input" in str(crash) and "preload" not in str(crash)


def test_daft_engine_a_poison_input_costs_its_item():
    pytest.importorskip("daft")
    from hardy.integrations.daft import daft_engine
    items: list = list(range(12))
    items[3], items[5], items[9] = threading.Lock(), Unloadable(), SegfaultsWhenUnpickled()
    out = Pipeline(nodes=[plus_one], engine=daft_engine()).map(inputs={"x": items}, map_over="x", on_error="continue")
    assert [o for i, o in enumerate(out) if i not in (3, 5, 9)] == [{"y": x + 1} for x in range(12) if x not in (3, 5, 9)]
    assert isinstance(out[3].error, ShippingError) and "input 'x' (_thread.lock)" in str(out[3].error)
    assert isinstance(out[5].error, ShippingError) and "conftest._refuse_outside" in str(out[5].error)
    assert isinstance(out[9].error, NodeCrashed) and "while unpickling its input" in str(out[9].error)


NO_MAIN_GUARD = """
from hardy import Engine, Pipeline, node
from hardy.integrations.dask import DaskExecutor

@node(output_name="y")
def double(x):
    return 2 * x

with Engine(map_executor=DaskExecutor(workers=2)) as engine:
    print([o["y"] for o in Pipeline(nodes=[double], engine=engine).map(inputs={"x": [1, 2, 3]}, map_over="x")])
"""


def test_dask_executor_in_a_script_without_a_main_guard(tmp_path):
    done = subprocess.run([sys.executable, "-"], input=NO_MAIN_GUARD, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": HARDY_ROOT, "TMPDIR": str(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[2, 4, 6]"


def test_cache_filled_on_one_engine_is_hit_on_another(executors, tmp_path):
    calls = tmp_path / "calls"

    @node(output_name="sq")
    def square(x, log):
        with open(log, "a") as f:
            f.write("x\n")
        return x * x

    cache = DiskCache(tmp_path / "c")
    xs = list(range(40))
    inputs = {"x": xs, "log": str(calls)}
    Pipeline(nodes=[square], cache=cache, engine=Engine(map_executor=executors["dask-local"])).map(
        inputs=inputs, map_over="x")
    assert len(calls.read_text().split()) == 40  # written by the Dask workers as items finished
    for other in (Engine(map_executor=executors["ray"]), Engine(map_executor="process", workers=2), Engine()):
        with other:
            out = Pipeline(nodes=[square], cache=cache, engine=other).map(inputs=inputs, map_over="x")
        assert [o["sq"] for o in out] == [x * x for x in xs]
    assert len(calls.read_text().split()) == 40  # every other engine hit the cache


def test_shared_file_store_across_engines(executors, tmp_path):
    cache = DiskCache(tmp_path / "shared", store="files")
    p = Pipeline(nodes=[add_one], cache=cache, engine=Engine(map_executor=executors["ray"]))
    p.map(inputs={"x": list(range(30))}, map_over="x")
    again = DiskCache(tmp_path / "shared", store="files")
    Pipeline(nodes=[add_one], cache=again, engine=IN_PROCESS).map(inputs={"x": list(range(30))}, map_over="x")
    assert again.hits == 30 and again.misses == 0


MODULE = """
from hardy import node

def loud(text: str) -> str:  # a plain module function: pickled by reference, imported by the worker
    return text.upper() + "!"

@node(output_name="shouted")
def shout(text: str) -> str:
    return loud(text)
"""


def test_a_module_the_workers_cannot_reach_is_rebuilt_there(dask_cli, tmp_path, monkeypatch):
    """The command-line worker has its own sys.path: the caller's entries travel where they exist
    there, and a module whose file is gone is rebuilt from the caller's objects (docs/same-answer.md),
    so the map gives the caller's answer without `ship_modules=`."""
    folder = tmp_path / "only_here"
    folder.mkdir()
    (folder / "hardy_cli_only_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(folder))
    import hardy_cli_only_mod as mod
    shutil.rmtree(folder)  # nowhere for the worker to import it from
    p = Pipeline(nodes=[mod.shout], engine=Engine(map_executor=DaskExecutor(dask_cli)))
    assert p.map(inputs={"text": ["a", "b"]}, map_over="text") == [{"shouted": "A!"}, {"shouted": "B!"}]


def test_a_library_the_workers_cannot_import_is_named_with_the_fix(dask_cli, tmp_path, monkeypatch):
    """A library only the caller has (here: gone from disk since it was imported): the worker
    cannot make the node's module hold it, and the map fails naming the module and the fix."""
    site = tmp_path / "site-packages"  # a library's folder: not user code, not rebuilt
    site.mkdir()
    (site / "hardy_only_here_lib.py").write_text("def loud(text):\n    return text.upper()\n")
    (tmp_path / "hardy_uses_lib.py").write_text(
        "import hardy_only_here_lib\nfrom hardy import node\n\n@node(output_name='shouted')\n"
        "def shout(text):\n    return hardy_only_here_lib.loud(text)\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(tmp_path))
    import hardy_uses_lib as mod
    shutil.rmtree(site)
    p = Pipeline(nodes=[mod.shout], engine=Engine(map_executor=DaskExecutor(dask_cli)))
    with pytest.raises(WorkerImportError, match=r"hardy_only_here_lib.*ship_modules="):
        p.map(inputs={"text": ["a", "b"]}, map_over="text")


def test_cli_worker_imports_code_installed_there(dask_cli, installed_dir, monkeypatch):
    """The pipeline's module travels by reference and the worker imports its own installed copy."""
    monkeypatch.syspath_prepend(str(installed_dir))
    import hardy_installed_mod as mod
    p = Pipeline(nodes=[mod.cube_or_crash], engine=Engine(map_executor=DaskExecutor(dask_cli)))
    out = p.map(inputs={"x": list(range(8))}, map_over="x", on_error="continue")
    assert [o["y"] for i, o in enumerate(out) if i != 3] == [x ** 3 for x in range(8) if x != 3]
    assert out[3].error.node == "cube_or_crash" and out[3].error.item == 3


def test_items_travel_in_chunks_not_one_task_each(executors):
    """Counted in Dask's task stream (Dask and Ray share the chunking code); the items/s it buys
    are measured in bench/engines.py."""
    from distributed import get_task_stream

    xs = list(range(10_000))
    executor = executors["dask-local"]
    p = Pipeline(nodes=[add_one, total.__class__(lambda a: a, "same")], engine=Engine(map_executor=executor))
    p.map(inputs={"x": xs[:10]}, map_over="x")  # the executor connects on its first map
    with get_task_stream(executor.client) as stream:
        out = p.map(inputs={"x": xs}, map_over="x")
    assert len(out) == 10_000 and out[-1] == {"a": 10_000, "same": 10_000}
    chunks = [t for t in stream.data if "run_chunk_remote" in str(t["key"])]
    assert 1 < len(chunks) <= 64


def test_daft_engine_per_item_errors_crashes_and_shared_cache(tmp_path):
    pytest.importorskip("daft")
    from hardy.integrations.daft import daft_engine

    @node(output_name=("b", "half"))
    def split(a):
        if a == 4:
            raise ValueError("four")
        return 2 * a, a / 2

    cache = DiskCache(tmp_path / "c")
    p = Pipeline(nodes=[add_one, split, double_or_crash.__class__(lambda b: b + 1, "c")], engine=daft_engine(),
                 cache=cache)
    crashy = Pipeline(nodes=[add_one, double_or_crash, total], engine=daft_engine())
    out = crashy.map(inputs={"x": list(range(10))}, map_over="x", on_error="continue")
    local = Pipeline(nodes=[add_one, double_or_crash, total], engine=IN_PROCESS)
    assert [o for i, o in enumerate(out) if i != 7] == [local.run(inputs={"x": x}) for x in range(10) if x != 7]
    assert isinstance(out[7].error, NodeCrashed) and out[7].error.node == "double_or_crash" and out[7].error.item == 7
    assert out[7].error.signal == "SIGSEGV" and "test_distributed.py" in out[7].error.stack, out[7].error
    from daft.runners import get_or_infer_runner_type
    assert get_or_infer_runner_type() == "native"  # even when this process has started Ray (earlier tests)
    assert "in double_or_crash" in out[7].error.stack and "daft" not in out[7].error.stack
    out = p.map(inputs={"x": list(range(6))}, map_over="x", on_error="continue")
    assert isinstance(out[3], Failed) and out[3].error.node == "split" and out[3].error.item == 3
    assert out[5] == {"a": 6, "b": 12, "half": 3.0, "c": 13}
    # the cache Daft filled serves the sequential engine, key for key
    seq_cache = DiskCache(tmp_path / "c")
    again = Pipeline(nodes=p.nodes, cache=seq_cache, engine=IN_PROCESS).map(inputs={"x": list(range(6))}, map_over="x",
                                                          on_error="continue")
    assert [o for i, o in enumerate(again) if i != 3] == [o for i, o in enumerate(out) if i != 3]
    assert seq_cache.hits == 5 * 3 + 1  # every node of every good item, and item 3's add_one
    @node(output_name="y")
    def use_lock(x, lock):
        return x

    with pytest.raises(PicklingError, match="input 'lock'"):
        Pipeline(nodes=[use_lock], engine=daft_engine()).map(inputs={"x": [1], "lock": threading.Lock()},
                                                            map_over="x")


@stateful
class Model:
    """Records each construction, with the process that made it."""

    def __init__(self, log: str):
        self.pid = os.getpid()
        with open(log, "a") as f:
            f.write(f"{self.pid}\n")


@node(output_name="pid")
def built_by(x: int, model) -> int:
    return model.pid


def test_daft_engine_builds_stateful_resources_once_per_udf_process(tmp_path):
    """@stateful resources are the UDF class's state: built in its constructor, once per Daft
    worker process, never in the driver."""
    pytest.importorskip("daft")
    from hardy.integrations.daft import daft_engine
    log = tmp_path / "built.txt"
    p = Pipeline(nodes=[built_by], engine=daft_engine())
    out = p.map(inputs={"x": list(range(2000)), "model": Model(str(log))}, map_over="x")
    built = [int(b) for b in log.read_text().split()]
    assert {o["pid"] for o in out} <= set(built)  # every process that ran items had built it,
    assert len(built) == len(set(built)) and os.getpid() not in built  # once, and never the driver


@node(output_name=("b", "b_pid"))
def double_where(a: int, model) -> tuple:
    if a == 8:  # item 7
        os.kill(os.getpid(), signal.SIGSEGV)
    return 2 * a, model.pid


@node(output_name="a_pid")
def where_a(a: int) -> int:
    return os.getpid()


def test_daft_engine_gives_a_node_its_own_udf(tmp_path):
    """node_resources cuts the plan into stages, one UDF each: the same results, crash isolation
    and cache keys as the whole plan in one place; a resource is built only where it is used."""
    pytest.importorskip("daft")
    from hardy.integrations.daft import daft_engine
    log = tmp_path / "built.txt"
    nodes = [add_one, where_a, double_where, total]
    cache = DiskCache(tmp_path / "c")
    engine = daft_engine(node_resources={"double_where": {"max_concurrency": 1}})
    inputs = {"x": list(range(12)), "model": Model(str(log))}
    out = Pipeline(nodes=nodes, engine=engine, cache=cache).map(inputs=inputs, map_over="x", on_error="continue")
    err = out[7].error
    assert isinstance(err, NodeCrashed) and err.node == "double_where" and err.item == 7 and err.signal == "SIGSEGV"
    good = [o for i, o in enumerate(out) if i != 7]
    assert [o["c"] for o in good] == [3 * (x + 1) for x in range(12) if x != 7]
    built = {int(b) for b in log.read_text().split()}
    assert {o["b_pid"] for o in good} <= built and not {o["a_pid"] for o in good} & built
    seq = DiskCache(tmp_path / "c")  # every node of every good item is hit, key for key
    Pipeline(nodes=nodes, cache=seq, engine=IN_PROCESS).map(inputs={**inputs, "x": [x for x in range(12) if x != 7]}, map_over="x")
    assert (seq.hits, seq.misses) == (11 * 4, 0)
    with pytest.raises(ValueError, match="did you mean 'double_where'"):
        Pipeline(nodes=nodes, engine=daft_engine(node_resources={"double_wher": {"gpus": 1}})).map(
            inputs=inputs, map_over="x")
    with pytest.raises(ValueError, match="unknown option 'gpu'"):
        daft_engine(node_resources={"double_where": {"gpu": 1}})


@node(output_name="pid")
def slow_pid(x: int) -> int:
    time.sleep(0.02)
    return os.getpid()


def test_daft_engine_spreads_a_small_map_over_its_processes():
    """Even 64 items become several rows, so Daft's UDF processes share them."""
    pytest.importorskip("daft")
    from hardy.integrations.daft import daft_engine
    out = Pipeline(nodes=[slow_pid], engine=daft_engine(max_concurrency=2)).map(inputs={"x": list(range(64))},
                                                                               map_over="x")
    assert len({o["pid"] for o in out}) == 2


RAY_DRIVER = """
import os, signal, sys
from hardy import Engine, Failed, Pipeline, node
from hardy.integrations.ray import RayExecutor

@node(output_name="where")
def where(x):
    if x == 5:
        os.kill(os.getpid(), signal.SIGSEGV)
    import ray
    return ray.get_runtime_context().get_node_id(), x * 2

ex = RayExecutor(sys.argv[1])
with Engine(map_executor=ex) as e:
    out = Pipeline(nodes=[where], engine=e).map(inputs={"x": list(range(40))}, map_over="x", on_error="continue")
ex.close()
good = [o for o in out if not isinstance(o, Failed)]
print(len({o["where"][0] for o in good}), [i for i, o in enumerate(out) if isinstance(o, Failed)],
      out[5].error.node, [o["where"][1] for o in good] == [2 * x for x in range(40) if x != 5])
"""


@pytest.mark.slow
def test_two_node_ray_cluster_on_loopback(tmp_path):
    """A head on 127.0.0.2 and a worker node on 127.0.0.3: items run on both nodes, a crash costs one."""
    psutil = pytest.importorskip("psutil")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    import tempfile
    temp = tempfile.mkdtemp(prefix="hr", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "hardy-test-token-0123456789abcdef",
           "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        subprocess.run([ray_cli, "start", "--head", "--node-ip-address=127.0.0.2", f"--port={port}", "--num-cpus=1",
                        "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
                       env=env, check=True, capture_output=True, timeout=120)
        subprocess.run([ray_cli, "start", f"--address=127.0.0.2:{port}", "--node-ip-address=127.0.0.3",
                        "--num-cpus=1"], env=env, check=True, capture_output=True, timeout=120)
        run = subprocess.run([sys.executable, "-c", RAY_DRIVER, f"127.0.0.2:{port}"], env=env, capture_output=True,
                             text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip().splitlines()[-1] == "2 [5] where True"
    finally:  # tear the cluster down by process id: everything started for this temp dir
        doomed = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(str(temp) in a for a in (p.info["cmdline"] or [])):
                    doomed += [p, *p.children(recursive=True)]
            except psutil.Error:
                pass
        for p in doomed:
            try:
                p.kill()
            except psutil.Error:
                pass
        import shutil
        shutil.rmtree(temp, ignore_errors=True)


DAFT_ON_RAY = """
import os, signal
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
import ray
ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
from hardy import Failed, Pipeline, node
from hardy.integrations.daft import daft_engine

@node(output_name="y")
def f(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    return x * 2

@node(output_name="z")
def inc(y):
    return y + 1

out = Pipeline(nodes=[f], engine=daft_engine(address="auto")).map(inputs={"x": list(range(6))}, map_over="x",
                                                                 on_error="continue")
print([o["y"] if not isinstance(o, Failed) else (o.error.node, o.error.item) for o in out])
staged = daft_engine(address="auto", node_resources={"inc": {"cpus": 1}})  # two UDFs, two actor pools
out = Pipeline(nodes=[f, inc], engine=staged).map(inputs={"x": list(range(6))}, map_over="x", on_error="continue")
print([o["z"] if not isinstance(o, Failed) else (o.error.node, o.error.item) for o in out])
ray.shutdown()
"""


@pytest.mark.slow
def test_daft_engine_on_ray():
    pytest.importorskip("daft")
    run = subprocess.run([sys.executable, "-c", DAFT_ON_RAY], capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-2:] == ["[0, 2, 4, ('f', 3), 8, 10]", "[1, 3, 5, ('f', 3), 9, 11]"]


@pytest.mark.parametrize("name", [*ENGINES, "daft"])
def test_imap_streams_a_generator_in_windows(name, executors):
    if name == "daft":
        pytest.importorskip("daft")
        from hardy.integrations.daft import daft_engine
        engine = daft_engine()
    else:
        engine = Engine(map_executor=executors[name])
    p = Pipeline(nodes=[add_one, double_or_crash, total], engine=engine)
    out = list(p.imap(inputs={"x": (x for x in range(40))}, map_over="x", on_error="continue", window=16))
    assert [o["c"] for i, o in enumerate(out) if i != 7] == [3 * (x + 1) for x in range(40) if x != 7]
    assert isinstance(out[7].error, NodeCrashed) and out[7].error.item == 7
    loose = list(p.imap(inputs={"x": iter(range(40))}, map_over="x", on_error="continue", ordered=False,
                        window=16))
    assert sorted(o["c"] for o in loose if not isinstance(o, Failed)) == [3 * (x + 1) for x in range(40) if x != 7]


@pytest.mark.parametrize("name", ENGINES)
def test_node_events_come_back_from_the_engines_workers(name, executors):
    from test_events import Log
    log = Log()
    p = Pipeline(nodes=[add_one, double_or_crash, total], engine=Engine(map_executor=executors[name]), callbacks=[log])
    p.map(inputs={"x": list(range(10))}, map_over="x", on_error="continue")
    expected = [(kind, n) for n in ("add_one", "double_or_crash", "total") for kind in ("start", "end")]
    assert all(log.of_item(i) == expected for i in range(10) if i != 7)
    assert os.getpid() not in {e[-1] for e in log.events if e[0] == "end"}  # the engine's workers' pids
    assert [e[:3] for e in log.of_item(7)] == [("error", "double_or_crash", "NodeCrashed")]  # signal: if the engine says


def test_daft_engine_node_events_from_one_and_several_udfs(tmp_path):
    pytest.importorskip("daft")
    from hardy.integrations.daft import daft_engine
    from test_events import Log
    expected = [(kind, n) for n in ("add_one", "double_or_crash", "total") for kind in ("start", "end")]
    for engine in (daft_engine(), daft_engine(node_resources={"double_or_crash": {"cpus": 0.5}})):
        log = Log()
        p = Pipeline(nodes=[add_one, double_or_crash, total], engine=engine, callbacks=[log],
                     cache=DiskCache(tmp_path / "c"))
        p.map(inputs={"x": [0, 1, 2]}, map_over="x")
        assert [log.of_item(i) for i in range(3)] in ([expected] * 3, [[("cached", n) for n in
                                                                      ("add_one", "double_or_crash", "total")]] * 3)
        assert os.getpid() not in {e[-1] for e in log.events if e[0] in ("end", "cached")}


@node(output_name="y")
def logs_and_warns(x: int) -> int:
    logging.getLogger("hardy_test_remote").info("item %s logged", x)
    warnings.warn(f"item {x} warned", RuntimeWarning, stacklevel=1)
    return x


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("name", [*ENGINES, "daft"])
def test_a_nodes_log_records_and_warnings_reach_the_caller(name, executors):
    """As from hardy's own workers: each warning warned again here with its category and the node's
    file and line (catch_warnings sees it), each log record handled by this process's loggers at
    its level, whichever process of the engine ran the node."""
    if name == "daft":
        pytest.importorskip("daft")
        from hardy.integrations.daft import daft_engine
        engine = daft_engine(max_concurrency=1)
    else:
        engine = Engine(map_executor=executors[name])
    logger, kept = logging.getLogger("hardy_test_remote"), _Kept()
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Pipeline(nodes=[logs_and_warns], engine=engine).map(inputs={"x": [1, 2]}, map_over="x")
    finally:
        logger.removeHandler(kept)
        logger.setLevel(logging.NOTSET)
    ours = sorted((str(w.message), w.category, w.filename) for w in caught if "warned" in str(w.message))
    assert ours == [(f"item {x} warned", RuntimeWarning, __file__) for x in (1, 2)]
    assert sorted((r.getMessage(), r.levelno) for r in kept.records) == [(f"item {x} logged", logging.INFO)
                                                                      for x in (1, 2)]


def test_daft_engine_with_node_resources_serves_several_pipelines():
    """A name absent from one pipeline is another's once a pipeline the engine ran had it; a name
    no pipeline run so far has is a typo."""
    pytest.importorskip("daft")
    from hardy.integrations.daft import daft_engine
    engine = daft_engine(node_resources={"double_or_crash": {"cpus": 1}})
    with pytest.raises(ValueError, match="names node 'double_or_crash', which is not in this pipeline"):
        Pipeline(nodes=[add_one], engine=engine).map(inputs={"x": [1]}, map_over="x")
    both = Pipeline(nodes=[add_one, double_or_crash], engine=engine).map(inputs={"x": [1]}, map_over="x")
    assert both == [{"a": 2, "b": 4}]
    assert Pipeline(nodes=[add_one], engine=engine).map(inputs={"x": [1]}, map_over="x") == [{"a": 2}]

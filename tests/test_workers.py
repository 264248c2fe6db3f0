"""Worker processes contain native crashes: real processes, real signals, a real gcc-built library.

Every case crashes item K of a map of 20 items and checks that the other 19 results come back,
that the failure names node, item, signal and (where one exists) the worker's Python stack, and
that the same pool serves the next map.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hardy import Engine, Failed, NodeCrashed, NodeError, NodeTimeout, Pipeline, node
from hardy.errors import HazardError, PicklingError

K = 7
N = 20


def _crash(kind: str, lib: str) -> None:
    if kind == "segv_signal":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "null_deref":
        ctypes.string_at(0)
    elif kind == "abort":
        os.abort()
    elif kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit3":
        os._exit(3)
    elif kind == "c_loop":
        ctypes.CDLL(lib).spin_forever()
    elif kind == "c_sleep":  # a C call the signal before the kill interrupts: it must not return (a success)
        ctypes.CDLL(None).sleep(30)
    elif kind == "raise":
        raise ValueError("plain Python error")
    elif kind == "leak":
        hoard = b"x" * (400 << 20)  # touched pages: really resident
        time.sleep(10)
        del hoard


@node(output_name="y", timeout=2)
def maybe_crash(x: int, kind: str, lib: str) -> int:
    if x == K:
        _crash(kind, lib)
    return x * 10


CASES = {
    # kind: (error class, signal name, text in the message, expects a Python stack)
    "segv_signal": (NodeCrashed, "SIGSEGV", "segmentation fault", True),
    "null_deref": (NodeCrashed, "SIGSEGV", "segmentation fault", True),
    "abort": (NodeCrashed, "SIGABRT", "abort", True),
    "sigkill": (NodeCrashed, "SIGKILL", "out-of-memory", False),
    "exit3": (NodeCrashed, None, "exited with code 3: os._exit(3) was called", True),  # where: its stack
    "c_loop": (NodeTimeout, "SIGKILL", "timeout of 2 s", True),
    "c_sleep": (NodeTimeout, "SIGKILL", "timeout of 2 s", True),
    "raise": (NodeError, None, "plain Python error", False),
    "leak": (NodeCrashed, "SIGKILL", "max_memory_per_worker", True),
}


@pytest.fixture(scope="module")
def engine():
    e = Engine(map_executor="process", workers=2, max_memory_per_worker="300MB")
    yield e
    e.close()


@pytest.mark.parametrize("kind", list(CASES))
def test_one_crash_costs_one_item(kind, engine, native_lib):
    p = Pipeline(nodes=[maybe_crash], engine=engine)
    out = p.map(inputs={"x": list(range(N)), "kind": kind, "lib": str(native_lib)}, map_over="x",
                on_error="continue")
    cls, signame, text, has_stack = CASES[kind]
    assert [o["y"] for i, o in enumerate(out) if i != K] == [i * 10 for i in range(N) if i != K]
    failed = out[K]
    assert isinstance(failed, Failed)
    err = failed.error
    assert type(err) is cls, err
    assert err.node == "maybe_crash" and err.item == K
    assert text in str(err)
    if cls is not NodeError:
        assert err.signal == signame
        assert ("maybe_crash" in err.stack) == has_stack, err.stack
        if has_stack:  # a module-level node travels by reference: the stack shows the real file
            assert "test_workers.py" in err.stack and "<dynamic-code>" not in err.stack
    # the pool keeps working for the next map
    again = p.map(inputs={"x": [1, 2, 3], "kind": kind, "lib": str(native_lib)}, map_over="x")
    assert [o["y"] for o in again] == [10, 20, 30]


@node(output_name="y")
def crash_once(x: int, marker: str) -> int:
    if x == K and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return x


def test_retries_rerun_a_transient_crash_on_a_fresh_worker(tmp_path):
    flaky = node(output_name="y", retries=1)(crash_once.func)
    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline(nodes=[flaky], engine=engine)
        out = p.map(inputs={"x": list(range(N)), "marker": str(tmp_path / "m1")}, map_over="x")
        assert [o["y"] for o in out] == list(range(N))
        assert engine.process_pool().replaced == 1
        # without retries the same transient crash is reported
        p2 = Pipeline(nodes=[crash_once], engine=engine)
        out = p2.map(inputs={"x": list(range(N)), "marker": str(tmp_path / "m2")}, map_over="x",
                     on_error="continue")
        assert isinstance(out[K], Failed) and isinstance(out[K].error, NodeCrashed)


@node(output_name="y")
def crash_at_exit(x: int, lib: str) -> int:
    return ctypes.CDLL(lib).work_then_crash_at_exit(x)


def test_crash_at_interpreter_exit_loses_nothing(native_lib):
    # Proof the library really crashes at exit when a process leaves the normal way:
    code = f"import ctypes; print(ctypes.CDLL({str(native_lib)!r}).work_then_crash_at_exit(2))"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert plain.returncode == -signal.SIGSEGV and plain.stdout.strip() == "4"
    with Engine(map_executor="process", workers=2, max_tasks_per_worker=5) as engine:
        p = Pipeline(nodes=[crash_at_exit], engine=engine)
        out = p.map(inputs={"x": list(range(N)), "lib": str(native_lib)}, map_over="x")
        assert [o["y"] for o in out] == [2 * i for i in range(N)]


def test_workers_are_recycled_after_max_tasks():
    @node(output_name="pid")
    def pid(x):
        return os.getpid()

    with Engine(map_executor="process", workers=2, max_tasks_per_worker=4) as engine:
        out = Pipeline(nodes=[pid], engine=engine).map(inputs={"x": list(range(24))}, map_over="x")
        pids = [o["pid"] for o in out]
        assert len(set(pids)) >= 6  # 24 items / 4 per worker
        assert max(pids.count(p) for p in set(pids)) <= 4


def test_isolated_node_runs_in_a_worker_whatever_the_executor():
    @node(output_name="pid", isolate=True)
    def where(x):
        return os.getpid()

    @node(output_name="ok")
    def after(pid):
        return pid != os.getpid()

    with Engine(map_executor="sequential") as engine:  # run() here; the isolated node in a worker
        p = Pipeline(nodes=[where, after], engine=engine)
        assert p.run(inputs={"x": 1})["ok"] is True


def test_isolated_node_crash_is_contained():
    @node(output_name="y", isolate=True)
    def crashy(x):
        if x == 2:
            ctypes.string_at(0)
        return x

    with Engine() as engine:
        p = Pipeline(nodes=[crashy], engine=engine)
        with pytest.raises(NodeCrashed) as exc:
            p.run(inputs={"x": 2})
        assert exc.value.node == "crashy" and exc.value.signal == "SIGSEGV"
        out = p.map(inputs={"x": [1, 2, 3]}, map_over="x", on_error="continue")
        assert out[0] == {"y": 1} and out[2] == {"y": 3} and isinstance(out[1], Failed)


def test_unpicklable_input_is_named_before_any_worker_starts():
    import threading

    @node(output_name="y")
    def use(x, lock):
        return x

    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline(nodes=[use], engine=engine)
        with pytest.raises(PicklingError, match="input 'lock' \\(_thread.lock, given to every item\\)"):
            p.map(inputs={"x": [1, 2], "lock": threading.Lock()}, map_over="x")
        assert engine.process_pool().pids() == []  # nothing was started


def test_inputs_no_node_reads_are_not_shipped():
    import threading
    import warnings

    @node(output_name="y")
    def ident(x):
        return x

    with Engine(map_executor="process", workers=1) as engine, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unknown input is a warning, not a pickling error
        out = Pipeline(nodes=[ident], engine=engine).map(inputs={"x": [1, 2], "unused": threading.Lock()},
                                                          map_over="x")
    assert out == [{"y": 1}, {"y": 2}]


def test_unpicklable_node_is_named_with_what_it_reads_that_cannot_travel():
    """The message named the node alone, and told to define it at module level, which it may well
    be: what to move out of it (a lock it closes over, a client a helper it calls reads) is named."""
    import threading
    lock = threading.Lock()

    @node(output_name="y")
    def guarded(x):
        with lock:
            return x

    def helper(x):
        with lock:
            return x

    @node(output_name="y")
    def through_a_helper(x):
        return helper(x)

    with Engine(map_executor="process", workers=1) as engine:
        for n in (guarded, through_a_helper):
            with pytest.raises(PicklingError, match=f"node '{n.name}' cannot be sent to a worker process: the "
                               "closed-over variable 'lock' it reads \\(lock\\) cannot be pickled \\(.*\\)\\. "
                               "Build it inside the node"):
                Pipeline(nodes=[n], engine=engine).map(inputs={"x": [1]}, map_over="x")


def test_results_arrive_per_item_for_slow_items():
    @node(output_name="t")
    def slow(x):
        time.sleep(0.3)
        return time.monotonic()

    class Arrivals:
        def __init__(self):
            self.at = {}

        def __getattr__(self, name):
            return lambda *a: None

        def on_map_item_end(self, i, duration, ctx):
            self.at[i] = time.monotonic()

    arrivals = Arrivals()
    with Engine(map_executor="process", workers=1) as engine:
        engine.process_pool().per_item_times[0] = 0  # irrelevant; first chunk is a probe of one item
        p = Pipeline(nodes=[slow], engine=engine, callbacks=[arrivals])
        out = p.map(inputs={"x": list(range(4))}, map_over="x")
    for i in range(3):  # each result reached the parent before the next item was done computing
        assert arrivals.at[i] < out[i + 1]["t"]


def test_fork_is_refused_when_a_hazard_is_present():
    import threading
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        with pytest.raises(HazardError, match="Python thread"):
            Engine(map_executor="process", start_method="fork").process_pool()
        with pytest.warns(RuntimeWarning, match="fork hazards"):
            pool = Engine(map_executor="process", start_method="fork!").process_pool()
        assert pool.start_method == "fork"
        pool.close()
    finally:
        stop.set()
        t.join()


def test_worker_environment_caps_threads_and_tokenizers(monkeypatch):
    monkeypatch.setenv("MKL_NUM_THREADS", "3")  # a user's own choice is kept

    @node(output_name="env")
    def env(x):
        return {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")}

    with Engine(map_executor="process", workers=2) as engine:
        out = Pipeline(nodes=[env], engine=engine).map(inputs={"x": [0]}, map_over="x")
    per_worker = str(max(1, (os.cpu_count() or 1) // 2))
    assert out[0]["env"] == {"OMP_NUM_THREADS": per_worker, "MKL_NUM_THREADS": "3",
                             "TOKENIZERS_PARALLELISM": "false"}


SPARE_SCRIPT = textwrap.dedent("""
    import ctypes, time, psutil
    from hardy import Engine, Failed, Pipeline, node

    @node(output_name="y")
    def f(x):
        if x == 3:
            ctypes.string_at(0)
        return x

    left = []
    for round in range(6):
        engine = Engine(map_executor="process", workers=2)
        out = Pipeline([f], engine=engine).map(inputs={"x": list(range(8))}, map_over="x", on_error="continue")
        assert sum(isinstance(o, Failed) for o in out) == 1
        started = engine.executor.counts(peaks=False).started
        time.sleep(0.01 * round)  # close at another moment of the spare's start each round
        engine.close()
        time.sleep(0.5)
        left += [p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    print("started", started, "left", left)
""")


@pytest.mark.slow  # six rounds, each closing at another moment of the spare's start
def test_a_death_starts_a_spare_and_closing_stops_it_whenever_it_comes(tmp_path):
    """A worker's death starts a spare worker at once (it takes the dead one's place); closing the
    pool while that spare is still starting stops it when it comes: no worker, no fork server is
    left, whatever the moment of the close."""
    script = tmp_path / "spare.py"
    script.write_text(SPARE_SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    words = run.stdout.split()
    assert int(words[1]) >= 3  # two workers, and the one started when the first died
    assert words[2:] == ["left", "[]"], run.stdout


def test_a_worker_death_between_items_is_a_warning_not_an_error(caplog):
    caplog.set_level("WARNING", logger="hardy.workers")
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline(nodes=[maybe_crash], engine=engine)
        p.map(inputs={"x": [1], "kind": "raise", "lib": ""}, map_over="x")
        pool = engine.process_pool()
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)  # dies idle: no item in flight
        time.sleep(0.2)
        out = p.map(inputs={"x": [1, 2], "kind": "raise", "lib": ""}, map_over="x")
        assert [o["y"] for o in out] == [10, 20]
    assert "died while idle (worker died from SIGKILL" in caplog.text


def test_worker_script_runs_standalone(tmp_path, native_lib):
    """A user's script with nodes in __main__ works under the default forkserver start."""
    script = tmp_path / "pipeline.py"
    script.write_text(textwrap.dedent("""
        import ctypes
        from hardy import Engine, Failed, Pipeline, node

        @node(output_name="y")
        def f(x):
            if x == 3:
                ctypes.string_at(0)
            return x + 1

        if __name__ == "__main__":
            with Engine(map_executor="process", workers=2) as e:
                out = Pipeline(nodes=[f], engine=e).map(inputs={"x": list(range(6))}, map_over="x",
                                                       on_error="continue")
            print([o if isinstance(o, Failed) else o["y"] for o in out][:3],
                  type(out[3]).__name__, out[3].error.signal)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[1, 2, 3] Failed SIGSEGV"


class Model:
    """Stands for an expensive model: counts how often it is built in each process."""

    builds = 0

    def __init__(self, scale: int):
        Model.builds += 1
        self.scale = scale

    def predict(self, x: int) -> tuple[int, int, int]:
        return x * self.scale, os.getpid(), Model.builds


def test_stateful_resource_is_built_once_per_worker():
    from hardy import stateful

    model = stateful(Model)(3)
    assert Model.builds == 0  # constructing the handle loads nothing

    @node(output_name="pred")
    def predict(x, model):
        return model.predict(x)

    with Engine(map_executor="process", workers=2) as engine:
        out = Pipeline(nodes=[predict], engine=engine).map(inputs={"x": list(range(40)), "model": model},
                                                            map_over="x")
    assert [o["pred"][0] for o in out] == [3 * x for x in range(40)]
    per_worker = {}
    for _, pid, builds in (o["pred"] for o in out):
        per_worker.setdefault(pid, set()).add(builds)
    assert all(b == {1} for b in per_worker.values()), per_worker  # built once in each worker
    assert Model.builds == 0  # and never in the parent
    in_process = Engine(map_executor="sequential")
    assert Pipeline(nodes=[predict], engine=in_process).run(inputs={"x": 2, "model": model})["pred"][0] == 6
    assert Model.builds == 1


def test_the_fork_server_loads_the_pipeline_api_once_idle_for_the_workers_after(tmp_path):
    """A first map's workers fork before hardy's pipeline API is imported (nothing of it runs
    there); a user's module that a worker loads imports it (`from hardy import node`). Once the
    server is idle it imports the API itself, with what its calls run (a nested pipeline's, in a
    worker), so that later workers (a crash's replacement, a recycled one) fork with it. Whichever
    worker loads the module, the call's answer is the same."""
    (tmp_path / "api_user_mod.py").write_text(textwrap.dedent("""
        import os, sys
        with open(os.environ["HARDY_TEST_PROBE"], "a") as f:  # (before the import below)
            f.write(f"{'hardy.api.pipeline' in sys.modules and 'hardy.engine.streaming' in sys.modules}\\n")
        from hardy import node

        @node(output_name="y")
        def twice(x):
            return 2 * x
    """))
    probe = tmp_path / "probe.txt"
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        os.environ["HARDY_TEST_PROBE"] = {str(probe)!r}
        import api_user_mod
        from hardy import Engine, Pipeline
        with Engine(max_tasks_per_worker=1, workers=1) as engine:  # a fresh worker per call
            p = Pipeline([api_user_mod.twice], engine=engine)
            answers = []
            for attempt in range(100):
                answers.append(p.run(inputs={{"x": attempt}})["y"])
                if open({str(probe)!r}).read().split()[-1] == "True":
                    break
                time.sleep(0.1)
            print(answers == [2 * k for k in range(len(answers))], len(answers))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    same, calls = out.stdout.split()
    assert same == "True"
    seen = probe.read_text().split()  # the parent's import (before its own of hardy), then each worker's
    assert seen[0] == "False" and seen[-1] == "True" and len(seen) == int(calls) + 1

"""Crash containment is the default: map, run() and nested pipelines, with real segfaults, hangs,
timeouts and Ctrl-C, in scripts written the way users write them (no `__main__` guard, `python -`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from hardy import Engine, Failed, MapError, NodeCrashed, NodeTimeout, Pipeline, node

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_script(code: str, *args: str, stdin: bool = True, cwd: Path | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python - < script` (or `python script.py` with stdin=False), as a user runs it."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = textwrap.dedent(code)
    if stdin:
        return subprocess.run([sys.executable, "-", *args], input=code, capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=cwd)
    assert cwd is not None
    (cwd / "job.py").write_text(code)
    return subprocess.run([sys.executable, "job.py", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


@node(output_name="y")
def fragile(x: int) -> int:
    if x == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    return x * 2


@node(output_name="pid")
def where(x: int) -> int:
    return os.getpid()


def test_the_default_map_contains_a_segfault_in_a_script_without_main_guard():
    out = run_script("""
        import os, signal
        from hardy import Pipeline, node

        @node(output_name="y")
        def embed(x):
            if x == 7:
                os.kill(os.getpid(), signal.SIGSEGV)
            return x * 2

        out = Pipeline([embed]).map(inputs={"x": list(range(20))}, map_over="x", on_error="continue")
        print("ok", sum(1 for o in out if not hasattr(o, "error")))
        print("failed", [i for i, o in enumerate(out) if hasattr(o, "error")])
        print(out[7].error)
    """)
    assert out.returncode == 0, out.stderr
    assert "ok 19" in out.stdout and "failed [7]" in out.stdout
    assert "node 'embed' failed on item 7 (inputs: x=7): worker died from SIGSEGV" in out.stdout
    # the stack names the script's own line (stdin), and only the thread that ran the node
    assert 'File "<stdin>", line 8 in embed' in out.stdout
    assert "threading.py" not in out.stdout and "dynamic-code" not in out.stdout


def test_stacks_name_the_script_file_and_line(tmp_path):
    out = run_script("""
        import ctypes
        from hardy import Pipeline, node

        @node(output_name="y")
        def embed(x):
            return ctypes.string_at(0)

        print(Pipeline([embed]).map(inputs={"x": [1]}, map_over="x", on_error="continue")[0].error)
    """, stdin=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f'File "{tmp_path / "job.py"}", line 7 in embed' in out.stdout


def test_run_on_the_default_engine_contains_a_segfault():
    p = Pipeline([fragile])
    with pytest.raises(NodeCrashed) as info:
        p.run(inputs={"x": 3})
    assert info.value.signal == "SIGSEGV" and info.value.item is None
    assert "(inputs: x=3)" in str(info.value)
    assert p.run(inputs={"x": 2}) == {"y": 4}  # this process, and the pool, live on


def test_run_goes_to_a_worker_only_on_the_process_executor():
    assert Pipeline([where]).run(inputs={"x": 1})["pid"] != os.getpid()
    here = Pipeline([where], engine=Engine(map_executor="sequential"))
    assert here.run(inputs={"x": 1})["pid"] == os.getpid()


@node(output_name="z", timeout=1)
def sleepy(x: int) -> int:
    if x == 1:
        time.sleep(3600)
    return x


def test_run_enforces_a_timeout_in_its_worker():
    with pytest.raises(NodeTimeout) as info:
        Pipeline([sleepy]).run(inputs={"x": 1})
    assert "timeout of 1 s" in str(info.value)


def test_an_in_process_run_still_refuses_a_timeout_it_cannot_enforce():
    from hardy.errors import NodeDefinitionError
    with pytest.raises(NodeDefinitionError, match="Pipeline.run calls it in this process"):
        Pipeline([sleepy], engine=Engine(map_executor="sequential")).run(inputs={"x": 0})


# --- nested pipelines --------------------------------------------------------------------------

@node(output_name="token")
def tokenize(doc: str) -> str:
    if doc == "poison":
        os.kill(os.getpid(), signal.SIGSEGV)
    return doc.upper()


@node(output_name="n")
def count(tokens: list) -> int:
    return sum(1 for t in tokens if not isinstance(t, Failed))


def _nested(on_error: str) -> Pipeline:
    inner = Pipeline([tokenize], name="inner")
    prep = inner.as_node(name="prep", input_mapping={"docs": "doc"}, output_mapping={"token": "tokens"},
                         map_over="docs", on_error=on_error)
    return Pipeline([prep, count], name="outer")


def test_a_crash_in_a_nested_map_costs_only_its_inner_item_under_run_and_map():
    outer = _nested("continue")
    out = outer.run(inputs={"docs": ["a", "poison", "c"]})
    assert out["n"] == 2 and out["tokens"][0] == "A" and out["tokens"][2] == "C"
    err = out["tokens"][1].error
    # named by its path, as an exception in it would be
    assert isinstance(err, NodeCrashed) and err.node == "prep/tokenize" and err.item == 1 and err.signal == "SIGSEGV"
    assert "failed on item 1 (inputs: doc='poison')" in str(err)  # the inner item's, as an exception's names them
    rows = outer.map(inputs={"docs": [["a", "poison"], ["b"], ["poison", "poison", "d"]]}, map_over="docs")
    assert [r["n"] for r in rows] == [1, 1, 1]
    assert [i for i, t in enumerate(rows[2]["tokens"]) if isinstance(t, Failed)] == [0, 1]


def test_a_crash_in_a_nested_map_that_raises_names_the_inner_node_and_item():
    rows = _nested("raise").map(inputs={"docs": [["a"], ["b", "poison"]]}, map_over="docs", on_error="continue")
    assert rows[0] == {"tokens": ["A"], "n": 1}
    err = rows[1].error
    assert isinstance(err, NodeCrashed) and err.node == "prep/tokenize" and err.item == 1
    assert "in nested map at 'tokenize' item 1" in str(err)


@node(output_name="w", timeout=1)
def slow_inner(doc: str) -> str:
    if doc == "slow":
        time.sleep(3600)
    return doc


def test_a_timeout_inside_a_nested_pipeline_is_enforced_and_costs_its_inner_item():
    outer = Pipeline([Pipeline([slow_inner], name="inner").as_node(name="prep", map_over="doc",
                                                                     on_error="continue")])
    out = outer.run(inputs={"doc": ["a", "slow", "c"]})
    assert out["w"][0] == "a" and out["w"][2] == "c"
    assert isinstance(out["w"][1].error, NodeTimeout) and "timeout of 1 s" in str(out["w"][1].error)


def test_a_nested_pipeline_without_an_engine_follows_its_parent():
    inner = Pipeline([where], name="inner")  # no engine of its own
    outer = Pipeline([inner.as_node(name="nested")], engine=Engine(map_executor="sequential"))
    assert outer.run(inputs={"x": 1})["pid"] == os.getpid()
    own = Pipeline([where], name="own", engine=Engine(map_executor="process"))
    assert Pipeline([own.as_node(name="nested")], engine=Engine(map_executor="sequential")).run(
        inputs={"x": 1})["pid"] != os.getpid()


# --- nothing computed is lost --------------------------------------------------------------------

@node(output_name="v")
def fails_fast_or_hangs(x: int) -> int:
    if x == 0:
        time.sleep(3600)  # in flight, no timeout: before, the map waited for it forever
    if x == 5:
        time.sleep(0.3)
        raise ValueError("bad item")
    return x


def test_on_error_raise_does_not_wait_for_a_hung_item_in_flight():
    engine = Engine(workers=2)
    p = Pipeline([fails_fast_or_hangs], engine=engine)
    with pytest.raises(MapError) as info:
        p.map(inputs={"x": list(range(10))}, map_over="x")
    assert list(info.value.failures) == [5]
    assert info.value.results[0] is None  # the hung item was cancelled, not awaited
    assert [r["v"] for r in info.value.results[1:5]] == [1, 2, 3, 4]
    assert p.map(inputs={"x": [1, 2]}, map_over="x") == [{"v": 1}, {"v": 2}]  # the pool serves on
    engine.close()


def ctrl_c(script: str, marker: Path) -> tuple[str, str]:
    """Runs `script` as `python -`, sends SIGINT once it has written `marker`; its stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.stdin is not None
    proc.stdin.write(textwrap.dedent(script))
    proc.stdin.close()
    proc.stdin = None
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=60)


def test_ctrl_c_during_a_map_carries_every_finished_result(tmp_path):
    marker = tmp_path / "half"
    out, err = ctrl_c(f"""
        import os, time, psutil
        from hardy import Pipeline, node, Engine, MapInterrupted

        @node(output_name="y")
        def step(x):
            if x == 10:
                open({str(marker)!r}, "w").close()
            if x >= 10:
                time.sleep(3600)
            return x

        try:
            Pipeline([step], engine=Engine(workers=2)).map(inputs={{"x": list(range(40))}}, map_over="x")
        except KeyboardInterrupt as exc:
            print(type(exc).__name__, isinstance(exc, MapInterrupted))
            print("done", sum(1 for r in exc.results if r is not None), "of", len(exc.results))
            print("workers", len(psutil.Process().children(recursive=True)) <= 1)
    """, marker)
    assert "MapInterrupted True" in out, err
    assert "done 10 of 40" in out
    assert "workers True" in out  # the busy workers were stopped (the fork server may stay)


@pytest.mark.parametrize("executor", ["process", "sequential", "threaded"])
def test_an_uncaught_ctrl_c_of_a_map_shows_the_users_frames_not_hardys(tmp_path, executor):
    """Uncaught, a map's interrupt printed the KeyboardInterrupt as it landed in hardy's wait for
    its workers (seven of hardy's frames, down to a selector's poll) before the MapInterrupted;
    a `threaded` map's, as it landed in the standard library's (`waiter.acquire()`). The node's
    frame is shown where it ran: in this process, or (from its stack) in the worker."""
    marker = tmp_path / "half"
    out, err = ctrl_c(f"""
        import time
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def step(x):
            if x == 2:
                open({str(marker)!r}, "w").close()
            if x >= 2:
                time.sleep({3 if executor == "threaded" else 3600})  # (a thread cannot be stopped)
            return x

        Pipeline([step], engine=Engine(map_executor={executor!r}, workers=1)).map(inputs={{"x": list(range(9))}},
                                                                              map_over="x")
    """, marker)
    assert "MapInterrupted: map interrupted: 2 of 9 items completed" in err, err
    hardy_frames = [line for line in err.splitlines() if "/hardy/" in line and line.lstrip().startswith("File")]
    assert len(hardy_frames) == 1, err  # (`raise` in map: the one frame of hardy's API)
    assert (", in step" in err) == (executor != "threaded"), err
    assert "threading.py" not in err and "concurrent" not in err, err


@pytest.mark.parametrize("executor", ["process", "sequential"])
def test_ctrl_c_of_a_node_from_an_installed_package_still_shows_its_frame(tmp_path, executor):
    """A node that lives in an installed package (site-packages) is the user's code too: its
    frame is shown where a Ctrl-C landed in it, as the standard library's wait is not."""
    import sysconfig
    packages = Path(sysconfig.get_paths()["purelib"])
    if not os.access(packages, os.W_OK):
        pytest.skip("site-packages is not writable here")
    name = f"hardy_test_installed_{os.getpid()}"
    marker = tmp_path / "stuck"
    (packages / f"{name}.py").write_text(textwrap.dedent(f"""
        import time
        from hardy import node

        @node(output_name="y")
        def stuck_in_a_package(x):
            open({str(marker)!r}, "w").close()
            time.sleep(3600)
    """))
    try:
        out, err = ctrl_c(f"""
            from hardy import Engine, Pipeline
            from {name} import stuck_in_a_package
            Pipeline([stuck_in_a_package], engine=Engine(map_executor={executor!r})).run(inputs={{"x": 1}})
        """, marker)
    finally:
        (packages / f"{name}.py").unlink()
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert ", in stuck_in_a_package" in err, err


@pytest.mark.parametrize("executor", ["process", "sequential"])
@pytest.mark.parametrize("call", ["run", "imap"])
def test_ctrl_c_of_a_run_or_an_imap_shows_the_node_where_it_was_not_hardys_wait(tmp_path, executor, call):
    """Ctrl-C to see where a stuck script is: in a worker, `run()`'s KeyboardInterrupt ended in
    nine of hardy's frames (down to `poller.poll`), and `imap()`'s in three, without the node's."""
    marker = tmp_path / "stuck"
    out, err = ctrl_c(f"""
        import time
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def stuck(x):
            open({str(marker)!r}, "w").close()
            time.sleep(3600)

        pipeline = Pipeline([stuck], engine=Engine(map_executor={executor!r}))
        if {call!r} == "run":
            pipeline.run(inputs={{"x": 1}})
        else:
            for out in pipeline.imap(inputs={{"x": [1, 2]}}, map_over="x"):
                print(out)
    """, marker)
    frames = [line.strip() for line in err.splitlines() if line.lstrip().startswith("File")]
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert len([f for f in frames if "/hardy/" in f]) == 1, err  # (the `raise` in the API's method)
    if call == "run" or executor == "sequential":  # (an imap's windows run in a thread of hardy's)
        assert frames[-1].endswith(", in stuck"), err


def test_ctrl_c_during_an_imap_stops_a_hung_item_and_hands_out_what_finished_in_order(tmp_path):
    marker = tmp_path / "hung"
    out, err = ctrl_c(f"""
        import os, time
        from hardy import Pipeline, node, Engine

        @node(output_name="y")
        def step(x):
            if x == 10:
                with open({str(marker)!r}, "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(3600)
            return x

        got = []
        try:
            for r in Pipeline([step], engine=Engine(workers=2)).imap(inputs={{"x": range(40)}}, map_over="x",
                                                                      window=8):
                got.append(r["y"])
        except KeyboardInterrupt as exc:
            print("interrupted", type(exc).__name__, got)
    """, marker)  # before, the stream waited for the hung item forever
    # the first window, then what the second finished in order (8 and 9), which the interrupt lost
    # before: yielded first, as the in-process executor yields each item as it goes
    assert f"interrupted KeyboardInterrupt {list(range(10))}" in out, err
    hung = int(marker.read_text())
    assert not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE


def test_a_pool_whose_fork_server_was_killed_starts_a_fresh_one():
    engine = Engine(workers=1)
    p = Pipeline([where], engine=engine)
    first = p.map(inputs={"x": [1]}, map_over="x")[0]["pid"]
    server = engine.process_pool()._launcher.process
    os.kill(server.pid, signal.SIGKILL)  # killed from outside, as an OOM killer or a user would
    server.wait()
    os.kill(first, signal.SIGKILL)  # and its worker: the next map must start one
    out = p.map(inputs={"x": [1, 2]}, map_over="x")
    assert len(out) == 2 and first not in {o["pid"] for o in out}
    engine.close()


def test_every_map_keeps_a_light_report():
    p = Pipeline([fragile])
    p.map(inputs={"x": list(range(6))}, map_over="x", on_error="continue")
    data = p.report().to_dict()
    assert (data["items"], data["succeeded"], data["failed"]) == (6, 5, 1)
    assert data["failures"][0]["signal"] == "SIGSEGV" and data["failures"][0]["item"] == 3
    assert data["workers"]["died"] == 1 and data["nodes"] == []


def test_worker_log_records_reach_the_parents_handlers():
    out = run_script("""
        import logging
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(hardy_item)s %(message)s")
        from hardy import Pipeline, node
        log = logging.getLogger("mynodes")

        @node(output_name="y")
        def embed(x):
            log.info("embedding %s", x)
            log.debug("not shown")
            return x

        Pipeline([embed]).map(inputs={"x": [0, 1, 2]}, map_over="x")
    """)
    assert out.returncode == 0, out.stderr
    lines = sorted(ln for ln in out.stderr.splitlines() if "mynodes" in ln)
    assert lines == [f"INFO mynodes {i} embedding {i}" for i in range(3)]


def test_a_loggers_own_level_below_the_roots_lets_its_records_through():
    """A project's logger at INFO with its own handler, the root left at WARNING: in-process its
    INFO records are handled; from a worker too (the worker used to send the root's level only)."""
    out = run_script("""
        import logging, sys
        from hardy import Pipeline, node
        log = logging.getLogger("myproject")
        log.setLevel(logging.INFO)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        log.addHandler(handler)

        @node(output_name="y")
        def step(x):
            log.info("processing %s", x)
            log.debug("not shown %s", x)
            logging.getLogger("other").info("not shown either %s", x)
            return logging.getLogger("other").isEnabledFor(logging.INFO)  # (nothing handles it: not sent)

        print("others sent:", [r["y"] for r in Pipeline([step]).map(inputs={"x": [0, 1]}, map_over="x")])
    """)
    assert out.returncode == 0, out.stderr
    assert sorted(ln for ln in out.stdout.splitlines() if ln) == ["INFO myproject processing 0",
                                                                   "INFO myproject processing 1",
                                                                   "others sent: [False, False]"]
    assert "not shown" not in out.stdout + out.stderr



def test_a_log_level_changed_between_two_maps_applies_to_the_warm_workers():
    """"Turn on DEBUG and run it again" in a notebook: the workers a first map started took the
    levels of their start, and kept them for every later map of the engine."""
    out = run_script("""
        import logging
        from hardy import Pipeline, node
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        log = logging.getLogger("mine")

        @node(output_name="y")
        def step(x):
            log.info("info %s", x)
            log.debug("debug %s", x)
            return x

        p = Pipeline([step])
        p.map(inputs={"x": [1]}, map_over="x")
        logging.getLogger().setLevel(logging.INFO)
        p.map(inputs={"x": [2]}, map_over="x")
        p.run(inputs={"x": 3})
        log.setLevel(logging.DEBUG)
        p.map(inputs={"x": [4]}, map_over="x")
        log.setLevel(logging.NOTSET)
        logging.getLogger().setLevel(logging.WARNING)
        p.map(inputs={"x": [5]}, map_over="x")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stderr.split() == ["INFO", "info", "2", "INFO", "info", "3", "INFO", "info", "4", "DEBUG", "debug", "4"]

def test_a_logging_dict_config_leaves_the_calls_state_unchanged_between_calls():
    """`logging.config.dictConfig` disables the loggers it does not name, hardy's probe of level
    changes too: it then said "changed" at every call, and every call sent the worker its whole
    state again (about 190 us more a run())."""
    out = run_script("""
        import logging.config
        from hardy.shipping.context import current
        logging.config.dictConfig({"version": 1, "root": {"level": "INFO"}})
        first = current()
        print(current() is first, current() is current())
        logging.getLogger("mine").setLevel(logging.DEBUG)
        print(current() is first, current().settings.log_levels)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["True True", "False (20, (('mine', 10),))"]

def test_a_workers_log_record_keeps_its_template_arguments_and_exception():
    """A handler that groups by template (`record.msg`) or reports `exc_info` with its frames (as
    Sentry's does) reads what it reads in-process: a worker's records came with the message
    formatted, no arguments and no exception, its text alone left in `exc_text`."""
    script = """
        import logging, sys, threading, traceback
        from hardy import Engine, Pipeline, node

        class Grab(logging.Handler):
            def emit(self, r):
                kind = r.exc_info[0].__name__ if r.exc_info else None
                frames = [f.name for f in traceback.extract_tb(r.exc_info[2])] if r.exc_info else None
                print(repr(r.msg), r.args, kind, frames, r.getMessage(), sep=" | ")

        logging.getLogger().addHandler(Grab())
        logging.getLogger().setLevel(logging.INFO)
        log = logging.getLogger("mine")

        def inner(x):
            return 1 / (x - 1)

        @node(output_name="y")
        def step(x):
            log.info("item %s of %d", x, 2)
            log.info("holds %s", threading.Lock())
            try:
                inner(x)
            except ZeroDivisionError:
                log.exception("failed on %s", x)
            return x

        Pipeline([step], engine=Engine(map_executor=sys.argv[1])).map(inputs={"x": [1]}, map_over="x")
    """
    lines = {}
    for executor in ("sequential", "process"):
        out = run_script(script, executor)
        assert out.returncode == 0, out.stderr
        lines[executor] = [ln.split(" | ") for ln in out.stdout.splitlines() if " | " in ln]
    sequential, process = lines["sequential"], lines["process"]
    assert process[0] == sequential[0] == ["'item %s of %d'", "(1, 2)", "None", "None", "item 1 of 2"]
    assert process[2] == sequential[2] == ["'failed on %s'", "(1,)", "ZeroDivisionError", "['step', 'inner']",
                                           "failed on 1"]
    assert process[1][0].startswith("'holds <unlocked _thread.lock")  # an object's arguments: formatted there
    assert process[1][4] == process[1][0].strip("'")

@node(output_name="r", retries=1)
def dies_once(x: int, marker: str) -> int:
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def test_a_crash_retry_warning_names_node_and_item(tmp_path, caplog):
    out = Pipeline([dies_once]).map(inputs={"x": [5], "marker": str(tmp_path / "m")}, map_over="x")
    assert out == [{"r": 5}]
    assert any("node 'dies_once', item 0" in r.getMessage() and "retrying (1 of 1)" in r.getMessage()
               for r in caplog.records)

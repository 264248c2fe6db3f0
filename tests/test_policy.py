"""One failure policy under every executor: crashes, exceptions listed in retry_on, timeouts.

Every executor (sequential, threaded, async, process, Dask, Ray, Daft) runs the same three maps of
N items where item K misbehaves, with real worker processes and real clusters on loopback. Each
node call appends its item to a log file, so the tests see exactly how many times each item ran:
a retried item runs 1 + retries times, every other item exactly once (never again after a crash).
In-process executors cannot survive a crash: a real script shows what they print as they die.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import build_library, executors
from hardy import Engine, Failed, NodeTimeout, Pipeline, node
from hardy.errors import InvalidArgument, NodeDefinitionError
from hardy.model.policy import BACKOFF_MAX, delay

pytestmark = pytest.mark.timeout(300)

N, K = 8, 3
IN_PROCESS = ["sequential", "threaded", "async"]
CONTAINED = executors("process", "dask", "ray", "daft")


def _ran(log: str, x: int) -> int:
    """Record one run of item x; how many runs of it came before."""
    with open(log, "a+") as f:
        f.seek(0)
        before = f.read().split().count(str(x))
        f.write(f"{x}\n")
    return before


@node(output_name="y", retries=1)
def crash_once(x: int, log: str) -> int:
    if _ran(log, x) == 0 and x == K:
        ctypes.string_at(0)  # a real null-pointer read: SIGSEGV in the thread that runs it
    return x * 10


@node(output_name="y", retries=1, retry_on=OSError)
def flaky_once(x: int, log: str) -> int:
    if _ran(log, x) == 0 and x == K:
        raise OSError("the network share blinked")
    return x * 10


@node(output_name="y", timeout=1)
def hangs(x: int, log: str) -> int:
    _ran(log, x)
    if x == K:
        time.sleep(60)
    return x * 10


@node(output_name="y", timeout=1)
async def hangs_async(x: int, log: str) -> int:
    _ran(log, x)
    if x == K:
        await asyncio.sleep(60)
    return x * 10


@pytest.fixture(scope="module")
def engines():
    """Every executor, each started once for the whole module (clusters are slow to start)."""
    pytest.importorskip("distributed")
    pytest.importorskip("ray")
    pytest.importorskip("daft")
    from hardy.integrations.daft import DaftExecutor
    from hardy.integrations.dask import DaskExecutor
    from hardy.integrations.ray import RayExecutor
    made = {name: Engine(map_executor=name, workers=2) for name in IN_PROCESS + ["process"]}
    made.update(dask=Engine(map_executor=DaskExecutor(workers=2)), ray=Engine(map_executor=RayExecutor(workers=2)),
                daft=Engine(map_executor=DaftExecutor(max_concurrency=2)))
    yield made
    for engine in made.values():
        engine.close()


def _map(engine: Engine, n: Any, tmp_path) -> tuple[list, list[int]]:
    log = tmp_path / "runs.txt"
    log.touch()
    out = Pipeline(nodes=[n], engine=engine).map(inputs={"x": list(range(N)), "log": str(log)}, map_over="x",
                                                  on_error="continue")
    runs = [int(v) for v in log.read_text().split()]
    return out, [runs.count(i) for i in range(N)]


@pytest.mark.parametrize("executor", CONTAINED)
def test_a_crash_is_retried_by_the_crashing_nodes_retries(engines, executor, tmp_path):
    out, runs = _map(engines[executor], crash_once, tmp_path)
    assert [o["y"] for o in out] == [10 * x for x in range(N)], out
    assert runs == [2 if i == K else 1 for i in range(N)]  # the culprit twice, the others never again


def _crashing(script: Path, rest: str, address: int = 0) -> Path:
    """`script`: a user's script whose node `fragile` segfaults on item K, reading `address` (line
    8), then `rest`."""
    script.write_text(textwrap.dedent(f"""
        import ctypes, os
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def fragile(x):
            if x == {K}:
                ctypes.string_at({address})
            return x
    """) + textwrap.dedent(rest))
    return script


@pytest.mark.parametrize("how", ["map", "imap"])  # (a sequential imap said nothing before: `hardy run` uses it)
@pytest.mark.parametrize("executor", IN_PROCESS)
def test_a_crash_in_process_ends_it_with_node_item_stack_and_the_remedy(executor, how, tmp_path):
    script = _crashing(tmp_path / "crashes.py", f"""
        p = Pipeline(nodes=[fragile], engine=Engine(map_executor={executor!r}))
        list(p.{how}(inputs={{"x": list(range({N}))}}, map_over="x"))
        print("survived")
    """)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == -11 and "survived" not in run.stdout, (run.returncode, run.stderr)
    assert f"node 'fragile' on item {K} crashed this process with SIGSEGV" in run.stderr, run.stderr
    assert 'map_executor="process" or @node(isolate=True) contains it' in run.stderr
    assert f'File "{script}", line 8 in fragile' in run.stderr  # faulthandler's stack, the user's frame
    if executor == "sequential":  # faulthandler the user turned on is left alone: its stack, no words of hardy's
        run = subprocess.run([sys.executable, "-X", "faulthandler", str(script)], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == -11 and "hardy:" not in run.stderr and "line 8 in fragile" in run.stderr


REPORTER = r"""
#include <signal.h>
#include <string.h>
#include <unistd.h>
/* A native crash reporter (as Sentry's or Crashpad's): its SIGSEGV handler, installed with
 * SA_SIGINFO, reads the fault's details; 7 when they are the fault's own (a fault's code, the
 * address 0x10), 8 when not. */
static void on_crash(int sig, siginfo_t *info, void *context) {
    (void)context;
    _exit(info && info->si_signo == sig && info->si_code > 0 && info->si_addr == (void *)0x10 ? 7 : 8);
}
void reporter_init(void) {
    struct sigaction a = {0};
    a.sa_sigaction = on_crash;
    a.sa_flags = SA_SIGINFO;
    sigemptyset(&a.sa_mask);
    sigaction(SIGSEGV, &a, NULL);
}
"""


def test_an_in_process_crash_reaches_a_native_crash_reporter_with_its_details(tmp_path):
    """hardy's report of a crash in this process hands the fault on to the handler installed
    before it with that handler's flags, by letting it happen again: a reporter installed with
    SA_SIGINFO gets the fault's own details (its code, its address). Before, the handler was put
    back with `signal()`, which drops SA_SIGINFO (the reporter was called with garbage where its
    details should be), and the signal was raised again (a code and an address of `tkill`'s)."""
    lib = build_library(tmp_path, "libreporter.so", REPORTER)
    script = _crashing(tmp_path / "reported.py", f"""
        ctypes.CDLL({str(lib)!r}).reporter_init()
        Pipeline(nodes=[fragile], engine=Engine(map_executor="sequential")).map(inputs={{"x": list(range({N}))}},
                                                                               map_over="x")
    """, address=0x10)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert f"node 'fragile' on item {K} crashed this process with SIGSEGV" in run.stderr, run.stderr
    assert run.returncode == 7, (run.returncode, run.stderr)  # the reporter read the fault's own details


def test_a_fork_child_of_the_caller_reports_its_own_in_process_crash(tmp_path):
    """The report is installed once per process, at its first in-process map; a child forked
    after that (a multiprocessing worker, say) that runs a map and crashes reports it the same
    way (a check that hardy's handlers act only in their own process must not silence it)."""
    script = _crashing(tmp_path / "forks.py", f"""
        p = Pipeline(nodes=[fragile], engine=Engine(map_executor="sequential"))
        p.map(inputs={{"x": list(range({K}))}}, map_over="x")
        pid = os.fork()
        if pid == 0:
            p.map(inputs={{"x": list(range({N}))}}, map_over="x")
            os._exit(0)
        print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "child -11", (run.stdout, run.stderr)
    assert f"node 'fragile' on item {K} crashed this process with SIGSEGV" in run.stderr, run.stderr


@pytest.mark.parametrize("executor", IN_PROCESS + CONTAINED)
def test_an_exception_listed_in_retry_on_is_retried_in_place(engines, executor, tmp_path):
    out, runs = _map(engines[executor], flaky_once, tmp_path)
    assert [o["y"] for o in out] == [10 * x for x in range(N)], out
    assert runs == [2 if i == K else 1 for i in range(N)]


def test_an_exception_not_listed_is_not_retried(engines, tmp_path):
    picky = node(output_name="y", retries=3, retry_on=TimeoutError)(flaky_once.func)
    out, runs = _map(engines["sequential"], picky, tmp_path)
    assert isinstance(out[K], Failed) and isinstance(out[K].error.__cause__, OSError) and runs[K] == 1


@pytest.mark.parametrize("executor", CONTAINED + ["async"])
def test_a_timeout_is_enforced(engines, executor, tmp_path):
    out, runs = _map(engines[executor], hangs_async if executor == "async" else hangs, tmp_path)
    err = out[K].error
    assert isinstance(out[K], Failed) and isinstance(err, NodeTimeout) and err.item == K, out[K]
    assert "timeout of 1 s" in str(err)
    assert [o["y"] for i, o in enumerate(out) if i != K] == [10 * x for x in range(N) if x != K]
    assert runs == [1] * N


@pytest.mark.parametrize("executor", IN_PROCESS)
def test_a_timeout_nothing_enforces_is_refused_when_the_plan_is_built(engines, executor, tmp_path):
    with pytest.raises(NodeDefinitionError, match=rf"node 'hangs' has timeout=1, but map_executor='{executor}' "
                                                  r"calls it in this process.*map_executor='process'"):
        _map(engines[executor], hangs, tmp_path)
    assert (tmp_path / "runs.txt").read_text() == ""  # refused before anything ran
    with pytest.raises(NodeDefinitionError, match="Pipeline.run calls it in this process"):
        Pipeline(nodes=[hangs], engine=engines[executor]).run(inputs={"x": 1, "log": str(tmp_path / "runs.txt")})


@node(output_name="y", retries=1, backoff=6)
def patient(x: int, log: str) -> int:
    if x != K:
        time.sleep(0.5)  # 7 items on 2 workers: ~2 s of work, less than the 3-6 s of backoff
    return crash_once.func(x, log)


@pytest.mark.slow  # waits out a backoff
def test_a_crash_retry_waits_out_its_backoff_while_the_other_items_run(engines, tmp_path):
    out, runs = _map(engines["process"], patient, tmp_path)
    order = [int(v) for v in (tmp_path / "runs.txt").read_text().split()]
    assert [o["y"] for o in out] == [10 * x for x in range(N)] and runs[K] == 2
    assert order[-1] == K and order.index(K) < len(order) - 1  # retried after every other item, not at once


def test_backoff_doubles_with_jitter_up_to_its_cap():
    for retry in range(1, 12):
        nominal = min(BACKOFF_MAX, 0.5 * 2 ** (retry - 1))
        drawn = [delay(0.5, retry) for _ in range(200)]
        assert all(nominal / 2 <= d <= nominal for d in drawn) and len(set(drawn)) > 1
    assert delay(0, 3) == 0


BAD_NODES = [
    (dict(retries="x"), "retries='x' is not valid; retries must be a whole number >= 0"),
    (dict(retries=1.5), "retries=1.5 is not valid"),
    (dict(retries=-1), "retries=-1 is not valid"),
    (dict(timeout=-2), "timeout=-2 is not valid; timeout must be a finite number of seconds > 0 or None"),
    (dict(timeout="5s"), "timeout='5s' is not valid"),
    (dict(backoff=-1), "backoff=-1 is not valid"),
    (dict(retry_on=ValueError), "retry_on=<class 'ValueError'> has no effect with retries=0"),
    (dict(retries=2, retry_on="OSError"), "retry_on must be an exception class or a tuple of them"),
    (dict(cache="yes"), "cache='yes' is not valid; cache must be True or False"),
    (dict(isolate=1), "isolate=1 is not valid"),
    (dict(output_name=7), "output_name must be a string or a tuple of strings, got 7"),
    (dict(output_name=""), "output_name must be a string or a tuple of strings"),
    (dict(name=""), "a node's name must be a non-empty string"),
]


@pytest.mark.parametrize("kwargs, message", BAD_NODES, ids=[str(k) for k, _ in BAD_NODES])
def test_node_arguments_get_one_clear_message(kwargs, message):
    with pytest.raises(NodeDefinitionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        node(**kwargs)(lambda x: x) if "output_name" in kwargs else node(output_name="y", **kwargs)(lambda x: x)


def test_a_lambda_needs_an_output_name():
    with pytest.raises(NodeDefinitionError, match="a lambda node needs output_name="):
        node(lambda x: x + 1)
    with pytest.raises(NodeDefinitionError, match="a lambda node needs output_name="):
        Pipeline(nodes=[lambda x: x + 1])
    assert node(lambda x: x + 1, output_name="y").outputs == ("y",)


BAD_ENGINES = [
    (dict(workers=0), "workers=0 is not valid; workers must be a whole number >= 1 or None"),
    (dict(workers=2.5), "workers=2.5 is not valid"),
    (dict(workers=True), "workers=True is not valid"),
    (dict(map_executor="processes"), "map_executor='processes'\\) is not one of"),
    (dict(map_executor=4), "map_executor=4\\) is not one of"),
    (dict(node_executor="process"), "node_executor='process'\\) is not one of"),
    (dict(start_method="frok"), "start_method='frok'\\) is not one of"),
    (dict(preload="torch"), "preload='torch' is not valid; preload must be a list of strings, e.g. preload=\\['torch'\\]"),
    (dict(preload_libs=[1]), "preload_libs=\\[1\\] is not valid"),
    (dict(max_tasks_per_worker=0), "max_tasks_per_worker=0 is not valid"),
    (dict(max_memory_per_worker="lots"), "max_memory_per_worker='lots' is not valid; .* such as '10GB'"),
    (dict(max_memory_per_worker=0), "max_memory_per_worker=0 is not valid"),
    (dict(cache="/tmp/c"), "cache='/tmp/c'\\) is not a cache; pass DiskCache\\(path\\)"),
]


@pytest.mark.parametrize("kwargs, message", BAD_ENGINES, ids=[str(k) for k, _ in BAD_ENGINES])
def test_engine_arguments_get_one_clear_message(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        Engine(**kwargs)


@node(output_name="y", retries=2, retry_on=ConnectionError)
def always_down(x: int) -> int:
    raise ConnectionError(f"service down for {x}")


@node(output_name="y", retries=1, retry_on=ConnectionError)
async def always_down_async(x: int) -> int:
    await asyncio.sleep(0)
    raise ConnectionError(f"service down for {x}")


@pytest.mark.parametrize("name", ["sequential", "threaded", "process"])
def test_an_item_that_failed_every_attempt_says_how_many_ran(name):
    """The last attempt's exception carries a note saying every attempt raised: its message alone
    read as a first failure, on every executor."""
    from conftest import engine_named
    with engine_named(name) as engine:
        for n, tries in ((always_down, 3), (always_down_async, 2)):
            out = Pipeline([n], engine=engine).map(inputs={"x": [7]}, map_over="x", on_error="continue")
            cause = out[0].error.__cause__
            assert isinstance(cause, ConnectionError) and str(cause) == "service down for 7"
            assert cause.__notes__ == [f"node {n.name!r} was tried {tries} times (retries={tries - 1}); this is the "
                                       "last attempt's error"]


@pytest.mark.parametrize("how", ["map", "imap"])
@pytest.mark.parametrize("executor", IN_PROCESS)
def test_os_exit_in_a_node_in_process_names_node_and_item_as_a_crash_does(executor, how, tmp_path):
    """`os._exit(3)` in a node ended the process with code 3 and not a word (no handler, atexit or
    `finally` runs); now it first names node and item and what contains it, as a crash does.
    Exits that are no node's say nothing: a process the node forked, and the script's own."""
    script = tmp_path / "exits.py"
    script.write_text(textwrap.dedent(f"""
        import os
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def leaves(x):
            if x == {K}:
                os._exit(3)
            if x == 0:  # a child the node forks, which leaves by os._exit as multiprocessing's do
                pid = os.fork()
                if pid == 0:
                    os._exit(5)
                assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 5
            return x

        p = Pipeline(nodes=[leaves], engine=Engine(map_executor={executor!r}))
        print(list(p.{how}(inputs={{"x": list(range({K}))}}, map_over="x")), flush=True)
        if os.environ.get("EXIT_ITSELF"):
            os._exit(4)
        list(p.{how}(inputs={{"x": list(range({N}))}}, map_over="x"))
        print("survived")
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 3 and "survived" not in run.stdout, (run.returncode, run.stderr)
    assert run.stderr.count("hardy:") == 2, run.stderr  # (nothing from the forked child's exit)
    assert f"hardy: node 'leaves' on item {K} called os._exit(3), which ends this process.\n" in run.stderr
    assert (f"hardy: map_executor={executor!r} runs nodes in this process, so the exit ends it; "
            'map_executor="process" or @node(isolate=True) contains it: only that item would fail.') in run.stderr
    itself = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "EXIT_ITSELF": "1"})
    assert itself.returncode == 4 and itself.stderr == "", itself.stderr

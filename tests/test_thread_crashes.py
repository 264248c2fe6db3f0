"""Which item a worker's crash belongs to, when the crashing thread is not the node's: a Python
thread that an earlier item's node started (a prefetch thread) crashing while the next item runs
names that thread and that item, and the item in flight runs again, never blamed, at most
`MAX_THREAD_RERUNS` times; a thread the item itself started, and a native thread (an OpenMP team
working for the node's call), stay the node's. Real segfaults in gcc-built libraries, in users'
scripts (`python -`, no `__main__` guard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import build_library
from hardy.crash.blame import MAX_THREAD_RERUNS

SRC = str(Path(__file__).resolve().parents[1] / "src")

C_SOURCE = r"""
#include <unistd.h>
__attribute__((noinline)) static int crash_inner(volatile int *p) { return *p + 1; }
int crash_after(int ms) { usleep(ms * 1000); return crash_inner((volatile int *)0); }
"""

OMP_SOURCE = r"""
#include <omp.h>
__attribute__((noinline)) static int crash_inner(volatile int *p) { return *p + 1; }
int team_crash(void) {
    int s = 0;
    #pragma omp parallel num_threads(4) reduction(+:s)
    { if (omp_get_thread_num() == 2) s += crash_inner((volatile int *)0); else s += 1; }
    return s;
}
"""

HEAD = """
import ctypes, json, sys, threading, time
from hardy import Engine, Failed, Pipeline, node

LIB = sys.argv[1]

def run_map(step, xs):  # on one worker; each item's result, or its error's first line, as JSON
    with Engine(map_executor="process", workers=1) as engine:
        out = Pipeline(nodes=[step], engine=engine).map(inputs={"x": xs}, map_over="x", on_error="continue")
    print(json.dumps([o if not isinstance(o, Failed) else str(o.error).splitlines()[0] for o in out]))
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("threads")
    return {"libprefetch.so": str(build_library(folder, "libprefetch.so", C_SOURCE, "-O1")),
            "libteam.so": str(build_library(folder, "libteam.so", OMP_SOURCE, "-O1", "-fopenmp"))}


def run_script(body: str, *args: str, cwd: Path | None = None) -> tuple[list[object], str]:
    env = {**os.environ, "PYTHONPATH": SRC + (os.pathsep + str(cwd) if cwd else "")}
    done = subprocess.run([sys.executable, "-", *args], input=HEAD + textwrap.dedent(body), capture_output=True,
                          text=True, env=env, timeout=240, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_a_crash_in_a_thread_an_earlier_item_started_costs_no_item(libs):
    out, said = run_script("""
        @node(output_name="y")
        def load(x):
            if x == 0:  # item 0 starts a prefetch thread, which crashes while item 1 runs
                threading.Thread(target=ctypes.CDLL(LIB).crash_after, args=(300,), name="prefetch").start()
            if x == 1:
                time.sleep(1.5)
            return x * 10

        run_map(load, [0, 1, 2])
    """, libs["libprefetch.so"])
    assert out == [{"y": 0}, {"y": 10}, {"y": 20}], said  # item 1 ran again, on a fresh worker
    assert "a worker died in thread 'prefetch' (started by item 0, in node 'load'), not in the work in flight: " \
           "worker died from SIGSEGV in libprefetch.so (crash_inner+0x" in said, said
    assert "Item(s) 1 run again, not blamed (1 of 3)" in said, said


def test_a_crash_in_a_thread_the_item_started_is_the_items(libs):
    out, said = run_script("""
        @node(output_name="y")
        def load(x):
            if x == 1:
                worker = threading.Thread(target=ctypes.CDLL(LIB).crash_after, args=(100,), name="own-prefetch")
                worker.start()
                worker.join()
            return x * 10

        run_map(load, [0, 1, 2])
    """, libs["libprefetch.so"])
    assert out[0] == {"y": 0} and out[2] == {"y": 20}
    assert out[1].startswith("node 'load' failed on item 1 (inputs: x=1): worker died from SIGSEGV in "
                             "libprefetch.so (crash_inner+0x"), out[1]
    assert out[1].endswith(", in thread 'own-prefetch' (started by item 1, in node 'load')"), out[1]
    assert "not in the work in flight" not in said


def test_a_crash_in_a_native_thread_of_the_nodes_openmp_team_is_the_nodes(libs):
    out, _ = run_script("""
        @node(output_name="y")
        def reduce(x):
            return ctypes.CDLL(LIB).team_crash() if x == 1 else x

        run_map(reduce, [0, 1, 2])
    """, libs["libteam.so"])
    assert out[0] == {"y": 0} and out[2] == {"y": 2}
    assert out[1].startswith("node 'reduce' failed on item 1 (inputs: x=1): worker died from SIGSEGV in "
                             "libteam.so"), out[1]
    assert "in thread" not in out[1]


@pytest.mark.slow  # crashes repeated up to the bound
def test_an_item_that_keeps_meeting_other_threads_crashes_fails_after_a_bounded_number_of_runs(libs, tmp_path):
    # a module whose import starts a thread, in worker processes, that crashes a second later: each
    # fresh worker imports it as it loads the pipeline, so item 1 (slow) meets that crash on every
    # worker it runs on
    (tmp_path / "ticking.py").write_text(textwrap.dedent("""
        import ctypes, os, sys, threading, time
        from hardy import node

        if os.environ["SCRIPT_PID"] != str(os.getpid()):  # not in the script's own process
            threading.Thread(target=ctypes.CDLL(sys.argv[1]).crash_after, args=(1000,), name="ticker",
                             daemon=True).start()

        @node(output_name="y")
        def slow(x):
            time.sleep(3 if x == 1 else 0)
            return x
    """))
    out, said = run_script("""
        import os
        os.environ["SCRIPT_PID"] = str(os.getpid())
        import ticking
        run_map(ticking.slow, [0, 1])
    """, libs["libprefetch.so"], cwd=tmp_path)
    assert out[0] == {"y": 0}
    assert out[1].startswith("node 'slow' failed on item 1 (inputs: x=1): worker died from SIGSEGV"), out[1]
    assert out[1].endswith(f", in thread 'ticker' (started outside any item (while the worker loaded a pipeline, "
                           f"or between items)), {MAX_THREAD_RERUNS + 1} time(s) while this item ran"), out[1]
    assert said.count("Item(s) 1 run again, not blamed") == MAX_THREAD_RERUNS, said

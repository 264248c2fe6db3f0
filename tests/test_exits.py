"""A node that ends its worker keeps every finished result: `os._exit()`, `exit()` called from C
(a real gcc-built library) and a BaseException out of the worker's loop send what is finished
before the process ends, so no finished item runs twice (its side effects happen once); the item
that ended it fails, naming how. A node's own fork children exit as they always did. Each case is a
user's script (`python -`, no `__main__` guard) whose node counts its runs in a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import build_library

SRC = str(Path(__file__).resolve().parents[1] / "src")

C_SOURCE = r"""
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
void quit_now(int code) { exit(code); }
int fork_and_crash(void) {  /* a helper process forked from C, which segfaults */
    pid_t pid = fork();
    if (pid == 0) {
        *(volatile int *)0 = 1;
        _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) ? -WTERMSIG(status) : WEXITSTATUS(status);
}
"""

SCRIPT = r"""
import collections, ctypes, json, os, sys
from hardy import Engine, Failed, Pipeline, node

RUNS, HOW, LIB = sys.argv[1], sys.argv[2], sys.argv[3]


class Stop(BaseException):
    pass


@node(output_name="y")
def step(x):
    with open(RUNS, "a") as f:  # a side effect: it must happen once per item
        f.write(f"{x}\n")
    if x == 37:
        if HOW == "os._exit":
            os._exit(3)
        if HOW == "exit-from-c":
            ctypes.CDLL(LIB).quit_now(4)
        if HOW == "base-exception":
            raise Stop("out of the loop")
    return x * 2


with Engine(map_executor="process", workers=1) as engine:
    out = Pipeline(nodes=[step], engine=engine).map(inputs={"x": list(range(100))}, map_over="x",
                                                    on_error="continue")
runs = collections.Counter(int(line) for line in open(RUNS))
print(json.dumps({"twice": sorted(k for k, n in runs.items() if n > 1), "missing": sorted(set(range(100)) - set(runs)),
                  "ok": [o == {"y": 2 * x} for x, o in enumerate(out)].count(True),
                  "failed": {x: str(o.error) for x, o in enumerate(out) if isinstance(o, Failed)}}))
"""


def run_script(code: str, *args: str, timeout: float = 180,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-", *args], input=textwrap.dedent(code), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": SRC, **(env or {})}, timeout=timeout)


@pytest.fixture(scope="module")
def quitting_lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_library(tmp_path_factory.mktemp("exits"), "libquit.so", C_SOURCE, "-O1"))


@pytest.mark.parametrize(("how", "said", "line"), [
    ("os._exit", "worker exited with code 3: os._exit(3) was called", 18),
    ("exit-from-c", "worker exited with code 4: exit(4) was called by native code", 20),
    ("base-exception", "worker exited with code 0: Stop('out of the loop') ended the worker's loop", None),
])
def test_a_node_that_ends_its_worker_keeps_every_finished_result(how, said, line, quitting_lib, tmp_path):
    done = run_script(SCRIPT, str(tmp_path / "runs"), how, quitting_lib)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["twice"] == [] and out["missing"] == [], out  # every item ran, and exactly once
    assert out["ok"] == 99 and list(out["failed"]) == ["37"], out
    error = out["failed"]["37"]
    assert error.startswith(f"node 'step' failed on item 37 (inputs: x=37): {said}"), error
    assert line is None or f'File "<stdin>", line {line} in step' in error, error  # where it was called
    if how == "exit-from-c":
        assert "libquit.so" in error and "(quit_now+0x" in error, error  # the library that called exit()


def test_a_nodes_fork_children_exit_their_own_way(quitting_lib):
    done = run_script("""
        import ctypes, multiprocessing, os, sys
        from hardy import Engine, Pipeline, node

        def child(code):
            sys.exit(code)  # multiprocessing's child leaves through os._exit(code)

        @node(output_name="codes")
        def forks(x, lib):
            ctx = multiprocessing.get_context("fork")
            p = ctx.Process(target=child, args=(x,))
            p.start()
            p.join()
            pid = os.fork()
            if pid == 0:
                ctypes.CDLL(lib).quit_now(x + 1)  # exit() from C in a fork child of the worker
            _, status = os.waitpid(pid, 0)
            return p.exitcode, os.waitstatus_to_exitcode(status)

        with Engine(map_executor="process", workers=1) as engine:
            print(Pipeline(nodes=[forks], engine=engine).map(inputs={"x": [5, 6, 7], "lib": sys.argv[1]},
                                                             map_over="x"))
    """, quitting_lib)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "[{'codes': (5, 6)}, {'codes': (6, 7)}, {'codes': (7, 8)}]", done.stdout + done.stderr


@pytest.mark.parametrize("handler", ["auto", "ctypes", "off"])
def test_a_nodes_fork_child_that_crashes_is_its_own_affair(handler, quitting_lib):
    """A helper process that a node forks (multiprocessing's, a DataLoader's, one forked from C)
    and that crashes dies of its signal as it would outside hardy. Before, it inherited the
    worker's crash handlers: it sent the worker's unsent results to the parent as its own last
    words (each of those items ended twice), and wrote its stacks into the worker's crash record,
    so the worker's own later crash was reported at the helper's line. With each native handler:
    compiled, through ctypes, none (`HARDY_NATIVE_HANDLER`)."""
    done = run_script("""
        import collections, ctypes, json, os, sys
        from hardy import Engine, Pipeline, PipelineCallback, node

        class Ends(PipelineCallback):
            def __init__(self):
                self.ends = collections.Counter()

            def on_map_item_end(self, i, duration, ctx):
                self.ends[i] += 1

        @node(output_name="y")
        def step(x, lib):
            if x == 20:  # a helper process this node forks crashes; the node carries on
                pid = os.fork()
                if pid == 0:
                    ctypes.string_at(0)
                return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if x == 30:  # the same, forked from C
                return ctypes.CDLL(lib).fork_and_crash()
            if x == 40:
                ctypes.string_at(0)  # the worker's own crash
            return x

        ends = Ends()
        with Engine(map_executor="process", workers=1) as engine:
            out = Pipeline(nodes=[step], engine=engine, callbacks=[ends]).map(
                inputs={"x": list(range(60)), "lib": sys.argv[1]}, map_over="x", on_error="continue")
        print(json.dumps({"helpers": [out[20], out[30]], "twice": sorted(i for i, n in ends.ends.items() if n > 1),
                          "ok": [o == {"y": x} for x, o in enumerate(out)].count(True), "error": str(out[40].error)}))
    """, quitting_lib, env={"HARDY_NATIVE_HANDLER": handler})
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["helpers"] == [{"y": -11}, {"y": -11}], out  # each helper died of its SIGSEGV
    assert out["twice"] == [] and out["ok"] == 57, out  # no item ended twice; all but 20, 30 and 40 as computed
    error = out["error"]
    assert error.startswith("node 'step' failed on item 40 (inputs: lib="), error
    assert "SIGSEGV" in error and 'File "<stdin>", line 22 in step' in error, error  # the worker's own line
    assert "line 17 in step" not in error, error  # not the Python helper's
    if handler != "off":  # (without a native handler, faulthandler writes a C helper's stack: it cannot tell)
        assert "line 20 in step" not in error, error


def test_a_result_whose_pickling_calls_sys_exit_fails_its_item_and_ends_nothing():
    """Before, the SystemExit ended the worker with every unsent result, and each fresh worker did
    the same again: the map never ended."""
    done = run_script("""
        import sys
        from hardy import Engine, Pipeline, node

        class Quits:
            def __reduce__(self):
                sys.exit(9)

        @node(output_name="y")
        def make(x):
            return Quits() if x == 5 else x

        with Engine(map_executor="process", workers=1) as engine:
            out = Pipeline(nodes=[make], engine=engine).map(inputs={"x": list(range(100))}, map_over="x",
                                                            on_error="continue")
        print([o == {"y": x} for x, o in enumerate(out)].count(True), out[5].error)
    """, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == (
        "99 node 'make' failed on item 5: its output 'y' (__main__.Quits) cannot be pickled back to the parent "
        "process (SystemExit: 9); return plain data (numbers, arrays, dicts, paths) or make the type picklable"), \
        done.stdout + done.stderr

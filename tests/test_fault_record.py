"""A dead worker's fault record is read once: the parent opens the file one time per death, and
every part of the error (the sentence, the Python stack of the node's thread and of every thread,
the native frames, the chain of nested plans) comes from that one reading. Real segfaults in real
workers, counted by an audit hook in a user's script (`python -`, no `__main__` guard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

COUNTING = """
import ctypes, json, os, sys
from hardy import Engine, Failed, Pipeline, node

opened = []

def count(event, args):  # every open of a worker's fault record (a memfd named "worker-fault")
    if event == "open" and isinstance(args[0], str) and args[0].startswith("/proc/self/fd/"):
        try:
            if "worker-fault" in os.readlink(args[0]):
                opened.append(args[0])
        except OSError:
            pass

sys.addaudithook(count)
"""


def run_script(code: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-"], input=textwrap.dedent(COUNTING) + textwrap.dedent(code),
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    said: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return said


def test_each_death_opens_the_fault_record_once():
    """Two deaths (a node with one retry that segfaults both times): two opens, and the error
    still has its sentence, both stacks and the native frames."""
    said = run_script("""
        @node(output_name="y", retries=1)
        def crashes(x):
            if x == 1:
                ctypes.string_at(0)
            return x

        with Engine(map_executor="process", workers=1) as engine:
            out = Pipeline(nodes=[crashes], engine=engine).map(inputs={"x": [0, 1, 2]}, map_over="x",
                                                               on_error="continue")
        err = out[1].error
        print(json.dumps({"opens": len(opened), "first": str(err).splitlines()[0], "stack": err.stack,
                          "threads": err.threads, "frames": len(err.native_frames), "ok": [out[0], out[2]]}))
    """)
    assert said["ok"] == [{"y": 0}, {"y": 2}]
    assert "worker died from SIGSEGV" in str(said["first"]), said
    assert "in crashes" in str(said["stack"]) and "in crashes" in str(said["threads"]), said
    assert said["opens"] == 2, said


def test_a_death_inside_a_nested_map_opens_it_once_too():
    """The chain of nested plans comes from the same reading as the rest."""
    said = run_script("""
        @node(output_name="y")
        def inner(x):
            if x == 1:
                ctypes.string_at(0)
            return x

        @node(output_name="total")
        def outer(xs):
            return sum(o["y"] for o in Pipeline(nodes=[inner]).map(inputs={"x": xs}, map_over="x",
                                                                     on_error="continue") if not isinstance(o, Failed))

        with Engine(map_executor="process", workers=1) as engine:
            out = Pipeline(nodes=[outer], engine=engine).map(inputs={"xs": [[0, 1, 2]]}, map_over="xs",
                                                             on_error="continue")
        result = out[0] if not isinstance(out[0], Failed) else str(out[0].error).splitlines()[0]
        print(json.dumps({"opens": len(opened), "result": result}))
    """)
    assert said["opens"] == 1, said

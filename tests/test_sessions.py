"""Processes a node starts end with its worker, even those that leave the worker's session: a
`subprocess.Popen(start_new_session=True)` child and a grandchild that calls `setsid()` and
outlives its parent. They live as long as the worker (a node may keep a server it started), and
are gone after `engine.close()`, after a script using the default engine exits, after the worker
crashes, after it is SIGKILLed from outside, and with `start_method="fork"`. Users' scripts
(`python -`, no `__main__` guard), real sessions, real signals."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def running(pids: list[list[int]]) -> list[int]:
    """Those of the processes still running (not exited, and their pid not taken by another since),
    here and in the scripts."""
    alive = []
    for pid, start in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] not in "ZX" and int(fields[19]) == start:
            alive.append(pid)
    return alive


HEAD = r'''
import json, os, signal, subprocess, sys, time
from hardy import Engine, Failed, Pipeline, node

GRANDCHILD = """
import os, sys, time
os.setsid()
if os.fork() == 0:  # the grandchild: its parent exits at once, so it is nobody's child any more
    print(os.getpid(), flush=True)
    null = os.open(os.devnull, os.O_RDWR)  # lets go of the pipes its starter reads to the end
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(600)
"""


@node(output_name="started")
def escape(x):
    """Leaves two processes behind, in sessions of their own; returns [pid, its start time] of each."""
    if x < 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    out = subprocess.run([sys.executable, "-c", GRANDCHILD], capture_output=True, text=True, check=True)
    child = subprocess.Popen(["sleep", "600"], start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    return [[pid, started(pid)] for pid in (int(out.stdout), child.pid)] + [[os.getpid(), started(os.getpid())]]


def started(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[19])


def gone(pids):
    """Whether all have ended, waiting up to a minute for the kernel to deliver the kills."""
    for _ in range(600):
        if not running(pids):
            return True
        time.sleep(0.1)
    return False
''' + inspect.getsource(running)


@pytest.fixture
def script():
    """Runs a script; afterwards ends whatever it left running (a failed test leaves nothing behind)."""
    left: list[list[int]] = []

    def run(body: str) -> dict[str, object]:
        env = {**os.environ, "PYTHONPATH": SRC}
        done = subprocess.run([sys.executable, "-"], input=HEAD + body, capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        out: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
        left.extend(out["left"])  # type: ignore[arg-type]
        return out
    yield run
    for pid in running(left):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_they_live_as_long_as_the_worker_and_end_with_the_engine(start_method, script):
    out = script(f"""
engine = Engine(map_executor="process", workers=1, start_method={start_method!r})
first = Pipeline(nodes=[escape], engine=engine).map(inputs={{"x": [1, 2]}}, map_over="x")
left = [p for o in first for p in o["started"][:2]]
second = Pipeline(nodes=[escape], engine=engine).map(inputs={{"x": [3]}}, map_over="x")  # the worker lives on
alive_between = running(left)
left += second[0]["started"][:2]
engine.close()
print(json.dumps({{"between": alive_between, "left": left, "gone": gone(left)}}))
""")
    assert sorted(out["between"]) == sorted(p for p, _ in out["left"][:4])  # not ended while their worker lives
    assert out["gone"], out


def test_a_script_on_the_default_engine_leaves_none_behind(script):
    out = script("""
out = Pipeline(nodes=[escape]).map(inputs={"x": [1, 2, 3]}, map_over="x")
print(json.dumps({"left": [p for o in out for p in o["started"][:2]]}))
""")
    deadline = time.monotonic() + 60
    while running(out["left"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(out["left"]) == [], out


@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_a_crashed_workers_processes_end_with_it(start_method, script):
    out = script(f"""
engine = Engine(map_executor="process", workers=1, start_method={start_method!r})
first = Pipeline(nodes=[escape], engine=engine).map(inputs={{"x": [1, -1]}}, map_over="x", on_error="continue")
assert isinstance(first[1], Failed), first
left = first[0]["started"][:2]
print(json.dumps({{"gone": gone(left), "left": left}}))  # the engine still open: the crash ended them
engine.close()
""")
    assert out["gone"], out


def test_a_worker_killed_from_outside_has_its_processes_ended_by_its_fork_server(script):
    out = script("""
engine = Engine(map_executor="process", workers=1)
first = Pipeline(nodes=[escape], engine=engine).map(inputs={"x": [1]}, map_over="x")
left, worker = first[0]["started"][:2], first[0]["started"][2][0]
os.kill(worker, signal.SIGKILL)  # the OOM killer's way: no last words
print(json.dumps({"gone": gone(left), "left": left}))
engine.close()
""")
    assert out["gone"], out


def test_a_worker_never_piles_up_more_than_zombies_max_exited_orphans(caplog):
    """A subreaper adopts the orphans of its nodes' processes, and nobody else collects them once
    they exit: a worker whose nodes leave many (a shell's `cmd &`) retires after ZOMBIES_MAX, and
    its fork server collects them; no item is lost or run twice."""
    from hardy import Engine, Pipeline, node
    from hardy.workers.lifeline import ZOMBIES_MAX

    @node(output_name="y")
    def leaves_an_orphan(x: int) -> tuple[int, int, int]:
        subprocess.run(["sh", "-c", "true & exit 0"], check=True)  # `true` outlives its shell, then exits
        me, exited = os.getpid(), 0
        tasks = Path(f"/proc/{me}/task")
        children = [c for t in tasks.iterdir() for c in (t / "children").read_text().split()]
        for c in children:
            try:
                exited += Path(f"/proc/{c}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
            except OSError:
                pass
        return x, me, exited

    with caplog.at_level("INFO", logger="hardy.workers"), Engine(map_executor="process", workers=1) as engine:
        out = Pipeline(nodes=[leaves_an_orphan], engine=engine).map(inputs={"x": list(range(2 * ZOMBIES_MAX + 50))},
                                                                    map_over="x")
    assert [o["y"][0] for o in out] == list(range(2 * ZOMBIES_MAX + 50))
    assert max(o["y"][2] for o in out) < ZOMBIES_MAX + 64  # at most a chunk's worth past the bound
    assert len({o["y"][1] for o in out}) >= 2, "no worker retired"
    assert "retired because it held 100 or more exited processes" in caplog.text, caplog.text

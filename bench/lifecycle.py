"""Worker-process lifecycle, measured (no `__main__` guard: hardy's workers never re-run this file).

    python bench/lifecycle.py

1. A parent process SIGKILLed (and SIGTERMed) while an item hangs and its node has started a child
   process: time until every descendant (fork server, workers, the node's child) is gone
   (target <= 2 s).
2. A second engine with another `preload=` while the first one's workers live: time of its first
   map (target <= 100 ms + a worker start), against an engine that shares the first one's server
   (a worker start alone).
3. An `@node(isolate=True)` of 0.2 s called from 4 threads on 4 workers, against one call.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil

from hardy import Engine, Pipeline, node
from workers import show, timed  # bench/workers.py

HANGING_PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from hardy import Engine, Pipeline, node

    @node(output_name="y")
    def hang(x, marker):
        if x == 1:
            subprocess.Popen(["sleep", "1000"])
            open(marker, "w").close()
            time.sleep(1000)
        return x

    Pipeline(nodes=[hang], engine=Engine(map_executor="process", workers=2)).map(
        inputs={"x": [0, 1, 2, 3], "marker": sys.argv[1]}, map_over="x")
""")


def running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def parent_death(sig: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        script, marker = os.path.join(tmp, "job.py"), os.path.join(tmp, "started")
        with open(script, "w") as f:
            f.write(HANGING_PARENT)
        parent = subprocess.Popen([sys.executable, script, marker])
        while not os.path.exists(marker):
            time.sleep(0.01)
        family = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
        start = time.perf_counter()
        os.kill(parent.pid, sig)
        parent.wait()
        while running(family) and time.perf_counter() - start < 30:
            time.sleep(0.002)
        return time.perf_counter() - start


@node(output_name="y")
def ident(x: int) -> int:
    return x


def first_map(preload: list[str]) -> float:
    with Engine(map_executor="process", workers=1, preload=preload) as e:
        t = time.perf_counter()
        Pipeline(nodes=[ident], engine=e).map(inputs={"x": [1]}, map_over="x")
        return time.perf_counter() - t


def second_preload(rows: list) -> None:
    with Engine(map_executor="process", workers=1, preload=["colorsys"]) as first:
        Pipeline(nodes=[ident], engine=first).map(inputs={"x": [0]}, map_over="x")  # its server is up
        shared = statistics.median(first_map(["colorsys"]) for _ in range(7))
        other = statistics.median(first_map(["wave"]) for _ in range(7))
    rows.append(("first map of a 2nd engine", "same preload: shares the live server", f"{shared * 1000:.0f} ms",
                 "a worker start"))
    floor = statistics.median(timed(lambda: subprocess.run([sys.executable, "-c", "pass"])) for _ in range(7))
    rows.append(("", "another preload: its own server, side by side", f"{other * 1000:.0f} ms",
                 f"+{(other - shared) * 1000:.0f} ms for the server"))
    rows.append(("", "floor: `python -c pass`, any fresh process", f"{floor * 1000:.0f} ms",
                 f"server = {(other - shared) / floor:.1f}x the floor"))


@node(output_name="t", isolate=True)
def nap(x: int) -> float:
    time.sleep(0.2)
    return x


def isolated_threads(rows: list) -> None:
    with Engine(workers=4) as e:
        p = Pipeline(nodes=[nap], engine=e)
        for _ in range(2):  # all 4 workers up
            threads = [threading.Thread(target=p.run, kwargs={"inputs": {"x": k}}) for k in range(4)]
            [t.start() for t in threads]
            [t.join() for t in threads]
        one = min(timed(lambda: p.run(inputs={"x": 0})) for _ in range(3))

        def four() -> None:
            threads = [threading.Thread(target=p.run, kwargs={"inputs": {"x": k}}) for k in range(4)]
            [t.start() for t in threads]
            [t.join() for t in threads]
        both = min(timed(four) for _ in range(3))
    rows.append(("isolated 0.2 s node, 4 workers", "1 call", f"{one:.2f} s", "1.00x"))
    rows.append(("", "4 calls from 4 threads", f"{both:.2f} s", f"{both / one:.2f}x one call (4.00x if serialised)"))


rows: list = []
for sig in (signal.SIGKILL, signal.SIGTERM):
    samples = [parent_death(sig) for _ in range(5)]
    rows.append((f"parent {sig.name} -> all descendants gone", "fork server, 2 workers, a node's child",
                 f"{statistics.median(samples) * 1000:.0f} ms", f"max {max(samples) * 1000:.0f} ms of 5"))
second_preload(rows)
isolated_threads(rows)
show("worker lifecycle", rows)

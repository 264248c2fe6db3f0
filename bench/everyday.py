"""The default engine's everyday calls against the floor and the peers, in one run (no `__main__`
guard, as users write scripts; hardy's workers never re-run this file).

    python bench/everyday.py [calls] [maps] [start] [first] [cpu] [soak]   (all by default)

Work: three trivial nodes (a = x+1, b = 2a, c = a+b). Each figure is the best of 5 rounds (a round:
many calls, their mean), the rows of a section taking turns round after round, so that a busy
moment of this shared machine falls on all of them alike; the load average is printed.
`multiprocessing.Pool` and hardy's sequential executor run in processes of their own and time their
calls there (`side_process`).

1. calls: one call. The floor is a bare pipe round trip between two Python processes with the same
   payloads (a pickled int out, the 3-key dict back, over a socket pair as the pools use); beside
   it `multiprocessing.Pool.apply`, HyperNodes 0.4.8's in-process `run()` (bench/.venv-hn, made
   here or by tests/test_hypernodes_compat.py), hardy's sequential executor and its default.
   Target: the default `run()` <= 1.25x the floor.
2. maps: a map of 100 and of 10,000 items: `Pool.map` of the same function, hardy sequential and
   hardy default. Targets: <= 1.5x Pool.map (100 items), <= 1.0x (10,000).
3. start: a fresh worker with torch preloaded (`Engine(preload=["torch"], max_tasks_per_worker=1)`:
   each call starts one), beside what the fork server's own fork of such a process costs.
   Target: <= 50 ms.
4. first: the first default map (10 items) in a fresh interpreter, with compiled bytecode as an
   installed package has it, against a bare `python -c pass`, and where the time goes.
   Target: <= 100 ms above the bare interpreter.
5. cpu: 200 items x 10 ms of CPU, the default map against the plain loop. Target: >= 1.9x.
6. soak: maps of 10,000 items of which 1 in 1,000 segfaults, on_error="continue". Target: 0 lost.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _measure import three_nodes  # bench/_measure.py
from hardy import Engine, Failed, NodeCrashed, Pipeline, node
from workers import burn  # bench/workers.py

ROUNDS = 5
HERE = Path(__file__).resolve().parent
VENV_HN = HERE / ".venv-hn"


def three(x: int) -> dict:
    a = x + 1
    b = 2 * a
    return {"a": a, "b": b, "c": a + b}


NODES = three_nodes(node)  # a = x+1, b = 2a, c = a+b (bench/_measure.py)


def plus_one(x: int) -> int:  # a module's function: a fresh worker imports it (its nodes above travel by value)
    return x + 1


def rounds(cases: dict, number: dict) -> dict:
    """{name: seconds per call}, the best of ROUNDS rounds; each round runs every case once, in
    turn, `number[name]` calls of it (one warm-up round first), timed here or, for an
    `Elsewhere` case, where it runs."""
    best = dict.fromkeys(cases, float("inf"))
    for r in range(ROUNDS + 1):
        for name, call in cases.items():
            n = number[name]
            if isinstance(call, Elsewhere):
                took = call(n)
            else:
                t = time.perf_counter()
                for _ in range(n):
                    call()
                took = (time.perf_counter() - t) / n
            if r:
                best[name] = min(best[name], took)
    return best


class Elsewhere:
    """`n` calls timed in a process of their own (`side_process`): seconds per call. `what`: which
    of its calls, over a list of `size` items."""

    def __init__(self, side: Connection, what: str, size: int = 0):
        self.side, self.what, self.size = side, what, size

    def __call__(self, n: int) -> float:
        self.side.send((self.what, n, self.size))
        return self.side.recv()


def side_process(make: Callable[[], tuple[dict[str, Callable[[list], Any]], Callable[[], Any]]]
                 ) -> tuple[Connection, int]:
    """A forked process that makes its calls (`make()`, there: {what: call(items)}, and how to
    close them) and times them there (`Elsewhere`), until it is sent None. Each contender runs in
    a process of its own, as a user's program would: `Pool`'s three threads in hardy's process
    would switch hardy's collector pause off (it pauses only while the parent is the process's one
    thread, `workers.scheduling._collector_paused`), and an in-process map's garbage would be the default
    map's collector's work (its full collections landed in the default's rounds: 3.1 ms a map
    alone, 3.9 ms taking turns in one process)."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        conn = Connection(theirs.detach())
        made, close = make()
        while True:
            try:
                asked = conn.recv()
            except EOFError:
                asked = None
            if asked is None:
                close()
                os._exit(0)
            what, n, size = asked
            call, xs = made[what], list(range(size))
            t = time.perf_counter()
            for _ in range(n):
                call(xs)
            conn.send((time.perf_counter() - t) / n)
    theirs.close()
    return Connection(ours.detach()), pid


def pool_calls() -> tuple[dict[str, Callable[[list], Any]], Callable[[], Any]]:
    """`multiprocessing.Pool(2)`'s calls of `three` (forked: it is the function of this module)."""
    pool = mp.get_context("fork").Pool(2)
    pool.map(three, range(100))
    return {"apply": lambda xs: pool.apply(three, (1,)), "map": lambda xs: pool.map(three, xs)}, pool.terminate


def sequential_calls() -> tuple[dict[str, Callable[[list], Any]], Callable[[], Any]]:
    """hardy's in-process executor's calls of the same nodes."""
    p = Pipeline(NODES, engine=Engine(map_executor="sequential"))
    return {"run": lambda xs: p.run(inputs={"x": 1}),
            "map": lambda xs: p.map(inputs={"x": xs}, map_over="x")}, lambda: None


def echo_server() -> tuple[Connection, int]:
    """A second Python process answering each pickled int with the 3-key dict: the floor."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        conn = Connection(theirs.detach())
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:
                os._exit(0)
            conn.send_bytes(pickle.dumps(three(pickle.loads(data)), protocol=5))
    theirs.close()
    return Connection(ours.detach()), pid


def hypernodes_run() -> tuple[float | None, str]:
    """HyperNodes 0.4.8's in-process run() of the same nodes, best of ROUNDS rounds, in its venv."""
    python = VENV_HN / "bin" / "python"
    if not python.exists():
        made = subprocess.run([sys.executable, "-m", "venv", str(VENV_HN)], capture_output=True, text=True)
        pip = made if made.returncode else subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "hypernodes==0.4.8", "tqdm", "cloudpickle", "pyarrow"],
            capture_output=True, text=True)
        if pip.returncode:
            return None, f"HyperNodes 0.4.8 could not be installed: {(pip.stderr or pip.stdout).strip()[-200:]}"
    code = textwrap.dedent(f"""
        import timeit
        from hypernodes import Pipeline, node
        a = node(output_name="a")(lambda x: x + 1)
        b = node(output_name="b")(lambda a: 2 * a)
        c = node(output_name="c")(lambda a, b: a + b)
        p = Pipeline(nodes=[a, b, c])
        p.run(inputs={{"x": 1}})
        print(min(timeit.repeat(lambda: p.run(inputs={{"x": 1}}), number=2000, repeat={ROUNDS})) / 2000)
    """)
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if out.returncode:
        return None, f"HyperNodes 0.4.8 failed: {out.stderr.strip()[-200:]}"
    return float(out.stdout.split()[-1]), "HyperNodes 0.4.8, in-process run()"


def calls(sides: dict[str, Connection], rows: list) -> None:
    conn, pid = echo_server()

    def floor():
        conn.send_bytes(pickle.dumps(1, protocol=5))
        return pickle.loads(conn.recv_bytes())
    default = Pipeline(NODES)
    default.run(inputs={"x": 1})
    cases = {"floor": floor, "Pool.apply": Elsewhere(sides["pool"], "apply"),
             "hardy sequential": Elsewhere(sides["sequential"], "run"),
             "hardy default": lambda: default.run(inputs={"x": 1})}
    best = rounds(cases, {"floor": 3000, "Pool.apply": 1000, "hardy sequential": 20000, "hardy default": 3000})
    conn.close()
    os.waitpid(pid, 0)
    hn, label = hypernodes_run()
    base = best["floor"]
    rows.append(("run(), 3 trivial nodes", "floor: bare pipe round trip between two processes",
                 f"{base * 1e6:.1f} µs", "1.00x"))
    rows.append(("", "multiprocessing Pool.apply", f"{best['Pool.apply'] * 1e6:.1f} µs",
                 f"{best['Pool.apply'] / base:.2f}x the floor"))
    rows.append(("", label, f"{hn * 1e6:.1f} µs" if hn else "-", f"{hn / base:.2f}x the floor" if hn else ""))
    rows.append(("", "hardy sequential (in-process, opt-in)", f"{best['hardy sequential'] * 1e6:.2f} µs",
                 f"{best['hardy sequential'] / base:.2f}x the floor"))
    rows.append(("", "hardy default (a worker process)", f"{best['hardy default'] * 1e6:.1f} µs",
                 f"{best['hardy default'] / base:.2f}x the floor (target <= 1.25x)"))


def maps(sides: dict[str, Connection], rows: list) -> None:
    default = Pipeline(NODES)
    for n, number in ((100, 200), (10_000, 10)):
        xs = list(range(n))
        items = {"x": xs}
        default.map(inputs=items, map_over="x")
        default.map(inputs=items, map_over="x")
        cases = {"Pool.map": Elsewhere(sides["pool"], "map", n),
                 "hardy sequential": Elsewhere(sides["sequential"], "map", n),
                 "hardy default": lambda items=items: default.map(inputs=items, map_over="x")}
        best = rounds(cases, dict.fromkeys(cases, number))
        base = best["Pool.map"]
        target = "1.5x" if n == 100 else "1.0x"
        rows.append((f"map, {n:,} items x 3 nodes", "multiprocessing Pool.map (2 processes)",
                     f"{base * 1e3:.3f} ms", "1.00x"))
        rows.append(("", "hardy sequential (in-process, opt-in)", f"{best['hardy sequential'] * 1e3:.3f} ms",
                     f"{best['hardy sequential'] / base:.2f}x Pool.map"))
        rows.append(("", "hardy default (2 worker processes)", f"{best['hardy default'] * 1e3:.3f} ms",
                     f"{best['hardy default'] / base:.2f}x Pool.map (target <= {target})"))


FORK = textwrap.dedent("""
    import gc, os, sys, time
    import hardy.workers.worker, torch
    gc.freeze()
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        best = min(best, time.perf_counter() - t)
        os.waitpid(pid, 0)
    print(best)
""")


def start(rows: list) -> None:
    try:
        import torch  # noqa: F401  (the parent has torch imported, as a torch user's does)
    except ImportError:
        rows.append(("fresh worker, torch preloaded", "torch is not installed", "-", ""))
        return
    with Engine(preload=["torch"], max_tasks_per_worker=1, workers=1) as engine:
        p = Pipeline([node(output_name="y")(plus_one)], engine=engine)
        p.run(inputs={"x": 1})
        best = rounds({"fresh": lambda: p.run(inputs={"x": 1})}, {"fresh": 5})["fresh"]
    fork = float(subprocess.run([sys.executable, "-c", FORK], capture_output=True, text=True, check=True).stdout)
    rows.append(("fresh worker, torch preloaded", "run() with max_tasks_per_worker=1: a worker per call",
                 f"{best * 1e3:.1f} ms", "target <= 50 ms"))
    rows.append(("", "the fork server's own fork (hardy's worker modules and torch loaded)",
                 f"{fork * 1e3:.1f} ms", f"{fork / best:.0%} of a fresh worker"))


FIRST = textwrap.dedent("""
    import time
    began = time.perf_counter()
    from hardy import Pipeline, node

    @node(output_name="y")
    def f(x):
        return x + 1

    imported = time.perf_counter()
    Pipeline([f]).map(inputs={"x": list(range(10))}, map_over="x")
    print(time.time(), imported - began, time.perf_counter() - imported)
""")


SERVER_IMPORTS = "import time, gc; gc.disable(); t = time.perf_counter(); " \
    "import hardy.workers.server, hardy.workers.worker; print(time.time(), time.perf_counter() - t)"


def first(rows: list) -> None:
    # compiled bytecode, as an installed package has it (this machine may set PYTHONDONTWRITEBYTECODE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "first.py")
        with open(script, "w") as f:
            f.write(FIRST)
        subprocess.run([sys.executable, script], env=env, capture_output=True, check=True)  # bytecode written

        def launch(args: list) -> tuple[float, float, list]:
            t = time.time()
            out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, check=True)
            done = time.time()
            fields = [float(v) for v in out.stdout.split()]
            return fields[0] - t, done - t, fields[1:]
        took: dict[str, list] = {k: [] for k in ("bare", "nosite", "map", "end", "import", "mapping", "server")}
        for _ in range(ROUNDS):
            took["bare"].append(launch(["-c", "import time; print(time.time())"])[0])
            took["nosite"].append(launch(["-S", "-c", "import time; print(time.time())"])[0])
            took["server"].append(launch(["-c", SERVER_IMPORTS])[2][0])
            ready, ended, (imported, mapped) = launch([script])
            took["map"].append(ready)
            took["end"].append(ended)
            took["import"].append(imported)
            took["mapping"].append(mapped)
    k = min(range(ROUNDS), key=took["map"].__getitem__)
    bare, server = min(took["bare"]), min(took["server"])
    site = bare - min(took["nosite"])
    rows.append(("first default map, 10 items, fresh interpreter", "bare interpreter: `python -c` to its first line",
                 f"{bare * 1e3:.0f} ms", f"of which site-packages' .pth files {site * 1e3:.0f} ms"))
    rows.append(("", "launch to the first map's results", f"{took['map'][k] * 1e3:.0f} ms",
                 f"+{(took['map'][k] - bare) * 1e3:.0f} ms (target <= +100 ms): import hardy "
                 f"{took['import'][k] * 1e3:.0f} ms, the map {took['mapping'][k] * 1e3:.0f} ms"))
    rows.append(("", "  the map waits for the fork server: an interpreter and hardy's worker modules",
                 f"{(bare + server) * 1e3:.0f} ms", f"their imports {server * 1e3:.0f} ms"))
    rows.append(("", "launch to the process's exit (workers stopped)", f"{took['end'][k] * 1e3:.0f} ms", ""))


def cpu(rows: list) -> None:
    items = list(range(200))
    p = Pipeline([node(output_name="y")(burn)])  # 10 ms of CPU (bench/workers.py)
    p.map(inputs={"x": items[:4]}, map_over="x")
    best = rounds({"loop": lambda: [burn(x) for x in items],
                   "default": lambda: p.map(inputs={"x": items}, map_over="x")}, {"loop": 1, "default": 1})
    rows.append(("200 items x 10 ms CPU", "plain loop", f"{best['loop']:.2f} s", "1.00x"))
    rows.append(("", "hardy default (2 worker processes)", f"{best['default']:.2f} s",
                 f"{best['loop'] / best['default']:.2f}x the loop (target >= 1.9x)"))


@node(output_name="y")
def sometimes_crashes(x: int) -> int:
    if x % 1000 == 999:
        os.kill(os.getpid(), signal.SIGSEGV)
    return x + 1


def soak(rows: list) -> None:
    n, maps_, lost, crashed, took = 10_000, 3, 0, 0, []
    p = Pipeline([sometimes_crashes])
    for _ in range(maps_):
        t = time.perf_counter()
        out = p.map(inputs={"x": list(range(n))}, map_over="x", on_error="continue")
        took.append(time.perf_counter() - t)
        for x, r in enumerate(out):
            if isinstance(r, Failed):
                crashed += isinstance(r.error, NodeCrashed) and x % 1000 == 999
                lost += not (isinstance(r.error, NodeCrashed) and x % 1000 == 999)
            else:
                lost += r != {"y": x + 1}
    rows.append((f"soak: {maps_} maps of {n:,} items, 1 in 1,000 segfaults", "hardy default",
                 f"{lost} lost", f"{crashed} crashes, each its item alone; a map {min(took):.2f} s"))


sections = sys.argv[1:] or ["calls", "maps", "start", "first", "cpu", "soak"]
print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, Python {sys.version.split()[0]}, "
      f"best of {ROUNDS} rounds")
rows: list = []
sides = ({"pool": side_process(pool_calls), "sequential": side_process(sequential_calls)}
         if {"calls", "maps"} & set(sections) else {})
for section in sections:
    if section in ("calls", "maps"):
        globals()[section]({name: conn for name, (conn, _) in sides.items()}, rows)
    else:
        globals()[section](rows)
for conn, pid in sides.values():
    conn.send(None)  # (not its end closed: the processes forked since hold it too)
    conn.close()
    os.waitpid(pid, 0)
for work, how, figure, ratio in rows:
    print(f"{work:<48} {how:<66} {figure:>11}   {ratio}")
print(f"load average {os.getloadavg()[0]:.2f} at the end")

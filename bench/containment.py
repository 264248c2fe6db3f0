"""What crash containment by default costs, measured (no `__main__` guard, as users write scripts).

    python bench/containment.py

1. The default `map` (worker processes) of 200 items of 10 ms CPU each, against the plain
   sequential loop in this process (target: >= 1.8x on 2 cores: the default parallelises).
2. The first default map of 10 trivial items in a fresh process, worker start included
   (target: <= 150 ms), beside the same script on map_executor="sequential".
3. on_error="raise" with a hung item in flight: time from the first failure to MapError
   (target: <= 0.2 s; before, the map waited for the hung item forever).
4. A default `run()` (its item in a worker) against `run()` on map_executor="sequential".
5. What the light run report every map keeps costs per map (`Recorder.begin` + `end`, light).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from hardy import Engine, MapError, Pipeline, node


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@node(output_name="y")
def busy(x: int) -> int:
    spin(0.01)
    return x


def cpu_bound() -> None:
    items = list(range(200))
    t = time.perf_counter()
    for x in items:
        busy.func(x)
    plain = time.perf_counter() - t
    p = Pipeline([busy])  # the default engine
    p.map(inputs={"x": items[:4]}, map_over="x")  # workers started: the steady state is measured
    t = time.perf_counter()
    p.map(inputs={"x": items}, map_over="x")
    default = time.perf_counter() - t
    print(f"1. 200 x 10 ms: plain loop {plain:.2f} s, default map {default:.2f} s: {plain / default:.2f}x "
          "(target >= 1.8x)")


FIRST_MAP = textwrap.dedent("""
    import sys, time
    t = time.perf_counter()
    from hardy import Engine, Pipeline, node

    @node(output_name="y")
    def f(x):
        return x + 1

    engine = Engine() if sys.argv[1] == "default" else Engine(map_executor="sequential")
    start = time.perf_counter()
    Pipeline([f], engine=engine).map(inputs={"x": list(range(10))}, map_over="x")
    print(time.perf_counter() - start, start - t)
""")


def first_map() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "first.py")
        with open(script, "w") as f:
            f.write(FIRST_MAP)
        # compiled bytecode, as an installed package has (pip writes it; this machine's environment
        # may say PYTHONDONTWRITEBYTECODE, which makes every import compile from source)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        subprocess.run([sys.executable, script, "default"], env=env, capture_output=True, check=True)
        for mode in ("default", "sequential"):
            runs = [subprocess.run([sys.executable, script, mode], env=env, capture_output=True, text=True,
                                   check=True).stdout.split() for _ in range(7)]
            maps = [float(r[0]) for r in runs]
            imports = [float(r[1]) for r in runs]
            target = " (target <= 150 ms)" if mode == "default" else ""
            print(f"2. first map of 10 trivial items, fresh process, {mode}: "
                  f"median {statistics.median(maps) * 1e3:.0f} ms (min {min(maps) * 1e3:.0f}; "
                  f"import hardy {statistics.median(imports) * 1e3:.0f} ms){target}")


@node(output_name="v")
def hang_or_fail(x: int, failed_at: str) -> int:
    if x == 0:
        time.sleep(3600)
    if x == 1:
        time.sleep(0.2)
        with open(failed_at, "w") as f:
            f.write(repr(time.time()))
        raise ValueError("bad item")
    return x


def raise_fast() -> None:
    p = Pipeline([hang_or_fail], engine=Engine(workers=2))
    lags = []
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "failed")
        for _ in range(5):
            try:
                p.map(inputs={"x": [0, 1, 2, 3], "failed_at": marker}, map_over="x")
            except MapError:
                with open(marker) as f:
                    lags.append(time.time() - float(f.read()))
    p.engine.close()
    print(f"3. on_error='raise', hung item in flight: MapError {statistics.median(lags) * 1e3:.0f} ms after the "
          f"failure (median of 5, max {max(lags) * 1e3:.0f} ms; target <= 200 ms)")


@node(output_name="z")
def trivial(x: int) -> int:
    return x


def runs() -> None:
    default, here = Pipeline([trivial]), Pipeline([trivial], engine=Engine(map_executor="sequential"))
    default.run(inputs={"x": 0})
    for name, p in (("sequential", here), ("default (worker)", default)):
        n = 2000 if p is here else 300
        best = []
        for _ in range(3):
            t = time.perf_counter()
            for i in range(n):
                p.run(inputs={"x": i})
            best.append((time.perf_counter() - t) / n)
        print(f"4. run() of a trivial node, {name}: {min(best) * 1e6:.1f} us per call")


def light_report() -> None:
    p = Pipeline([trivial], engine=Engine(map_executor="sequential"))
    p.map(inputs={"x": [1]}, map_over="x")
    rec, n = p._recorder, 20000
    t = time.perf_counter()
    for _ in range(n):
        rec.end(p, {}, 1, rec.begin(p, "map", 1, light=True))
    per = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(2000):
        p.map(inputs={"x": [1]}, map_over="x")
    whole = (time.perf_counter() - t) / 2000
    print(f"5. light run report: {per * 1e6:.1f} us per map ({per / whole:.0%} of a one-item sequential map, "
          f"{whole * 1e6:.0f} us)")


cpu_bound()
first_map()
raise_fast()
runs()
light_report()

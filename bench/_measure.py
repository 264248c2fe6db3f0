"""Measures the 3-node work (a = x+1, b = 2a, c = a+b) in whatever frameworks are importable.

Run by compare.py inside its own venv (peers installed there) and by core.py directly (hardy and
the plain loop only). Prints one JSON object: {framework: {"run_us": median, "map_per_s": rate}}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

RUNS = 3000
ITEMS = 10_000


def engines() -> dict:
    """{name: a function making an Engine}: the local process executor and each distributed engine
    on this machine, 2 workers each where the engine lets one choose."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from hardy import Engine
    from hardy.integrations.daft import daft_engine
    from hardy.integrations.dask import DaskExecutor
    from hardy.integrations.ray import RayExecutor
    return {
        "local process executor (2 workers)": lambda: Engine(map_executor="process", workers=2),
        "Dask LocalCluster (2 workers)": lambda: Engine(map_executor=DaskExecutor(workers=2)),
        "Ray, local (2 CPUs)": lambda: Engine(map_executor=RayExecutor(workers=2)),
        "daft_engine(), native runner, process UDF": lambda: daft_engine(),
    }


def median_us(call, runs: int = RUNS) -> float:
    for _ in range(200):
        call()
    samples = []
    for _ in range(runs):
        t = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - t)
    return statistics.median(samples) / 1000


def best_rate(call, items: int, repeats: int = 5) -> float:
    call()
    return max(items / _timed(call) for _ in range(repeats))


def _timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def plain() -> dict:
    def fa(x): return x + 1
    def fb(a): return 2 * a
    def fc(a, b): return a + b

    def run(x):
        a = fa(x)
        b = fb(a)
        return {"a": a, "b": b, "c": fc(a, b)}
    xs = list(range(ITEMS))
    return {"run_us": median_us(lambda: run(1)), "map_per_s": best_rate(lambda: [run(x) for x in xs], ITEMS)}


def three_nodes(node) -> list:
    """The benchmark work, with a framework's HyperNodes-style `node` decorator."""

    @node(output_name="a")
    def fa(x): return x + 1

    @node(output_name="b")
    def fb(a): return 2 * a

    @node(output_name="c")
    def fc(a, b): return a + b
    return [fa, fb, fc]


def _hypernodes_style(Pipeline, node, **engine) -> dict:
    """hardy and HyperNodes share one API: the same code measures both (hardy's in-process
    executor, the per-call overhead being measured; its default runs calls in worker processes)."""
    p = Pipeline(nodes=three_nodes(node), **engine)
    inputs, xs = {"x": 1}, {"x": list(range(ITEMS))}
    return {"run_us": median_us(lambda: p.run(inputs=inputs)),
            "map_per_s": best_rate(lambda: p.map(inputs=xs, map_over="x"), ITEMS, repeats=3)}


def hardy() -> dict:
    from hardy import Engine, Pipeline, node
    return _hypernodes_style(Pipeline, node, engine=Engine(map_executor="sequential"))


def hypernodes() -> dict:
    from hypernodes import Pipeline, node
    return _hypernodes_style(Pipeline, node)


def pipefunc() -> dict:
    from pipefunc import Pipeline
    from pipefunc import pipefunc as pf

    fa = pf(output_name="a")(lambda x: x + 1)
    fb = pf(output_name="b")(lambda a: 2 * a)
    fc = pf(output_name="c")(lambda a, b: a + b)
    p = Pipeline([fa, fb, fc])
    run_us = median_us(lambda: p("c", x=1), runs=2000)
    ma = pf(output_name="a", mapspec="x[i] -> a[i]")(lambda x: x + 1)
    mb = pf(output_name="b", mapspec="a[i] -> b[i]")(lambda a: 2 * a)
    mc = pf(output_name="c", mapspec="a[i], b[i] -> c[i]")(lambda a, b: a + b)
    mp = Pipeline([ma, mb, mc])
    xs = list(range(ITEMS))
    rate = best_rate(lambda: mp.map({"x": xs}, parallel=False, storage="dict", show_progress=False),
                     ITEMS, repeats=2)
    return {"run_us": run_us, "map_per_s": rate}


if __name__ == "__main__":
    wanted = sys.argv[1:] or ["plain", "hardy"]
    out = {}
    for name in wanted:
        try:
            out[name] = globals()[name]()
        except Exception as exc:  # a peer that changed its API is reported, not fatal
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))

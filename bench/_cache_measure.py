"""One cache measurement in a fresh interpreter: `python _cache_measure.py FRAMEWORK DIR`.

Prints seconds for a map of 10,000 items through 3 trivial nodes with each framework's disk cache.
Run twice on the same DIR: the first is the cold run, the second the warm re-run.
"""

from __future__ import annotations

import sys
import time

N = 10_000


def hardy(folder: str) -> float:
    from _measure import three_nodes
    from hardy import DiskCache, Engine, Pipeline, node
    p = Pipeline(nodes=three_nodes(node), cache=DiskCache(folder), engine=Engine(map_executor="sequential"))
    start = time.perf_counter()
    out = p.map(inputs={"x": list(range(N))}, map_over="x", progress=False)
    assert out[-1]["c"] == 3 * N
    return time.perf_counter() - start


def add_one(x): return x + 1
def double(a): return 2 * a
def total(a, b): return a + b


def joblib(folder: str) -> float:
    from joblib import Memory
    mem = Memory(folder, verbose=0)
    fa, fb, fc = mem.cache(add_one), mem.cache(double), mem.cache(total)
    start = time.perf_counter()
    for x in range(N):
        a = fa(x)
        b = fb(a)
        fc(a, b)
    return time.perf_counter() - start


def pipefunc(folder: str) -> float:
    from pipefunc import Pipeline
    from pipefunc import pipefunc as pf
    fa = pf(output_name="a", cache=True)(lambda x: x + 1)
    fb = pf(output_name="b", cache=True)(lambda a: 2 * a)
    fc = pf(output_name="c", cache=True)(lambda a, b: a + b)
    p = Pipeline([fa, fb, fc], cache_type="disk", cache_kwargs={"cache_dir": folder})
    start = time.perf_counter()
    for x in range(N):
        p("c", x=x)
    return time.perf_counter() - start


if __name__ == "__main__":
    print(globals()[sys.argv[1]](sys.argv[2]))

"""What one segfaulting item costs on Dask, Ray and Daft: `python bench/crash_isolation.py`.

450 digits-like items (an 8x8 image classified by nearest neighbour among 1,000 references, ~1 ms
of numpy), each engine with 2 workers; the same map without and with item 200 segfaulting (a real
null-pointer read), warm (the engine started, one map run before), median of 3. Every node call
appends its item to a log, so the table also shows how many times the culprit ran and how many
innocent items ran more than once. Target: with the crash <= 2x without. Run it with another
hardy on PYTHONPATH to compare versions in the same conditions.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from _measure import engines
from hardy import Engine, Pipeline, node

N, CULPRIT = 450, 200
REFERENCES = np.random.default_rng(0).random((1000, 64))


@node(output_name="label")
def classify(x: int, crash: bool, log: str) -> int:
    with open(log, "a") as f:
        f.write(f"{x}\n")
    if crash and x == CULPRIT:
        ctypes.string_at(0)
    image = np.random.default_rng(x).random(64)
    return int(np.argmin(((REFERENCES - image) ** 2).sum(axis=1)) % 10)


def measure(engine: Engine) -> dict[str, float]:
    p = Pipeline(nodes=[classify], engine=engine)
    log = tempfile.mktemp(prefix="hardy-bench-")

    def run(crash: bool) -> float:
        open(log, "w").close()
        t = time.perf_counter()
        p.map(inputs={"x": list(range(N)), "crash": crash, "log": log}, map_over="x", on_error="continue",
              progress=False)
        return time.perf_counter() - t

    start = time.perf_counter()
    run(False)
    cold = time.perf_counter() - start
    plain = statistics.median(run(False) for _ in range(3))
    crashed = statistics.median(run(True) for _ in range(3))
    with open(log) as f:
        runs = [int(v) for v in f.read().split()]
    os.unlink(log)
    return {"cold": cold, "plain": plain, "crash": crashed, "culprit": runs.count(CULPRIT),
            "innocents": sum(1 for i in set(runs) if i != CULPRIT and runs.count(i) > 1)}


if __name__ == "__main__":
    t = Table(title=f"{N} digits-like items, item {CULPRIT} segfaults; {os.cpu_count()} cores; "
                    f"hardy from {os.path.dirname(__import__('hardy').__file__)}")
    for col in ("engine", "cold start + first map", "no crash", "with the crash", "ratio", "culprit ran",
                "innocents run again"):
        t.add_column(col, justify="right")
    for name, make in engines().items():
        engine = make()
        m = measure(engine)
        engine.close()
        t.add_row(name, f"{m['cold']:.2f} s", f"{m['plain']:.2f} s", f"{m['crash']:.2f} s",
                  f"{m['crash'] / m['plain']:.2f}x", f"{m['culprit']}", f"{m['innocents']}")
    Console(width=140).print(t)

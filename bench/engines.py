"""10,000 trivial items through the 3-node plan on each engine, in one run: `python bench/engines.py`.

Each engine beside the local process executor; cold start = engine start plus the first map.
Targets: Dask (2 local workers) >= 50,000 items/s, Ray >= 300,000 items/s, daft_engine() with process
isolation >= 50,000 items/s. The last row shows what a node with its own Daft resources costs: the
plan runs as three UDFs, and Daft starts each one's process in every query.
"""

from __future__ import annotations

import os
import time

from rich.console import Console
from rich.table import Table

from _measure import engines, three_nodes
from hardy import Pipeline, node

N = 10_000


def measure(make_engine, repeats: int = 5) -> tuple[float, float]:
    xs = list(range(N))
    start = time.perf_counter()
    engine = make_engine()
    p = Pipeline(nodes=three_nodes(node), engine=engine)
    p.map(inputs={"x": xs}, map_over="x", progress=False)
    cold = time.perf_counter() - start
    best = min(_timed(lambda: p.map(inputs={"x": xs}, map_over="x", progress=False)) for _ in range(repeats))
    engine.close()
    return cold, N / best


def _timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


if __name__ == "__main__":
    from hardy.integrations.daft import daft_engine
    rows = {name: measure(make) for name, make in {
        **engines(),
        "daft_engine(), node fb in its own UDF (3 UDFs)": lambda: daft_engine(node_resources={"fb": {"cpus": 1}}),
    }.items()}
    local = rows["local process executor (2 workers)"][1]
    t = Table(title=f"{N:,} trivial items x 3 nodes, {os.cpu_count()} cores")
    for col in ("engine", "cold start + first map", "items/s (best of 5)", "vs local process executor"):
        t.add_column(col, justify="right")
    for name, (cold, rate) in rows.items():
        t.add_row(name, f"{cold:.2f} s", f"{rate:,.0f}", f"{rate / local:.2f}x")
    Console(width=120).print(t)

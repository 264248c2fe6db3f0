"""What keeping workers in step with the caller costs (docs/same-answer.md), measured on the default
engine (no `__main__` guard: hardy's workers never re-run this file).

    python bench/same_answer.py

1. The checks made at every call — what the plan reads (`Pipeline._stale`: names rebound, values
   changed in place) and the caller's environment, working directory, argv and sys.path
   (`shipping.context.current`) — timed alone, against a warm default `run()` of 3 trivial nodes and
   a warm default map of 10,000 items (targets: <= 2 us per run(), <= 5 % of the map).
2. A reload between two maps on a warm engine: the map after `importlib.reload` (the plan made,
   stamped and shipped again, each worker's module made the caller's) minus a warm map of the same
   size, against a fresh worker's start (the same engine, `max_tasks_per_worker=1`) (target <= 1.5x).
Best of 5 rounds; the load average is printed.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
import timeit

from hardy import Engine, Pipeline, node
from hardy.shipping import context

ROUNDS = 5


@node(output_name="a")
def inc(x):
    return x + 1


@node(output_name="b")
def double(a):
    return 2 * a


@node(output_name="c")
def total(a, b):
    return a + b


def best(call, number: int) -> float:
    """Seconds per call, the best of ROUNDS rounds of `number` calls."""
    return min(timeit.repeat(call, number=number, repeat=ROUNDS)) / number


def checks() -> list[tuple[str, str, str]]:
    p = Pipeline([inc, double, total])
    p.run(inputs={"x": 1})
    items = list(range(10_000))
    p.map(inputs={"x": items}, map_over="x")
    run_key = (("x",), None, False)
    stale = best(lambda: p._stale(run_key), 100_000)
    now = best(context.current, 100_000)
    per_call = stale + now
    run = best(lambda: p.run(inputs={"x": 1}), 2_000)
    mapped = best(lambda: p.map(inputs={"x": items}, map_over="x", progress=False), 3)
    return [("checks per call (plan reads + process state)", f"{per_call * 1e6:.2f} us",
             f"{stale * 1e6:.2f} + {now * 1e6:.2f} us"),
            ("warm default run(), 3 trivial nodes", f"{run * 1e6:.1f} us", f"checks: {per_call / run:.1%}"),
            ("warm default map, 10,000 items", f"{mapped * 1e3:.1f} ms", f"checks: {per_call / mapped:.3%}")]


MODULE = '''
from hardy import node
OFFSET = {offset}

@node(output_name="y")
def shifted(x):
    return x + OFFSET
'''


def reload_cost() -> list[tuple[str, str, str]]:
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "edited_steps.py")
    with open(path, "w") as f:
        f.write(MODULE.format(offset=0))
    sys.path.insert(0, folder)
    steps = importlib.import_module("edited_steps")
    items = list(range(8))
    with Engine(workers=2) as engine:
        Pipeline([steps.shifted], engine=engine).map(inputs={"x": items}, map_over="x")
        warm, after = [], []
        for k in range(1, ROUNDS + 1):
            p = Pipeline([steps.shifted], engine=engine)
            warm.append(_timed(lambda p=p: p.map(inputs={"x": items}, map_over="x", progress=False)))
            with open(path, "w") as f:
                f.write(MODULE.format(offset=k))
            steps = importlib.reload(steps)
            p = Pipeline([steps.shifted], engine=engine)
            after.append(_timed(lambda p=p: p.map(inputs={"x": items}, map_over="x", progress=False)))
            assert p.run(inputs={"x": 0})["y"] == k  # the reloaded code ran
    reload = min(after) - min(warm)
    with Engine(workers=1, max_tasks_per_worker=1) as fresh:  # each item a fresh worker
        p = Pipeline([inc], engine=fresh)
        p.map(inputs={"x": [0]}, map_over="x")
        start = min(_timed(lambda: p.map(inputs={"x": [0]}, map_over="x", progress=False)) for _ in range(ROUNDS))
    return [("a reload between two maps (map after it - warm map)", f"{reload * 1e3:.1f} ms",
             f"{reload / start:.2f}x a fresh worker"),
            ("a fresh worker's start and one item", f"{start * 1e3:.1f} ms", "1.00x")]


def _timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


rows = checks() + reload_cost()
print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, best of {ROUNDS} rounds")
for what, figure, ratio in rows:
    print(f"{what:<52} {figure:>12}   {ratio}")

"""What one bad item costs a map on the process executor: `python bench/bad_items.py`.

3,000 trivial items on 2 workers (warm: the workers started, one map run before), median of 9 (the maps taking turns),
the same map clean and with item 1,500 replaced by a poison input of each kind: one that cannot be
pickled here (a lock), one whose class raises when the worker unpickles it, one whose unpickling
segfaults the worker. Each must give 2,999 results and 1 `Failed`; target: the poison map takes
<= 1.2x the clean one. The plain-Python floor (a loop over the same function in this process) is
printed for scale.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time

from hardy import Engine, Failed, Pipeline, node

N, CULPRIT, RUNS = 3000, 1500, 9


class RaisesWhenUnpickled:
    def __reduce__(self) -> tuple:
        return _refuse, ()


def _refuse() -> None:
    raise ValueError("this value cannot be rebuilt here")


class SegfaultsWhenUnpickled:
    def __reduce__(self) -> tuple:
        return ctypes.string_at, (0,)  # a null-pointer read where it is unpickled


def plus_one(x):
    return x + 1 if isinstance(x, int) else 0


def plus_one_in_1ms(x):
    end = time.perf_counter() + 0.001
    while time.perf_counter() < end:
        pass
    return x + 1 if isinstance(x, int) else 0


def timed(p: Pipeline, items: list) -> tuple[float, int, int]:
    t = time.perf_counter()
    out = p.map(inputs={"x": items}, map_over="x", on_error="continue", progress=False)
    elapsed = time.perf_counter() - t
    return elapsed, sum(not isinstance(o, Failed) for o in out), sum(isinstance(o, Failed) for o in out)


def main() -> None:
    compare(plus_one, RUNS)
    compare(plus_one_in_1ms, 3)


def compare(fn, turns: int) -> None:
    clean = list(range(N))
    t = time.perf_counter()
    for x in clean:
        fn(x)
    floor = time.perf_counter() - t
    poisons = {"unpicklable (a lock)": threading.Lock(), "unpickling raises": RaisesWhenUnpickled(),
               "unpickling segfaults": SegfaultsWhenUnpickled()}
    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline(nodes=[node(output_name="y")(fn)], engine=engine)
        timed(p, clean)  # warm
        maps = {"clean": clean}
        for name, poison in poisons.items():
            maps[name] = clean.copy()
            maps[name][CULPRIT] = poison
        runs: dict[str, list[tuple[float, int, int]]] = {name: [] for name in maps}
        for _ in range(turns):  # the maps take turns, so that a change of load hits them alike
            for name, items in maps.items():
                runs[name].append(timed(p, items))
    base = statistics.median(r[0] for r in runs["clean"])
    rows = [(name, statistics.median(r[0] for r in done), done[-1][1], done[-1][2]) for name, done in runs.items()]
    print(f"\n{N} items of {fn.__name__}, 2 workers, median of {turns}; plain-Python loop: {floor * 1e3:.2f} ms; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'map':<24}{'ms':>9}{'x clean':>9}{'results':>9}{'Failed':>8}")
    for name, secs, ok, failed in rows:
        print(f"{name:<24}{secs * 1e3:>9.1f}{secs / base:>9.2f}{ok:>9}{failed:>8}")


main()

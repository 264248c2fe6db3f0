"""Big maps and big values, each figure measured in a fresh child process, peers in the same run.

    python bench/bigdata.py

1. Streaming: parent peak RSS (ru_maxrss of a child that does only that) of a 2,000,000-item map
   consumed as `map`'s list, through `imap`, and a hand-built list of the same dicts (the floor
   for holding every result); then `imap` over 10,000,000 items from a generator (flat: the same
   peak as 2,000,000).
"""

from __future__ import annotations

import subprocess
import sys

from rich.console import Console
from rich.table import Table

STREAM = """
import resource, sys, time
from hardy import Engine, Pipeline, node
n, how, executor = int(sys.argv[1]), sys.argv[2], sys.argv[3]
p = Pipeline(nodes=[node(output_name="y")(lambda x: x + 1)],
             engine=Engine(map_executor=executor, workers=2))
start = time.perf_counter()
if how == "map":
    total = sum(o["y"] for o in p.map(inputs={"x": range(n)}, map_over="x", progress=False))
elif how == "imap":
    total = sum(o["y"] for o in p.imap(inputs={"x": (x for x in range(n))}, map_over="x", progress=False))
elif how == "list":
    out = [{"y": x + 1} for x in range(n)]
    total = sum(o["y"] for o in out)
else:
    total = n * (n + 1) // 2
assert total == n * (n + 1) // 2
elapsed = time.perf_counter() - start
p.engine.close()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, elapsed)
"""


def child(code: str, *args: object) -> list[float]:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         check=True)
    return [float(v) for v in out.stdout.split()]


def streaming(rows: list) -> None:
    base, _ = child(STREAM, 10, "none", "sequential")
    n = 2_000_000
    peaks = {}
    for how, executor, label in [("list", "sequential", "hand-built list of result dicts (no pipeline)"),
                                 ("map", "sequential", "hardy map (sequential)"),
                                 ("imap", "sequential", "hardy imap (sequential)"),
                                 ("imap", "threaded", "hardy imap (threaded, 2 threads)"),
                                 ("imap", "process", "hardy imap (process, 2 workers)")]:
        peak, secs = child(STREAM, n, how, executor)
        peaks[(how, executor)] = peak
        rows.append((f"{n:,} items" if how == "list" else "", label, f"{peak:,.0f} MB",
                     f"{n / secs:,.0f} items/s"))
    ratio = peaks[("imap", "sequential")] / peaks[("map", "sequential")]
    rows.append(("", "imap / map peak RSS", f"{ratio:.2f}x", ""))
    peak, secs = child(STREAM, 10_000_000, "imap", "sequential")
    rows.append(("10,000,000 items", "hardy imap (sequential), from a generator", f"{peak:,.0f} MB",
                 f"{10_000_000 / secs:,.0f} items/s"))
    rows.append(("", "interpreter + import hardy alone", f"{base:,.0f} MB", ""))


def main() -> None:
    rows: list = []
    streaming(rows)
    table = Table(title="hardy: big maps and big values (peak RSS of a child process doing only that)")
    for col in ("work", "how", "peak RSS / result", "rate"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


main()

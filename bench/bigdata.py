"""Big maps and big values, each figure measured in a fresh child process, peers in the same run.

    python bench/bigdata.py [streaming] [transport] [hashing]     (default: all three)

1. Streaming: parent peak RSS (ru_maxrss of a child that does only that) of a 2,000,000-item map
   consumed as `map`'s list, through `imap`, and a hand-built list of the same dicts (the floor
   for holding every result); then `imap` over 10,000,000 items from a generator (flat: the same
   peak as 2,000,000).
2. Big values: 40 float64 arrays of 20 MB through 2 worker processes, in and back out (the node
   returns its array) and in only (it returns a float): MB/s for hardy's process executor, joblib
   (loky, with its automatic memmapping of inputs over 1 MB) and ProcessPoolExecutor; then 40
   torch float32 tensors and 40 bytes objects of 20 MB, in and back out, hardy and joblib.
3. Hashing an 8 MB float64 array: blake2b (the old key hash), xxh3-128 and BLAKE3 where installed,
   and hardy's `hash_value`; a DiskCache hit on a node whose input and output are an 80 MB array.
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


TRANSPORT = """
import concurrent.futures as cf, sys, time
import numpy as np
from hardy import Engine, Pipeline, node

def echo(x):
    return x

def total(x):
    return float(x[0])

who, how, kind = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "torch":
    import torch
    arrays = [torch.full((20 * 2**20 // 4,), float(i)) for i in range(40)]
elif kind == "bytes":
    arrays = [bytes([i]) * (20 * 2**20) for i in range(40)]
else:
    arrays = [np.full(20 * 2**20 // 8, float(i)) for i in range(40)]
mb = 40 * 20
func = echo if how == "both" else total

def run():
    if who == "hardy":
        return [o["y"] for o in p.map(inputs={"x": arrays}, map_over="x", progress=False)]
    if who == "joblib":
        return Parallel(n_jobs=2)(delayed(func)(a) for a in arrays)
    return list(ex.map(func, arrays))

if who == "hardy":
    e = Engine(map_executor="process", workers=2)
    p = Pipeline(nodes=[node(output_name="y")(func)], engine=e)
elif who == "joblib":
    from joblib import Parallel, delayed
else:
    ex = cf.ProcessPoolExecutor(2)
run()  # workers up
times = []
for _ in range(3):
    t0 = time.perf_counter()
    out = run()
    times.append(time.perf_counter() - t0)
    assert len(out) == 40 and (how != "both" or float(out[7][3]) == 7.0)
print(mb / min(times))
"""

HASH = """
import hashlib, time
import numpy as np
from hardy.hashing import hash_value
a = np.random.default_rng(0).random(2**20)  # 8 MB
mv = memoryview(a).cast("B")
def best(f):
    f()
    return min(timed(f) for _ in range(20)) * 1e3
def timed(f):
    t = time.perf_counter(); f(); return time.perf_counter() - t
print("blake2b (hashlib)", best(lambda: hashlib.blake2b(mv, digest_size=16).digest()))
try:
    import xxhash
    print("xxh3-128 (xxhash)", best(lambda: xxhash.xxh3_128(mv).digest()))
except ImportError:
    pass
try:
    import blake3
    print("BLAKE3 (blake3)", best(lambda: blake3.blake3(mv, max_threads=blake3.blake3.AUTO).digest(16)))
except ImportError:
    pass
print("hardy hash_value", best(lambda: hash_value(a)))
"""

CACHE_HIT = """
import tempfile, time
import numpy as np
from hardy import DiskCache, Engine, Pipeline, node
big = np.random.default_rng(1).random(10 * 2**20)  # 80 MB
@node(output_name="y")
def same(x):
    return x
p = Pipeline(nodes=[same], cache=DiskCache(tempfile.mkdtemp()), engine=Engine(map_executor="sequential"))
p.run(inputs={"x": big})
best = min((lambda t: (p.run(inputs={"x": big}), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print(big.nbytes / 2**30 / best)
"""


def transport(rows: list) -> None:
    for how, label in [("both", "40 x 20 MB in and back out, 2 workers"), ("in", "40 x 20 MB in only")]:
        rates = {who: child(TRANSPORT, who, how, "numpy")[0] for who in ("hardy", "joblib", "ppe")}
        rows.append((label, "hardy process executor", f"{rates['hardy']:,.0f} MB/s",
                     f"{rates['hardy'] / rates['joblib']:.2f}x joblib"))
        rows.append(("", "joblib (loky + memmapping)", f"{rates['joblib']:,.0f} MB/s", "1.00x"))
        rows.append(("", "ProcessPoolExecutor", f"{rates['ppe']:,.0f} MB/s",
                     f"{rates['ppe'] / rates['joblib']:.2f}x joblib"))
    for kind, label in [("torch", "40 x 20 MB torch float32 tensors in and out"),
                        ("bytes", "40 x 20 MB bytes in and out")]:
        rates = {who: child(TRANSPORT, who, "both", kind)[0] for who in ("hardy", "joblib")}
        rows.append((label, "hardy process executor", f"{rates['hardy']:,.0f} MB/s",
                     f"{rates['hardy'] / rates['joblib']:.2f}x joblib"))
        rows.append(("", "joblib (loky; no memmapping for these)", f"{rates['joblib']:,.0f} MB/s", "1.00x"))


def hashing(rows: list) -> None:
    out = subprocess.run([sys.executable, "-c", HASH], capture_output=True, text=True, check=True).stdout
    for k, line in enumerate(out.strip().splitlines()):
        name, ms = line.rsplit(" ", 1)
        rows.append(("hash an 8 MB float64 array" if k == 0 else "", name, f"{float(ms):.2f} ms",
                     f"{8 / float(ms):,.1f} GB/s"))
    rate = float(subprocess.run([sys.executable, "-c", CACHE_HIT], capture_output=True, text=True,
                                check=True).stdout)
    rows.append(("cache hit, 80 MB array input and output", "hardy DiskCache (hash + read + MAC + unpickle)",
                 "", f"{rate:.2f} GB/s"))


def main() -> None:
    rows: list = []
    wanted = sys.argv[1:] or ["streaming", "transport", "hashing"]
    for section in (streaming, transport, hashing):
        if section.__name__ in wanted:
            section(rows)
    table = Table(title="hardy: big maps and big values (peak RSS of a child process doing only that)")
    for col in ("work", "how", "peak RSS / result", "rate"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


main()

"""The embed pipeline, batched: `python bench/batching.py` (`N=5000` for a quicker run, `PEERS=0` without
Ray Data, Daft and HyperNodes, `MODEL=light` with a model five times faster per document).

20,000 generated documents: tokenize (per item, CPU) -> embed (a torch EmbeddingBag + MLP built
here, one CPU thread per process, as fast as the issue's model: see `MODEL`) -> score (per item),
all in one run:

- the plain single-process loop, per item and batched (64 per model call): the floors;
- the plain batched loop in two processes, half the documents each (`multiprocessing.Pool`): what
  two cores give this work with no framework and no containment, the ceiling of a 2-worker map;
- hardy per item and hardy batched (`@node(batch_size=64)`), process executor, 2 workers;
- Ray Data (`map` + `map_batches`; Ray started on 127.0.0.1 with 2 CPUs and a 200 MiB object
  store; when it cannot start, the table says why) and Daft (row functions + a batch UDF class);
- HyperNodes 0.4.8, `DualNode` on its `DaftEngine`, from the side environment in HN_PYTHON (a
  venv with `hypernodes==0.4.8` and `daft<0.7`, made with pip when missing; skipped, saying why,
  when it cannot be);

then hardy batched again with one poisoned document whose tokens make the embed call segfault (a
real NULL read), the same document through Ray Data, Daft and HyperNodes, and a warm cached re-run
(its batch calls counted). Throughput is warm (each engine started and run once on a small map),
the best of `REPEATS` maps; the plain batched loop (one and two processes), hardy batched and hardy
batched with the poisoned document are measured in turns, `ROUNDS` times, the best of each kept. Ratios against the
plain loops and against each peer are printed, with the load average at the start and the end.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")
os.environ.setdefault("DAFT_PROGRESS_BAR", "0")

N = int(os.environ.get("N", "20000"))
REPEATS = int(os.environ.get("REPEATS", "2"))
ROUNDS = int(os.environ.get("ROUNDS", "5"))  # turns of plain batched / hardy clean / hardy poisoned
BATCH = 64
VOCAB = 20_000
POISON_ID = VOCAB  # the token only the poisoned document has: the embed call that sees it segfaults
HN_PYTHON = os.environ.get("HN_PYTHON", "/tmp/hn26-venv/bin/python")
PEER_TIMEOUT = float(os.environ.get("PEER_TIMEOUT", "900"))  # seconds a peer's run may take
PEERS = os.environ.get("PEERS", "1") != "0"  # PEERS=0: hardy and the plain loops only (minutes less)

# --- the work: the same functions for every framework (this file is imported by the side runs) ---

WORDS = [f"w{k}" for k in range(5000)]


def documents(n: int, poisoned: int | None = None) -> list[str]:
    import random
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(n)]
    if poisoned is not None:
        docs[poisoned] = "POISON " + docs[poisoned]
    return docs


def tokenize(text: str) -> list[int]:
    """Word ids by a stable hash (CRC-32: the same in every process, unlike `hash`)."""
    return [POISON_ID if w == "POISON" else zlib.crc32(w.encode()) % (VOCAB - 1) + 1 for w in text.split()]


# The model's size. "issue" (the default): the model the issue describes by its speed, about
# 14,500 documents/s in batches of 64 and 2,100/s one at a time, embed alone, on one thread here
# (the issue measured 14,359/s and 2,124/s): EmbeddingBag(20,000 x 128) + an MLP of 15 hidden layers
# of 384 (many small operations per call, as in a transformer, so batching pays as it does there).
# "light": EmbeddingBag(20,000 x 64) + MLP(64-128-64), five times faster per document, where hardy's
# own cost per item weighs five times more (the bench's model until 2026-11-27).
MODEL = os.environ.get("MODEL", "issue")
DIM, HIDDEN, LAYERS = {"issue": (128, 384, 15), "light": (64, 128, 1)}[MODEL]

_model: list = []


def model():
    """EmbeddingBag(20,000 x DIM, mean) + an MLP of LAYERS hidden layers of HIDDEN, built once per
    process, seeded."""
    if not _model:
        import torch
        torch.set_num_threads(1)
        torch.manual_seed(0)

        class Embedder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.bag = torch.nn.EmbeddingBag(VOCAB + 1, DIM, mode="mean")
                layers = [torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU()]
                for _ in range(LAYERS - 1):
                    layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
                self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(HIDDEN, 64))

            def forward(self, docs):
                flat = torch.tensor([i for d in docs for i in d], dtype=torch.long)
                lengths = torch.tensor([len(d) for d in docs])
                offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
                return self.mlp(self.bag(flat, offsets))
        _model.append(Embedder().eval())
    return _model[0]


def embed_many(ids: list[list[int]]) -> list:
    """The model on a batch; a batch holding the poisoned document segfaults."""
    import torch
    if any(POISON_ID in d for d in ids):
        ctypes.string_at(0)
    with torch.no_grad():
        return model()(ids).numpy()


def embed_one(ids: list[int]):
    return embed_many([ids])[0]


def score(embedding) -> float:
    import numpy as np
    e = np.asarray(embedding, dtype=np.float32)
    return float(e @ e)


# --- runs -------------------------------------------------------------------------------------

def timed(call) -> tuple[float, object]:
    t = time.perf_counter()
    out = call()
    return time.perf_counter() - t, out


def best(call, repeats: int = REPEATS) -> tuple[float, object]:
    runs = [timed(call) for _ in range(repeats)]
    return min(runs, key=lambda r: r[0])


def plain_per_item(docs):
    return [score(embed_one(tokenize(d))) for d in docs]


def plain_batched(docs):
    out = []
    for s in range(0, len(docs), BATCH):
        vectors = embed_many([tokenize(d) for d in docs[s:s + BATCH]])
        out += [score(v) for v in vectors]
    return out


def split_in_two(pool, docs):
    """The plain batched loop in two processes, half the documents each (`multiprocessing.Pool`,
    spawned): what two cores give this work with no framework and no containment, its transfers
    included. Each process slows the other (shared caches and memory), so this is the ceiling a
    2-worker map can reach, not 2x."""
    halves = pool.map(plain_batched, [docs[0::2], docs[1::2]], chunksize=1)
    out = [0.0] * len(docs)
    out[0::2], out[1::2] = halves
    return out


def hardy_pipeline(batched: bool, engine):
    from hardy import Pipeline, node
    calls = Path(tempfile.mktemp(prefix="hardy-batch-calls-"))

    @node(output_name="ids")
    def tok(text):
        return tokenize(text)

    if batched:
        @node(output_name="embedding", batch_size=BATCH)
        def embed(ids):
            if os.environ.get("HARDY_BENCH_COUNT"):
                with open(os.environ["HARDY_BENCH_COUNT"], "a") as f:
                    f.write(f"{len(ids)}\n")
            return embed_many(ids)
    else:
        @node(output_name="embedding")
        def embed(ids):
            return embed_one(ids)

    @node(output_name="score")
    def sc(embedding):
        return score(embedding)
    return Pipeline(nodes=[tok, embed, sc], engine=engine), calls


def hardy_map(p, docs):
    return p.map(inputs={"text": docs}, map_over="text", output_name="score", on_error="continue", progress=False)


def ray_data(docs):
    import ray
    import ray.data
    if not ray.is_initialized():  # (its workers import this file's functions: PYTHONPATH, `side`)
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20,
                     _node_ip_address="127.0.0.1", _temp_dir=tempfile.mkdtemp(prefix="ray-"))
        except Exception as exc:  # reported in the table: Ray did not start here
            raise RuntimeError(f"Ray did not start: {type(exc).__name__}: {str(exc)[:200]}") from exc
        ray.data.DataContext.get_current().enable_progress_bars = False

    def embed_batch(batch):  # tasks, each process building its model once (`model()`)
        batch["embedding"] = list(embed_many(list(batch["ids"])))
        return batch
    ds = (ray.data.from_items([{"text": d} for d in docs], override_num_blocks=8)
          .map(lambda row: {"ids": tokenize(row["text"])})
          .map_batches(embed_batch, batch_size=BATCH, batch_format="pandas")
          .map(lambda row: {"score": score(row["embedding"])}))
    return [r["score"] for r in ds.take_all()]


def daft_run(docs):
    import daft

    @daft.func(return_dtype=daft.DataType.list(daft.DataType.int64()))
    def tok(text: str):
        return tokenize(text)

    @daft.cls(max_concurrency=2, use_process=True)
    class Embed:
        @daft.method.batch(return_dtype=daft.DataType.list(daft.DataType.float32()), batch_size=BATCH)
        def embed(self, ids):
            return [row.tolist() for row in embed_many(ids.to_pylist())]

    @daft.func(return_dtype=daft.DataType.float64())
    def sc(embedding: list):
        return score(embedding)
    df = daft.from_pydict({"text": docs})
    df = df.with_column("ids", tok(df["text"]))
    df = df.with_column("embedding", Embed().embed(df["ids"]))
    df = df.with_column("score", sc(df["embedding"]))
    return df.select("score").to_pydict()["score"]


HN_SCRIPT = """
import json, sys, time
sys.path.insert(0, {here!r})
from batching import documents, tokenize, embed_many, embed_one, score
from hypernodes import Pipeline, DualNode, node
from hypernodes.engines import DaftEngine

@node(output_name="ids")
def tok(text: str) -> list[int]: return tokenize(text)
def embed_single(ids: list[int]) -> list[float]: return [float(v) for v in embed_one(ids)]
def embed_batch(ids: list[list[int]]) -> list[list[float]]:
    return [[float(v) for v in row] for row in embed_many(ids.to_pylist() if hasattr(ids, "to_pylist") else list(ids))]
@node(output_name="score")
def sc(embedding: list[float]) -> float: return score(embedding)
p = Pipeline(nodes=[tok, DualNode(output_name="embedding", singular=embed_single, batch=embed_batch), sc],
             engine=DaftEngine())
docs = documents({n}, {poisoned})
p.map(inputs={{"text": docs[:500]}}, map_over="text", output_name="score")
t = time.perf_counter()
try:
    out = p.map(inputs={{"text": docs}}, map_over="text", output_name="score")
    print(json.dumps({{"s": time.perf_counter() - t, "results": len(out)}}))
except BaseException as e:
    print(json.dumps({{"s": time.perf_counter() - t, "results": 0, "error": type(e).__name__}}))
"""


def side(kind: str, poisoned: int | None, timeout: float = 900) -> dict:
    """A peer in a child process (a segfault there must not end this run): seconds and results,
    or why it has none."""
    here = os.path.dirname(os.path.abspath(__file__))
    if kind == "hypernodes":
        python = hn_python()
        if python.startswith("skipped"):
            return {"skipped": python}
        code = HN_SCRIPT.format(here=here, n=N, poisoned=poisoned)
    else:
        code = (f"import json, sys, time; sys.path.insert(0, {here!r}); import batching as b\n"
                f"docs = b.documents({N}, {poisoned}); run = b.{kind}\n"
                f"try:\n    run(b.documents(500))\n"
                f"except BaseException as e:\n"
                f"    print(json.dumps({{'skipped': f'{{type(e).__name__}}: {{e}}'[:200]}})); sys.exit()\n"
                f"t = time.perf_counter()\n"
                f"try:\n    out = run(docs); print(json.dumps({{'s': time.perf_counter() - t, 'results': len(out)}}))\n"
                f"except BaseException as e:\n"
                f"    print(json.dumps({{'s': time.perf_counter() - t, 'results': 0, 'error': type(e).__name__}}))\n")
        python = sys.executable
    t = time.perf_counter()
    # the peers' own worker processes (Ray's tasks, Daft's UDF processes) import this file's functions
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))}
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"s": timeout, "results": 0, "error": f"no answer in {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1][:120]
        return {"s": time.perf_counter() - t, "results": 0, "error": f"process died ({done.returncode}): {why}"}
    return json.loads(lines[-1])


def hn_python() -> str:
    """The side environment's Python for HyperNodes 0.4.8 (its DaftEngine needs daft < 0.7, whose
    wheels conflict with the daft this environment runs): HN_PYTHON, made there with pip when
    it is missing; or why it is skipped."""
    check = [HN_PYTHON, "-c", "import hypernodes, daft; from hypernodes.engines import DaftEngine"]
    if os.path.exists(HN_PYTHON) and subprocess.run(check, capture_output=True).returncode == 0:
        return HN_PYTHON
    venv = os.path.dirname(os.path.dirname(HN_PYTHON))
    steps = ([sys.executable, "-m", "venv", "--system-site-packages", venv],
             [HN_PYTHON, "-m", "pip", "install", "-q", "hypernodes==0.4.8", "daft<0.7"])
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"skipped: {' '.join(step[:4])}... failed ({exc})"
        if done.returncode != 0:
            return f"skipped: {' '.join(step[-3:])} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:100]}"
    if subprocess.run(check, capture_output=True).returncode != 0:
        return "skipped: hypernodes 0.4.8 installed but its DaftEngine does not import"
    return HN_PYTHON


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from hardy import DiskCache, Engine, Failed, NodeCrashed
    docs = documents(N)
    rows: dict[str, dict] = {}
    print(f"load average (1, 5, 15 min) at the start: {os.getloadavg()}")
    model()
    rows["plain loop, per item (1 process)"] = {"s": best(lambda: plain_per_item(docs))[0], "results": N}
    reference = plain_batched(docs)

    engine = Engine(map_executor="process", workers=2, preload=["torch"])
    p, _ = hardy_pipeline(False, engine)
    hardy_map(p, docs[:500])
    s, out = best(lambda p=p: hardy_map(p, docs))
    assert sum(not isinstance(o, Failed) for o in out) == N
    rows["hardy, per item (2 workers)"] = {"s": s, "results": N}

    # The three figures the targets compare, measured in turns (the plain loop, hardy clean, hardy
    # with the poisoned document; best of ROUNDS each), so that a busy moment of a shared machine
    # falls on all three alike.
    p, _ = hardy_pipeline(True, engine)
    hardy_map(p, docs[:500])
    poisoned = documents(N, poisoned=N // 3)
    import multiprocessing
    two = multiprocessing.get_context("spawn").Pool(2)  # spawned: torch in this process makes fork unsafe
    for _ in range(3):  # each process builds its model (the call lands on both, in turns)
        two.map(plain_batched, [docs[:200], docs[200:400]], chunksize=1)
    times: dict[str, list[float]] = {"plain": [], "two": [], "clean": [], "poisoned": []}
    for _ in range(ROUNDS):
        times["plain"].append(timed(lambda: plain_batched(docs))[0])
        times["two"].append(timed(lambda: split_in_two(two, docs))[0])
        s, out = timed(lambda p=p: hardy_map(p, docs))
        ok = [o for o in out if not isinstance(o, Failed)]
        assert len(ok) == N and max(abs(a["score"] - b) for a, b in zip(ok, reference)) < 1e-3 * max(reference)
        times["clean"].append(s)
        s, out = timed(lambda p=p: hardy_map(p, poisoned))
        crashed = [o.error for o in out if isinstance(o, Failed)]
        assert len(crashed) == 1 and isinstance(crashed[0], NodeCrashed) and crashed[0].item == N // 3, crashed
        times["poisoned"].append(s)
    two.close()
    rows["plain loop, batched 64 (1 process)"] = {"s": min(times["plain"]), "results": N}
    rows["plain loop, batched 64, 2 processes (half each, no containment)"] = {"s": min(times["two"]), "results": N}
    rows["hardy, batched 64 (2 workers)"] = {"s": min(times["clean"]), "results": N}
    rows["hardy, batched 64, 1 poisoned document"] = {"s": min(times["poisoned"]), "results": N - 1, "crashed": 1}
    print("each round's seconds (plain batched loop, the same in two processes, hardy batched, hardy batched with "
          "the poisoned document):",
          [tuple(round(times[k][r], 3) for k in times) for r in range(ROUNDS)])

    reported = Engine(map_executor="process", workers=2, preload=["torch"], report=True)
    p, _ = hardy_pipeline(True, reported)  # its batch calls as the run report shows them (not timed)
    hardy_map(p, docs[:500])
    hardy_map(p, docs)
    (embed_row,) = [n for n in p.report().to_dict()["nodes"] if n["name"] == "embed"]
    reported.close()

    for name, kind in (("Ray Data, map + map_batches(64) tasks (2 CPUs)", "ray_data"),
                       ("Daft, row UDFs + batch UDF(64) (2 processes)", "daft_run"),
                       ("HyperNodes 0.4.8 DualNode on DaftEngine", "hypernodes")):
        if not PEERS:
            rows[name] = {"skipped": "PEERS=0", "results": 0}
            continue
        rows[name] = side(kind, None, PEER_TIMEOUT)
        rows[name + ", 1 poisoned document"] = side(kind, N // 3, PEER_TIMEOUT / 2)

    # a warm cached re-run: every item's embedding comes from its own entry
    count = tempfile.mktemp(prefix="hardy-batch-count-")
    os.environ["HARDY_BENCH_COUNT"] = count
    cached = Engine(map_executor="process", workers=2, preload=["torch"], cache=DiskCache(tempfile.mkdtemp()))
    p, _ = hardy_pipeline(True, cached)
    cold, _ = timed(lambda: hardy_map(p, docs))
    calls_cold = len(Path(count).read_text().split())
    warm, out = timed(lambda: hardy_map(p, docs))
    calls_warm = len(Path(count).read_text().split()) - calls_cold
    rows["hardy, batched 64, cache cold"] = {"s": cold, "results": N, "batch calls": calls_cold}
    rows["hardy, batched 64, cache warm re-run"] = {"s": warm, "results": len(out), "batch calls": calls_warm}
    engine.close()
    cached.close()

    batched_s = rows["hardy, batched 64 (2 workers)"]["s"]
    t = Table(title=f"{N:,} documents: tokenize -> embed (torch, 1 thread/process) -> score, "
                    f"{os.cpu_count()} cores")
    for col in ("run", "time", "docs/s", "results", "hardy batched is"):
        t.add_column(col, justify="right")
    for name, r in rows.items():
        if "skipped" in r:
            t.add_row(name, "-", "-", r["skipped"], "")
            continue
        note = f"{r['results']:,}" + (f" ({r['error']})" if r.get("error") else "") + \
            (f", {r['crashed']} NodeCrashed" if r.get("crashed") else "") + \
            (f", {r['batch calls']} batch calls" if "batch calls" in r else "")
        rate = r["results"] / r["s"] if r["results"] else 0
        ratio = f"{r['s'] / batched_s:.2f}x faster" if r["results"] == N and "poisoned" not in name else ""
        t.add_row(name, f"{r['s']:.2f} s", f"{rate:,.0f}", note, ratio)
    Console(width=140).print(t)
    clean = batched_s
    print(f"poisoned / clean (hardy batched): {rows['hardy, batched 64, 1 poisoned document']['s'] / clean:.2f}x")
    plain_s = rows["plain loop, batched 64 (1 process)"]["s"]
    two_s = rows["plain loop, batched 64, 2 processes (half each, no containment)"]["s"]
    print(f"against the plain batched loop: two plain processes {plain_s / two_s:.2f}x (the ceiling of 2 cores "
          f"here), hardy batched {plain_s / clean:.2f}x ({two_s / clean:.2f} of the ceiling)")
    b = embed_row["batches"]
    print(f"the run report of a batched map (Engine(report=True)): embed {b['calls']} calls, "
          f"{b['size_mean']:.1f} items per call (min {b['size_min']}, max {b['size_max']}), "
          f"{b['mean_s'] * 1e3:.2f} ms per call (p95 {b['p95_s'] * 1e3:.2f} ms), "
          f"{embed_row['mean_s'] * 1e6:.1f} us per item")
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

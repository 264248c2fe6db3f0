"""The cache is never wrong: distinct inputs never collide, edits invalidate exactly what they
affect, damaged or foreign entries are never served (nor unpickled), many processes share it."""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hardy import DiskCache, Engine, Failed, MapError, Pipeline, node
from hardy.cache.entry import HEADER, MAGIC, VERSION
from hardy.errors import UnhashableError
from hardy.hashing import hash_value

pytestmark = pytest.mark.usefixtures("in_process_default")  # the cache's own counters and warnings, seen here


class Counter:
    """Counts node executions across processes: one line appended per call."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, label: str) -> None:
        with open(self.path, "a") as f:
            f.write(label + "\n")

    def calls(self) -> list[str]:
        return self.path.read_text().split() if self.path.exists() else []


@pytest.fixture
def counter(tmp_path):
    return Counter(tmp_path / "calls.txt")


def make_echo(counter):
    @node(output_name="out")
    def echo(x):
        counter("echo")
        return (type(x).__name__, x)
    return echo


WRONG_HIT_PAIRS = [(1, "1"), (True, "True"), (1.5, "1.5"), ([1, 2], (1, 2)), (None, "None"), (1, 1.0),
                   (1, True), (0, False), (b"1", "1"), ({"a": 1}, {"a": 1.0}), ({1, 2}, [1, 2]),
                   (np.float64(1.0), 1.0), (np.arange(3), np.arange(3.0)), (np.zeros((2, 3)), np.zeros((3, 2)))]


def test_no_wrong_hits_between_values_that_look_alike(tmp_path, counter):
    p = Pipeline(nodes=[make_echo(counter)], cache=DiskCache(tmp_path / "c"))
    for a, b in WRONG_HIT_PAIRS:
        ra, rb = p.run(inputs={"x": a})["out"], p.run(inputs={"x": b})["out"]
        assert ra[0] == type(a).__name__ and rb[0] == type(b).__name__, (a, b)
        assert p.run(inputs={"x": a})["out"][0] == type(a).__name__
    distinct = {hash_value(v) for pair in WRONG_HIT_PAIRS for v in pair}
    assert len(distinct) == 22  # 28 values, some repeated across pairs (1, "1", 1.0 ...)
    assert len(counter.calls()) == len(distinct)  # each distinct value computed once, then hit


def test_dicts_key_by_insertion_order_sets_do_not(tmp_path, counter):
    @node(output_name="first")
    def first(d):
        counter("first")
        return next(iter(d))
    p = Pipeline(nodes=[first], cache=DiskCache(tmp_path / "c"))
    assert p.run(inputs={"d": {"a": 1, "b": 2}})["first"] == "a"
    assert p.run(inputs={"d": {"b": 2, "a": 1}})["first"] == "b"  # the other order is another key
    assert p.run(inputs={"d": {"a": 1, "b": 2}})["first"] == "a" and counter.calls() == ["first"] * 2
    assert hash_value({3, 1, 2}) == hash_value({1, 2, 3})
    assert hash_value([1, 2]) != hash_value([2, 1])


@dataclasses.dataclass
class Params:
    lr: float
    _seed: int = 0  # private state is part of the key


class Opaque:
    __slots__ = ()


class Keyed:
    def __init__(self, name, handle):
        self.name, self.handle = name, handle

    def __cache_key__(self):
        return self.name


def test_structured_values_hash_by_content():
    pd = pytest.importorskip("pandas")
    assert hash_value(Params(0.1)) == hash_value(Params(0.1))
    assert hash_value(Params(0.1, 1)) != hash_value(Params(0.1, 0))
    df = pd.DataFrame({"a": [1, 2], "b": [0.5, 1.5]})
    assert hash_value(df) == hash_value(df.copy())
    assert hash_value(df) != hash_value(df.set_index(pd.Index([5, 6])))
    assert hash_value(df) != hash_value(df.astype({"a": "float64"}))
    assert hash_value(Keyed("m", object())) == hash_value(Keyed("m", object()))  # __cache_key__ decides
    with pytest.raises(UnhashableError, match="__cache_key__"):
        hash_value(Opaque())


def test_unhashable_input_is_a_clear_error(tmp_path):
    import threading

    @node(output_name="y")
    def use(x, lock):
        return x

    p = Pipeline(nodes=[use], cache=DiskCache(tmp_path / "c"))
    with pytest.raises(Exception) as exc:
        p.run(inputs={"x": 1, "lock": threading.Lock()})
    text = str(exc.value)
    assert "node 'use'" in text and "input 'lock'" in text and "__cache_key__" in text and "cache=False" in text


def test_per_item_caching_and_resume(tmp_path, counter):
    @node(output_name="y")
    def slow(x):
        counter(f"slow{x}")
        if x == 500 and not os.path.exists(tmp_path / "fixed"):
            raise RuntimeError("transient")
        return x * 2

    p = Pipeline(nodes=[slow], cache=DiskCache(tmp_path / "c"))
    with pytest.raises(MapError):
        p.map(inputs={"x": list(range(1000))}, map_over="x")
    assert len(counter.calls()) == 501  # stopped at the failure; 0..499 are cached
    (tmp_path / "fixed").touch()
    out = p.map(inputs={"x": list(range(1000))}, map_over="x")
    assert [o["y"] for o in out] == [2 * x for x in range(1000)]
    assert len(counter.calls()) == 501 + 500  # only the unfinished items ran
    p.map(inputs={"x": list(range(1010))}, map_over="x")
    assert len(counter.calls()) == 1001 + 10  # 10 new items: 10 computations


def test_cache_false_nodes_always_run(tmp_path, counter):
    @node(output_name="now", cache=False)
    def stamp(x):
        counter("stamp")
        return time.time_ns()

    @node(output_name="y")
    def use(now):
        counter("use")
        return now

    p = Pipeline(nodes=[stamp, use], cache=DiskCache(tmp_path / "c"))
    a, b = p.run(inputs={"x": 1}), p.run(inputs={"x": 1})
    assert a["now"] != b["now"] and a["y"] == a["now"] and b["y"] == b["now"]
    assert counter.calls().count("stamp") == 2 and counter.calls().count("use") == 2


MODULE = """
import os
CONST = {const}
SCALE = 1

def helper(v):
    return v + {helper}

def make(k):
    def closed(x):
        return x * k
    return closed

from hardy import node

def _log(name):
    with open(os.environ["CALLS"], "a") as f:
        f.write(name + "\\n")

@node(output_name="a")
def uses_helper(x):
    _log("a")
    return helper(x)

@node(output_name="b")
def uses_const(x):
    _log("b")
    return x + CONST

_closed = make({closure})

@node(output_name="c")
def uses_closure(x):
    _log("c")
    return _closed(x)

@node(output_name="d")
def independent(x):
    _log("d")
    return x * SCALE
"""

SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import steps
from hardy import DiskCache, Pipeline
p = Pipeline(nodes=[steps.uses_helper, steps.uses_const, steps.uses_closure, steps.independent],
             cache=DiskCache(sys.argv[2]))
print(p.run(inputs={"x": 10}))
"""


def test_editing_code_invalidates_exactly_the_affected_nodes(tmp_path):
    calls = tmp_path / "calls.txt"
    src = tmp_path / "src"
    src.mkdir()

    def run(const=1, helper=1, closure=2) -> tuple[set[str], str]:
        (src / "steps.py").write_text(MODULE.format(const=const, helper=helper, closure=closure))
        calls.write_text("")
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(tmp_path / "c")], check=True,
                             capture_output=True, text=True, env={**os.environ, "CALLS": str(calls)}).stdout
        return set(calls.read_text().split()), out.strip()

    assert run()[0] == {"a", "b", "c", "d"}
    assert run()[0] == set()
    ran, out = run(helper=5)
    assert ran == {"a"} and "'a': 15" in out
    ran, out = run(helper=5, const=7)
    assert ran == {"b"} and "'b': 17" in out
    ran, out = run(helper=5, const=7, closure=3)
    assert ran == {"c"} and "'c': 30" in out
    assert run(helper=5, const=7, closure=3)[0] == set()
    assert run()[0] == set()  # the original code's entries are still there


def test_different_output_mappings_never_share_a_wrong_result(tmp_path, counter):
    @node(output_name="y")
    def inc(x):
        counter("inc")
        return x + 1

    inner = Pipeline(nodes=[inc], name="inner")
    cache = DiskCache(tmp_path / "c")
    p1 = Pipeline(nodes=[inner.as_node(name="n", output_mapping={"y": "first"})], cache=cache)
    p2 = Pipeline(nodes=[inner.as_node(name="n", input_mapping={"z": "x"}, output_mapping={"y": "second"})],
                  cache=cache)
    assert p1.run(inputs={"x": 1}) == {"first": 2}
    assert p2.run(inputs={"z": 5}) == {"second": 6}
    assert p2.run(inputs={"z": 1}) == {"second": 2}  # same inner computation: a correct hit
    assert counter.calls() == ["inc", "inc"]


def test_nested_map_caches_each_item(tmp_path, counter):
    @node(output_name="y")
    def inc(x):
        counter("inc")
        return x + 1

    inner = Pipeline(nodes=[inc], name="inner")
    outer = Pipeline(nodes=[inner.as_node(name="each", input_mapping={"xs": "x"}, output_mapping={"y": "ys"},
                                          map_over="xs")], cache=DiskCache(tmp_path / "c"))
    assert outer.run(inputs={"xs": [1, 2, 3]}) == {"ys": [2, 3, 4]}
    assert outer.run(inputs={"xs": [1, 2, 3, 4]}) == {"ys": [2, 3, 4, 5]}
    assert len(counter.calls()) == 4


def test_cache_under_the_process_executor(tmp_path, counter):
    @node(output_name="y")
    def square(x):
        counter("sq")
        return x * x

    cache = DiskCache(tmp_path / "c")
    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline(nodes=[square], engine=engine, cache=cache)
        assert [o["y"] for o in p.map(inputs={"x": list(range(30))}, map_over="x")] == [x * x for x in range(30)]
        assert [o["y"] for o in p.map(inputs={"x": list(range(30))}, map_over="x")] == [x * x for x in range(30)]
    assert len(counter.calls()) == 30
    local = Pipeline(nodes=[square], cache=cache)  # entries written by workers serve this process too
    assert local.run(inputs={"x": 7}) == {"y": 49} and len(counter.calls()) == 30


# --- damaged and foreign entries ------------------------------------------------------------------

@node(output_name="blob")
def make_blob(x: int, size: int) -> bytes:
    return bytes([x % 251]) * size


def _entries(cache: DiskCache) -> list:
    return cache.entries()


def _damage_inline(db: Path, key: bytes, how: str) -> None:
    conn = sqlite3.connect(db)
    (data,) = conn.execute("SELECT data FROM entries WHERE key = ?", (key,)).fetchone()
    conn.execute("UPDATE entries SET data = ? WHERE key = ?", (_damaged(data, how), key))
    conn.commit()
    conn.close()


def _damaged(data: bytes, how: str) -> bytes:
    if how == "truncate":
        return data[: len(data) // 2]
    if how == "zero":
        return bytes(len(data))
    i = random.randrange(len(data))
    return data[:i] + bytes([data[i] ^ (1 << random.randrange(8))]) + data[i + 1:]


@pytest.mark.parametrize("size", [100, 400_000])  # an inline entry and a blob file
@pytest.mark.parametrize("how", ["truncate", "zero", "flip"])
def test_damaged_entries_are_detected_and_recomputed(tmp_path, size, how, caplog):
    random.seed(size)
    cache = DiskCache(tmp_path / "c")
    p = Pipeline(nodes=[make_blob], cache=cache)
    xs = list(range(20))
    p.map(inputs={"x": xs, "size": size}, map_over="x")
    entries = _entries(cache)
    assert len(entries) == 20 and all(e.inline == (size < 256 << 10) for e in entries)
    for e in entries:
        if e.inline:
            _damage_inline(tmp_path / "c" / "index.sqlite", e.key, how)
        else:
            blob = tmp_path / "c" / "blobs" / e.key.hex()[:2] / e.key.hex()
            blob.write_bytes(_damaged(blob.read_bytes(), how))
    fresh = DiskCache(tmp_path / "c")
    out = Pipeline(nodes=[make_blob], cache=fresh).map(inputs={"x": xs, "size": size}, map_over="x")
    assert [o["blob"] for o in out] == [bytes([x % 251]) * size for x in xs]
    # every damaged entry detected, none served; a flip in the key id looks like another secret's
    assert fresh.rejected + fresh.skipped == 20 and fresh.rejected >= 18 and fresh.hits == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "hardy.cache"]
    assert len(warnings) == 1 and f"{fresh.rejected} damaged entries deleted and recomputed" in warnings[0]
    again = DiskCache(tmp_path / "c")
    Pipeline(nodes=[make_blob], cache=again).map(inputs={"x": xs, "size": size}, map_over="x")
    assert again.hits == 20 - fresh.skipped and again.rejected == 0  # recomputed entries are good


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('PWNED_FILE', '/tmp/hardy-pwned')}",))


def test_foreign_and_moved_entries_are_never_unpickled(tmp_path, monkeypatch):
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("PWNED_FILE", str(pwned))
    cache = DiskCache(tmp_path / "c")
    p = Pipeline(nodes=[make_blob], cache=cache)
    p.map(inputs={"x": [1, 2], "size": 10}, map_over="x")
    k1, k2 = (e.key for e in _entries(cache))
    payload = pickle.dumps(Exploit())
    # an entry crafted by someone without the key: right format, wrong MAC
    crafted = MAGIC + bytes([VERSION]) + b"\0" * (HEADER - 4) + payload
    cache.store.put(k1, crafted)
    # a genuine entry moved under another key
    genuine = cache.store.get(k2)
    cache.store.put(k2, genuine)  # unchanged: still valid
    other = DiskCache(tmp_path / "c")
    other.store.put(k1, crafted)
    out = Pipeline(nodes=[make_blob], cache=other).map(inputs={"x": [1, 2], "size": 10}, map_over="x")
    assert [o["blob"] for o in out] == [b"\x01" * 10, b"\x02" * 10]
    assert not pwned.exists()
    other.store.put(k1, genuine)  # k2's valid entry copied under k1
    assert other.get(k1, "miss") == "miss" and not pwned.exists()


def test_key_file_and_shared_key(tmp_path, monkeypatch):
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    cache = DiskCache(tmp_path / "c")
    Pipeline(nodes=[make_blob], cache=cache).run(inputs={"x": 1, "size": 3})
    key_file = tmp_path / "c" / "secret.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_bytes()) == 32
    monkeypatch.setenv("HARDY_CACHE_KEY", "team-secret")
    shared = DiskCache(tmp_path / "c")
    assert shared.secret != key_file.read_bytes()
    Pipeline(nodes=[make_blob], cache=shared).run(inputs={"x": 1, "size": 3})
    # written under the directory key: not trusted under another key, and left to its owner
    assert shared.skipped == 1 and shared.rejected == 0 and shared.stats().entries == 1
    monkeypatch.delenv("HARDY_CACHE_KEY")
    owner = DiskCache(tmp_path / "c")
    Pipeline(nodes=[make_blob], cache=owner).run(inputs={"x": 1, "size": 3})
    assert owner.hits == 1


def test_damaged_index_is_moved_aside(tmp_path):
    cache = DiskCache(tmp_path / "c")
    p = Pipeline(nodes=[make_blob], cache=cache)
    p.run(inputs={"x": 1, "size": 3})
    db = tmp_path / "c" / "index.sqlite"
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    db.write_bytes(b"this is not a database" * 100)
    fresh = DiskCache(tmp_path / "c")
    assert Pipeline(nodes=[make_blob], cache=fresh).run(inputs={"x": 1, "size": 3}) == {"blob": b"\x01" * 3}
    assert list((tmp_path / "c").glob("index.sqlite.damaged-*"))


# --- many processes -------------------------------------------------------------------------------

VALUE_NODE = """
from hardy import node

@node(output_name="v")
def value(x: int, size: int) -> bytes:
    return (str(x).encode() + b":") * size
"""

HAMMER = VALUE_NODE + """
import json, os, random, sys, time
from hardy import DiskCache, Pipeline

cache = DiskCache(sys.argv[1])
p = Pipeline(nodes=[value], cache=cache)
me, deadline = int(sys.argv[2]), time.time() + float(sys.argv[3])
rng = random.Random(me)
rounds = wrong = 0
used = set()
while time.time() < deadline:
    shared = [rng.randrange(200) for _ in range(20)]       # keys every process uses
    own = [10_000 * (me + 1) + rng.randrange(200) for _ in range(5)]  # keys only this one uses
    for x in shared + own:
        size = 3 if x % 3 else 30_000                       # inline entries and blob files
        if p.run(inputs={"x": x, "size": size})["v"] != (str(x).encode() + b":") * size:
            wrong += 1
        used.add(x)
    rounds += 1
print(json.dumps([rounds, wrong, cache.rejected, sorted(used)]))
"""


@pytest.mark.slow
def test_eight_processes_hammering_the_same_cache(tmp_path):
    import json
    seconds = 10
    procs = [subprocess.Popen([sys.executable, "-c", HAMMER, str(tmp_path / "c"), str(i), str(seconds)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(8)]
    results = [p.communicate(timeout=120) for p in procs]
    used = set()
    for (out, err), proc in zip(results, procs):
        assert proc.returncode == 0, err  # 0 exceptions
        rounds, wrong, rejected, xs = json.loads(out)
        assert rounds > 0 and wrong == 0 and rejected == 0
        used.update(xs)
    # 0 lost entries: every value any process computed is served from the cache here
    ns: dict = {}
    exec(VALUE_NODE, ns)
    cache = DiskCache(tmp_path / "c")
    p = Pipeline(nodes=[ns["value"]], cache=cache)
    for x in sorted(used):
        p.run(inputs={"x": x, "size": 3 if x % 3 else 30_000})
    assert cache.misses == 0 and cache.hits == len(used) and len(used) > 200
    assert cache.verify().bad == []


KILLED_WRITER = """
import sys
from hardy import DiskCache, Pipeline, node

@node(output_name="v")
def value(x: int) -> bytes:
    return bytes([x % 256]) * (1000 + (x % 7) * 100_000)   # inline and blob entries

p = Pipeline(nodes=[value], cache=DiskCache(sys.argv[1]))
start = int(sys.argv[2])
p.run(inputs={"x": start})
print("writing", flush=True)
for x in range(start + 1, start + 10_000):
    p.run(inputs={"x": x})
"""


@pytest.mark.slow
def test_writers_killed_mid_write_never_leave_a_served_corrupt_value(tmp_path):
    rng = random.Random(3)
    for _ in range(10):  # 100 writers, 10 at a time, each SIGKILLed at a random moment
        procs = [subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "c"), str(i * 50)],
                                  stdout=subprocess.PIPE, text=True) for i in range(10)]
        for p in procs:
            assert p.stdout.readline() == "writing\n"  # started, whatever the machine's load
        for p in procs:
            time.sleep(rng.uniform(0, 0.05))
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
            p.stdout.close()
    cache = DiskCache(tmp_path / "c")
    served = 0
    for e in cache.entries():
        value = cache.get(e.key, None)
        if value is not None:
            served += 1
            assert value == bytes([value[0]]) * len(value) and len(value) % 100_000 == 1000
    assert served > 50
    assert cache.verify().bad == []


SINGLE_FLIGHT = """
import os, sys, time
from hardy import DiskCache, Pipeline, node

@node(output_name="v")
def expensive(x: int) -> int:
    with open(sys.argv[2], "a") as f:
        f.write("computed\\n")
    time.sleep(1.0)
    return x * 3

p = Pipeline(nodes=[expensive], cache=DiskCache(sys.argv[1], single_flight=True))
print(p.run(inputs={"x": 14})["v"])
"""


@pytest.mark.slow
def test_single_flight_computes_once_across_processes(tmp_path):
    log = tmp_path / "computed.txt"
    procs = [subprocess.Popen([sys.executable, "-c", SINGLE_FLIGHT, str(tmp_path / "c"), str(log)],
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs == ["42"] * 4
    assert log.read_text().split() == ["computed"]


def test_prune_evicts_least_recently_used(tmp_path):
    cache = DiskCache(tmp_path / "c")
    p = Pipeline(nodes=[make_blob], cache=cache)
    p.map(inputs={"x": list(range(10)), "size": 1000}, map_over="x")
    total = cache.stats().bytes
    deleted = cache.prune(max_size=total // 2)
    assert deleted >= 5 and cache.stats().bytes <= total // 2
    remaining = cache.stats().entries
    assert cache.prune(older_than=0) == remaining and cache.stats().entries == 0


def test_cli_cache_commands(tmp_path):
    cache = DiskCache(tmp_path / "c")
    Pipeline(nodes=[make_blob], cache=cache).map(inputs={"x": [1, 2, 3], "size": 5}, map_over="x")

    def hardy(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hardy.cli", "cache", *args, "--dir", str(tmp_path / "c")],
                              capture_output=True, text=True)

    assert '"entries": 3' in hardy("stats", "--json").stdout
    assert hardy("verify").returncode == 0
    assert len([ln for ln in hardy("ls").stdout.splitlines() if "index" in ln]) == 3
    _damage_inline(tmp_path / "c" / "index.sqlite", cache.entries()[0].key, "zero")
    bad = hardy("verify")
    assert bad.returncode == 1 and "1 bad" in bad.stdout
    assert "deleted" in hardy("prune", "--max-size", "0").stdout
    assert hardy("clear", "--yes").returncode == 0
    assert '"entries": 0' in hardy("stats", "--json").stdout


@pytest.mark.parametrize("command", ["stats", "ls", "verify"])
def test_cli_on_a_directory_without_a_cache_says_so_and_creates_nothing(tmp_path, command):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "missing", tmp_path / "empty"):
        out = subprocess.run([sys.executable, "-m", "hardy.cli", "cache", command, "--dir", str(folder)],
                             capture_output=True, text=True)
        assert out.returncode == 2 and f"no hardy cache in {folder}" in out.stderr
    assert not (tmp_path / "missing").exists() and list((tmp_path / "empty").iterdir()) == []


def test_failed_items_are_not_cached(tmp_path, counter):
    @node(output_name="y")
    def flaky(x):
        counter("flaky")
        raise ValueError("no")

    p = Pipeline(nodes=[flaky], cache=DiskCache(tmp_path / "c"))
    out = p.map(inputs={"x": [1]}, map_over="x", on_error="continue")
    out = p.map(inputs={"x": [1]}, map_over="x", on_error="continue")
    assert isinstance(out[0], Failed) and counter.calls() == ["flaky", "flaky"]


def test_stateful_resource_keys_by_constructor_arguments():
    from hardy import stateful

    class Model:
        def __init__(self, name):
            self.name = name

    M = stateful(Model)
    assert hash_value(M("a")) == hash_value(M("a")) and hash_value(M("a")) != hash_value(M("b"))


def test_large_arrays_hash_by_every_byte():
    """How fast is measured in bench/cache.py; here, that no part of a big buffer is skipped."""
    a = np.random.rand(1 << 20)  # 8 MB
    key = hash_value(a)
    assert hash_value(a.copy()) == key
    for where in (0, len(a) // 2, len(a) - 1):
        b = a.copy()
        b[where] = np.nextafter(b[where], 2.0)  # the smallest change a float can take
        assert hash_value(b) != key



def test_engine_level_cache_and_pipeline_override(tmp_path, counter):
    @node(output_name="y")
    def inc(x):
        counter("inc")
        return x + 1

    engine_cache, own_cache = DiskCache(tmp_path / "engine"), DiskCache(tmp_path / "own")
    engine = Engine(cache=engine_cache)
    Pipeline(nodes=[inc], engine=engine).run(inputs={"x": 1})
    Pipeline(nodes=[inc], engine=engine).run(inputs={"x": 1})
    assert counter.calls() == ["inc"] and engine_cache.stats().entries == 1
    Pipeline(nodes=[inc], engine=engine, cache=own_cache).run(inputs={"x": 1})  # the pipeline's wins
    assert counter.calls() == ["inc", "inc"] and own_cache.stats().entries == 1


def test_keyed_stages_key_every_node_as_the_whole_plan(tmp_path):
    """A plan cut into keyed stages (how daft_engine() gives nodes their own UDF) derives every cache
    key exactly as the whole plan does: multi-output and uncached producers included."""
    from hardy.plan.compiled import KEYS, Plan

    @node(output_name="a")
    def inc(x):
        return x + 1

    @node(output_name=("b", "h"))
    def split(a):
        return 2 * a, a / 2

    @node(output_name="c", cache=False)
    def uncached(b):
        return b + 1

    @node(output_name="d")
    def join(c, h, x):
        return c + h + x

    graph = Pipeline(nodes=[inc, split, uncached, join]).graph
    cache = DiskCache(tmp_path / "c")
    whole = Plan(graph, ["x"], ["a", "b", "h", "c", "d"], cache=cache, keyed=True).run({"x": 3})
    first = Plan(graph, ["x"], ["b", "h"], cache=DiskCache(tmp_path / "other"), keyed=True).run({"x": 3})
    second = Plan(graph, ["x", "b", "h"], ["d"], cache=cache, keyed=True)
    hits = cache.hits
    out = second.run({"x": 3, **first})
    assert out["d"] == whole["d"] == 14.0 and out[KEYS]["d"] == whole[KEYS]["d"]
    assert cache.hits == hits + 1  # the second stage found the whole plan's entry for join
    assert first[KEYS]["h"] == whole[KEYS]["h"] and "a" not in first


@pytest.mark.slow  # 200 races of 16 connections
def test_many_connections_opening_a_fresh_index_at_once(tmp_path):
    """Workers of every engine open the index at the same moment on a map's first items; on a fresh
    index SQLite can refuse the switch to WAL at once ("database is locked", no busy wait). Seen in
    Daft UDF processes; here 16 connections race on each of 200 fresh indexes (threads: the same
    race, at a fraction of the cost of processes)."""
    import threading

    from hardy.cache.store import LocalStore
    errors: list[Exception] = []
    for n in range(200):
        stores = [LocalStore(tmp_path / str(n)) for _ in range(16)]
        barrier = threading.Barrier(len(stores))

        def put(store: LocalStore, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                store.put(bytes(16), b"x")
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=put, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


SETTINGS = """
import decimal, sys
import numpy as np
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="y")
def third(x):
    with open(sys.argv[3], "a") as f:
        f.write("ran\\n")
    return [str(decimal.Decimal(x) / 3), str(np.array([x / 3]))]

if sys.argv[2] == "narrow":
    decimal.getcontext().prec = 5
    np.set_printoptions(precision=3)
p = Pipeline(nodes=[third], cache=DiskCache(sys.argv[4]), engine=Engine(map_executor=sys.argv[1]))
print(p.run(inputs={"x": 1})["y"])
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_settings_that_change_a_result_are_in_its_key(tmp_path, executor):
    """decimal's precision and numpy's print options change what a node returns for the same code
    and inputs: a result cached under one was served under the other. Each process below starts
    afresh; the ones with the default settings share the keys made before this rule existed."""
    ran, cache = tmp_path / "ran", tmp_path / "cache"

    def run(settings: str) -> tuple[str, int]:
        before = ran.read_text().count("ran") if ran.exists() else 0
        out = subprocess.run([sys.executable, "-", executor, settings, str(ran), str(cache)], input=SETTINGS,
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip(), ran.read_text().count("ran") - before

    wide = "['0.3333333333333333333333333333', '[0.33333333]']"
    assert run("default") == (wide, 1)
    assert run("narrow") == ("['0.33333', '[0.333]']", 1)  # (served the default's before)
    assert run("narrow") == ("['0.33333', '[0.333]']", 0)
    assert run("default") == (wide, 0)


@node(output_name="y")
def third_of(x: int) -> str:
    import decimal
    return str(decimal.Decimal(x) / decimal.Decimal(3))


def test_threads_with_their_own_decimal_contexts_share_a_cached_pipeline(tmp_path):
    """decimal's context is a thread's own: one thread in `localcontext(prec=3)` and others in the
    default, on one cached pipeline, each get their own precision, and no call fails (a plan
    compiled under one context was served to the other, and another thread could forget the plans
    between a look-up and a read)."""
    import decimal
    import threading
    p = Pipeline([third_of], cache=DiskCache(tmp_path), engine=Engine(map_executor="sequential"))
    wrong: list[tuple[int, str]] = []
    failed: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(60):
                x = i * 6 + k
                if k % 2:
                    with decimal.localcontext(prec=3):
                        got, want = p.run(inputs={"x": x})["y"], str(decimal.Decimal(x) / decimal.Decimal(3))
                else:
                    got, want = p.run(inputs={"x": x})["y"], str(decimal.Decimal(x) / decimal.Decimal(3))
                if got != want:
                    wrong.append((x, got))
        except BaseException as exc:  # noqa: BLE001  # (a KeyError from the plans' memo, before)
            failed.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == [] and wrong == []
    assert p.run(inputs={"x": 1})["y"] == "0.3333333333333333333333333333"

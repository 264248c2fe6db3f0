"""A cache that cannot be read or written is never the node's failure: real full disks (a 2 MB
tmpfs), real read-only mounts, damaged indexes and another user's secret on the same directory."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from hardy import DiskCache, Pipeline, node
from hardy.cache import VerifyReport

pytestmark = pytest.mark.usefixtures("in_process_default")  # the cache's own counters and warnings, seen here


def _mount(*args: str) -> None:
    out = subprocess.run(["mount", *args], capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"mount {' '.join(args)} failed ({out.stderr.strip() or out.returncode}): needs root")


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A real 2 MB filesystem that fills up."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder))
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.fixture
def read_only_view(tmp_path: Path):
    """(a writable folder, a read-only bind mount of it): a prepared cache shared read-only."""
    source, view = tmp_path / "rw", tmp_path / "ro"
    source.mkdir()
    view.mkdir()
    _mount("--bind", str(source), str(view))
    try:
        _mount("-o", "remount,bind,ro", str(view))
    except BaseException:
        subprocess.run(["umount", str(view)])
        raise
    yield source, view
    subprocess.run(["umount", "-l", str(view)], check=True)


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hardy.cache" and r.levelno >= logging.WARNING]


def files(folder: Path, pattern: str) -> list[Path]:
    return [p for p in folder.rglob(pattern) if p.is_file()]


@node(output_name="blob")
def make_blob(x: int, size: int) -> bytes:
    return bytes([x % 251]) * size


@pytest.mark.parametrize("size", [100_000, 300_000])  # entries inline in the index, and blob files
def test_disk_full_runs_uncached_and_keeps_what_was_stored(tiny_disk, size, caplog):
    caplog.set_level(logging.WARNING, "hardy.cache")
    cache = DiskCache(tiny_disk / "c")
    p = Pipeline(nodes=[make_blob], cache=cache)
    xs = list(range(60))  # 6 to 18 MB of results on a 2 MB disk
    out = p.map(inputs={"x": xs, "size": size}, map_over="x")
    assert [o["blob"] for o in out] == [bytes([x % 251]) * size for x in xs]  # no item failed
    stored = cache.stats().entries
    assert 0 < stored < 60
    [warning] = cache_warnings(caplog)
    assert f"{60 - stored} entries could not be written (disk full)" in warning and "uncached" in warning
    assert files(tiny_disk, "index.sqlite.damaged-*") == [] and files(tiny_disk, "*.tmp") == []

    caplog.clear()
    again = DiskCache(tiny_disk / "c")
    out = Pipeline(nodes=[make_blob], cache=again).map(inputs={"x": xs, "size": size}, map_over="x")
    assert [o["blob"] for o in out] == [bytes([x % 251]) * size for x in xs]
    assert again.hits == stored and again.rejected == 0  # what was stored before the disk filled stays
    assert len(cache_warnings(caplog)) == 1 and files(tiny_disk, "*.tmp") == []


SQUARES = """
import os
from hardy import node

@node(output_name="y")
def square(x):
    with open(os.environ["CALLS"], "a") as f:
        f.write(f"{x}\\n")
    return x * x
"""

PREPARE = """
import os, sys
sys.path.insert(0, sys.argv[2])
from squares import square
from hardy import DiskCache, Engine, Pipeline
engine = Engine(map_executor="sequential") if sys.argv[3] == "unfolded" else None
Pipeline(nodes=[square], cache=DiskCache(sys.argv[1]), engine=engine).map(inputs={"x": list(range(20))}, map_over="x")
if sys.argv[3] == "unfolded":  # ended before its index's write-ahead log was folded in (killed, in effect)
    os._exit(0)
"""


@pytest.mark.parametrize("ending", ["exits", "unfolded"])
def test_a_read_only_prepared_cache_is_served_and_never_written(read_only_view, tmp_path, caplog, monkeypatch,
                                                                ending):
    caplog.set_level(logging.WARNING, "hardy.cache")
    source, view = read_only_view
    (tmp_path / "squares.py").write_text(SQUARES)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.syspath_prepend(str(tmp_path))
    subprocess.run([sys.executable, "-c", PREPARE, str(source / "c"), str(tmp_path), ending], check=True)
    wal = source / "c" / "index.sqlite-wal"
    assert (ending == "unfolded") <= (wal.exists() and wal.stat().st_size > 0)  # the log the reader must see
    before = sorted(p.name for p in (source / "c").rglob("*"))
    calls.write_text("")
    from squares import square

    cache = DiskCache(view / "c")
    out = Pipeline(nodes=[square], cache=cache).map(inputs={"x": list(range(25))}, map_over="x")
    assert [o["y"] for o in out] == [x * x for x in range(25)]
    ran = [int(x) for x in calls.read_text().split()]
    assert ran == [20, 21, 22, 23, 24] and cache.hits == 20  # the node ran only for what is not there
    [warning] = cache_warnings(caplog)
    assert "5 entries could not be written (read-only)" in warning and "damaged" not in warning
    assert sorted(p.name for p in (source / "c").rglob("*")) == before


def test_a_new_cache_on_a_read_only_mount_runs_uncached(read_only_view, caplog):
    caplog.set_level(logging.WARNING, "hardy.cache")
    _, view = read_only_view
    cache = DiskCache(view / "new")  # nothing raised here, nor in the map
    out = Pipeline(nodes=[make_blob], cache=cache).map(inputs={"x": [1, 2, 3], "size": 4}, map_over="x")
    assert [o["blob"] for o in out] == [bytes([x]) * 4 for x in (1, 2, 3)]
    [warning] = cache_warnings(caplog)
    assert "3 entries could not be written (read-only)" in warning


def test_a_damaged_index_is_quarantined_at_most_once_an_hour(tmp_path, caplog):
    folder = tmp_path / "c"
    for _ in range(3):  # damaged again and again within the hour
        Pipeline(nodes=[make_blob], cache=DiskCache(folder)).run(inputs={"x": 1, "size": 3})
        for suffix in ("-wal", "-shm"):
            Path(f"{folder}/index.sqlite{suffix}").unlink(missing_ok=True)
        (folder / "index.sqlite").write_bytes(b"this is not a database" * 100)
        again = Pipeline(nodes=[make_blob], cache=DiskCache(folder)).run(inputs={"x": 1, "size": 3})
        assert again == {"blob": b"\x01" * 3}  # never the node's failure
    assert len(list(folder.glob("index.sqlite.damaged-*"))) == 1


def test_another_secret_on_the_same_directory_is_skipped_not_deleted(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "hardy.cache")
    xs = list(range(30))

    def run(secret: str) -> DiskCache:
        cache = DiskCache(tmp_path / "c", secret=secret)
        out = Pipeline(nodes=[make_blob], cache=cache).map(inputs={"x": xs, "size": 10}, map_over="x")
        assert [o["blob"] for o in out] == [bytes([x]) * 10 for x in xs]
        return cache

    assert run("alice").stats().entries == 30
    caplog.clear()
    bob = run("bob")
    assert (bob.skipped, bob.rejected, bob.hits) == (30, 0, 0)
    [warning] = cache_warnings(caplog)
    assert "30 entries written under another secret skipped" in warning
    alice = run("alice")
    assert alice.hits == 30 and alice.rejected == 0  # bob neither deleted nor overwrote them
    report = DiskCache(tmp_path / "c", secret="bob").verify()
    assert (report.other_secret, report.bad) == (30, [])


def test_lock_files_do_not_pile_up(tmp_path):
    cache = DiskCache(tmp_path / "c", single_flight=True)
    Pipeline(nodes=[make_blob], cache=cache).map(inputs={"x": list(range(50)), "size": 3}, map_over="x")
    locks = tmp_path / "c" / "locks"
    assert list(locks.iterdir()) == []
    stale = [locks / f"{i:032x}" for i in range(5)]  # left by holders that were killed
    for path in stale:
        path.touch()
    held = os.open(stale[0], os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # a computation still in flight
    try:
        cache.prune()
        assert list(locks.iterdir()) == [stale[0]]
    finally:
        os.close(held)
    cache.clear()
    assert list(locks.iterdir()) == []


def test_a_locked_index_is_a_fault_not_a_failure(tmp_path, caplog, monkeypatch):
    """A writer holding the index past the busy timeout (shortened here from 60 s)."""
    caplog.set_level(logging.WARNING, "hardy.cache")
    Pipeline(nodes=[make_blob], cache=DiskCache(tmp_path / "c")).run(inputs={"x": 0, "size": 3})
    blocker = sqlite3.connect(tmp_path / "c" / "index.sqlite", isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        cache = DiskCache(tmp_path / "c")
        conn = cache.store._conn()
        conn.execute("PRAGMA busy_timeout=50")
        out = Pipeline(nodes=[make_blob], cache=cache).map(inputs={"x": [1, 2], "size": 3}, map_over="x")
        assert [o["blob"] for o in out] == [b"\x01" * 3, b"\x02" * 3]
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    [warning] = cache_warnings(caplog)
    assert "index locked past the timeout" in warning


def test_disk_full_in_worker_processes_fails_no_item(tiny_disk):
    from hardy import Engine

    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline(nodes=[make_blob], engine=engine, cache=DiskCache(tiny_disk / "c"))
        out = p.map(inputs={"x": list(range(30)), "size": 300_000}, map_over="x")
    assert [o["blob"] for o in out] == [bytes([x]) * 300_000 for x in range(30)]
    assert 0 < DiskCache(tiny_disk / "c").stats().entries < 30
    assert files(tiny_disk, "*.tmp") == [] and files(tiny_disk, "index.sqlite.damaged-*") == []


BLOBS = """
import os
from hardy import node

@node(output_name="blob")
def counted_blob(x, size):
    with open(os.environ["CALLS"], "a") as f:
        f.write(f"{x}\\n")
    return bytes([x]) * size
"""

FILL_YESTERDAY = """
import sys
sys.path.insert(0, sys.argv[2])
from fullblobs import counted_blob
from hardy import DiskCache, Engine, Pipeline
# (in this process alone: a worker stopped as the process exits may leave the index's log behind it)
Pipeline(nodes=[counted_blob], cache=DiskCache(sys.argv[1]), engine=Engine(map_executor="sequential")).map(
    inputs={"x": list(range(int(sys.argv[3]))), "size": int(sys.argv[4])}, map_over="x")
"""


def fill(disk: Path) -> None:
    """Fill the filesystem of `disk` to its last byte."""
    with open(disk / "fill", "wb", buffering=0) as f:
        for block in (65536, 4096, 512, 1):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError:
                pass


def cache_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hardy.cli", "cache", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400"})


def _counted_blobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Path:
    """`fullblobs.counted_blob` importable, its calls counted in the file returned; the cache's warnings captured."""
    caplog.set_level(logging.WARNING, "hardy.cache")
    (tmp_path / "fullblobs.py").write_text(BLOBS)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.syspath_prepend(str(tmp_path))
    return calls


@pytest.mark.parametrize("n, size, executor", [(20, 1000, "sequential"), (4, 300_000, "sequential"),
                                               (20, 1000, "process")])  # in the index, in files
def test_a_cache_closed_before_the_disk_filled_is_served_and_can_be_emptied(tiny_disk, tmp_path, monkeypatch,
                                                                             caplog, n, size, executor):
    """Yesterday's cache, its index folded and closed (no -wal, no -shm: WAL mode would have to make
    them to open it), on a disk that is full today: served whole, with the tools that free it."""
    from hardy import Engine

    calls = _counted_blobs(tmp_path, monkeypatch, caplog)
    folder = tiny_disk / "c"
    subprocess.run([sys.executable, "-c", FILL_YESTERDAY, str(folder), str(tmp_path), str(n), str(size)], check=True)
    assert not (folder / "index.sqlite-wal").exists()  # closed cleanly: its log folded in and removed
    fill(tiny_disk)
    calls.write_text("")
    from fullblobs import counted_blob

    with Engine(map_executor=executor) as engine:
        p = Pipeline(nodes=[counted_blob], cache=DiskCache(folder), engine=engine)
        out = p.map(inputs={"x": list(range(n + 2)), "size": size}, map_over="x")
    assert [o["blob"] for o in out] == [bytes([x]) * size for x in range(n + 2)]
    assert sorted(int(x) for x in calls.read_text().split()) == [n, n + 1]  # only what was never stored ran
    if executor == "sequential":
        [warning] = cache_warnings(caplog)
        assert "2 entries could not be written (disk full)" in warning and "I/O error" not in warning
        assert f"hardy cache prune {folder} --max-size SIZE" in warning
    stats = cache_command("stats", "--json", str(folder))
    assert stats.returncode == 0 and json.loads(stats.stdout)["entries"] == n
    prune, clear = cache_command("prune", str(folder), "--max-size", "1KB"), cache_command("clear", "--yes", str(folder))
    if size > 256 << 10:  # files: removing them makes the room the index's write needs
        assert (prune.returncode, prune.stdout.strip(), prune.stderr) == (0, f"deleted {n} entries", "")
        assert clear.returncode == 0 and files(folder / "blobs", "*") == []
        assert DiskCache(folder).stats().entries == 0
    else:  # in the index: nothing to remove without writing it, which a full disk refuses; said so, in one line
        assert prune.returncode == 0 and "could not be pruned (disk full)" in prune.stderr
        assert clear.returncode == 1 and clear.stderr.startswith(f"cannot clear {folder}: disk full; ")
        assert "free space elsewhere on that disk" in clear.stderr and "Traceback" not in clear.stderr
        (tiny_disk / "fill").unlink()
        assert cache_command("clear", "--yes", str(folder)).returncode == 0
        assert DiskCache(folder).stats().entries == 0


WRITER = """
import sys
from hardy.cache.store import LocalStore

def pieces():
    yield b"x" * 100_000
    print("writing", flush=True)
    sys.stdin.readline()  # killed here, halfway through the entry
    yield b"y" * 100_000

LocalStore(sys.argv[1]).folder(create=True).sub("blobs", create=True).sub("ab", create=True).write("ab" * 16, pieces())
"""


def test_a_killed_writers_temporary_file_is_swept_and_a_live_ones_kept(tmp_path):
    folder = tmp_path / "c"
    cache = DiskCache(folder)
    Pipeline(nodes=[make_blob], cache=cache).map(inputs={"x": [1, 2], "size": 300_000}, map_over="x")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        [tmp] = files(folder / "blobs", ".*.tmp")
        assert cache.verify().bad == [] and cache.prune(older_than=0) == 2 and not cache.entries()
        assert tmp.exists()  # its writer is alive: never removed under it
    finally:
        writer.kill()
        writer.wait()
        writer.stdout.close()
        writer.stdin.close()
    assert tmp.exists()  # left for good by the killed writer, until a sweep
    cache.verify()
    assert files(folder / "blobs", "*") == []


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_a_cache_folder_deleted_while_in_use_is_made_again(tmp_path, monkeypatch, caplog, executor):
    """`rm -rf` of the folder between two maps (a temporary-file cleaner, a user freeing space):
    what is computed after it is stored in the folder made again, not in the deleted index."""
    from hardy import Engine

    calls = _counted_blobs(tmp_path, monkeypatch, caplog)
    from fullblobs import counted_blob

    folder = tmp_path / "c"
    with Engine(map_executor=executor, workers=2) as engine:
        p = Pipeline(nodes=[counted_blob], cache=DiskCache(folder), engine=engine)
        p.map(inputs={"x": list(range(10)), "size": 10}, map_over="x")
        shutil.rmtree(folder)
        calls.write_text("")
        p.map(inputs={"x": list(range(10, 20)), "size": 10}, map_over="x")
        p.map(inputs={"x": list(range(10, 20)), "size": 10}, map_over="x")
    assert sorted(int(x) for x in calls.read_text().split()) == list(range(10, 20))  # once: then served
    assert DiskCache(folder).verify() == VerifyReport(checked=10, bad=[])  # signed with the key made with it
    again = DiskCache(folder)  # a new process's view of it
    out = Pipeline(nodes=[counted_blob], cache=again).map(inputs={"x": list(range(10, 20)), "size": 10}, map_over="x")
    assert [o["blob"] for o in out] == [bytes([x]) * 10 for x in range(10, 20)] and again.hits == 10
    if executor == "sequential":
        [warning] = cache_warnings(caplog)
        assert warning == f"cache {folder} was deleted while in use: it is made again, empty, at the next write"


def test_a_prune_fault_is_never_said_to_have_made_nodes_run_uncached():
    """Pruning runs in `put` too, and a prune that failed costs no node its cache: with writes and
    a prune failing on a full disk, "those nodes ran uncached" was said of the prune, the rarest
    fault, listed last. It follows the faults that did cost nodes their cache, and each fix comes after."""
    import errno

    from hardy.cache.tally import Tally
    tally = Tally("/caches/c")
    full = OSError(errno.ENOSPC, "No space left on device")
    for _ in range(3):
        tally.fault("written", full)
    tally.fault("pruned", full)
    parts = tally.parts([])
    assert parts[:2] == ["3 entries could not be written (disk full); those nodes ran uncached",
                         "1 entry could not be pruned (disk full)"], parts
    assert parts[2].startswith("free space on its disk: `hardy cache prune /caches/c") and len(parts) == 4, parts
    tally.fault("pruned", full)
    assert "uncached" not in "; ".join(tally.parts([]))

"""What other users can do to a cache, acted out: another local uid (setpriv) in a shared directory,
a bucket writer without the secret on a real S3 server. Each test is a row of docs/security.md.

The attacker plants symbolic links at every level of a shared directory, holds lock files, and
rewrites entries' bytes; the victim's run (root here, as in CI) must never write, read or delete
through a link, never wait on a lock another user holds, and never keep skipping an entry on the
strength of bytes anyone can write: the node runs, a forged entry is deleted and recomputed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hardy import DiskCache, Pipeline
from hardy.cache.keys import call_fingerprint, call_key
from hardy.hashing import hash_value
from test_cache_trust import ATTACKER, area, needs_root  # noqa: F401  (area: a fixture)

pytestmark = [pytest.mark.usefixtures("in_process_default"), pytest.mark.timeout(300)]

BIG = 300 << 10  # bytes: an entry this size was a blob file of its own in the old layout

NODES = f"""
from hardy import node

@node(output_name="y")
def big(x):
    return bytes([x]) * {BIG}
"""


def attacker(script: str, *args: str, wait: bool = True) -> subprocess.Popen[str] | str:
    """`script` run as uid 65534 with the standard library only; its output, or the process
    (`wait=False`) once it has printed its first line."""
    command = ["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups",
               sys.executable, "-I", "-c", textwrap.dedent(script), *args]
    if wait:
        done = subprocess.run(command, capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": os.environ["PATH"]})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


def victim_key(folder: Path) -> bytes:
    """The key of big(x=1): anyone can derive it from the code and the input."""
    sys.path.insert(0, str(folder))
    try:
        from victim_nodes import big
        return call_key(call_fingerprint(big, ["x"]), hash_value(1))
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("victim_nodes", None)


def run_victim(folder: Path, cache: DiskCache, limit: float = 120.0) -> dict:
    """big(x=1) through `cache`, in a thread: a run still waiting after `limit` seconds fails the test
    (a liveness bound, not a measurement: the run takes milliseconds unless something blocks it)."""
    out: list = []

    def go() -> None:
        sys.path.insert(0, str(folder))
        try:
            from victim_nodes import big
            out.append(Pipeline(nodes=[big], cache=cache).run(inputs={"x": 1}))
        except BaseException as exc:  # shown by the assertion below
            out.append(exc)
        finally:
            sys.path.remove(str(folder))
            sys.modules.pop("victim_nodes", None)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"the victim's run was still blocked after {limit:.0f} s"
    assert not isinstance(out[0], BaseException), out[0]
    return out[0]


@pytest.fixture
def team(area, monkeypatch):  # noqa: F811
    """A team's shared cache directory (mode 0777) beside the victim's node module; the victim's own
    state folder (its own cache key) is private, as ~/.local/state is."""
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(area / "root-state"))
    (area / "victim_nodes.py").write_text(NODES)
    folder = area / "team-cache"
    folder.mkdir()
    folder.chmod(0o777)
    return folder


# --- 1. links: the cases of the issue, in the layout hardy used before --------------------------

PLANT_LINKS = """
import os, sys
folder, key, blobs_to, lock_to = sys.argv[1:]
os.makedirs(os.path.join(folder, "blobs"), exist_ok=True)
os.makedirs(os.path.join(folder, "locks"), exist_ok=True)
os.symlink(blobs_to, os.path.join(folder, "blobs", key[:2]))
os.symlink(lock_to, os.path.join(folder, "locks", key))
print("planted")
"""


@needs_root
def test_links_another_user_plants_in_a_shared_directory_are_not_followed(area, team, caplog):  # noqa: F811
    """`blobs/<ab>` and `locks/<key>` planted as links: writes through them made root create files
    in a directory of the attacker's choosing, and a file at any path."""
    private = area / "root-only"  # any folder the victim may write: /etc for a victim that is root
    private.mkdir(mode=0o700)
    made_by_lock = area / "made-by-the-lock"
    key = victim_key(area).hex()
    assert "planted" in attacker(PLANT_LINKS, str(team), key, str(private), str(made_by_lock))
    cache = DiskCache(team, shared=True, single_flight=True)
    assert run_victim(area, cache) == {"y": bytes([1]) * BIG}
    assert list(private.iterdir()) == [] and not made_by_lock.exists()
    assert run_victim(area, DiskCache(team, shared=True, single_flight=True)) == {"y": bytes([1]) * BIG}
    assert list(private.iterdir()) == [] and not made_by_lock.exists()


# --- 2. a lock another user holds ------------------------------------------------------------------

HOLD_LOCKS = """
import fcntl, os, sys, time
folder, key = sys.argv[1:]
held = []
for path in [os.path.join(folder, "locks", key)] + sys.argv[3:]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    os.fchmod(fd, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.append(fd)
print("ready", flush=True)
time.sleep(600)
"""


@needs_root
def test_a_lock_another_user_holds_never_blocks_single_flight(area, team):  # noqa: F811
    key = victim_key(area).hex()
    holder = attacker(HOLD_LOCKS, str(team), key, wait=False)
    try:
        cache = DiskCache(team, shared=True, single_flight=True)
        assert run_victim(area, cache) == {"y": bytes([1]) * BIG}
        assert run_victim(area, DiskCache(team, shared=True, single_flight=True)) == {"y": bytes([1]) * BIG}
    finally:
        holder.kill()
        holder.wait()


def warnings_of(caplog) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.name == "hardy.cache" and r.levelno >= logging.WARNING)


# --- 3. a bucket writer without the secret -------------------------------------------------------

s3_only = pytest.mark.skipif(not all(__import__("importlib").util.find_spec(m) for m in ("s3fs", "moto", "boto3")),
                             reason="needs s3fs, moto and boto3")


@pytest.fixture(scope="module")
def s3():
    from test_cache_s3 import S3, start_moto, stop
    proc, endpoint = start_moto()
    yield S3(endpoint)
    stop(proc)


def machine(s3, bucket: str, folder: Path, **kw) -> DiskCache:
    """One machine's cache of the team's bucket: its own local directory, the team's secret."""
    return DiskCache(f"s3://{bucket}/team", storage_options=s3.options(), local=folder, secret="team-secret", **kw)


@s3_only
def test_a_forged_key_id_in_the_bucket_is_removed_and_republished_not_skipped_forever(tmp_path, s3, caplog):
    """Rewriting only an entry's key-id bytes made every reader skip it as "another secret's": never
    deleted or replaced, recomputed on every machine at every run."""
    bucket = s3.bucket()
    (tmp_path / "victim_nodes.py").write_text(NODES)
    run_victim(tmp_path, first := machine(s3, bucket, tmp_path / "a"))
    first.report()  # waits for the publication
    [name] = [k for k in s3.keys(bucket) if "/leases/" not in k]
    body = s3.client.get_object(Bucket=bucket, Key=name)["Body"].read()
    s3.client.put_object(Bucket=bucket, Key=name, Body=body[:4] + os.urandom(8) + body[12:])  # no secret needed
    with caplog.at_level(logging.WARNING, logger="hardy.cache"):
        second = machine(s3, bucket, tmp_path / "b")
        assert run_victim(tmp_path, second) == {"y": bytes([1]) * BIG}
        second.report()
    assert second.hits == 0 and second.skipped == 0 and second.rejected == 1
    said = warnings_of(caplog)
    assert "named another secret in this secret's own folder" in said and "deleted and recomputed" in said and "HARDY_CACHE_KEY" not in said
    assert s3.client.get_object(Bucket=bucket, Key=name)["Body"].read() == body  # republished, verifiable
    third = machine(s3, bucket, tmp_path / "c")
    assert run_victim(tmp_path, third) == {"y": bytes([1]) * BIG} and third.hits == 1


# --- a shared directory with a team secret: links at every level, forged entries ------------------

TEAM = "team-secret"
TEAM_CACHE = dict(shared=True, secret=TEAM, single_flight=True)

PLANT_AT = """
import os, sys
folder, level, target = sys.argv[1:]
path = os.path.join(folder, level)
os.makedirs(os.path.dirname(path), exist_ok=True)
for k in range(1, level.count("/") + 1):
    os.chmod(os.path.join(folder, *level.split("/")[:k]), 0o777)  # the team's folders, as umask 0 makes them
os.symlink(target, path)
print("planted")
"""


def team_layout(area: Path) -> dict[str, str]:  # noqa: F811
    """The names of the team secret's folders and of the victim's entry and lock (the key id is in
    the directory's listing for anyone to read)."""
    cache = DiskCache(area / "scratch" / "names", **TEAM_CACHE)
    fmt, ns = cache.namespace.split("/")
    key = victim_key(area).hex()
    return {"F": fmt, "N": ns, "ab": key[:2], "key": key}


LEVELS = ["entries", "entries/{F}", "entries/{F}/{N}", "entries/{F}/{N}/{ab}", "entries/{F}/{N}/{ab}/{key}",
          "locks", "locks/{F}/{N}", "locks/{F}/{N}/{key}"]


@needs_root
@pytest.mark.parametrize("level", LEVELS)
def test_a_link_at_any_level_of_a_shared_directory_is_never_followed(area, team, level, caplog):  # noqa: F811
    """Every file and folder hardy reaches there, planted as a link to a folder or file of root's
    own: runs, verify, prune and clear never read, write, create or delete through it."""
    precious = area / "root-only"
    precious.mkdir(mode=0o700)
    (precious / "config").write_text("root's own file\n")
    names = team_layout(area)
    path = level.format(**names)
    target = precious / "config" if path.endswith(names["key"]) and path.startswith("entries") else \
        precious / "made-by-root" if path.endswith(names["key"]) else precious
    assert "planted" in attacker(PLANT_AT, str(team), path, str(target))
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="hardy.cache"):
            cache = DiskCache(team, **TEAM_CACHE)
            assert run_victim(area, cache) == {"y": bytes([1]) * BIG}
    for maintenance in (lambda: cache.verify(), lambda: cache.prune(max_size=0), cache.clear):
        try:
            maintenance()
        except OSError as exc:  # refused: a link where a folder should be
            assert exc.errno == 40, exc  # ELOOP
    assert sorted(p.name for p in precious.iterdir()) == ["config"]
    assert (precious / "config").read_text() == "root's own file\n"
    if not path.startswith("locks"):  # an entry that cannot be read or written through a link says so
        assert "symbolic link" in warnings_of(caplog) or cache.hits


FORGE = """
import os, sys
shard, name, kind, body = sys.argv[1], sys.argv[2], sys.argv[3], bytes.fromhex(sys.argv[4])
os.makedirs(shard, exist_ok=True)
for k in range(3):
    os.chmod(os.path.join(shard, *[".."] * k), 0o777)
path = os.path.join(shard, name)
if kind == "fifo":
    os.mkfifo(path, 0o666)
elif kind == "sparse":  # a terabyte that takes no room
    with open(path, "wb") as f:
        f.truncate(1 << 40)
    os.chmod(path, 0o666)
elif kind == "folder":
    os.mkdir(path, 0o777)
else:
    with open(path, "wb") as f:
        f.write(body)
    os.chmod(path, 0o666)
print("planted")
"""


class Pwn:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('attacker code ran')",))


@needs_root
@pytest.mark.parametrize("kind", ["another key id", "a newer format", "garbage", "fifo", "sparse", "folder"])
def test_a_forged_entry_in_a_shared_directory_is_deleted_and_recomputed(area, team, kind, caplog):  # noqa: F811
    """A writer without the team secret puts an entry where the victim's is kept: a header naming
    another secret, an unknown format byte, garbage, a FIFO (to hang the reader), a sparse file of
    a terabyte (no buffer that size can be made), a folder. None is skipped for good, unpickled or
    waited on: the node runs, and a forgery it may delete is replaced."""
    if kind == "sparse" and Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("this kernel would grant a terabyte's buffer (vm.overcommit_memory=1) and read it")
    import pickle

    from hardy.cache.entry import HEADER, MAGIC, VERSION
    names = team_layout(area)
    payload = pickle.dumps(Pwn(area / "PWNED"))
    body = {"another key id": MAGIC + bytes([VERSION]) + os.urandom(HEADER - 4) + payload,
            "a newer format": MAGIC + bytes([9]) + bytes.fromhex(names["N"]) + os.urandom(HEADER - 12) + payload,
            "garbage": os.urandom(64)}.get(kind, b"")
    shard = team / "entries" / names["F"] / names["N"] / names["ab"]
    assert "planted" in attacker(FORGE, str(shard), names["key"], kind.split()[0], body.hex())
    with caplog.at_level(logging.WARNING, logger="hardy.cache"):
        first = DiskCache(team, **TEAM_CACHE)
        assert run_victim(area, first) == {"y": bytes([1]) * BIG}
        first.report()
    again = DiskCache(team, **TEAM_CACHE)
    assert run_victim(area, again) == {"y": bytes([1]) * BIG}
    assert not (area / "PWNED").exists() and first.skipped == 0
    if kind == "folder":  # not a file: not deletable as one, nor replaceable; the node runs uncached
        assert "could not be" in warnings_of(caplog)
        return
    assert first.rejected == 1 and again.hits == 1  # deleted, recomputed and stored: served from now on
    said = warnings_of(caplog)
    assert ("named another secret in this secret's own folder" if kind == "another key id" else "1 damaged entry") \
        in said and "HARDY_CACHE_KEY" not in said


def bounded(call, limit: float = 120.0) -> None:
    """`call()` in a thread; still running after `limit` seconds fails the test (a liveness bound:
    it takes milliseconds unless something blocks it)."""
    failed: list = []

    def go() -> None:
        try:
            call()
        except BaseException as exc:  # shown by the assertion below
            failed.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still blocked after {limit:.0f} s"
    assert not failed, failed[0]


@needs_root
@pytest.mark.parametrize("name", ["the victim's lock", "any name"])
def test_a_fifo_another_user_plants_among_the_teams_locks_never_blocks(area, team, name):  # noqa: F811
    """With a team secret, the team can write the secret's lock folder: a FIFO there, where a plain
    open waits for a writer for ever, is not a lock file. Single flight computes at once, and the
    sweep of stale locks (prune, clear) passes it by."""
    names = team_layout(area)
    locks = team / "locks" / names["F"] / names["N"]
    planted = names["key"] if name == "the victim's lock" else "anything"
    assert "planted" in attacker(FORGE, str(locks), planted, "fifo", "")
    cache = DiskCache(team, **TEAM_CACHE)
    assert run_victim(area, cache) == {"y": bytes([1]) * BIG}
    bounded(lambda: cache.prune(max_size=0))
    bounded(cache.clear)
    assert (locks / planted).exists()  # not a lock file: not ours to remove


@needs_root
def test_your_own_keys_folder_in_a_shared_directory_is_yours_alone(area, team):  # noqa: F811
    """Signed with the user's own key, their entries and locks live in a 0700 folder of theirs:
    another user who reads its name in the listing can neither add, replace nor delete anything there."""
    cache = DiskCache(team, shared=True, single_flight=True)
    assert run_victim(area, cache) == {"y": bytes([1]) * BIG}
    fmt, ns = cache.namespace.split("/")
    key = victim_key(area).hex()
    tried = attacker("""
        import os, sys
        team, fmt, key = sys.argv[1:]
        [ns] = os.listdir(os.path.join(team, "entries", fmt))  # the folder's name is no secret
        mine = os.path.join(team, "entries", fmt, ns)
        for what, act in [("add", lambda: open(os.path.join(mine, "planted"), "w")),
                          ("replace", lambda: open(os.path.join(mine, key[:2], "planted"), "w")),
                          ("delete", lambda: os.unlink(os.path.join(mine, key[:2], key))),
                          ("rename", lambda: os.rename(mine, mine + ".moved")),
                          ("lock", lambda: open(os.path.join(team, "locks", fmt, ns, key), "w"))]:
            try:
                act()
                print(what, "done")
            except OSError as exc:
                print(what, type(exc).__name__)
        """, str(team), fmt, key)
    assert tried.split("\n")[:4] == ["add PermissionError", "replace PermissionError", "delete PermissionError",
                                      "rename PermissionError"] and "lock done" not in tried, tried
    again = DiskCache(team, shared=True)
    assert run_victim(area, again) == {"y": bytes([1]) * BIG} and again.hits == 1


# --- a private directory: nobody else can hold its index's locks ---------------------------------------

@needs_root
def test_another_user_cannot_open_a_private_caches_index_to_hold_its_locks(area):  # noqa: F811
    """A private cache in a folder others may enter (0755, the user's own: allowed): SQLite made its
    index, -wal and -shm with the umask's 0644, so another user could open them and hold the locks
    SQLite takes (a read lock on the WAL's write-lock byte stalls every writer)."""
    folder = area / "mine"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    (area / "victim_nodes.py").write_text(NODES)
    old = os.umask(0o022)
    try:
        cache = DiskCache(folder, secret="mine")
        assert run_victim(area, cache) == {"y": bytes([1]) * BIG}
        reader = DiskCache(folder, secret="mine")
        assert reader.get(victim_key(area), "miss") != "miss"  # -wal and -shm are there while a connection is
        tried = attacker("""
            import fcntl, os, sys
            for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
                try:
                    fd = os.open(os.path.join(sys.argv[1], name), os.O_RDONLY)
                    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, 120)
                    print(name, "held")
                except OSError as exc:
                    print(name, type(exc).__name__)
            """, str(folder))
    finally:
        os.umask(old)
    assert "held" not in tried and tried.count("PermissionError") == 3, tried


@s3_only
def test_a_lease_forged_by_a_bucket_writer_without_the_secret_never_blocks_single_flight(tmp_path, s3, caplog):
    """Single flight waited for a lease object until it expired; a writer without the secret who keeps
    rewriting one (its path is in the listing, its body was unsigned JSON) held every reader for good."""
    import json
    bucket = s3.bucket()
    (tmp_path / "victim_nodes.py").write_text(NODES)
    victim = machine(s3, bucket, tmp_path / "a", single_flight=True)
    path = victim.store.bucket.lease_path(victim_key(tmp_path))
    stop = threading.Event()

    def hold() -> None:  # as a bucket writer who lacks the secret: rewrite the lease, again and again
        while not stop.is_set():
            s3.client.put_object(Bucket=bucket, Key=path, Body=json.dumps({"holder": "them", "ttl": 1e9}))
            stop.wait(0.05)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        with caplog.at_level(logging.WARNING, logger="hardy.cache"):
            assert run_victim(tmp_path, victim) == {"y": bytes([1]) * BIG}
            victim.report()
    finally:
        stop.set()
        holder.join()
    [entry] = [k for k in s3.keys(bucket) if "/leases/" not in k]  # published all the same
    s3.client.delete_object(Bucket=bucket, Key=entry)
    s3.client.put_object(Bucket=bucket, Key=path, Body=b"\x00not json")  # garbled: no reason to leave the bucket
    other = machine(s3, bucket, tmp_path / "b", single_flight=True)
    assert run_victim(tmp_path, other) == {"y": bytes([1]) * BIG} and other.hits == 0
    other.report()
    assert entry in s3.keys(bucket)  # computed under a lease taken over, and published again


def lease_taken(store, key: bytes, times: int = 1, limit: float = 120.0, **kw) -> list[str]:
    """Enter `store.lease(key, **kw)` in a thread and leave at once, `times` times; what `settle()`
    has to say after (nothing when the lease was held: its holder settles on leaving). A thread
    still waiting after `limit` seconds fails the test (a liveness bound, not a measurement)."""
    out: list = []

    def go() -> None:
        try:
            for _ in range(times):
                with store.lease(key, **kw):
                    pass
            out.append(store.settle())
        except BaseException as exc:  # shown by the assertion below
            out.append(exc)

    waiter = threading.Thread(target=go, daemon=True)
    waiter.start()
    waiter.join(limit)
    assert out and not isinstance(out[0], BaseException), out or f"still waiting on the lease after {limit} s"
    return out[0]


def put_back(s3, bucket: str, path: str, bodies: list[bytes]) -> tuple[threading.Event, threading.Thread]:
    """As a writer of the bucket without the secret: put copied lease bodies back, in turn, again and again."""
    stop = threading.Event()

    def replay() -> None:
        while not stop.is_set():
            for body in bodies:
                s3.client.put_object(Bucket=bucket, Key=path, Body=body)
                stop.wait(0.05)

    replayer = threading.Thread(target=replay, daemon=True)
    replayer.start()
    return stop, replayer


@s3_only
def test_a_genuine_lease_copied_and_put_back_is_taken_over_not_waited_on_forever(tmp_path, s3):
    """A lease verified for ever (its MAC covered path, holder and ttl) and expired by LastModified,
    which every put refreshes: a writer without the secret who copied one lease body while its
    holder computed, and put it back every 20 s, held every later reader of that key for good."""
    bucket, key = s3.bucket(), os.urandom(32)
    holder = machine(s3, bucket, tmp_path / "h", single_flight=True).store.bucket
    path = holder.lease_path(key)
    with holder.lease(key, ttl=1):
        copied = s3.client.get_object(Bucket=bucket, Key=path)["Body"].read()  # genuine, signed
    stop, replayer = put_back(s3, bucket, path, [copied])
    try:
        reader = machine(s3, bucket, tmp_path / "r", single_flight=True).store.bucket
        assert lease_taken(reader, key) == []  # held, not given up on: the copy ran out with its lease
    finally:
        stop.set()
        replayer.join()


@s3_only
def test_copies_of_old_leases_put_back_in_turn_are_taken_over_by_their_signed_time(tmp_path, s3):
    """Each renewal's body differs (its time and nonce); copies of a lease written long ago, put
    back in turn so that no nonce stays, are expired by the time their holder signed."""
    bucket, key = s3.bucket(), os.urandom(32)
    reader = machine(s3, bucket, tmp_path / "r", single_flight=True).store.bucket
    old = [reader._lease_body(key, "them", 600, written=time.time() - 3600) for _ in range(2)]
    stop, replayer = put_back(s3, bucket, reader.lease_path(key), old)
    try:
        assert lease_taken(reader, key) == []
    finally:
        stop.set()
        replayer.join()


@s3_only
def test_a_lease_in_the_earlier_format_is_read_as_expired(tmp_path, s3):
    """A lease of hardy's earlier format (its MAC over path, holder and ttl, no time) is taken over
    at once, without an error."""
    import json

    from hardy.cache.trust import sign
    bucket, key = s3.bucket(), os.urandom(32)
    reader = machine(s3, bucket, tmp_path / "r", single_flight=True).store.bucket
    path = reader.lease_path(key)
    mac = sign(reader.lease_key, f"{path}\0old:1\0{600.0!r}".encode()).hex()
    s3.client.put_object(Bucket=bucket, Key=path, Body=json.dumps({"holder": "old:1", "ttl": 600.0, "mac": mac}))
    assert lease_taken(reader, key) == []


@s3_only
def test_a_lease_held_past_the_wait_limit_is_computed_alone_and_said_once(tmp_path, s3):
    """Waiting for a lease had no overall limit: a holder renewing for ever (stuck, or a replay
    that outlives the other checks) held its readers for ever. Past `wait` the reader computes,
    and the map's warning names the lease's path."""
    bucket, key = s3.bucket(), os.urandom(32)
    holder = machine(s3, bucket, tmp_path / "h", single_flight=True).store.bucket
    reader = machine(s3, bucket, tmp_path / "r", single_flight=True).store.bucket
    release, held = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.lease(key, ttl=600):
            held.set()
            release.wait(120)

    holding = threading.Thread(target=hold, daemon=True)
    holding.start()
    try:
        assert held.wait(60)
        said = lease_taken(reader, key, times=2, wait=0.5)
    finally:
        release.set()
        holding.join()
    [one] = [part for part in said if "still held after waiting 0.5 s" in part]  # one line for both
    assert one.startswith("2 entries") and holder.lease_path(key) in one and "a lease copied and put back" in one

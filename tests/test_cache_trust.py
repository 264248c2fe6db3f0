"""Another local user never gets code execution through the cache: real uids (setpriv), real files.

The attacker (uid 65534) plants a key and MAC-valid entries whose pickle writes a PWNED file, in
the ways a shared temporary directory or project folder allows; the victim's run (root here, as in
CI) refuses the directory or key, or ignores what it did not sign, and never runs the pickle."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hardy import DiskCache, Engine, Pipeline
from hardy.cache import FileStore
from hardy.cache.keys import call_fingerprint, call_key
from hardy.errors import UntrustedCacheError
from hardy.hashing import FORMAT, hash_value

pytestmark = pytest.mark.usefixtures("in_process_default")  # the cache's counters, seen here

ATTACKER = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to act as another uid")

NODE = """
from hardy import node

@node(output_name="y")
def double(x):
    return 2 * x
"""

# What the attacker does as uid 65534 (with the standard library only: root's Python packages are
# not theirs to read here): create the folder if needed, plant a key of their choosing (0644) and an
# entry signed with it under the key of the victim's node call: in an index (a private cache's
# layout), and as a file where a shared directory keeps the entries of that key's key id.
PLANT = """
import hashlib, os, sqlite3, sys, time
folder, mode, key_format = sys.argv[1], sys.argv[2], sys.argv[3]
secret, key, entry = (bytes.fromhex(h) for h in sys.stdin.read().split())
os.makedirs(folder, exist_ok=True)
if mode == "plant-key":
    with open(os.path.join(folder, "secret.key"), "wb") as f:
        f.write(secret)
    os.chmod(os.path.join(folder, "secret.key"), 0o644)
db = sqlite3.connect(os.path.join(folder, "index.sqlite"))
db.execute("CREATE TABLE IF NOT EXISTS entries (key BLOB PRIMARY KEY, data BLOB, file TEXT, size INTEGER, "
           "created REAL, accessed REAL) WITHOUT ROWID")
db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, NULL, ?, ?, ?)", (key, entry, len(entry), time.time(), 0))
db.commit()
key_id = hashlib.blake2b(b"hardy-key-id", key=secret, digest_size=8).hexdigest()
shard = os.path.join(folder, "entries", key_format, key_id, key.hex()[:2])
os.makedirs(shard, exist_ok=True)
with open(os.path.join(shard, key.hex()), "wb") as f:
    f.write(entry)
print("planted")
"""

class Pwn:
    """Unpickling it runs code: writes the PWNED file, saying as whom."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"import os; open({self.path!r}, 'w').write('attacker code ran in uid %d' % os.getuid())",))


def crafted(area: Path, secret: bytes) -> tuple[bytes, bytes]:
    """The victim's call key for double(x=1), and a MAC-valid entry for it under `secret`."""
    sys.path.insert(0, str(area))
    try:
        from victim_nodes import double
        key = call_key(call_fingerprint(double, ["x"]), hash_value(1))
    finally:
        sys.path.remove(str(area))
        sys.modules.pop("victim_nodes", None)
    scratch = DiskCache(tempfile.mkdtemp(dir=area / "scratch"))
    scratch._secret = secret
    assert scratch.put(key, Pwn(area / "PWNED"))
    return key, scratch.store.get(key)


@pytest.fixture
def area():
    """A folder both users can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="trust-"))
    path.chmod(0o1777)  # like /tmp: anyone may create, only owners may remove
    (path / "victim_nodes.py").write_text(NODE)
    (path / "victim_nodes.py").chmod(0o644)
    (path / "scratch").mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_attacker(area: Path, folder: Path, mode: str = "plant-key") -> tuple[bytes, bytes]:
    """Plant as the attacker; their secret and the victim's key."""
    secret = os.urandom(32)
    key, entry = crafted(area, secret)
    out = subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups",
                          sys.executable, "-I", "-c", PLANT, str(folder), mode, FORMAT.decode()],
                         input=f"{secret.hex()} {key.hex()} {entry.hex()}", text=True, capture_output=True,
                         env={"PATH": os.environ["PATH"]}, timeout=120)
    assert out.returncode == 0 and "planted" in out.stdout, out.stderr
    return secret, key


def victim_run(area: Path, cache: DiskCache) -> dict:
    sys.path.insert(0, str(area))
    try:
        from victim_nodes import double
        return Pipeline(nodes=[double], cache=cache).run(inputs={"x": 1})
    finally:
        sys.path.remove(str(area))
        sys.modules.pop("victim_nodes", None)


@needs_root
def test_a_directory_another_user_made_first_is_refused(area, monkeypatch):
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    folder = area / "cache"
    as_attacker(area, folder)  # they create the folder, plant secret.key (0644) and an entry
    assert folder.stat().st_uid == ATTACKER
    with pytest.raises(UntrustedCacheError, match=r"belongs to nobody \(uid 65534\).*shared=True"):
        DiskCache(folder)
    # with a team secret too: the directory is not ours
    with pytest.raises(UntrustedCacheError):
        DiskCache(folder, secret="team")
    assert not (area / "PWNED").exists()


@needs_root
def test_a_directory_another_user_makes_after_the_constructor_is_refused_without_failing_the_node(
        area, monkeypatch, caplog):
    """The directory is made on the first write, so another user can make it after `DiskCache(...)`
    looked: it is refused all the same, but the node runs (uncached) and the warning says why."""
    import logging
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    folder = area / "late"
    cache = DiskCache(folder)
    as_attacker(area, folder)
    with caplog.at_level(logging.WARNING, logger="hardy.cache"):
        assert victim_run(area, cache) == {"y": 2}
        assert victim_run(area, cache) == {"y": 2}
        cache.report()
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "hardy.cache")
    assert "UntrustedCacheError" in said and "belongs to nobody (uid 65534)" in said and "ran uncached" in said
    assert cache.hits == 0 and not (area / "PWNED").exists()


@needs_root
@pytest.mark.parametrize("single_flight", [False, True])
@pytest.mark.parametrize("executor", ["process", "sequential"])
def test_a_directory_another_user_makes_after_the_constructor_never_fails_a_map(area, monkeypatch, executor,
                                                                                single_flight):
    """A worker's copy of the cache checks the directory again as it is unpickled: one another
    user made since `DiskCache(...)` looked was refused there, and the whole map failed as its
    plan loaded ("the pipeline could not be loaded in the worker process"); with single flight,
    each node failed (its lock folder refused). It is a fault, as anywhere: the nodes run uncached."""
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    folder = area / "late"
    cache = DiskCache(folder, single_flight=single_flight)
    as_attacker(area, folder)
    sys.path.insert(0, str(area))
    try:
        from victim_nodes import double
        out = Pipeline(nodes=[double], cache=cache, engine=Engine(map_executor=executor)).map(
            inputs={"x": [1, 2, 3]}, map_over="x")
    finally:
        sys.path.remove(str(area))
        sys.modules.pop("victim_nodes", None)
    assert out == [{"y": 2}, {"y": 4}, {"y": 6}]
    assert not (area / "PWNED").exists()


@needs_root
def test_a_group_writable_directory_is_refused_and_shared_mode_never_runs_their_entry(area, monkeypatch, caplog):
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(area / "root-state"))
    folder = area / "project-cache"
    folder.mkdir()
    folder.chmod(0o777)  # a project folder the team (and so the attacker) can write
    planted, key = as_attacker(area, folder)
    assert (folder / "secret.key").stat().st_uid == ATTACKER
    with pytest.raises(UntrustedCacheError, match="writable by others.*chmod go-w"):
        DiskCache(folder)
    shared = DiskCache(folder, shared=True)  # signed with root's own key: theirs is never read
    assert victim_run(area, shared) == {"y": 2}
    assert shared.skipped == 0 and shared.hits == 0 and shared.rejected == 0  # their entries are not even looked at
    assert not (area / "PWNED").exists()
    # the entry is live: a run that trusted the planted key (as hardy did before) runs their code
    key_id = hashlib.blake2b(b"hardy-key-id", key=planted, digest_size=8).hexdigest()
    naive = DiskCache(folder, shared=True, store=FileStore(folder, f"{FORMAT.decode()}/{key_id}", shared=True))
    naive._secret = (folder / "secret.key").read_bytes()
    naive.get(key)
    assert (area / "PWNED").read_text() == "attacker code ran in uid 0"
    key = area / "root-state" / "hardy" / "cache.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700


@needs_root
def test_a_planted_entry_under_their_own_key_is_never_unpickled(area, monkeypatch):
    """The attacker signs with their own user key in a shared directory: skipped, kept, not run."""
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(area / "root-state"))
    folder = area / "team-cache"
    folder.mkdir()
    folder.chmod(0o777)
    as_attacker(area, folder, mode="entry-only")
    cache = DiskCache(folder, shared=True)
    assert victim_run(area, cache) == {"y": 2} and (cache.hits, cache.skipped, cache.rejected) == (0, 0, 0)
    again = DiskCache(folder, shared=True)
    assert victim_run(area, again) == {"y": 2} and again.hits == 1  # its own entry, beside theirs
    assert not (area / "PWNED").exists()


@needs_root
def test_a_symlinked_key_is_refused(area, monkeypatch):
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    theirs = area / "their-cache"
    as_attacker(area, theirs)
    mine = area / "mine"
    mine.mkdir(mode=0o700)
    (mine / "secret.key").symlink_to(theirs / "secret.key")
    with pytest.raises(UntrustedCacheError, match="is a symbolic link"):
        DiskCache(mine)
    assert not (area / "PWNED").exists()


@needs_root
def test_a_key_folder_of_someone_else_is_refused(area, monkeypatch):
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    state = area / "nobody-state"  # the attacker's state folder, offered as ours
    state.mkdir()
    os.chown(state, ATTACKER, ATTACKER)
    (state / "hardy").mkdir()
    os.chown(state / "hardy", ATTACKER, ATTACKER)
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    folder = area / "shared"
    folder.mkdir(mode=0o777)
    with pytest.raises(UntrustedCacheError, match="key folder"):
        DiskCache(folder, shared=True)


def test_a_key_others_can_read_is_refused(tmp_path, monkeypatch):
    """Anyone who can read the key can sign entries: 0644 is refused, whoever owns it."""
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    folder = tmp_path / "c"
    folder.mkdir(mode=0o700)
    (folder / "secret.key").write_bytes(os.urandom(32))
    (folder / "secret.key").chmod(0o644)
    with pytest.raises(UntrustedCacheError, match=r"read or written by others \(mode 644\).*chmod 600"):
        DiskCache(folder)


def test_a_new_cache_directory_is_private_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.delenv("HARDY_CACHE_KEY", raising=False)
    old = os.umask(0o002)  # user-private-group systems: new folders are group-writable
    try:
        cache = DiskCache(tmp_path / "c")
        assert cache.put(b"k" * 16, 1) and cache.get(b"k" * 16) == 1
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "c" / "secret.key").stat().st_mode) == 0o600
    assert DiskCache(tmp_path / "c").get(b"k" * 16) == 1


# A process holding a hit on a 32 MB array from a blob file; another user truncates the file; the
# holder then reads every element. A mapped file truncated under its mapping kills its reader (SIGBUS).
HOLDER = """
import sys
import numpy as np
from hardy.cache import DiskCache
cache = DiskCache(sys.argv[1], shared=True, secret="team")
value = cache.get(bytes(16))
print("mapped" if bytes(16).hex() in open("/proc/self/maps").read() else "copied", flush=True)
sys.stdin.readline()  # the file is truncated meanwhile
print(int(value.sum()), cache.hits, flush=True)
"""


@needs_root
@pytest.mark.parametrize("owner", ["theirs", "mine"])
def test_a_hit_survives_another_user_truncating_its_blob(area, owner):
    np = pytest.importorskip("numpy")
    folder = area / "team"
    folder.mkdir(mode=0o777)
    array = np.ones(4 << 20, dtype=np.int64)  # 32 MB
    cache = DiskCache(folder, shared=True, secret="team")
    assert cache.put(bytes(16), array)
    blob = Path(cache.store.root) / "00" / ("00" * 16)
    if owner == "theirs":  # a teammate's entry: their file, which they may truncate
        os.chown(blob, ATTACKER, ATTACKER)
        blob.chmod(0o644)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "copied"  # a shared directory's entries are read, never mapped
        cut = subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups",
                              "truncate", "-s", "0", str(blob)], capture_output=True, text=True)
        # ours is read-only to everyone: they cannot; theirs they can, and the holder has a copy
        assert (cut.returncode == 0) == (owner == "theirs"), cut.stderr
        assert (blob.stat().st_size == 0) == (owner == "theirs")
        out, _ = holder.communicate("go\n", timeout=60)
    finally:
        holder.kill()
    assert holder.returncode == 0, f"the reader died with {holder.returncode}"
    assert out.split() == [str(4 << 20), "1"]


@needs_root
def test_a_bucket_caches_default_local_folder_made_by_another_user_names_local_as_the_fix(area, monkeypatch):
    """`DiskCache("s3://...")` without `local=` reads through ./.hardy-cache; another user who made
    that folder first in a shared working folder got it refused with `DiskCache(path, shared=True)`
    as the fix, which would have replaced the bucket cache by a local one."""
    folder = area / ".hardy-cache"
    subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "mkdir", "-m", "777",
                    str(folder)], check=True, env={"PATH": os.environ["PATH"]}, timeout=60)
    monkeypatch.chdir(area)
    with pytest.raises(UntrustedCacheError) as refused:
        DiskCache("s3://team/hardy", secret="team-secret", storage_options={"endpoint_url": "http://127.0.0.1:9"})
    said = str(refused.value)
    assert f"{folder} belongs to nobody (uid {ATTACKER})" in said and "local='a folder of yours'" in said, said

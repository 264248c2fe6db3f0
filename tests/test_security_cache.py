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

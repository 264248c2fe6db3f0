"""Files another user made where hardy reads: a FIFO or a sparse file of a huge apparent size, as a
run report (`hardy report FILE`) and as an entry of a shared cache directory. docs/security.md: they
must not hang the reader, nor make it read gigabytes of holes into memory (a 1 GiB cgroup's run was
killed by the kernel), nor fail the node; each is refused without being read.

Each reader runs in a process of its own, measured (`os.wait4`): its peak memory shows whether it
read the file, and a time limit turns a hang into a failure."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cache_trust import ATTACKER, area  # noqa: F401  (area: a fixture)

SPARSE = 1 << 30  # bytes of apparent size, none on disk: read, it costs the reader a GiB
READ_IT = 256 << 20  # peak memory (bytes) past which the reader must have read the holes
TEAM_GID = 2000  # the team's group: the shared folder's, and the attacker's (a member without the secret)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def measured(command: list[str], timeout: float = 30.0, **kw) -> tuple[int, str, int]:
    """(exit code, output, peak RSS in bytes) of `command`; a process still running after `timeout`
    seconds is killed and fails the test (a hang). The peak is the highest VmHWM seen while it
    runs, every 50 ms: reading a GiB of holes takes seconds. Not `ru_maxrss`, which for a child
    starts at its parent's size as it forked (this test process's, near a GiB late in a full run)."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"measured-{os.getpid()}-{time.monotonic_ns()}.out"
    with open(out, "w+") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, text=True, **kw)
        deadline, peak = time.monotonic() + timeout, 0
        while True:
            peak = max(peak, _high_water(proc.pid))
            pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                f.seek(0)
                pytest.fail(f"{command[-1]!r} still running after {timeout:.0f} s (hung): {f.read()[-2000:]}")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        f.seek(0)
        text = f.read()
    out.unlink()
    return proc.returncode, text, peak


def _high_water(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (0 once it has ended)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(ln.split()[1]) * 1024 for ln in status if ln.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def hardy_report(path: Path) -> tuple[int, str, int]:
    return measured([sys.executable, "-m", "hardy.cli", "report", str(path)])


def test_a_fifo_as_a_report_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "ci-report.json"
    os.mkfifo(fifo, 0o644)  # nobody will ever write into it
    code, out, _ = hardy_report(fifo)
    assert code == 2, out
    assert "not a regular file" in out and "ci-report.json" in out, out


def test_a_sparse_report_of_a_gibibyte_is_refused_without_reading_it(tmp_path):
    report = tmp_path / "ci-report-big.json"
    with open(report, "wb") as f:
        f.write(b'{"format": 1, "pipeline": "')
        f.truncate(SPARSE)  # holes: no disk spent
    assert os.stat(report).st_blocks * 512 < 1 << 20
    code, out, peak = hardy_report(report)
    assert code == 2, out
    assert "not read" in out and "ci-report-big.json" in out, out
    assert peak < READ_IT, f"hardy report peaked at {peak / 2**20:.0f} MiB: it read the holes"


def test_a_genuine_report_still_loads(tmp_path):
    """The caps leave hardy's own reports alone (and the loader's checks of them)."""
    from hardy import Engine, Pipeline, node

    @node(output_name="y")
    def fails_on_odd(x):
        if x % 2:
            raise ValueError(f"odd {x}")
        return x

    pipeline = Pipeline([fails_on_odd], engine=Engine(map_executor="sequential", report=True))
    pipeline.map(inputs={"x": list(range(20))}, map_over="x", on_error="continue", progress=False)
    path = pipeline.report().save(tmp_path / "run.json")
    code, text, _ = hardy_report(path)
    assert code == 0, text
    assert "fails_on_odd" in text


# --- a shared cache directory, signed with a team secret the attacker lacks ---------------------------

VICTIM = """
import logging, os, resource, sys
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
os.umask(0o002)  # a team folder's members' umask: what they make, the group may write
from hardy import DiskCache
folder, action = sys.argv[1:3]
cache = DiskCache(folder, shared=True, secret="team-secret")
key = bytes(range(16))
if action == "put":
    cache.put(key, "the value")
    print([os.path.join(d, f) for d, _, fs in os.walk(os.path.join(folder, "entries")) for f in fs][0])
else:
    print("got", repr(cache.get(key, "MISS")))
    cache.report()
"""


def as_member(fn, *args) -> None:
    """`fn(*args)` in a forked child acting as uid ATTACKER, a member of the team's group."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([TEAM_GID])
            os.setgid(ATTACKER)
            os.setuid(ATTACKER)
            fn(*args)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def replace_by_sparse(path: str) -> None:
    os.unlink(path)  # the team's shard folder: the group may replace entries
    with open(path, "wb") as f:
        f.truncate(SPARSE)


@needs_root
def test_a_sparse_entry_another_member_plants_in_a_team_folder_is_damage_not_read(area):  # noqa: F811
    team = area / "team-cache"  # a team's folder: its group's, setgid, group-writable
    team.mkdir()
    os.chown(team, 0, TEAM_GID)
    team.chmod(0o2770)
    code, out, _ = measured([sys.executable, "-c", VICTIM, str(team), "put"])
    assert code == 0, out
    entry = out.strip().splitlines()[-1]
    as_member(replace_by_sparse, entry)
    st = os.stat(entry)
    assert st.st_uid == ATTACKER and st.st_size == SPARSE and st.st_blocks * 512 < 1 << 20
    code, out, peak = measured([sys.executable, "-c", VICTIM, str(team), "get"])
    assert code == 0, out
    assert "got 'MISS'" in out, out
    assert "1 damaged entry deleted and recomputed" in out, out  # the cache's one warning, as for any damage
    assert peak < READ_IT, f"the lookup peaked at {peak / 2**20:.0f} MiB: it read the holes"
    assert not os.path.lexists(entry)  # deleted, to be written again


def link_a_file_of_theirs_made_sparse(path: str, theirs: str) -> None:
    os.unlink(path)
    with open(theirs, "r+b") as f:  # a file of the victim's the group may write (umask 002)
        f.truncate(SPARSE)
    os.link(theirs, path)  # protected_hardlinks allows it: the member may read and write that file


@needs_root
def test_a_file_of_yours_another_member_links_as_an_entry_is_damage_not_read(area):  # noqa: F811
    """A member without the secret who may write one of your files (a team folder's umask 002)
    made it sparse and linked it at an entry's name: the file was yours, so it was read whole (a
    GiB for a 16-byte value, at every name it was linked to). An entry has one link: a second is damage."""
    team = area / "team-cache"
    team.mkdir()
    os.chown(team, 0, TEAM_GID)
    team.chmod(0o2770)
    notes = area / "notes.txt"
    notes.write_text("the victim's notes")
    os.chown(notes, 0, TEAM_GID)
    notes.chmod(0o664)
    code, out, _ = measured([sys.executable, "-c", VICTIM, str(team), "put"])
    assert code == 0, out
    entry = out.strip().splitlines()[-1]
    as_member(link_a_file_of_theirs_made_sparse, entry, str(notes))
    st = os.stat(entry)
    assert st.st_uid == 0 and st.st_nlink == 2 and st.st_size == SPARSE
    code, out, peak = measured([sys.executable, "-c", VICTIM, str(team), "get"])
    assert code == 0, out
    assert "got 'MISS'" in out and "1 damaged entry deleted and recomputed" in out, out
    assert peak < READ_IT, f"the lookup peaked at {peak / 2**20:.0f} MiB: it read the holes"
    assert notes.exists() and not os.path.lexists(entry)  # the link is gone, the victim's file stays


def test_an_entry_bigger_than_the_read_limit_is_read_if_ours_and_not_if_anothers(tmp_path):
    """The cap a bucket's objects are read under (half the memory) holds for another user's entry
    in a shared directory: a miss, counted as damage, never read. The user's own entries are read
    as they were written, however big (a filesystem that compresses stores their zeros as holes)."""
    from hardy import DiskCache
    cache = DiskCache(tmp_path / "team", shared=True, secret="team-secret")
    key, value = bytes(range(16)), b"x" * (64 << 10)
    cache.put(key, value)
    cache.store.read_limit = 32 << 10
    assert cache.get(key, "MISS") == value  # ours
    if os.geteuid() != 0:
        pytest.skip("needs root to give the entry to another uid")
    for folder, _, files in os.walk(tmp_path / "team" / "entries"):
        for name in files:
            os.chown(os.path.join(folder, name), 65534, -1)  # as if another member had written it
    assert cache.get(key, "MISS") == "MISS"


def plant_a_file(path: str) -> None:
    open(path, "w").close()


@needs_root
def test_clear_of_a_team_folder_where_another_member_made_locks_a_file_clears_and_returns(area):  # noqa: F811
    """`clear()` deleted the entries, then raised NotADirectoryError: a member had made `locks`
    (where single flight's lock files go) a file. Sweeping lock files is done at best, as `prune` does."""
    from hardy import DiskCache
    team = area / "team-cache"
    team.mkdir()
    os.chown(team, 0, TEAM_GID)
    team.chmod(0o2770)
    cache = DiskCache(team, shared=True, secret="team-secret")
    cache.put(bytes(range(16)), "the value")
    as_member(plant_a_file, str(team / "locks"))
    assert (team / "locks").is_file() and len(cache.entries()) == 1
    cache.clear()
    assert cache.entries() == []

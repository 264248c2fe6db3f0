"""Another local user against the workers' shared memory, acted out by a real second uid (a forked
child that drops to uid/gid 65534): the memfd segments and status pages of workers and of their
parent, reached through /proc. Refused, where this user opens the same paths. The fork server's
socket is attacked the same way in test_lifecycle.py (connect, a request that skips the handshake,
the right key from another uid). Rows of docs/security.md."""

from __future__ import annotations

import ast
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from hardy import Engine, Pipeline, node
from test_lifecycle import _as_nobody as as_other_user

SRC = str(Path(__file__).resolve().parent.parent / "src")
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user"),
              pytest.mark.timeout(180)]


@node(output_name="y")
def hold(x: int, big, folder: str) -> int:
    """Signals that its worker holds the map's shared array, then waits to be let go."""
    with open(os.path.join(folder, f"ready-{x}"), "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.02)
    return x + int(big[0])


def memfds(pid: int | str) -> list[str]:
    """The /proc paths through which `pid`'s memfds can be opened: its descriptors, and its mappings."""
    found = []
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{n}").startswith("/memfd:"):
                found.append(f"/proc/{pid}/fd/{n}")
        except OSError:
            continue
    with open(f"/proc/{pid}/maps") as f:
        ranges = {line.split()[0] for line in f if "/memfd:hardy" in line}
    return found + [f"/proc/{pid}/map_files/{r}" for r in sorted(ranges)]


def test_another_user_cannot_open_the_shared_memory_of_a_worker_or_its_parent(tmp_path):
    np = pytest.importorskip("numpy")
    big = np.ones(8 << 20, dtype=np.uint8)  # shipped out of band, in memfd segments the worker maps
    out: list = []
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline([hold], engine=engine)
        mapping = threading.Thread(target=lambda: out.append(
            p.map(inputs={"x": [1], "big": big, "folder": str(tmp_path)}, map_over="x")))
        mapping.start()
        try:
            while not (tmp_path / "ready-1").exists():
                time.sleep(0.02)
            worker = int((tmp_path / "ready-1").read_text())
            paths = memfds(worker) + memfds(os.getpid())
            assert any("/map_files/" in p for p in paths) and any(f"/proc/{os.getpid()}/fd/" in p for p in paths)
            for path in paths:  # this user may (the paths are right)...
                os.close(os.open(path, os.O_RDONLY))

            def reach() -> int:  # ...another may not, by any of them
                opened = 0
                for path in [*paths, f"/proc/{worker}/mem", f"/proc/{os.getppid()}/mem"]:
                    try:
                        os.close(os.open(path, os.O_RDONLY))
                        opened += 1
                    except PermissionError:
                        pass
                for folder in (f"/proc/{worker}/fd", f"/proc/{worker}/map_files"):
                    try:
                        os.listdir(folder)
                        opened += 1
                    except PermissionError:
                        pass
                return opened

            assert as_other_user(reach) == 0
        finally:
            (tmp_path / "go").touch()
            mapping.join(60)
    assert out == [[{"y": 2}]]


def _shared_tmp() -> tuple[Path, Path]:
    """A folder of ours that another user can reach, and in it a `/tmp` like folder (sticky, writable by
    anyone), to be their `$TMPDIR` too; remove the first once done."""
    base = Path(tempfile.mkdtemp(prefix="hardy-shared-tmp-", dir="/tmp"))
    base.chmod(0o755)
    shared = base / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    return base, shared


DASK_MAP = """
import sys
from hardy import Engine, Pipeline, node
from hardy.integrations.dask import DaskExecutor

@node(output_name="y")
def where(x):
    return [p for p in sys.path if "dask-scratch-space" in p]

engine = Engine(map_executor=DaskExecutor(workers=1))
out = Pipeline([where], engine=engine).map(inputs={"x": [1, 2]}, map_over="x")
print("paths", [p for o in out for p in o["y"]])
engine.close()
print("left", [p for p in sys.path if "dask-scratch-space" in p])
"""


def test_another_users_dask_scratch_folder_is_neither_imported_from_nor_waited_on():
    """Dask's scratch folder was `$TMPDIR/dask-scratch-space`, taken as found: another user who
    made it (writable by anyone) got its workers' folders first on `sys.path`, in your process and
    hardy's fork server (their `numpy.py` ran as you), and held its lock file, on which your next
    cluster waited for ever. `DaskExecutor()` now starts its LocalCluster in a private folder."""
    pytest.importorskip("distributed")
    base, shared = _shared_tmp()
    holder = os.fork()
    if holder == 0:  # another user: makes the folder Dask takes, writable by anyone, and holds its lock
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            folder = shared / "dask-scratch-space"
            folder.mkdir()
            folder.chmod(0o777)
            with open(folder / "global.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                (folder / "held").touch()
                time.sleep(600)
        finally:
            os._exit(1)
    try:
        while not (shared / "dask-scratch-space" / "held").exists():
            assert os.waitpid(holder, os.WNOHANG) == (0, 0), "the other user's process ended"
            time.sleep(0.05)
        try:
            out = subprocess.run([sys.executable, "-c", DASK_MAP], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "TMPDIR": str(shared), "PYTHONPATH": SRC})
        except subprocess.TimeoutExpired:
            pytest.fail("the map waited on the lock another user holds in $TMPDIR/dask-scratch-space")
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
        left = [p.name for p in shared.iterdir()]
        shutil.rmtree(base)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    mine = [p for p in ast.literal_eval(lines["paths"]) if p.startswith(str(shared / "dask-scratch-space"))]
    assert mine == [], f"the other user's folder is on sys.path: {mine}"
    assert ast.literal_eval(lines["left"]) == [], "Dask's folders stayed on sys.path once the executor closed"
    assert left == ["dask-scratch-space"], "the private folder was left behind"


RAY_MAP = """
from hardy import Engine, Pipeline, node
from hardy.integrations.ray import RayExecutor

@node(output_name="y")
def plus(x):
    return x + 1

engine = Engine(map_executor=RayExecutor(workers=1))
print([o["y"] for o in Pipeline([plus], engine=engine).map(inputs={"x": [1, 2]}, map_over="x")])
engine.close()
"""


def test_another_users_ray_folder_does_not_stop_a_local_ray_instance():
    """Ray's folder was `$TMPDIR/ray`, taken as found: another user who made it first (a folder
    of theirs, `0755`, or a file) stopped every local instance from starting, and Ray makes its
    folders there writable by anyone. `RayExecutor()` now keeps them in a private one. (This
    process is root, whom a folder's mode does not stop: the other user makes a file.)"""
    pytest.importorskip("ray")
    base, shared = _shared_tmp()
    try:
        assert as_other_user(lambda: ((shared / "ray").touch(mode=0o644), 0)[1]) == 0
        out = subprocess.run([sys.executable, "-c", RAY_MAP], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "TMPDIR": str(shared), "PYTHONPATH": SRC})
        left = sorted(p.name for p in shared.iterdir())
    finally:
        shutil.rmtree(base)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "[2, 3]"
    assert left == ["ray"], "the private folder was left behind"


RAY_PRIVATE = """
import os
from hardy import Engine, Pipeline, node
from hardy.integrations.ray import RayExecutor

@node(output_name="y")
def plus(x):
    return x + 1

executor = RayExecutor(workers=1)
engine = Engine(map_executor=executor)
Pipeline([plus], engine=engine).map(inputs={"x": [1]}, map_over="x")
private = executor._removal.peek()[2][0]
child = os.fork()
if child == 0:  # another user, while the instance runs: Ray's own folder (its sockets) out of reach
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    try:
        os.listdir(os.path.join(private, "r"))
        os._exit(0)
    except PermissionError:
        os._exit(13)
print(oct(os.stat(private).st_mode & 0o777), os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
engine.close()
"""


def test_another_user_cannot_reach_a_local_ray_instances_sockets():
    """Ray makes the folder it is given writable by anyone (`chmod 0777`, its sockets in it): given
    hardy's private folder, that folder was open to every local user while the instance ran. It
    is given a folder inside the private one, which stays `0700`."""
    pytest.importorskip("ray")
    base, shared = _shared_tmp()
    try:
        out = subprocess.run([sys.executable, "-c", RAY_PRIVATE], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "TMPDIR": str(shared), "PYTHONPATH": SRC})
    finally:
        shutil.rmtree(base)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "0o700 13"


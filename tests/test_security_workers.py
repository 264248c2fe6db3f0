"""Another local user against the worker machinery, acted out by a real second uid (a forked child
that drops to uid/gid 65534): the fork server's socket (connect, a forged request that skips the
handshake, a request with a guessed key) and the shared memory of workers and their parent (memfd
segments and status pages, reached through /proc). Each is refused; the server serves on. Rows
of docs/security.md."""

from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection, answer_challenge

import psutil
import pytest

from hardy import Engine, Pipeline, node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user"),
              pytest.mark.timeout(180)]
OTHER = 65534


def as_other_user(action) -> int:
    """`action()`'s exit code, run in a forked child that has dropped to uid/gid 65534 (99: it raised)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            os._exit(action())
        except BaseException:
            os._exit(99)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


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


def test_another_user_gets_no_worker_from_the_fork_server(tmp_path):
    with Engine(map_executor="process", workers=1) as engine:
        p = Pipeline([hold], engine=engine)
        (tmp_path / "go").touch()
        assert p.map(inputs={"x": [0], "big": [1], "folder": str(tmp_path)}, map_over="x") == [{"y": 1}]
        server = engine.process_pool()._launcher
        children = {c.pid for c in psutil.Process(server.process.pid).children()}

        def connect() -> int:
            try:
                socket.socket(socket.AF_UNIX).connect(server.address)
            except PermissionError:
                return 13
            return 0

        assert as_other_user(connect) == 13  # the 0700 folder keeps other users out
        os.chmod(server.folder, 0o755)  # as if the folder's mode were lost: the peer check remains
        os.chmod(server.address, 0o777)

        def forged_request() -> int:
            """Skip the handshake: send a socket for a worker straight away, then read what comes."""
            s = socket.socket(socket.AF_UNIX)
            s.connect(server.address)
            mine, _ = socket.socketpair()
            try:
                reduction.sendfds(s, [mine.fileno()])
                s.settimeout(30)
                said = s.recv(4096)
            except OSError:
                return 1
            return 1 if said == b"" else 2  # hung up on at once, before any challenge was sent

        def guessed_key() -> int:
            s = socket.socket(socket.AF_UNIX)
            s.connect(server.address)
            try:
                answer_challenge(Connection(s.detach()), os.urandom(32))
            except (EOFError, OSError):
                return 1
            except Exception:
                return 3
            return 0

        assert forged_request() == 2  # this user's request is answered with the challenge: the check is the uid
        assert as_other_user(forged_request) == 1 and as_other_user(guessed_key) == 1
        assert {c.pid for c in psutil.Process(server.process.pid).children()} == children  # nothing forked
        assert p.map(inputs={"x": [2, 3], "big": [1], "folder": str(tmp_path)}, map_over="x") == [{"y": 3}, {"y": 4}]

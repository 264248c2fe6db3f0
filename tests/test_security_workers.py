"""Another local user against the workers' shared memory, acted out by a real second uid (a forked
child that drops to uid/gid 65534): the memfd segments and status pages of workers and of their
parent, reached through /proc. Refused, where this user opens the same paths. The fork server's
socket is attacked the same way in test_lifecycle.py (connect, a request that skips the handshake,
the right key from another uid). Rows of docs/security.md."""

from __future__ import annotations

import os
import threading
import time

import pytest

from hardy import Engine, Pipeline, node
from test_lifecycle import _as_nobody as as_other_user

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

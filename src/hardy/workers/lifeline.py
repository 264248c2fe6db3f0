"""How worker processes and fork servers follow their parent: they never outlive it.

Three mechanisms, because each alone has a gap:
- `PR_SET_PDEATHSIG`: the kernel sends SIGKILL when the parent *thread* that forked us ends. It needs
  no cooperation from us (a node spinning in C holding the GIL still dies), but it follows the
  forking thread, so it is set only where that thread lives as long as its process (the fork
  server's main thread; the main thread of a user process).
- a watchdog on a pipe or socket: the peer's end closes when its process ends, however it ends
  (SIGKILL included). `watch_peer` waits for that in a thread, without consuming any data.
- process groups: each worker leads its own session, so the processes a node starts
  (`subprocess.Popen`) share its group and `kill_group` ends them with it.

A process that leaves the group (`start_new_session=True`, `setsid`, a daemon's double fork) is
still ended with its worker: each worker and each fork server is a child subreaper
(`become_subreaper`), so a node's process whose parent ended is adopted by its worker rather
than by init, and every process under a worker stays under it. A worker that leaves ends them all
(`end_descendants`); one that dies (a crash, a SIGKILL) hands them to its fork server, which ends
every process it adopted as it collects the worker (`server.py`). A subreaper also collects the
exit status of the orphans it adopted, which nobody else will: a worker, whose nodes wait for
their own children, cannot tell those apart, so it leaves once too many have piled up
(`ZOMBIES_MAX`, `retiring`), and its fork server collects them all.

What no process can clean up after itself is a SIGKILL. So none of them has anything on disk to
clean up: status words, crash records and a fork server's note are memfds, and a fork server keeps
no file.
"""

from __future__ import annotations

import _thread
import os
import select
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
ZOMBIES_MAX = 100  # exited processes a worker may hold uncollected before it leaves (`retiring`)


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Get `sig` when the parent ends. False if that happened already (no signal will come): the
    caller leaves its own way, a fork server through the clean-up that ends its workers."""
    import ctypes  # (here: a first map's parent loads this module before its fork server starts)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog still applies
        pass
    return os.getppid() == parent_pid  # else the parent died before prctl took effect


def watch_peer(fd: int, on_hangup: Callable[[], None]) -> None:
    """Call `on_hangup` once the other end of `fd` (a socket or pipe) is closed.

    poll() reports POLLHUP whatever events are asked for, so waiting on POLLRDHUP alone never
    competes with the reader of `fd` for its data. A bare thread (`_thread`): `threading.Thread.start`
    waits until the new thread has run, a wait for the scheduler on every worker's start.
    """
    def wait() -> None:
        p = select.poll()
        p.register(fd, getattr(select, "POLLRDHUP", 0) | select.POLLHUP)
        while True:
            try:
                events = p.poll()
            except InterruptedError:
                continue
            if any(ev & (select.POLLHUP | getattr(select, "POLLRDHUP", 0) | select.POLLERR | select.POLLNVAL)
                   for _, ev in events):
                on_hangup()
                return

    _thread.start_new_thread(wait, ())


def end_worker() -> None:
    """In a worker whose parent died: end every process under it, then its group (itself too)."""
    end_descendants(os.getpid())
    kill_group(os.getpgid(0))


def kill_group(pgid: int) -> None:
    """SIGKILL every process of a worker's group (the worker and whatever its nodes started)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def become_subreaper() -> bool:
    """Adopt the processes under this one whose parent ends (Linux 3.4+); False where it cannot."""
    import ctypes
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every process, from /proc/<pid>/stat."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()  # after "(comm)", which may hold anything
            found[int(name)] = (int(fields[1]), fields[0].decode())
        except (OSError, IndexError, ValueError):
            continue
    return found


def descendants(root: int, processes: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """The processes whose chain of parents leads to `root`, alive (not exited), parents first."""
    processes = _processes() if processes is None else processes
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop(0)
        if processes[pid][1] not in "ZX":
            found.append(pid)
        todo += children.get(pid, ())
    return found


def end_descendants(root: int, spare: frozenset[int] = frozenset()) -> None:
    """SIGKILL every process under `root` but those under the pids in `spare` (a fork server's
    live workers, which end their own), again until none is left: a process forked meanwhile
    is found by the next pass. Each is signalled through a pidfd taken after it was listed, so a
    pid that was reused in between is never signalled."""
    if _children(root) == []:  # (a subreaper with no child has nothing under it: no /proc scan)
        return
    for _ in range(8):
        processes = _processes()
        spared = set(spare).union(*(descendants(pid, processes) for pid in spare))
        found = [pid for pid in descendants(root, processes) if pid not in spared]
        if not found:
            return
        for pid in found:
            _kill(pid)


def _kill(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone already
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def _children(pid: int) -> list[str] | None:
    """The pids of the children of process `pid`, from its threads' /proc children lists (a
    kernel built with CONFIG_PROC_CHILDREN); None where there are none to read."""
    children = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += f.read().split()
    except OSError:
        return None
    return children


def retiring(pid: int) -> bool:
    """Whether worker `pid` (this process) holds ZOMBIES_MAX exited processes it adopted and nobody
    collects. Asked before every chunk, so first the one question that answers it almost always:
    whether any child has exited at all (`waitid` that collects nothing), before reading /proc."""
    try:
        if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return False  # children, none exited
    except ChildProcessError:
        return False  # no child
    children = _children(pid)
    if children is None or len(children) < ZOMBIES_MAX:  # (unknown: its fork server collects them at its end)
        return False
    states = _processes()
    return sum(states.get(int(c), (0, ""))[1] == "Z" for c in children) >= ZOMBIES_MAX

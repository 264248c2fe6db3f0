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
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Get `sig` when the parent ends. False if that happened already (no signal will come): the
    caller leaves its own way, a fork server through the clean-up that removes its folder."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog still applies
        pass
    return os.getppid() == parent_pid  # else the parent died before prctl took effect


def watch_peer(fd: int, on_hangup: Callable[[], None]) -> threading.Thread:
    """Call `on_hangup` once the other end of `fd` (a socket or pipe) is closed.

    poll() reports POLLHUP whatever events are asked for, so waiting on POLLRDHUP alone never
    competes with the reader of `fd` for its data.
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

    t = threading.Thread(target=wait, name="hardy-lifeline", daemon=True)
    t.start()
    return t


def kill_group(pgid: int) -> None:
    """SIGKILL every process of a worker's group (the worker and whatever its nodes started)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

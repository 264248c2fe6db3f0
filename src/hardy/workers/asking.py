"""Asking a fork server for workers: this process's end of the server's standard input.

One message per worker (a `SOCK_SEQPACKET` pair: each message whole, whichever thread sends it),
carrying two descriptors (`SCM_RIGHTS`): the worker's end of its socket to this process, and the
end of a second pair on which the server answers about it, ("pid", pid) and later ("exit",
code). Requests queue in the socket while the server imports its modules. A map asks for its
first workers together (`ahead`), so that they fork at once rather than each after the one
before it was set up, and each is then taken in turn (`take`).
"""

from __future__ import annotations

import array
import socket
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (multiprocessing's connections load after a fork server starts: `launch.ForkServer`)
    from multiprocessing.connection import Connection

AHEAD_MOST = 64  # workers asked for ahead at most: each request holds two descriptors in the queue


class Requests:
    """The request channel of one fork server, and the workers asked for ahead on it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.asked: deque[tuple[socket.socket, Connection]] = deque()

    def one(self, flags: int = 0) -> tuple[socket.socket, Connection]:
        """Ask for one worker: this process's end of its socket, and the server's replies about it."""
        from multiprocessing.connection import Connection
        ours, theirs = socket.socketpair()
        mine, replies = socket.socketpair()
        try:  # (not `socket.send_fds`, which drops `flags` before Python 3.13: a full queue would block)
            fds = array.array("i", [theirs.fileno(), replies.fileno()])
            self.sock.sendmsg([b"w"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)], flags)
        except OSError:
            ours.close()
            mine.close()
            raise
        finally:
            theirs.close()
            replies.close()
        return ours, Connection(mine.detach())

    def ahead(self, n: int) -> None:
        """Ask for `n` workers now (at most AHEAD_MOST). Never waits: a full queue (a server still
        importing `preload`) ends the asking, as does a server that has gone; `take` then asks."""
        for _ in range(min(n, AHEAD_MOST) - len(self.asked)):
            try:
                asked = self.one(socket.MSG_DONTWAIT)
            except OSError:  # (BlockingIOError: the queue is full)
                return
            self.asked.append(asked)
            if self.sock.fileno() == -1:  # closed meanwhile (`close`, maybe in a signal handler)
                self.close()
                return

    def take(self) -> tuple[socket.socket, Connection, Any] | None:
        """A worker asked for ahead, with what the server said of it so far (its pid, or None
        before it forked); None if there is none. One that died waiting (its exit said after its
        pid, or the server gone) is dropped."""
        while True:
            try:
                ours, conn = self.asked.popleft()
            except IndexError:
                return None
            import pickle  # (here: the fork server's launch need not wait for it)
            try:
                said = pickle.loads(conn.recv_bytes()) if conn.poll(0) else None
                if said is None or not conn.poll(0):  # nothing but its pid: alive
                    return ours, conn, said
            except (OSError, EOFError):
                pass
            ours.close()
            conn.close()

    def close(self) -> None:
        """End of file for the server; the workers asked for and never set up leave with it. No
        lock: this may run in a signal handler (`launch._stop_everything`)."""
        self.sock.close()
        while True:
            try:
                ours, conn = self.asked.popleft()
            except IndexError:
                return
            ours.close()
            conn.close()

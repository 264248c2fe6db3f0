"""The parent's handle of one worker process: its pipe, status words, crash file, and how it is
stopped or killed (asking for its last words first). Also how much memory a process holds.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import time
from array import array
from collections.abc import Iterable, Iterator, MutableMapping

from ..crash.stacks import hang_stacks
from ..errors import WorkerStartError
from ..plan.compiled import Plan
from ..shipping import context, transport
from . import launch
from . import status as words
from .messages import Context, Setup, Stop

STACK_GRACE = 0.2      # seconds a hung worker gets to write its stack before SIGKILL
WAKE_MS = 100          # milliseconds a wait for a worker sleeps at most, between looks at pending signals
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class Unsent(MutableMapping[int, None]):
    """The items of a worker's current chunk with no result yet, in order: a dict of them, but
    for consecutive items answered in order (most chunks), which stay a range. In a map of
    10,000 fast items, a dict entry made and freed per item was a tenth of the parent's time."""

    __slots__ = ("start", "stop", "rest")

    def __init__(self, items: Iterable[int] = ()) -> None:
        self.start = self.stop = 0
        self.rest: dict[int, None] | None = None  # (None: the items are range(start, stop))
        if type(items) is range and items.step == 1:
            self.start, self.stop = items.start, max(items.start, items.stop)
        else:
            self.rest = dict.fromkeys(items)

    def _dict(self) -> dict[int, None]:
        if self.rest is None:
            self.rest = dict.fromkeys(range(self.start, self.stop))
        return self.rest

    def __len__(self) -> int:
        return len(self.rest) if self.rest is not None else self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(self.rest if self.rest is not None else range(self.start, self.stop))

    def __contains__(self, i: object) -> bool:
        if self.rest is not None:
            return i in self.rest
        if type(i) is int:
            return self.start <= i < self.stop
        return i in range(self.start, self.stop)  # (equal to an int, as a dict's key would be: True, 2.0)

    def __getitem__(self, i: int) -> None:
        if i not in self:
            raise KeyError(i)

    def __setitem__(self, i: int, value: None) -> None:
        self._dict()[i] = value

    def __delitem__(self, i: int) -> None:
        if self.rest is None and i == self.start < self.stop:
            self.start += 1
        else:
            del self._dict()[i]

    def pop(self, i: int, default: None = None) -> None:  # type: ignore[override]  # (values are None)
        if i in self:
            del self[i]
        return default

    def clear(self) -> None:
        self.rest, self.start, self.stop = None, 0, 0

    def answered(self, first: int, n: int) -> None:
        """Items `first` to `first` + n - 1 answered."""
        if self.rest is None and first == self.start:
            self.start = min(self.stop, first + n)
        else:
            for i in range(first, first + n):
                self.pop(i)


def rss(pid: int) -> int:
    """Resident memory of a process in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        try:
            import psutil
            rss: int = psutil.Process(pid).memory_info().rss
            return rss
        except Exception:
            return 0


def peak_rss(pid: int) -> int:
    """The most resident memory a process has had (VmHWM), in bytes; 0 where unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class Worker:
    """One worker process, its pipe, its status words and its faulthandler file.

    The status words and the faulthandler file are memfds passed to the worker with its first
    message: files with no name, gone with the last process holding them, so that no death of
    either side (a SIGKILL of this process included) can leave one behind."""

    def __init__(self, launcher: launch.Launcher, number: int, env: dict[str, str],
                 preload_libs: tuple[str, ...]):
        self.number = number
        self._fds = [os.memfd_create("worker-status", os.MFD_CLOEXEC), os.memfd_create("worker-fault", os.MFD_CLOEXEC)]
        os.write(self._fds[0], array("d", [-1.0] * words.SLOTS).tobytes())
        self.fault_path = f"/proc/self/fd/{self._fds[1]}"  # read by path, here, after a death
        self._mm, self.status = words.open_status(self._fds[0])
        try:
            self.process, self.conn = launcher.start_worker()
            # this process's state now (a fork server's dates from its start), with the caps; `follow` keeps
            # it so (the log levels too: the records it forwards, `shipping.context.Settings`)
            self.overlay = dict(env)
            self.context = context.current()
            self._set_up(preload_libs)
        except BaseException:  # (a preload that fails or blocks): nothing of it stays open
            del self.status
            self._mm.close()
            for fd in self._fds:
                os.close(fd)
            raise
        self.fd = self.conn.fileno()
        with socket.fromfd(self.fd, socket.AF_UNIX, socket.SOCK_STREAM) as end:  # (the same socket: `wait`)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, WAKE_MS * 1000))
        # polled without a selector made per call (multiprocessing's `wait` and `Connection.poll` make one)
        self._readable = select.poll()
        self._readable.register(self.fd, select.POLLIN)
        self._either = select.poll()  # its pipe, or its end
        for fd in (self.fd, self.process.sentinel):
            self._either.register(fd, select.POLLIN)
        self.plans: set[int] = set()
        self.plan: Plan | None = None
        self.unsent = Unsent()  # items of the current chunk with no result yet, in order
        self.tasks = 0
        self.started_any = False
        self.chunk_size = 0
        self.group = 0  # items per batched call in its chunk
        self.resend = False  # a batch of its results could not be unpickled here
        self.killed_for: str | None = None  # "timeout" / "memory" when the parent killed it
        self.kill_detail = ""
        self.hang: tuple[str, str] = ("", "")  # py-spy's stacks before a kill for a timeout, or why none

    def _set_up(self, preload_libs: tuple[str, ...]) -> None:
        """Its first message (`worker.run`); a worker that ended before it (killed while it waited,
        asked for ahead: `launch.ForkServer.ask`) is collected and named."""
        try:
            transport.send(self.conn, b"", transport.Packed(
                pickle.dumps(Setup({**self.context.environ, **self.overlay}, preload_libs, self.context.sys_path,
                                   self.context.cwd or os.getcwd(), self.context.argv, self.context.umask,
                                   self.context.settings)),
                self._fds))
        except OSError as exc:
            self.process.kill()
            self.process.join(1)
            self.conn.close()
            self.process.close()
            raise WorkerStartError(f"a new worker (pid {self.process.pid}) ended before it was set up "
                                   f"(exit code {self.process.exitcode}; {exc}): killed from outside?") from exc

    def follow(self, now: context.Snapshot) -> None:
        """Bring the worker to the caller's state `now` (environment, working directory, argv,
        sys.path, settings) before it runs a call made then: what changed since it last heard, if anything."""
        if now is self.context:
            return
        before, after = {**self.context.environ, **self.overlay}, {**now.environ, **self.overlay}
        changed, unset = context.environ_delta(before, after)
        self.send(pickle.dumps(Context(changed, unset, now.cwd or self.context.cwd, now.argv, now.sys_path,
                                       now.umask, now.settings)))
        self.context = now

    def readable(self) -> bool:
        """Whether a message (or its pipe's end) is there to read now."""
        return bool(self._readable.poll(0))

    def wait(self, spin: float = 0.0) -> bytes | None:
        """Its next message, waiting as long as it takes; None when it has died (its pipe closed,
        or it ended with nothing more to read). The wait is a read, as a bare pipe's: waiting on
        its pipe and its end at once (poll) cost a woken process several microseconds more on this
        project's machine. So the read times out every WAKE_MS (SO_RCVTIMEO) to look at its end
        (a process its nodes forked may hold its pipe open after it died) and to let a Ctrl-C that
        another thread received be raised. `spin`: seconds it first waits awake (`transport.spin_for`)."""
        if spin:
            transport.spin_for(self._readable, spin)
        while True:
            try:
                return transport.read_frame(self.fd)
            except BlockingIOError:
                if self._either.poll(0) and not self.readable():  # ended, and said nothing more
                    return None
            except (EOFError, OSError):
                return None

    @property
    def busy(self) -> bool:
        return bool(self.unsent) or self.plan is not None

    def idle(self) -> None:
        """Its status words say idle before it is handed work, as its parent knows it is (its last
        answer was read): a worker that sent that answer and was preempted before it marked itself
        idle, then killed, would otherwise read as dying while it sent results, and the work handed
        to it would be charged with its death instead of going to another worker."""
        self.status.item = words.IDLE
        self.status.step = words.NO_STEP

    def send(self, data: bytes | transport.Packed) -> None:
        if type(data) is bytes:
            transport.write_frame(self.fd, b"", data)
        elif data.fds:  # type: ignore[union-attr]
            transport.send(self.conn, b"", data)  # type: ignore[arg-type]
        else:
            transport.write_frame(self.fd, b"", data.data)  # type: ignore[union-attr]

    def kill(self, reason: str, detail: str) -> None:
        """Ask for its last words and faulthandler's stack (works inside C loops too), then SIGKILL its group."""
        self.killed_for, self.kill_detail = reason, detail
        if reason == "timeout":
            self.hang = hang_stacks(self.process.pid)
        self.ask_last_words()
        self.await_last_words(time.monotonic() + STACK_GRACE)
        self.process.kill()

    def ask_last_words(self) -> None:
        """SIGUSR1: the worker sends the results it holds, then faulthandler writes its stack."""
        try:
            os.kill(self.process.pid, signal.SIGUSR1)
        except (ProcessLookupError, OSError):
            pass

    def await_last_words(self, deadline: float) -> None:
        try:
            while time.monotonic() < deadline and os.path.getsize(self.fault_path) == 0:
                time.sleep(0.005)
            time.sleep(0.01)
        except OSError:
            pass

    def stop(self, timeout: float = 2.0) -> None:
        self.leave()
        self.finish(timeout)

    def finish(self, timeout: float) -> None:
        """Wait up to `timeout` for it to end (asked to leave), kill it if it has not, close its files."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1)
        self.close_files()

    def leave(self) -> None:
        """Ask it to leave (`Stop`), without waiting: `stop` waits, `WorkerPool` collects it later."""
        try:
            self.send(pickle.dumps(Stop()))
        except (OSError, ValueError):
            pass

    def close_files(self) -> None:
        self.conn.close()
        self.process.close()
        del self.status
        self._mm.close()
        self.close_fds()

    def close_fds(self) -> None:
        """Close this process's descriptors of its status words and fault file (in a fork child:
        the worker is the parent's, which keeps its own)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []

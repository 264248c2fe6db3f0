"""Starting worker processes, and making sure none outlives this process.

hardy runs its own fork servers (`server.py`) instead of multiprocessing's single process-global
one: one per distinct (start method, preload list, worker environment), side by side, each shared
by the pools that need it and closed with the last of them. multiprocessing's can only be
replaced by stopping it, which waits for a server whose children still hold its pipe (the old hang
with two engines of different `preload=`), and its workers import the user's `__main__` again
(scripts without a `__main__` guard, `python - < file`). Ours never do either.

start_method:
- "forkserver": workers fork from a server that imported `preload` once (milliseconds per worker).
- "spawn": the server execs a fresh interpreter for each worker.
- "fork": workers fork from this process (only when `fork_hazards()` finds nothing, or "fork!").

A SIGTERM to this process (a scheduler, `kill`) first stops every server and worker it started,
then ends the process as SIGTERM would have; SIGKILL is covered by the servers and workers
themselves (`lifeline.py`), which watch for the end of their pipe to this process. A child that
this process forks (`multiprocessing`'s fork, `os.fork`) would hold those pipes open and keep them
alive after a SIGKILL of this one: so a fork child lets go of them at once (`_forked`).

A fork server imports `preload` before it answers: one whose import blocks fails the map after
`PRELOAD_TIMEOUT` seconds (the environment variable HARDY_PRELOAD_TIMEOUT, default 120), naming
the module; a warning names it after `PRELOAD_WARN` seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import WorkerStartError
from .asking import Requests
from .lifeline import die_with_parent, kill_group

if TYPE_CHECKING:  # (multiprocessing's connections load after a fork server starts: `ForkServer`)
    from multiprocessing.connection import Connection

_HARDY_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# `python -c` puts "" (the working directory) first on sys.path, where the caller's `python script.py`
# has the script's own folder: a `socket.py` or `cloudpickle.py` another user left in a shared working
# directory would be imported by the server. Dropped before any import; a worker then takes the
# caller's own sys.path (`take_import_path`), and the server imports `preload` from it.
_BOOT = f"import sys; sys.path[:] = [{_HARDY_ROOT!r}, *(p for p in sys.path if p)]; from hardy.workers.%s"
# The server's collector stays paused through its imports and `preload` (objects that live as long
# as the process: collections would only walk them), until `server._settle` freezes them.
SERVER_BOOT = "import gc; gc.disable(); " + _BOOT % "server import serve; serve()"
SERVER_TAG = "hardy-fork-server"  # its one argument: what `ps` shows (and the tests look for)
NOTE_MAX = 4096  # bytes: the note of the module a server imports, kept current in a memfd (`server._say`)


# Thread caps: N workers each running an OpenMP/BLAS pool of `cores` threads oversubscribe the
# machine N-fold; each worker gets cores ÷ workers unless the user already chose.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def worker_environment(workers: int) -> dict[str, str]:
    """Variables to set in each worker: the caller's own value where it set one, else the cap.

    Every variable is listed, user-set ones too, because a worker forks from a fork server whose
    environment may date from an earlier pool: the worker must not inherit a stale value.
    """
    per_worker = str(max(1, (os.cpu_count() or 1) // max(1, workers)))
    env = {v: os.environ.get(v, per_worker) for v in THREAD_VARIABLES}
    env["TOKENIZERS_PARALLELISM"] = os.environ.get("TOKENIZERS_PARALLELISM", "false")
    return env


DEFAULT_START_METHOD = "forkserver"  # workers never fork this process (hardy runs on Linux alone: `system.py`)


def _preload_timeout() -> float:
    text = os.environ.get("HARDY_PRELOAD_TIMEOUT", "120")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # (nan too)
        raise WorkerStartError(f"HARDY_PRELOAD_TIMEOUT={text!r} is not a number of seconds above 0; "
                               "set it to one (the default is 120), or unset it")
    return value


PRELOAD_TIMEOUT = _preload_timeout()
PRELOAD_WARN = 10.0  # seconds: a server still importing `preload` then is named in a warning
WORKER_BOOT = _BOOT % "worker import run; %s"


class WorkerProcess:
    """The parent's view of one worker, however it started: pid, sentinel, exit code, kill."""

    def __init__(self, pid: int, sentinel: int, collect: Callable[[], int | None], close: Callable[[], None]):
        self.pid = pid
        self.sentinel = sentinel  # readable once the worker has ended
        self._collect, self._close = collect, close
        self._ended = False
        self.exitcode: int | None = None
        self._end = select.poll()  # (asked before every chunk: no selector made per question)
        self._end.register(sentinel, select.POLLIN)
        self._collecting = threading.Lock()
        _live.add(self)

    def join(self, timeout: float | None = None) -> None:
        if self._ended:
            return
        ms = -1 if timeout is None else max(0, math.ceil(timeout * 1000))
        try:
            ended = self._end.poll(ms)
        except RuntimeError:  # another thread asks at this moment (Engine.close beside a stream's runner):
            once = select.poll()  # a poll object answers one thread at a time, so this one asks its own
            once.register(self.sentinel, select.POLLIN)
            ended = once.poll(ms)
        if ended:
            with self._collecting:
                if not self._ended:  # collected once, by whichever thread got here first
                    self.exitcode = self._collect()
                    self._ended = True

    def is_alive(self) -> bool:
        self.join(0)
        return not self._ended

    def kill(self) -> None:
        """SIGKILL the worker's whole process group: the processes its nodes started go too."""
        if self.is_alive():
            kill_group(self.pid)

    def close(self) -> None:
        _live.discard(self)
        self._close()


_live: weakref.WeakSet[WorkerProcess] = weakref.WeakSet()


class ForkServer:
    """A hardy fork server process: started clean (fork+exec), reachable only by this process.

    Asked for workers over a socket pair that is the server's standard input (`server.py`): one
    message per worker, no connection or handshake, so a first map's workers start as soon as the
    server has imported its modules, and a crash's replacement costs one message each way."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str], spawn: bool):
        self.users: set[int] = set()
        self.label = f"preload={list(preload)}" if preload else "no preload"
        self.preloads = bool(preload)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._requests = Requests(ours)
        # where the server keeps the name of the module it imports (`_importing`), ours and its (not on 0-2)
        self._note = above_stdio(os.memfd_create("server-note", os.MFD_CLOEXEC))
        config = dict(spawn=spawn, preload=list(preload), sys_path=list(sys.path), note=self._note,
                      parent=os.getpid(), boot=WORKER_BOOT,
                      pdeathsig=threading.current_thread() is threading.main_thread())
        closed = closed_stdio()  # /dev/null there, for the server and its workers: not a descriptor of theirs
        try:
            self.process = subprocess.Popen([sys.executable, "-c", SERVER_BOOT, SERVER_TAG], stdin=theirs.fileno(),
                                            stdout=subprocess.DEVNULL if 1 in closed else None,
                                            stderr=subprocess.DEVNULL if 2 in closed else None,
                                            pass_fds=(self._note,), env={**os.environ, **env}, start_new_session=True)
        except BaseException:  # (EAGAIN past the process limit: `pool._new_worker` says so)
            ours.close()
            os.close(self._note)
            raise
        finally:
            theirs.close()
        _ends.add(ours)  # stays open: its end of file tells the server we are gone
        import pickle  # (here and below, as logging: a first map's fork server starts without waiting for them)
        ours.sendall(pickle.dumps(config))

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, n: int) -> None:
        """Ask for `n` workers now, which `start_worker` then sets up one by one (`asking.py`)."""
        self._requests.ahead(n)

    def start_worker(self) -> tuple[WorkerProcess, Connection]:
        from multiprocessing.connection import Connection
        try:
            ours, conn, said = self._requests.take() or (*self._requests.one(), None)
        except OSError as exc:
            raise self._failed(exc) from exc
        try:
            if said is None:
                self._wait_for_preload(conn)
                import pickle
                said = pickle.loads(conn.recv_bytes())
        except (OSError, EOFError) as exc:
            ours.close()
            conn.close()
            raise self._failed(exc) from exc
        kind, value = said
        if kind != "pid":  # "error" (preload), "unforked" (EAGAIN past the process limit: `pool._new_worker` says so)
            ours.close()
            conn.close()
            raise WorkerStartError(value) if kind == "error" else \
                OSError(value[0], f"the fork server ({self.label}) could not fork a worker ({value[1]})")
        return WorkerProcess(value, conn.fileno(), lambda: _exit_status(conn), conn.close), \
            _parent_end(Connection(ours.detach()))

    def _failed(self, exc: BaseException) -> WorkerStartError:
        """The error for a worker this server could not start, once the server has ended if it is
        ending (then the pool starts a fresh one in its place: `pool._new_worker`)."""
        try:
            code = self.process.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            why = f"exited with code {code}" + (
                "; a module in preload= may crash on import: try importing it in a plain python" if self.preloads
                else " (killed from outside? the OOM killer, a kill -9)")
        elif isinstance(exc, OSError) and exc.errno == errno.EMFILE:
            why = (f"could not be asked ({exc}): this process ran out of descriptors (each worker holds a few); "
                   "raise the limit (ulimit -n) or use fewer workers")
        else:
            why = f"did not answer ({exc})"
        return WorkerStartError(f"the fork server ({self.label}) {why}")

    def _importing(self) -> str:
        """The preload module the server imports now ("" once it is done, or before it began), as
        its note says (`server._say`): one current value, however many modules it went through,
        readable after the server died. (A read that meets a note being rewritten may find a
        mix of two names, which only a server that is not blocked writes; it reads as no name.)"""
        try:
            said = os.pread(self._note, NOTE_MAX, 0)
        except OSError:  # (closed: the server was stopped)
            return ""
        name, end, _ = said.partition(b"\n")
        return name.decode(errors="replace") if end else ""

    def _wait_for_preload(self, status: Connection) -> None:
        """Until the server answers (a server that dies ends the connection too): after
        PRELOAD_WARN seconds a warning names the module it imports; after PRELOAD_TIMEOUT the
        server is killed and the map fails naming it."""
        from multiprocessing.connection import wait
        warn = min(PRELOAD_WARN, PRELOAD_TIMEOUT)
        if wait([status], warn):
            return
        module = self._importing()
        if module:
            import logging
            log = logging.getLogger("hardy.workers")
            log.warning("the fork server has been importing preload module %r for %g s (it fails after %g s: "
                        "HARDY_PRELOAD_TIMEOUT)", module, warn, PRELOAD_TIMEOUT)
        if wait([status], max(0.0, PRELOAD_TIMEOUT - PRELOAD_WARN)):
            return
        module = self._importing()
        self.process.kill()  # (its workers: none could start)
        self.process.wait()
        what = f"preload module {module!r}" if module else f"the fork server ({self.label})"
        raise WorkerStartError(
            f"{what} did not finish importing within {PRELOAD_TIMEOUT:g} s, so no worker could start: its import "
            "blocks (waiting on a lock, a network service, input?). Import it in a plain python to see "
            "where, leave it out of preload=, or raise the limit with the environment variable "
            "HARDY_PRELOAD_TIMEOUT (seconds).")

    def stop(self, wait: bool = True) -> None:
        """End of file on its stdin: it kills what is left of its workers and exits."""
        self._requests.close()
        if not wait:  # in a signal handler: it cleans up by itself, and waiting could deadlock
            return
        note, self._note = self._note, -1  # (stopped once: a second close could hit a reused descriptor)
        if note >= 0:
            os.close(note)
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:  # (with its group: a compiler building the crash handler, handler.py)
            kill_group(self.process.pid)
            self.process.wait()


def _exit_status(status: Connection) -> int | None:
    import pickle
    try:
        kind, code = pickle.loads(status.recv_bytes())
        return code if kind == "exit" else None
    except (EOFError, OSError):
        return None  # the server itself died: the worker went with it


def closed_stdio() -> tuple[int, ...]:
    """Which of this process's standard descriptors (0-2) are closed (at its start, `cmd >&- 2>&-`,
    whatever took the number since; or now): /dev/null there for its fork servers and workers, where
    the memfds a worker receives would take the number (a node's stderr in its crash record)."""
    streams = (sys.__stdin__, sys.__stdout__, sys.__stderr__)
    return tuple(fd for fd, s in enumerate(streams) if s is None or not os.path.lexists(f"/proc/self/fd/{fd}"))


def above_stdio(fd: int) -> int:
    """`fd`, moved above 0-2 where it took one of their numbers: a child's standard stream there."""
    if fd > 2:
        return fd
    import fcntl
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


class Forker:
    """start_method="fork": workers are forks of this process, reaped here."""

    alive = True

    def __init__(self) -> None:
        self.users: set[int] = set()

    def start_worker(self) -> tuple[WorkerProcess, Connection]:
        from multiprocessing.connection import Connection
        ours, theirs = socket.socketpair()
        parent, main_thread = os.getpid(), threading.current_thread() is threading.main_thread()
        closed = closed_stdio()
        pid = os.fork()  # (EAGAIN past the process limit: `pool._new_worker` says so)
        if pid == 0:
            try:
                ours.close()
                fd, null = above_stdio(theirs.detach()), above_stdio(os.open(os.devnull, os.O_RDWR))
                for n in closed:  # /dev/null where this process's are closed (not its copy of what took them)
                    os.dup2(null, n)
                os.close(null)
                os.setsid()
                # PDEATHSIG follows the forking thread: only the main one lives long enough
                if main_thread and not die_with_parent(parent):
                    os._exit(1)
                from .worker import run
                run(fd)
            finally:
                os._exit(1)
        theirs.close()
        pidfd = os.pidfd_open(pid)

        def collect() -> int | None:
            kill_group(pid)  # not reaped yet, so the group id still names only its processes
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return WorkerProcess(pid, pidfd, collect, lambda: os.close(pidfd)), _parent_end(Connection(ours.detach()))

    def stop(self, wait: bool = True) -> None:
        """Nothing to stop: its workers are the pools' to stop, and it has no files."""


Launcher = ForkServer | Forker
_launchers: dict[tuple[Any, ...], Launcher] = {}
_lock = threading.Lock()


def warm(preload: tuple[str, ...], workers: int) -> None:
    """Start now the fork server that a pool of `workers` with the default start method will use:
    it boots (a fresh interpreter importing hardy's worker modules, the longest part of a first
    map) while the caller imports the pool and ships its plan. The pool then acquires it."""
    with contextlib.suppress(BlockingIOError):  # (EAGAIN, out of processes: the pool's start says so)
        _launcher(DEFAULT_START_METHOD, preload, worker_environment(workers), None)


def acquire(user: object, start_method: str, preload: tuple[str, ...], env: dict[str, str]) -> Launcher:
    """The launcher for these settings, shared with pools that use the same ones."""
    return _launcher(start_method, preload, env, user)


def _key(start_method: str, preload: tuple[str, ...], env: dict[str, str], user: object | None) -> tuple[Any, ...]:
    key: tuple[Any, ...] = (start_method, preload if start_method == "forkserver" else (),
                            tuple(sorted(env.items())))
    return key + (id(user),) if start_method == "fork" else key  # (forks are never shared: each pool reaps its own)


def _launcher(start_method: str, preload: tuple[str, ...], env: dict[str, str], user: object | None) -> Launcher:
    _watch_sigterm()
    key = _key(start_method, preload, env, user)
    with _lock:
        launcher = _launchers.get(key)
        if launcher is None or not launcher.alive:
            if isinstance(launcher, ForkServer):  # killed from outside: collected, its requests' end closed
                launcher.stop()
            launcher = _launchers[key] = (Forker() if start_method == "fork" else
                                          ForkServer(key[1], env, spawn=start_method == "spawn"))
        if user is not None:
            launcher.users.add(id(user))
        return launcher


def release(user: object, launcher: Launcher) -> None:
    """`user` no longer needs the launcher; the last user stops it (its workers are gone by then)."""
    with _lock:
        launcher.users.discard(id(user))
        if launcher.users:
            return
        for key, value in list(_launchers.items()):
            if value is launcher:
                del _launchers[key]
    launcher.stop()


def release_unused(start_method: str, preload: tuple[str, ...], env: dict[str, str]) -> None:
    """Stop the server for these settings if no pool uses it: one `warm` started for a pool that
    never took it (its first map had no items). A pool that warmed the same one meanwhile and
    finds it gone starts another (`pool._new_worker`)."""
    key = _key(start_method, preload, env, None)
    with _lock:
        launcher = _launchers.get(key)
        if launcher is None or launcher.users:
            return
        del _launchers[key]
    launcher.stop()


def _stop_everything(wait: bool = True) -> None:
    """Kill every worker's group and stop every server; takes no lock, so a signal handler may."""
    for w in list(_live):
        w.kill()  # only while it runs: an ended worker's pid may name someone else by now
    for launcher in list(_launchers.values()):
        launcher.stop(wait)


_ends: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's ends of its servers' and workers' pipes


def _parent_end(conn: Connection) -> Connection:
    """`conn`, this process's end of a worker's socket, let go of by fork children (`_forked`)."""
    _ends.add(conn)
    return conn


def _forked() -> None:
    """In a child forked from this process: the servers, workers and pipes are the parent's. The
    child lets go of its copies of the pipes (its ends now read /dev/null, so that no later close
    can hit a reused descriptor), so that their end-of-file still tells servers and workers when
    the parent dies, and it forgets them all, so that its exit stops nothing of the parent's.
    Its pools start workers of their own if it maps (`pool._forked`)."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for end in list(_ends):
            if not _closed(end):
                os.dup2(null, end.fileno(), inheritable=False)
        for w in list(_live):
            if not w._ended:
                os.dup2(null, w.sentinel, inheritable=False)  # (its server's status socket, or a pidfd)
                w._ended = True  # not ours to kill or reap
    finally:
        os.close(null)
    _ends.clear()
    _live.clear()
    _launchers.clear()
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # nothing of hardy's to stop here: SIGTERM ends it
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # (not the main thread: cannot happen in a fork child, whose one thread is)
            pass
    _unmask()


def _closed(end: Any) -> bool:
    """A connection's or a socket's (a fork server's requests) own answer to "closed?"."""
    return end.fileno() == -1 if isinstance(end, socket.socket) else bool(end.closed)


_masked: list[Any] = []  # the forking thread's signal mask before `_mask`


def _mask() -> None:
    """Before a fork, while hardy's SIGTERM handler is installed: SIGTERM blocked until the child
    has put the default action back (`_forked`). A SIGTERM that comes between the fork and that
    moment would otherwise be lost: Python drops the signals pending in a fork child, and a
    multiprocessing pool's `terminate()` then waits forever on a worker that never got it."""
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        _masked.append(signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}))


def _unmask() -> None:
    if _masked:
        signal.pthread_sigmask(signal.SIG_SETMASK, _masked.pop())


def _watch_sigterm() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    _stop_everything(wait=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # end as SIGTERM would have: same exit status


atexit.register(_stop_everything)
os.register_at_fork(before=_mask, after_in_parent=_unmask, after_in_child=_forked)

"""The fork server process: imports `preload` once, then forks one worker per request.

Started clean by fork+exec (`launch.ForkServer`), so no CUDA context, OpenMP pool or lock of the
user's process is ever inherited. Its standard input is one end of a socket pair whose other end
only the parent process holds: it reads its configuration there, then its requests, and
end-of-file means the parent has closed it or died. Either way it kills every worker's process
group and exits, so nothing outlives the user's process. It never waits on a child that is still
running, so closing it cannot hang. It keeps no file: what it tells the parent goes on each
request's own socket (a worker's pid and exit) or in a memfd the parent gave it (the module it
imports), so a server killed at any moment leaves nothing on disk to sweep.

Who may ask for a worker: only a holder of that socket pair, which has no name anywhere (no path,
no abstract address) and which the parent lets go of in its fork children and the server closes
in its workers. There is nothing to connect to, so nothing to authenticate: another process, of
this user or another, cannot reach the server at all.

Each request is one message carrying two descriptors (SCM_RIGHTS): the worker's end of a socket
pair to the parent, and the end of a second pair on which the server replies ("pid", pid), later
("exit", code).
"""

from __future__ import annotations

import gc
import os
import pickle
import selectors
import signal
import socket
import sys
import traceback
from typing import Any

from ..crash.handler import prepare as prepare_native_handler
from ..safety.environment import cap_loaded_runtimes
from ..shipping import transport
from .lifeline import become_subreaper, die_with_parent, end_descendants, kill_group

CONFIG_MAX = 1 << 20  # bytes: the configuration's message (a few hundred, with a long preload list a few thousand)
IDLE_IMPORT = 0.05  # seconds without a request after which the server imports the pipeline API (`_import_api`)


def serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    serving = [True]

    def leave(*_: Any) -> None:
        """SIGTERM (the parent's death signal, sent as its end closes): leave through the clean-up
        below, once. Raised inside that clean-up, it would cut it short and leave workers running."""
        if serving[0]:
            serving[0] = False
            sys.exit(0)

    signal.signal(signal.SIGTERM, leave)
    children: dict[int, transport.Channel] = {}
    try:
        parent = socket.socket(fileno=0)
        config = pickle.loads(parent.recv(CONFIG_MAX))  # end of file (b""): the parent died before sending it
        if config["pdeathsig"] and not die_with_parent(config["parent"], signal.SIGTERM):
            return  # the parent died while we started
        become_subreaper()  # a dead worker's processes come here, to be ended (`_reap_one`)
        failure = _preload(["hardy.workers.worker"], config["note"], serving)
        if not failure and config["preload"]:  # the user's modules, found as the parent finds them (a script's
            sys.path[:] = config["sys_path"]  # `sys.path.insert` included), as a worker does once set up
            failure = _preload(config["preload"], config["note"], serving)
        os.close(config["note"])  # (not a worker's)
        prepare_native_handler()  # built and loaded once here: workers fork with it (handler.py)
        _settle(failure)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        sel = selectors.DefaultSelector()
        sel.register(0, selectors.EVENT_READ, "parent")
        sel.register(wake_r, selectors.EVENT_READ, "child")
        closing = [wake_r, wake_w]  # (and 0, the requests' socket: /dev/null takes its place, `_become_worker`)
        idle: float | None = IDLE_IMPORT
        while True:
            ready = sel.select(idle)
            if not ready:  # idle since the first workers were asked for: what they may need later
                _import_api(failure)
                idle = None
            for key, _ in ready:
                if key.data == "child":
                    os.read(wake_r, 4096)
                    _reap(children)
                elif not _answer(parent, config, failure, children, closing):
                    serving[0] = False  # a SIGTERM from here on finds the clean-up under way
                    return  # end of file: the parent closed us or died
    finally:
        serving[0] = False
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the parent's death signal must not cut this short
        for pid in children:
            kill_group(pid)
        for pid in list(children):
            _reap_one(pid, children)
        end_descendants(os.getpid())  # what the last workers' nodes started, in sessions of their own
        os._exit(0)


def _preload(modules: list[str], note: int, serving: list[bool]) -> str | None:
    """Import the preload modules; the error text if one fails (reported to every request). The
    module being imported is named in the note, for the parent to name one whose import blocks
    (`launch.ForkServer._importing`)."""
    import importlib
    for name in modules:
        _say(note, name)
        try:
            importlib.import_module(name)
        except BaseException as exc:
            if not serving[0]:  # the SystemExit of `leave`: the parent's SIGTERM
                raise
            return (f"preload module {name!r} failed to import in the fork server ({type(exc).__name__}: "
                    f"{exc}); fix or install it, or leave it out of preload=. Its traceback:\n"
                    + "".join(traceback.format_exc().splitlines(keepends=True)[-12:]))
    _say(note, "")
    return None


def _say(note: int, module: str) -> None:
    """Name the module being imported ("": done) in the note, rewritten in place: the parent
    reads it only when the server is slow to answer, and finds the current name however many
    modules came before (up to its first newline: a longer name's end may follow). Only a help:
    a note that cannot be written (memory short) costs the name, not the import."""
    try:
        os.pwrite(note, (module + "\n").encode(errors="replace"), 0)
    except OSError:
        pass


def _settle(failure: str | None) -> None:
    """What every worker would otherwise do first, done once here: the thread caps applied to the
    runtimes `preload` loaded (`cap_loaded_runtimes`: a comparison in each worker then), and every
    object this process holds frozen (`gc.freeze`), so that no collection in a worker walks them:
    a walk would write to every page that holds one (copying the server's heap into each worker,
    torch's included) and cost each worker's first full collection as much as the server's heap."""
    if failure is None:
        cap_loaded_runtimes()
    gc.freeze()
    gc.enable()  # (paused since the server's start: `launch.SERVER_BOOT`)


def _import_api(failure: str | None) -> None:
    """hardy's pipeline API, imported once the first workers have forked without it (a first map
    waits for nothing it does not use): a user's module that a worker loads imports it (`from hardy
    import node`), in each worker forked before this. With it, what its calls run (the executors,
    the results sink, streaming), which a script's import leaves to its first call: a pipeline
    nested in a node would otherwise load them inside the node's timed call, once per worker.
    Frozen as the preload is (`_settle`)."""
    if failure is not None:
        return
    import importlib
    try:
        import hardy
        hardy.Pipeline  # noqa: B018  # (its first use loads the API: hardy/__init__.py)
        importlib.import_module("hardy.engine.streaming")  # (by name, as `_preload`: a module above this one)
    except Exception:  # a worker that needs it says why
        return
    gc.freeze()


def _answer(parent: socket.socket, config: dict[str, Any], failure: str | None,
            children: dict[int, transport.Channel], closing: list[int]) -> bool:
    """One request: fork a worker on the descriptors it brings. False at end of file (the parent is gone)."""
    try:
        said, fds, _, _ = socket.recv_fds(parent, 1, 2, socket.MSG_CMSG_CLOEXEC)
    except OSError:
        return False
    if not said and not fds:
        return False
    if len(fds) != 2:  # (the parent never sends one without its two ends)
        for fd in fds:
            os.close(fd)
        return True
    fd, status = fds
    conn = transport.Channel(status)
    if failure:
        return _refuse(conn, fd, ("error", failure))
    # SIGTERM held while it forks: delivered inside the fork's own hooks (logging's), `leave`'s exit
    # would be swallowed there, and the server would stay; it comes right after instead
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        pid = os.fork()
    except OSError as exc:  # out of processes (EAGAIN: `ulimit -u`, a pids limit) or memory: said, and it serves on
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return _refuse(conn, fd, ("unforked", (exc.errno, str(exc))))
    if pid == 0:
        try:
            _become_worker(fd, config, closing + [conn.fileno()] + [c.fileno() for c in children.values()], mask)
        finally:
            os._exit(1)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(fd)
    children[pid] = conn
    try:
        conn.send_bytes(pickle.dumps(("pid", pid)))
    except OSError:
        pass
    return True


def _refuse(conn: transport.Channel, fd: int, said: tuple[str, Any]) -> bool:
    """Tell the parent why its request gets no worker, on the request's own socket; True: the
    server serves on."""
    try:
        conn.send_bytes(pickle.dumps(said))
    except OSError:  # the parent closed its end: nothing to tell
        pass
    conn.close()
    os.close(fd)
    return True


def _become_worker(fd: int, config: dict[str, Any], closing: list[int], mask: set[int | signal.Signals]) -> None:
    server = os.getppid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (SIGTERM, held as the server forked)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for other in closing:
        try:
            os.close(other)
        except OSError:
            pass
    # its standard input: /dev/null, not the server's (the requests' socket), nor left closed, where
    # the first descriptor it receives (its status words) would take its number
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.setsid()  # its own process group: whatever its nodes start goes with it
    if not die_with_parent(server):
        os._exit(1)
    if config["spawn"]:  # a fresh interpreter per worker: nothing of the server is inherited
        os.set_inheritable(fd, True)
        os.execv(sys.executable, [sys.executable, "-c", config["boot"] % f"run({fd})"])
    from .worker import run
    run(fd)


def _reap(children: dict[int, transport.Channel]) -> None:
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        _reap_one(info.si_pid, children)


def _reap_one(pid: int, children: dict[int, transport.Channel]) -> None:
    """Kill what is left of the worker's group while its pid still names it, then collect it, and
    end the processes its nodes started that left its group (a subreaper, this server adopted
    them as the worker ended: any child of ours that is not a live worker). Orphans come here too
    as they exit, and are collected the same way."""
    kill_group(pid)
    try:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        code = None
    conn = children.pop(pid, None)
    if conn is not None:
        end_descendants(os.getpid(), spare=frozenset(children))
        try:
            conn.send_bytes(pickle.dumps(("exit", code)))
        except OSError:
            pass
        conn.close()

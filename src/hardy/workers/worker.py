"""The worker process: receive a plan once, run chunks of items, report each result.

Kept import-light because it is imported in the fork server: each worker forks from there already
holding this module (and whatever `preload` named), so it starts in milliseconds. Results travel
pickled one item at a time inside each batch, so a result that cannot be pickled here, or unpickled
in the parent, fails its own item and nothing else.
"""

from __future__ import annotations

import ctypes
import faulthandler
import mmap
import os
import pickle
import signal
import sys
import time
from typing import Any, Callable

from multiprocessing.connection import Connection

from ..errors import NodeError
from ..plan import Plan
from ..shipping import build_plan, dumps, portable
from ..safety.environment import install_numba_guard
from .lifeline import kill_group, watch_peer

# Shared status words, written by the worker, read by the parent after a death or for deadlines.
ITEM, STEP, STEP_START, SLOTS = 0, 1, 2, 4
STATUS_SIZE = 8 * SLOTS
FLUSH_EVERY = 0.005  # seconds: fast items are batched, slow items are reported one by one


def open_status(path: str) -> tuple[mmap.mmap, Any]:
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), STATUS_SIZE)
    return mm, (ctypes.c_int64 * SLOTS).from_buffer(mm)


def _marked(status: Any, k: int, func: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.monotonic_ns

    def call(*args: Any, **kwargs: Any) -> Any:
        status[STEP] = k
        status[STEP_START] = clock()
        return func(*args, **kwargs)
    return call


def run(fd: int) -> None:
    """A worker's life, however it was started: `fd` is its socket to the parent process.

    The first message says where its status words and faulthandler file are, its environment,
    and the parent's sys.path and working directory: the worker imports the user's modules as
    the parent does, but never re-runs the parent's `__main__`.
    """
    conn = Connection(fd)
    try:
        status_path, fault_path, env, preload_libs, sys_path, cwd = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        os._exit(0)
    watch_peer(fd, lambda: kill_group(os.getpgid(0)))  # the parent died: so do we and our children
    os.environ.update(env)
    sys.path[:] = sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass
    fault_file = open(fault_path, "w")
    faulthandler.enable(file=fault_file, all_threads=True)
    # The parent sends SIGUSR1 before killing a hung or oversized worker: the stack of a loop in C too.
    faulthandler.register(signal.SIGUSR1, file=fault_file, all_threads=True)
    install_numba_guard()
    if preload_libs:  # seed 001: dependencies first, so each library finds what it needs
        from ..native.libs import preload
        preload(packages=[p for p in preload_libs if not os.path.isdir(p)],
                paths=[p for p in preload_libs if os.path.isdir(p)])
    _, status = open_status(status_path)
    status[ITEM] = -1
    status[STEP] = -1
    plans: dict[int, tuple[Plan, dict[str, str]] | str] = {}
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:
                break
            if msg[0] == "plan":
                plans[msg[1]] = _load_plan(msg[2], status)
            elif msg[0] == "chunk":
                _run_chunk(conn, plans[msg[1]], msg[2], status)
            else:
                break
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave without running atexit handlers or native destructors: a library that crashes
        # while tearing down (seed 000) cannot take results with it, they were sent already.
        os._exit(0)


def _load_plan(spec: bytes, status: Any) -> tuple[Plan, dict[str, str]] | str:
    """The plan and which node produces each output; or why it cannot be loaded here."""
    try:
        plan = build_plan(spec, wrap=lambda k, n: _marked(status, k, n.func))
    except Exception as exc:
        return (f"the pipeline could not be loaded in the worker process ({type(exc).__name__}: {exc}); "
                "its nodes must come from the script or a module importable from the parent's sys.path "
                "(a module loaded from elsewhere can be sent by value with "
                "cloudpickle.register_pickle_by_value)")
    return plan, {o: s.node.name for s in plan.steps for o in s.node.outputs}


def _run_chunk(conn: Any, loaded: tuple[Plan, dict[str, str]] | str,
               items: list[tuple[int, dict[str, Any]]], status: Any) -> None:
    start = last = time.monotonic()
    batch: list[tuple[int, bool, bytes]] = []
    if isinstance(loaded, str):
        batch = [(i, False, dumps(NodeError("<pipeline>", None, i, loaded))) for i, _ in items]
        items = []
    else:
        plan, producers = loaded
    for i, item in items:
        status[STEP] = -1
        status[ITEM] = i
        try:
            batch.append(_pack(producers, i, plan.run(item, i)))
        except NodeError as err:
            batch.append((i, False, dumps(portable(err))))
        status[ITEM] = -1
        now = time.monotonic()
        if now - last >= FLUSH_EVERY:
            _send(conn, batch, False, 0.0)
            batch = []
            last = now
    _send(conn, batch, True, time.monotonic() - start)


def _pack(producers: dict[str, str], i: int, out: dict[str, Any]) -> tuple[int, bool, bytes]:
    """One item's outputs, pickled on their own: one that cannot travel fails only its item."""
    try:
        return i, True, dumps(out)
    except Exception:
        for name, value in out.items():
            try:
                dumps(value)
            except Exception as exc:
                err = NodeError(producers.get(name, name), None, i,
                                f"its output {name!r} ({type(value).__module__}.{type(value).__qualname__}) "
                                f"cannot be pickled back to the parent process ({type(exc).__name__}: {exc}); "
                                "return plain data (numbers, arrays, dicts, paths) or make the type picklable")
                return i, False, dumps(err)
        raise


def _send(conn: Any, batch: list[tuple[int, bool, bytes]], done: bool, elapsed: float) -> None:
    conn.send_bytes(pickle.dumps(("results", batch, done, elapsed), protocol=5))

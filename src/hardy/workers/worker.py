"""The worker process: receive a plan once, run chunks of items, report each result.

Kept import-light because it is imported in the fork server: each worker forks from there already
holding this module (and whatever `preload` named), so it starts in milliseconds.
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

from ..errors import NodeError
from ..plan import Plan
from ..shipping import build_plan, dumps, portable
from ..safety.environment import install_numba_guard

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


def main(conn: Any, status_path: str, fault_path: str, env: dict[str, str],
         preload_libs: tuple[str, ...] = ()) -> None:
    os.environ.update(env)
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
    plans: dict[int, Plan] = {}
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:
                break
            if msg[0] == "plan":
                plans[msg[1]] = build_plan(msg[2], wrap=lambda k, n: _marked(status, k, n.func))
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


def _run_chunk(conn: Any, plan: Plan, items: list[tuple[int, dict[str, Any]]], status: Any) -> None:
    run = plan.run
    start = last = time.monotonic()
    batch: list[tuple[int, bool, Any]] = []
    for i, item in items:
        status[STEP] = -1
        status[ITEM] = i
        try:
            batch.append((i, True, run(item, i)))
        except NodeError as err:
            batch.append((i, False, portable(err)))
        status[ITEM] = -1
        now = time.monotonic()
        if now - last >= FLUSH_EVERY:
            _send(conn, batch, False, 0.0)
            batch = []
            last = now
    if plan.cache is not None:
        plan.cache.report()  # the cache faults of this batch, in one warning
    _send(conn, batch, True, time.monotonic() - start)


def _send(conn: Any, batch: list[tuple[int, bool, Any]], done: bool, elapsed: float) -> None:
    try:
        data = dumps(("results", batch, done, elapsed))
    except Exception:  # one unpicklable output must not cost the others
        fixed = []
        for i, ok, value in batch:
            try:
                dumps(value)
                fixed.append((i, ok, value))
            except Exception as exc:
                err = NodeError("<output>", None, i, f"the result could not be pickled back to the parent: "
                                f"{type(exc).__name__}: {exc}")
                fixed.append((i, False, err))
        data = dumps(("results", fixed, done, elapsed))
    conn.send_bytes(data)

"""The parent side of the worker processes: dispatch chunks, watch for deaths, classify, replace.

See the data-flow picture in `hardy/workers/__init__.py`. The scheduling loop runs in the calling
thread, waiting on every busy worker's pipe *and* its process sentinel, so a death is noticed the
moment it happens (no heartbeat, no polling of exit codes). Per-node deadlines and memory limits
are checked on the same loop, every `TICK` seconds while a limited node is in flight.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable, Sequence

from ..engine.core import Results
from ..errors import NodeCrashed, NodeDefinitionError, NodeTimeout, WorkerStartError
from ..graph import Graph
from ..node import Node
from ..observe.progress import MapProgress
from ..plan import Plan
from ..safety.environment import worker_environment
from ..shipping import ship_items, ship_plan
from ..sizes import parse_size
from ..safety.hazards import choose_start_method
from . import worker as worker_main
from ..crash import describe_exit, read_stack

log = logging.getLogger("hardy.workers")

TICK = 0.05            # seconds between deadline / memory checks while limits apply
CHUNK_TARGET = 0.05    # seconds of work per chunk, once the per-item time is known
STACK_GRACE = 0.2      # seconds a hung worker gets to write its stack before SIGKILL
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_forkserver_lock = threading.Lock()
_forkserver_preload: tuple[str, ...] | None = None


def rss(pid: int) -> int:
    """Resident memory of a process in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        try:
            import psutil
            return psutil.Process(pid).memory_info().rss
        except Exception:
            return 0


class _Worker:
    """One worker process, its pipe, its status words and its faulthandler file."""

    def __init__(self, ctx: Any, folder: str, number: int, env: dict[str, str], preload_libs: tuple[str, ...]):
        self.number = number
        self.status_path = os.path.join(folder, f"status-{number}")
        self.fault_path = os.path.join(folder, f"fault-{number}.txt")
        with open(self.status_path, "wb") as f:
            f.write(b"\xff" * worker_main.STATUS_SIZE)  # -1 in every slot
        self._mm, self.status = worker_main.open_status(self.status_path)
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main.main, name=f"hardy-worker-{number}", daemon=True,
                                   args=(child, self.status_path, self.fault_path, env, preload_libs))
        self.process.start()
        child.close()
        self.plans: set[int] = set()
        self.plan: Plan | None = None
        self.unsent: dict[int, None] = {}   # items of the current chunk with no result yet, in order
        self.tasks = 0
        self.started_any = False
        self.chunk_size = 0
        self.killed_for: str | None = None  # "timeout" / "memory" when the parent killed it
        self.kill_detail = ""

    @property
    def busy(self) -> bool:
        return bool(self.unsent) or self.plan is not None

    def send(self, data: bytes) -> None:
        self.conn.send_bytes(data)

    def kill(self, reason: str, detail: str) -> None:
        """Ask faulthandler for the stack (works inside C loops too), then SIGKILL."""
        self.killed_for, self.kill_detail = reason, detail
        pid = self.process.pid
        try:
            os.kill(pid, signal.SIGUSR1)
            deadline = time.monotonic() + STACK_GRACE
            while time.monotonic() < deadline and os.path.getsize(self.fault_path) == 0:
                time.sleep(0.005)
            time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass

    def stop(self, timeout: float = 2.0) -> None:
        try:
            self.send(pickle.dumps(("stop",)))
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1)
        self.close_files()

    def close_files(self) -> None:
        self.conn.close()
        del self.status
        self._mm.close()
        for p in (self.status_path, self.fault_path):
            try:
                os.unlink(p)
            except OSError:
                pass


class WorkerPool:
    """Long-lived worker processes that run chunks of map items and single isolated node calls.

    It is the "process" map executor and the runner of `@node(isolate=True)`. One lock serialises
    use, so threads sharing an engine take turns (each turn still uses every worker).
    """

    mode = "sequential"

    def __init__(self, workers: int | None = None, start_method: str | None = None,
                 preload: Sequence[str] = (), preload_libs: Sequence[str] = (),
                 max_tasks_per_worker: int | None = None,
                 max_memory_per_worker: int | str | None = None, slot_env: Sequence[dict[str, str]] = ()):
        """`slot_env`: variables for each worker on top of the worker environment, one dict per
        worker (GPU workers: their CUDA_VISIBLE_DEVICES); it then sets the number of workers."""
        self.slot_env = list(slot_env)
        self.size = len(self.slot_env) or workers or os.cpu_count() or 1
        self.start_method = choose_start_method(start_method)
        self.preload = tuple(preload)
        self.preload_libs = tuple(preload_libs)
        self.max_tasks = max_tasks_per_worker
        self.max_memory = parse_size(max_memory_per_worker)
        if self.max_tasks is not None and self.max_tasks < 1:
            raise NodeDefinitionError("max_tasks_per_worker must be at least 1")
        self.env = worker_environment(self.size)
        self._ctx = mp.get_context(self.start_method)
        self._folder = tempfile.mkdtemp(prefix="hardy-workers-")
        self._workers: list[_Worker | None] = [None] * self.size
        self._started = 0
        self._lock = threading.RLock()
        self._plan_ids: weakref.WeakKeyDictionary[Plan, tuple[int, bytes]] = weakref.WeakKeyDictionary()
        self._next_plan = 0
        self._node_plans: dict[tuple[int, tuple[str, ...]], Plan] = {}
        self._per_item: dict[int, float] = {}
        self.replaced = 0
        self.start_failures = 0
        atexit.register(_close_at_exit, weakref.ref(self))

    # --- workers ---------------------------------------------------------------------------------

    def _start_worker(self, slot: int) -> _Worker:
        if self.start_method == "forkserver":
            _ensure_forkserver(self._ctx, ("hardy.workers.worker", *self.preload), self.env)
        self._started += 1
        env = {**self.env, **self.slot_env[slot]} if self.slot_env else self.env
        w = _Worker(self._ctx, self._folder, self._started, env, self.preload_libs)
        self._workers[slot] = w
        return w

    def start(self) -> None:
        """Start every worker now (otherwise they start on first use)."""
        with self._lock:
            for k in range(self.size):
                if self._workers[k] is None:
                    self._start_worker(k)

    def _replace(self, slot: int, stop: bool) -> None:
        w = self._workers[slot]
        if w is not None:
            if stop:
                w.stop()
            else:
                w.process.join(1)
                w.close_files()
        self._workers[slot] = None
        self.replaced += 1

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w is not None and w.process.pid]

    # --- shipping plans and items ----------------------------------------------------------------

    def _ship(self, plan: Plan) -> tuple[int, bytes]:
        shipped = self._plan_ids.get(plan)
        if shipped is None:
            spec = ship_plan(plan)
            self._next_plan += 1
            shipped = (self._next_plan, pickle.dumps(("plan", self._next_plan, spec), protocol=5))
            self._plan_ids[plan] = shipped
        return shipped

    def _chunk_bytes(self, plan_id: int, items: Sequence[dict[str, Any]], chunk: list[int]) -> bytes:
        return ship_items(items, chunk, lambda pairs: ("chunk", plan_id, pairs))

    # --- the map executor ------------------------------------------------------------------------

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: Any) -> None:
        with self._lock:
            _Run(self, plan, items, results).loop()

    def isolated(self, node: Node) -> Callable[..., Any]:
        """`node` as a function whose every call runs in a worker (for @node(isolate=True))."""
        outputs = node.outputs

        def call(*args: Any, **kwargs: Any) -> Any:
            item = dict(zip(node.inputs, args))
            item.update(kwargs)
            with self._lock:
                key = (id(node), tuple(item))
                plan = self._node_plans.get(key)
                if plan is None:
                    plan = self._node_plans[key] = Plan(Graph([node]), tuple(item), outputs)
                results = Results(1, "raise", MapProgress(1, node.name, False))
                _Run(self, plan, [item], results).loop()
            if results.failures:
                err = results.failures[0]
                err.item = None
                raise err
            out = results.values[0]
            return out[outputs[0]] if len(outputs) == 1 else tuple(out[o] for o in outputs)

        if node.is_async:
            import asyncio

            async def acall(*args: Any, **kwargs: Any) -> Any:
                return await asyncio.to_thread(call, *args, **kwargs)
            return acall
        return call

    def close(self) -> None:
        with self._lock:
            for k, w in enumerate(self._workers):
                if w is not None:
                    w.stop()
                    self._workers[k] = None
            try:
                os.rmdir(self._folder)
            except OSError:
                pass


class _Run:
    """One map (or one isolated call) through the pool: the scheduling loop and its bookkeeping."""

    def __init__(self, pool: WorkerPool, plan: Plan, items: Sequence[dict[str, Any]], results: Any):
        self.pool, self.plan, self.items, self.results = pool, plan, items, results
        self.plan_id, self.plan_msg = pool._ship(plan)
        self.next_fresh = 0
        self.retry: deque[list[int]] = deque()
        self.attempts: dict[int, int] = {}
        self.per_item = pool._per_item.get(self.plan_id)
        self.limited = pool.max_memory is not None or any(s.node.timeout for s in plan.steps)
        if items:  # fail before any worker starts if the first item cannot travel
            pool._chunk_bytes(self.plan_id, items, [0])

    def next_chunk(self, w: _Worker) -> list[int] | None:
        if self.retry:
            return self.retry.popleft()
        remaining = len(self.items) - self.next_fresh
        if remaining <= 0:
            return None
        if self.per_item is None:
            size = 1 if len(self.items) < 64 else 4  # probe: learn the per-item time first
        else:
            size = int(CHUNK_TARGET / max(self.per_item, 1e-7))
        size = max(1, min(size, -(-remaining // (2 * self.pool.size))))
        if self.pool.max_tasks:
            size = max(1, min(size, self.pool.max_tasks - w.tasks))
        chunk = list(range(self.next_fresh, self.next_fresh + size))
        self.next_fresh += size
        return chunk

    def assign(self) -> None:
        pool = self.pool
        for slot in range(pool.size):
            if self.results.stop:
                return
            w = pool._workers[slot]
            if w is not None and w.busy:
                continue
            if not self.retry and self.next_fresh >= len(self.items):
                return
            if w is not None and not w.process.is_alive():
                log.warning("worker %d died while idle (%s); replacing it", w.number,
                            describe_exit(w.process.exitcode)[1])
                pool._replace(slot, stop=False)
                w = None
            if w is None:
                w = pool._start_worker(slot)
            chunk = self.next_chunk(w)
            if not chunk:
                return
            data = pool._chunk_bytes(self.plan_id, self.items, chunk)
            w.plan = self.plan
            w.unsent = dict.fromkeys(chunk)
            w.chunk_size = len(chunk)
            for i in chunk:
                self.results.started(i)
            try:
                if self.plan_id not in w.plans:
                    w.send(self.plan_msg)
                    w.plans.add(self.plan_id)
                w.send(data)
            except OSError:  # it died just now: its chunk goes back to the queue
                self.on_death(w)

    def loop(self) -> None:
        pool = self.pool
        try:
            while True:
                self.assign()
                busy = [w for w in pool._workers if w is not None and w.busy]
                if not busy:
                    return
                waitables: dict[Any, _Worker] = {}
                for w in busy:
                    waitables[w.conn] = w
                    waitables[w.process.sentinel] = w
                ready = wait(list(waitables), timeout=TICK if self.limited else None)
                dead = []
                for obj in ready:
                    w = waitables[obj]
                    if obj is w.conn:
                        if not self.receive(w):
                            dead.append(w)
                    elif w not in dead:
                        dead.append(w)
                for w in dict.fromkeys(dead):
                    self.on_death(w)
                if self.limited:
                    self.check_limits(busy)
        except BaseException:
            # Interrupted (Ctrl-C, a PicklingError): workers still busy would answer into the next
            # map, so they are replaced.
            for slot, w in enumerate(pool._workers):
                if w is not None and w.busy:
                    w.process.kill()
                    pool._replace(slot, stop=False)
            raise

    def receive(self, w: _Worker) -> bool:
        """Take everything the worker sent; False if its pipe is closed (it died)."""
        try:
            while w.conn.poll():
                msg = pickle.loads(w.conn.recv_bytes())
                _, batch, done, elapsed = msg
                w.started_any = True
                self.pool.start_failures = 0
                for i, ok, value in batch:
                    w.unsent.pop(i, None)
                    if ok:
                        self.results.ok(i, value)
                    else:
                        self.results.fail(i, value)
                if done:
                    self.chunk_done(w, elapsed)
        except (EOFError, OSError):
            return False
        return True

    def chunk_done(self, w: _Worker, elapsed: float) -> None:
        size = w.chunk_size
        w.plan = None
        w.unsent = {}
        w.tasks += size
        if elapsed > 0:  # learn the per-item time: it sizes the next chunks toward CHUNK_TARGET
            sample = elapsed / size
            self.per_item = sample if self.per_item is None else 0.5 * (self.per_item + sample)
            self.pool._per_item[self.plan_id] = self.per_item
        pool = self.pool
        slot = pool._workers.index(w)
        if pool.max_tasks and w.tasks >= pool.max_tasks:
            pool._replace(slot, stop=True)
        elif pool.max_memory and rss(w.process.pid) > pool.max_memory:
            pool._replace(slot, stop=True)

    def check_limits(self, busy: list[_Worker]) -> None:
        now = time.monotonic_ns()
        for w in busy:
            if not w.busy or not w.process.is_alive():
                continue
            item, step = w.status[worker_main.ITEM], w.status[worker_main.STEP]
            if item >= 0 and 0 <= step < len(self.plan.steps):
                timeout = self.plan.steps[step].node.timeout
                started = w.status[worker_main.STEP_START]
                if timeout and (now - started) / 1e9 > timeout:
                    w.kill("timeout", f"node ran past its timeout of {timeout:g} s")
                    self.on_death(w)
                    continue
            limit = self.pool.max_memory
            if limit is not None:
                used = rss(w.process.pid)
                if used > limit:
                    w.kill("memory", f"worker memory {used / 2**20:.0f} MiB passed max_memory_per_worker "
                                     f"({limit / 2**20:.0f} MiB)")
                    self.on_death(w)

    def on_death(self, w: _Worker) -> None:
        pool = self.pool
        slot = pool._workers.index(w) if w in pool._workers else None
        if slot is None:
            return
        self.receive(w)  # results it sent before dying are kept
        w.process.join(1)
        signame, text = describe_exit(w.process.exitcode)
        if w.killed_for:
            signame, text = "SIGKILL", w.kill_detail
        item, step = w.status[worker_main.ITEM], w.status[worker_main.STEP]
        in_flight = item if item in w.unsent else None
        if in_flight is not None:
            del w.unsent[in_flight]
            steps = self.plan.steps
            node = steps[step].node if 0 <= step < len(steps) else (steps[0].node if len(steps) == 1 else None)
            stack = read_stack(w.fault_path)
            retries = node.retries if node else 0
            self.attempts[in_flight] = self.attempts.get(in_flight, 0) + 1
            if self.attempts[in_flight] <= retries:
                log.warning("item %d: %s; retrying (%d of %d)", in_flight, text, self.attempts[in_flight], retries)
                self.retry.appendleft([in_flight])
            else:
                cls = NodeTimeout if w.killed_for == "timeout" else NodeCrashed
                err = cls(node.name if node else "?", in_flight, text, signal=signame,
                          exitcode=w.process.exitcode, stack=stack)
                self.results.fail(in_flight, err)
        elif w.tasks == 0 and not w.started_any:
            pool.start_failures += 1
            if pool.start_failures >= 3:  # dies before running anything: retrying would loop forever
                pool._replace(slot, stop=False)
                raise WorkerStartError(
                    f"worker processes die before running anything ({text}; 3 in a row). A module in "
                    f"preload=, a library in preload_libs= or the worker environment fails to load: see the "
                    f"worker's error above. {read_stack(w.fault_path)}".strip())
        else:
            log.warning("a worker died with no item in flight (%s); its results were already kept", text)
        if w.unsent:  # innocent items whose results had not been sent yet: run them again
            self.retry.append(list(w.unsent))
        w.unsent = {}
        w.plan = None
        pool._replace(slot, stop=False)


def _ensure_forkserver(ctx: Any, preload: tuple[str, ...], env: dict[str, str]) -> None:
    """Start (or restart, when the preload list changes) the fork server with the worker env.

    The fork server is started with fork+exec, so it is clean even when this process has CUDA or
    an OpenMP pool. Modules it preloads are imported there once; every worker forks from it.
    Thread caps are put in its environment so preloaded native libraries read them at load time.
    """
    global _forkserver_preload
    from multiprocessing import forkserver
    with _forkserver_lock:
        if _forkserver_preload == preload and forkserver._forkserver._forkserver_pid is not None:
            return
        if forkserver._forkserver._forkserver_pid is not None:
            forkserver._forkserver._stop()
        ctx.set_forkserver_preload(list(preload))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _forkserver_preload = preload


def _close_at_exit(ref: "weakref.ref[WorkerPool]") -> None:
    pool = ref()
    if pool is not None:
        pool.close()

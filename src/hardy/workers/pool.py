"""The parent side of the worker processes: dispatch chunks, watch for deaths, classify, replace.

See the data-flow picture in `hardy/workers/__init__.py`. The scheduling loop runs in the calling
thread, waiting on every busy worker's pipe *and* its process sentinel, so a death is noticed the
moment it happens (no heartbeat, no polling of exit codes). Per-node deadlines and memory limits
are checked on the same loop, every `TICK` seconds while a limited node is in flight.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from .. import transport
from ..batching import batched
from ..crash import describe_exit, read_nesting, read_stack
from ..errors import (
    GpuOutOfMemory,
    InvalidArgument,
    NodeCrashed,
    NodeError,
    NodeTimeout,
    ShippingError,
    WorkerStartError,
)
from ..forensics.frames import examine
from ..forensics.stacks import hang_stacks
from ..plan import KEYS, Plan
from ..policy import delay
from ..safety.environment import worker_environment
from ..safety.hazards import choose_start_method
from ..shipping import (
    Pickled,
    Unshippable,
    check_constants,
    described,
    dumps,
    globals_in,
    item_error,
    readers,
    seal,
    ship_items,
    ship_plan,
)
from ..sizes import parse_size
from . import launch
from . import worker as worker_main

if TYPE_CHECKING:
    from ..observe.nodelog import Records

log = logging.getLogger("hardy.workers")

TICK = 0.05            # seconds between deadline / memory checks while limits apply
CHUNK_TARGET = 0.05    # seconds of work per chunk, once the per-item time is known
STOP_POLL = 0.1       # seconds: how soon a run another thread stops (`results.stop`) notices
MAX_NESTED_CRASHES = 100  # inner items of one nested map that may crash workers before its outer item fails
STACK_GRACE = 0.2      # seconds a hung worker gets to write its stack before SIGKILL
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


COUNTED = ("started", "died", "recycled")  # what happens to worker processes, as run reports count it


def add_counts(total: dict[str, Any], more: dict[str, Any]) -> None:
    """`more` (as `WorkerPool.counts` gives them) into `total`: counts summed, peaks updated."""
    for k in COUNTED:
        total[k] += more[k]
    total["peak_rss"].update(more["peak_rss"])


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


class _Worker:
    """One worker process, its pipe, its status words and its faulthandler file.

    The status words and the faulthandler file are memfds passed to the worker with its first
    message: files with no name, gone with the last process holding them, so that no death of
    either side (a SIGKILL of this process included) can leave one behind."""

    def __init__(self, launcher: launch.Launcher, number: int, env: dict[str, str],
                 preload_libs: tuple[str, ...]):
        self.number = number
        self._fds = [os.memfd_create("worker-status", os.MFD_CLOEXEC), os.memfd_create("worker-fault", os.MFD_CLOEXEC)]
        os.write(self._fds[0], array("d", [-1.0] * worker_main.SLOTS).tobytes())
        self.fault_path = f"/proc/self/fd/{self._fds[1]}"  # read by path, here, after a death
        self._mm, self.status = worker_main.open_status(self._fds[0])
        try:
            self.process, self.conn = launcher.start_worker()
        except BaseException:  # (a preload that fails or blocks): nothing of it stays open
            del self.status
            self._mm.close()
            for fd in self._fds:
                os.close(fd)
            raise
        # this process's environment now (a fork server's dates from its start), with the caps
        level = {"HARDY_LOG_LEVEL": str(logging.getLogger().getEffectiveLevel())}  # records workers forward
        transport.send(self.conn, b"", transport.Packed(
            pickle.dumps(({**os.environ, **env, **level}, preload_libs, list(sys.path), os.getcwd(), list(sys.argv))),
            self._fds))
        self.plans: set[int] = set()
        self.plan: Plan | None = None
        self.unsent: dict[int, None] = {}   # items of the current chunk with no result yet, in order
        self.tasks = 0
        self.started_any = False
        self.chunk_size = 0
        self.group = 0  # items per batched call in its chunk
        self.resend = False  # a batch of its results could not be unpickled here
        self.killed_for: str | None = None  # "timeout" / "memory" when the parent killed it
        self.kill_detail = ""
        self.hang: tuple[str, str] = ("", "")  # py-spy's stacks before a kill for a timeout, or why none

    @property
    def busy(self) -> bool:
        return bool(self.unsent) or self.plan is not None

    def send(self, data: bytes | transport.Packed) -> None:
        transport.send(self.conn, b"", data if isinstance(data, transport.Packed) else transport.Packed(data))

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
        self.process.close()
        del self.status
        self._mm.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class WorkerPool:
    """Long-lived worker processes that run chunks of map items and single isolated node calls.

    It is the "process" map executor and the runner of `@node(isolate=True)`. Maps and isolated
    calls from several threads share it: each claims the idle workers it has work for and hands
    them back as soon as it has none, so N threads each calling an isolated node use N workers.
    """

    mode = "sequential"
    enforces_timeouts = True  # a worker that runs past a node's timeout is killed

    def __init__(self, workers: int | None = None, start_method: str | None = None,
                 preload: Sequence[str] = (), preload_libs: Sequence[str] = (),
                 max_tasks_per_worker: int | None = None,
                 max_memory_per_worker: int | str | None = None, slot_env: Sequence[dict[str, str]] = (),
                 stall_report: float | None = None):
        """`slot_env`: variables for each worker on top of the worker environment, one dict per
        worker (GPU workers: their CUDA_VISIBLE_DEVICES); it then sets the number of workers."""
        self.slot_env = list(slot_env)
        self.size = len(self.slot_env) or workers or os.cpu_count() or 1
        self.start_method = choose_start_method(start_method)
        self.preload = tuple(preload)
        self.preload_libs = tuple(preload_libs)
        self.max_tasks = max_tasks_per_worker
        self.max_memory = parse_size(max_memory_per_worker)
        self.stall_report = stall_report  # seconds: a node call running longer has its stacks logged
        if self.max_tasks is not None and self.max_tasks < 1:
            raise InvalidArgument("max_tasks_per_worker must be at least 1")
        self.env = worker_environment(self.size)
        self._launcher: launch.Launcher | None = None
        self._workers: list[_Worker | None] = [None] * self.size
        self._owners: list[_Run | None] = [None] * self.size  # which map or call uses each worker
        self._started = 0
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._plan_ids: weakref.WeakKeyDictionary[Plan, tuple[int, bytes]] = weakref.WeakKeyDictionary()
        self._next_plan = 0
        self._per_item: dict[int, float] = {}
        self.replaced = 0
        self.recycled = 0  # of the replaced: stopped on purpose (max_tasks_per_worker, max_memory_per_worker)
        self.start_failures = 0
        atexit.register(_close_at_exit, weakref.ref(self))
        _pools.add(self)

    # --- workers ---------------------------------------------------------------------------------

    def _start_worker(self, slot: int) -> _Worker:
        with self._lock:
            if self._launcher is not None and not self._launcher.alive:  # its fork server died (killed from
                launch.release(self, self._launcher)                      # outside): a fresh one serves on
                self._launcher = None
            if self._launcher is None:
                self._launcher = launch.acquire(self, self.start_method, self.preload, self.env)
            self._started += 1
            number = self._started
        env = {**self.env, **self.slot_env[slot]} if self.slot_env else self.env
        w = _Worker(self._launcher, number, env, self.preload_libs)
        self._workers[slot] = w
        return w

    def start(self) -> None:
        """Start every worker now (otherwise they start on first use)."""
        for k in range(self.size):
            if self._workers[k] is None:
                self._start_worker(k)

    def _replace(self, slot: int, stop: bool) -> None:
        w = self._workers[slot]
        if w is not None:
            if stop:
                w.stop()
            else:
                w.process.kill()
                w.process.join(1)
                w.close_files()
        self._workers[slot] = None
        self.replaced += 1
        self.recycled += stop

    def counts(self, peaks: bool = True) -> dict[str, Any]:
        """For run reports: workers started, died, recycled; peak RSS of the live ones by pid
        (`peaks`: read from /proc, the only part that costs anything)."""
        return {"started": self._started, "died": self.replaced - self.recycled, "recycled": self.recycled,
                "peak_rss": {str(pid): peak_rss(pid) for pid in self.pids()} if peaks else {}}

    def _claim(self, run: _Run) -> list[int]:
        """The slots `run` may use now: those it holds, plus every free one while it has work."""
        with self._lock:
            for slot, owner in enumerate(self._owners):
                if owner is None and run.has_work():
                    self._owners[slot] = run
            return [slot for slot, owner in enumerate(self._owners) if owner is run]

    def _release(self, run: _Run, slots: Sequence[int]) -> None:
        with self._lock:
            for slot in slots:
                if self._owners[slot] is run:
                    self._owners[slot] = None
            self._freed.notify_all()

    def _wait_for_a_free_worker(self) -> None:
        with self._lock:
            if all(owner is not None for owner in self._owners):
                self._freed.wait(1.0)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w is not None and w.process.pid]

    # --- shipping plans and items ----------------------------------------------------------------

    def _ship(self, plan: Plan) -> tuple[int, bytes]:
        with self._lock:
            shipped = self._plan_ids.get(plan)
            if shipped is None:
                self._next_plan += 1
                plan_id = self._next_plan
        if shipped is None:
            shipped = (plan_id, pickle.dumps(("plan", plan_id, ship_plan(plan)), protocol=5))
            with self._lock:
                shipped = self._plan_ids.setdefault(plan, shipped)
        return shipped

    def _chunk(self, plan_id: int, items: Any, chunk: list[int], shared: transport.Shared, log: bool = False,
               sealed: int = 0, singly: bool = False,
               poison: dict[Any, Any] | None = None) -> tuple[transport.Packed | None, dict[int, Unshippable]]:
        """The chunk's message, less the items that cannot be pickled (returned apart, with why);
        `log`: the worker logs node events (observe/nodelog.py) because the parent listens;
        `shared`: the segments of the values every item of the map holds (written once);
        `sealed`: `items` are sealed (`shipping.seal`), to be opened one by one (2: and each result
        sent alone); `singly`: batched nodes are called for one item at a time (a batch that
        killed a worker, `_Run.split`); `poison`: nested items that crashed a worker before
        (`crash.poisoned_here`)."""
        packed: tuple[transport.Packed | None, dict[int, Unshippable]] = ship_items(
            items, chunk, lambda pairs: ("chunk", plan_id, pairs, log, sealed, singly, *([poison] if poison else [])),
            dump=lambda msg: transport.pack(msg, dumps, shared))
        return packed  # what `dump` returned, and the items left out

    # --- the map executor ------------------------------------------------------------------------

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: Any) -> None:
        _Run(self, plan, items, results).loop()

    def _forget(self) -> None:
        """In a fork child: the workers are the parent's (launch.py let go of their pipes); this
        process starts its own if it maps."""
        for w in self._workers:
            if w is not None:
                for fd in w._fds:
                    os.close(fd)
                w._fds = []
        self._workers = [None] * self.size
        self._owners = [None] * self.size
        self._launcher = None
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)

    def close(self) -> None:
        """Stop every worker (a map still running in another thread loses its workers), then
        give the fork server back: it stops once no other pool uses it."""
        with self._lock:
            workers = list(enumerate(self._workers))
            self._workers = [None] * self.size
            launcher, self._launcher = self._launcher, None
        for _, w in workers:
            if w is not None:
                w.stop()
        if launcher is not None:
            launch.release(self, launcher)


class _Run:
    """One map (or one isolated call) through the pool: the scheduling loop and its bookkeeping."""

    def __init__(self, pool: WorkerPool, plan: Plan, items: Sequence[Any], results: Any):
        self.pool, self.plan, self.items, self.results = pool, plan, items, results
        self.plan_id, self.plan_msg = pool._ship(plan)
        self.next_fresh = 0
        self.retry: deque[list[int]] = deque()
        self.due: dict[int, float] = {}  # item -> when its backoff delay (hardy.policy) ends
        self.attempts: dict[int, int] = {}
        self.sealed: dict[int, int] = {}  # items sent again sealed (`send_sealed`), and how
        self.per_item = pool._per_item.get(self.plan_id)
        group = batched(plan)
        self.group = group.group if group is not None else 0  # a batched plan's chunks: whole groups
        self.singly: set[int] = set()  # first items of chunks whose batched calls take one item (`split`)
        self.limited = pool.max_memory is not None or bool(pool.stall_report) or _has_timeouts(plan.graph.nodes)
        self.stalled: dict[int, tuple[int, int, float]] = {}  # worker number -> the call whose stacks were logged
        self.poison: dict[tuple[Any, ...], dict[int | None, NodeError]] = {}  # see `crash.poisoned_here`
        self.log = results.log_nodes
        if items and isinstance(items[0], dict):  # a constant input that cannot travel: before anything starts
            check_constants(items)
        self.shared = transport.Shared(_shared_values(items), dumps)

    def next_chunk(self, w: _Worker) -> list[int] | None:
        now = time.monotonic()
        for chunk in self.retry:  # the first one not waiting out a backoff delay
            if self.due.get(chunk[0], 0.0) <= now:
                self.retry.remove(chunk)
                self.due.pop(chunk[0], None)
                return chunk
        remaining = len(self.items) - self.next_fresh
        if remaining <= 0:
            return None
        if self.per_item is None:
            size = 1 if len(self.items) < 64 else 4  # probe: learn the per-item time first
        else:
            size = int(CHUNK_TARGET / max(self.per_item, 1e-7))
        size = max(1, min(size, -(-remaining // (2 * self.pool.size))))
        if self.group:
            size = min(remaining, -(-size // self.group) * self.group)
        if self.pool.max_tasks:
            size = max(1, min(size, self.pool.max_tasks - w.tasks))
        chunk = list(range(self.next_fresh, self.next_fresh + size))
        self.next_fresh += size
        return chunk

    def backoff_left(self) -> float:
        """Seconds until a retry may run, when there is no fresh item and every retry waits."""
        if self.next_fresh < len(self.items) or not self.retry:
            return 0.0
        now = time.monotonic()
        return max(0.0, min(self.due.get(chunk[0], 0.0) for chunk in self.retry) - now)

    def has_work(self) -> bool:
        return not self.results.stop and (bool(self.retry) or self.next_fresh < len(self.items))

    def assign(self) -> None:
        """Give a chunk to every idle worker this run holds; hand back those it has no work for."""
        pool = self.pool
        unneeded = []
        for slot in pool._claim(self):
            w = pool._workers[slot]
            if w is not None and w.busy:
                continue
            if not self.has_work():
                unneeded.append(slot)
                continue
            if w is not None and not w.process.is_alive():
                signame, text = describe_exit(w.process.exitcode)
                log.warning("worker %d died while idle (%s); replacing it%s", w.number, text,
                            _after_return(w, signame, text))
                pool._replace(slot, stop=False)
                w = None
            if w is None:
                w = pool._start_worker(slot)
            fresh = self.next_fresh
            chunk, data = self.shippable_chunk(w)
            if data is None:
                unneeded.append(slot)
                continue
            singly = chunk[0] in self.singly
            w.plan = self.plan
            w.group = 1 if singly else self.group
            w.unsent = dict.fromkeys(chunk)
            w.chunk_size = len(chunk)
            self.results.handed(chunk, w.process.pid, again=self.next_fresh == fresh)
            try:
                if self.plan_id not in w.plans:
                    w.send(self.plan_msg)
                    w.plans.add(self.plan_id)
                w.send(data)
            except OSError:  # it died just now: its chunk goes back to the queue
                data.close()
                self.on_death(w)
        if unneeded:
            pool._release(self, unneeded)

    def shippable_chunk(self, w: _Worker) -> tuple[list[int], transport.Packed | None]:
        """The next chunk for `w` and its message; items that cannot be pickled fail here, alone."""
        while True:
            chunk = self.next_chunk(w)
            if not chunk:
                return [], None
            poison = {k: v for k, v in self.poison.items() if k[0][1] in chunk} if self.poison else None
            if chunk[0] in self.sealed:
                data, bad = self.pool._chunk(self.plan_id, {i: seal(self.items[i]) for i in chunk}, chunk,
                                             self.shared, self.log, sealed=self.sealed[chunk[0]],
                                             singly=chunk[0] in self.singly, poison=poison)
            else:
                data, bad = self.pool._chunk(self.plan_id, self.items, chunk, self.shared, self.log,
                                             singly=chunk[0] in self.singly, poison=poison)
            for i, why in bad.items():
                self.results.fail(i, item_error(self.plan, i, why))
            if data is not None:
                return [i for i in chunk if i not in bad], data
            if not self.has_work():
                return [], None

    def mine(self) -> list[_Worker]:
        pool = self.pool
        return [w for w, owner in zip(pool._workers, pool._owners) if owner is self and w is not None]

    def loop(self) -> None:
        pool = self.pool
        try:
            while True:
                if self.results.stop:  # on_error="raise" failed an item: the rest is not awaited
                    self.cancel()
                    return
                self.assign()
                busy = [w for w in self.mine() if w.busy]
                if not busy:
                    if not self.has_work():
                        return
                    backoff = self.backoff_left()
                    if backoff:  # only retries waiting out their backoff delay (hardy.policy)
                        time.sleep(backoff)
                    else:
                        pool._wait_for_a_free_worker()  # other threads' maps or calls hold them all
                    continue
                waitables: dict[Any, _Worker] = {}
                for w in busy:
                    waitables[w.conn] = w
                    waitables[w.process.sentinel] = w
                # woken every STOP_POLL at least: another thread may stop this run (a streamed map closed)
                ready = wait(list(waitables), timeout=TICK if self.limited or self.due else STOP_POLL)
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
            # map, so they are replaced, after sending what they computed.
            self.results.stop = True
            self.cancel()
            raise
        finally:
            self.shared.close()
            pool._release(self, range(pool.size))

    def cancel(self) -> None:
        """Stop this run's busy workers now (a hung or slow item must not delay the error or the
        interruption that ends the map), keeping every result they computed: each is asked for its
        last words (the results it holds, `worker._last_words`) before it is killed and replaced.
        Their items in flight stay unrun."""
        pool = self.pool
        busy = [(slot, w) for slot, w in enumerate(pool._workers)
                if w is not None and w.busy and pool._owners[slot] is self]
        for _, w in busy:
            w.ask_last_words()
        deadline = time.monotonic() + STACK_GRACE
        for slot, w in busy:
            w.await_last_words(deadline)
            w.process.kill()
            self.receive(w)
            pool._replace(slot, stop=False)

    def receive(self, w: _Worker) -> bool:
        """Take everything the worker sent; False if its pipe is closed (it died)."""
        try:
            while w.conn.poll():
                data = w.conn.recv_bytes()
                done, each, logged, unread, logs, elapsed = worker_main.HEADER.unpack_from(data)
                w.started_any = True
                self.pool.start_failures = 0
                if unread:  # its chunk could not be unpickled there: it goes again, sealed
                    chunk = list(w.unsent)
                    w.plan, w.unsent = None, {}
                    self.send_sealed(chunk, pickle.loads(memoryview(data)[worker_main.HEADER.size:]))
                    return True
                try:
                    batch = transport.unpack(w.conn, memoryview(data)[worker_main.HEADER.size:])
                except (EOFError, OSError):  # it died while passing its shared memory
                    raise
                except Exception:  # one result cannot be read here: at chunk end, ask for each alone
                    w.resend = True
                    batch, logged, logs = [], False, False
                if logs:
                    batch = _handle_logs(*batch)
                unsent, free = w.unsent, done and not w.resend
                if free:  # its next chunk goes first, to run while this batch is taken
                    self.chunk_done(w, elapsed)
                    if not self.results.stop:
                        self.assign()
                if each:
                    self.take_each(unsent, batch)
                else:
                    rows, records = batch if logged else (batch, None)
                    for i, _, err, *log in self.results.take(rows, unsent, records):  # the failures
                        if not self.retry_out_of_memory(i, err):
                            self.results.fail(i, err, *log)
                if free:  # what it sends next belongs to its next chunk (or, released, to another map)
                    return True
                if done:  # the items with no result yet are those of unreadable batches
                    w.send(pickle.dumps(("resend", list(w.unsent))))
                    w.resend = False
        except (EOFError, OSError):
            return False
        return True

    def take_each(self, unsent: dict[int, Any], batch: list[tuple[int, bool, bytes, Records | None]]) -> None:
        """Results sent again one by one (`worker._resend`), each with its node log."""
        for i, ok, blob, log in batch:
            unsent.pop(i, None)
            try:
                value = pickle.loads(blob)
            except Exception as exc:
                ok, value = False, self.unreadable(i, blob, exc)
            logs = (log,) if log is not None else ()
            if ok:
                self.results.ok(i, value, logs)
            elif not self.retry_out_of_memory(i, value):
                self.results.fail(i, value, logs)

    def retry_out_of_memory(self, i: int, err: Any) -> bool:
        """A GPU out-of-memory under `@node(retries=N)`: its worker retires (a fresh CUDA context has
        nothing allocated) and the item runs again on a fresh worker, after the node's backoff."""
        if not isinstance(err, GpuOutOfMemory) or self.attempts.get(i, 0) >= err.retries:
            return False
        self.attempts[i] = self.attempts.get(i, 0) + 1
        log.warning("item %d: GPU out of memory in node %r; retrying on a fresh worker (%d of %d)", i, err.node,
                    self.attempts[i], err.retries)
        self.retry.appendleft([i])
        if err.backoff:
            self.due[i] = time.monotonic() + delay(err.backoff, self.attempts[i])
        return True

    def send_sealed(self, chunk: list[int], why: str, alone: bool = False) -> None:
        """A chunk that could not be unpickled in the worker, or whose unpickling killed it, or
        that killed it while its results were pickled: sent again (first) sealed, so that each
        item's inputs are opened one by one (`alone`: and each result is sent alone), and the item
        at fault fails alone (`worker._open`, `died_between_items`). A sealed chunk that fails so
        (nothing an item holds can make it) fails its items: no loop."""
        if self.sealed.get(chunk[0], 0) >= 1 + alone:
            for i in chunk:
                self.results.fail(i, ShippingError(readers(self.plan, None), None, i, f"its chunk could not be "
                                                   f"unpickled in the worker process, even sealed: {why}"))
            return
        self.sealed.update(dict.fromkeys(chunk, 1 + alone))
        size = -(-len(chunk) // (2 * self.pool.size))  # in pieces, for every worker to share: it runs last
        self.retry.extendleft(reversed([chunk[k:k + size] for k in range(0, len(chunk), size)]))

    def unreadable(self, i: int, blob: bytes, exc: Exception) -> NodeError:
        """The error for a result this process cannot unpickle: node, item and the types involved."""
        steps = self.plan.steps
        producers = [s.node.name for s in steps if set(s.node.outputs) & set(self.plan.outputs)]
        types = ", ".join(globals_in(blob)) or "unknown"
        return NodeError(" / ".join(producers) or "?", None, i,
                         f"its result was computed but cannot be unpickled in this process "
                         f"({type(exc).__name__}: {exc}; types in it: {types}); make those types "
                         "importable here the same way, or return plain data")

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
        if pool.max_tasks and w.tasks >= pool.max_tasks or pool.max_memory and rss(w.process.pid) > pool.max_memory:
            pool._replace(slot, stop=True)

    def split(self, w: _Worker, signame: str | None, text: str) -> int | None:
        """A worker died in a batched node's call (docs/batching.md): its batch is the first group
        of the items it had not answered (those before had their results sent, last words
        included). A batch of one is the culprit, returned to fail (or retry) as any item in
        flight. A bigger batch goes back as one chunk
        whose batched calls take one item each: the culprit kills the worker running it (every
        item before it sent its result), and is then a batch of one. Why not halves: each level
        of a bisection costs a worker death and start (~0.2 s with torch imported), so 64 items
        cost 7 deaths where this costs 2, and an innocent item alone costs only its own call.
        The items after the batch, which never reached the call, go back as one chunk."""
        unsent = list(w.unsent)
        suspects, rest = unsent[:w.group], unsent[w.group:]
        if len(suspects) == 1:
            return suspects[0]  # the items after it stay unsent: they go back as a chunk
        w.unsent = {}
        log.info("a batch of %d items died (%s: %s); running them again one item per call", len(suspects),
                 signame, text)
        self.singly.add(suspects[0])
        self.retry.appendleft(suspects)
        if rest:
            self.retry.append(rest)
        return None

    def check_limits(self, busy: list[_Worker]) -> None:
        now = time.monotonic()
        for w in busy:
            if not w.busy or not w.process.is_alive():
                continue
            item, step = int(w.status[worker_main.ITEM]), int(w.status[worker_main.STEP])
            if (item >= 0 or item == worker_main.BATCH) and 0 <= step < len(self.plan.steps):
                timeout = self.plan.steps[step].node.timeout
                started = w.status[worker_main.STEP_START]
                if timeout and now - started > timeout:
                    w.kill("timeout", f"node ran past its timeout of {timeout:g} s")
                    self.on_death(w)
                    continue
                stall = self.pool.stall_report
                if stall and now - started > stall and self.stalled.get(w.number) != (item, step, started):
                    self.stalled[w.number] = (item, step, started)
                    self.report_stall(w, item, self.plan.steps[step].node.name, now - started)
                deadline = w.status[worker_main.DEADLINE]  # of a node nested in the step (crash.deadlined)
                if 0 < deadline < now:
                    w.kill("timeout", "node ran past its timeout")
                    self.on_death(w)
                    continue
            limit = self.pool.max_memory
            if limit is not None:
                used = rss(w.process.pid)
                if used > limit:
                    w.kill("memory", f"worker memory {used / 2**20:.0f} MiB passed max_memory_per_worker "
                                     f"({limit / 2**20:.0f} MiB)")
                    self.on_death(w)

    def report_stall(self, w: _Worker, item: int, node: str, running: float) -> None:
        """Log every thread's stack of a node call running past `stall_report` (it goes on running)."""
        text, why = hang_stacks(w.process.pid)
        log.warning("item %d: node %r has been running for %.0f s (stall_report=%g s) in worker pid %d; %s", item,
                    node, running, self.pool.stall_report, w.process.pid,
                    f"its stacks:\n{text}" if text else f"no stacks: {why}")
    def charge(self, w: _Worker, i: int, step: int, signame: str | None, text: str) -> None:
        """Item i was in flight when worker `w` died: it fails, or runs again (its node's retries;
        or, when it crashed inside a nested map, with that inner item failed: `crash.poisoned_here`)."""
        steps = self.plan.steps
        node = steps[step].node if 0 <= step < len(steps) else (steps[0].node if len(steps) == 1 else None)
        stack, chain = read_stack(w.fault_path), read_nesting(w.fault_path)
        cls = NodeTimeout if w.killed_for == "timeout" else NodeCrashed
        named = "/".join(str(level[0]) for level in chain) if len(chain) > 1 else node.name if node else "?"
        death = examine(w.fault_path, signame, text, named, stack, w.hang if w.killed_for == "timeout" else None)
        text = death.reason
        err = cls(node.name if node else "?", i, text, signal=signame, exitcode=w.process.exitcode, stack=stack,
                  native_frames=death.frames, native_stack=death.native_stack, diagnosis=death.diagnosis,
                  inputs=_inputs(self.items[i]))
        if isinstance(err, NodeTimeout):
            err.stacks = death.stacks
        err.threads = read_stack(w.fault_path, every_thread=True)
        if len(chain) > 1 and self.rerun_without(i, chain, err, _nested(err, chain, w.killed_for)):
            return
        self.attempts[i] = self.attempts.get(i, 0) + 1
        retries = node.retries if node else 0
        if self.attempts[i] <= retries:
            log.warning("node %r, item %d: %s; retrying (%d of %d)", err.node, i, text, self.attempts[i], retries)
            self.retry.appendleft([i])
            self.results.retried(i, err, w.process.pid)
            if node is not None and node.backoff:  # retries > 0: there is a node
                self.due[i] = time.monotonic() + delay(node.backoff, self.attempts[i])
        else:
            self.results.fail(i, err, worker=w.process.pid)

    def rerun_without(self, i: int, chain: list[list[Any]], err: NodeCrashed, crash: str) -> bool:
        """Item i crashed inside a nested map whose pipeline node keeps going (on_error="continue"):
        run item i again with that inner item failed as it crashed, so that only it is lost, as
        in-process. False when no such map encloses the crash (the item itself fails)."""
        for k in range(len(chain) - 1, 0, -1):
            if chain[k][1] is not None and chain[k - 1][2] == "continue":
                key = tuple((level[0], level[1]) for level in chain[:k])
                crashed = self.poison.setdefault(key, {})
                if chain[k][1] in crashed or len(crashed) >= MAX_NESTED_CRASHES:
                    return False
                inner = copy.copy(err)
                inner.node = "/".join(str(level[0]) for level in chain[k:])
                inner.inputs_summary = ""  # the inner item's inputs are not the outer item's
                inner.reason = crash
                crashed[chain[k][1]] = inner
                log.warning("node %r crashed on item %s of a nested map (%s): running the enclosing item %d again "
                            "without it", inner.node, chain[k][1], crash, i)
                self.retry.appendleft([i])
                return True
        return False

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
        item, step = int(w.status[worker_main.ITEM]), int(w.status[worker_main.STEP])
        in_flight = item if item in w.unsent else None
        if item == worker_main.BATCH and w.unsent:
            in_flight = self.split(w, signame, text)
        if in_flight is not None and step <= worker_main.OPENING:  # unpickling one input of a sealed item
            del w.unsent[in_flight]
            self.died_opening(in_flight, worker_main.OPENING - step, (signame, text, w.process.exitcode,
                                                                        read_stack(w.fault_path)))
        elif in_flight is not None:
            del w.unsent[in_flight]
            self.charge(w, in_flight, step, signame, text)
        elif item == worker_main.BATCH:
            pass  # a batch it died in is queued again in halves (`split`)
        elif item in (worker_main.READING, worker_main.SENDING, worker_main.LOADING) and w.unsent:
            self.died_between_items(w, item, step, (signame, text, w.process.exitcode, read_stack(w.fault_path)))
        elif w.status[worker_main.READY] != 1.0:  # (preload= modules load in the fork server, which says so)
            pool.start_failures += 1
            if pool.start_failures >= 3:  # dies setting up: retrying would loop forever
                pool._replace(slot, stop=False)
                raise WorkerStartError(
                    f"worker processes die while setting up, before reading any work ({text}; 3 in a row). A "
                    f"library in preload_libs= or the worker environment fails to load: see the worker's "
                    f"error above. {read_stack(w.fault_path)}".strip())
        elif w.process.exitcode == worker_main.RETIRED:
            log.info("worker %d retired after a CUDA error; a fresh one takes its place", w.number)
        else:
            log.warning("a worker died with no item in flight (%s); its results were already kept%s", text,
                        _after_return(w, signame, text))
        if w.unsent:  # innocent items whose results had not been sent yet: run them again
            self.retry.append(list(w.unsent))
        w.unsent = {}
        w.plan = None
        pool._replace(slot, stop=False)


    def died_opening(self, i: int, k: int, crash: tuple[str | None, str, int | None, str]) -> None:
        """Item i's input k killed the worker as it was unpickled there (a sealed chunk's)."""
        signame, text, exitcode, stack = crash
        item, name = self.items[i], None
        if isinstance(item, Pickled):
            what = f"input (types in it: {', '.join(globals_in(item.blob)) or 'builtins only'})"
        else:
            name = list(item)[k] if k < len(item) else "?"
            what = f"input {name!r} ({described(item.get(name))})"
        self.results.fail(i, NodeCrashed(readers(self.plan, name), i, f"the worker process died ({text}) while "
                                         f"unpickling its {what}, before the node ran", signal=signame,
                                         exitcode=exitcode, stack=stack))

    def died_between_items(self, w: _Worker, doing: int, count: int,
                           crash: tuple[str | None, str, int | None, str]) -> None:
        """The worker died with no node running: unpickling a chunk (READING: it is sent again
        sealed), pickling a batch of `count` results (SENDING: those items run again sealed, each
        result sent alone; an item alone fails), or loading the pipeline (LOADING: the chunk's
        items fail, as when loading raises). `w.unsent` keeps the innocent items."""
        unsent = list(w.unsent)
        signame, text, exitcode, stack = crash
        if doing == worker_main.READING:
            w.unsent = {}
            self.send_sealed(unsent, f"the worker process died ({text}) unpickling it")
            return
        if doing == worker_main.LOADING:
            w.unsent = {}
            for i in unsent:
                self.results.fail(i, NodeCrashed("<pipeline>", i, f"the worker process died ({text}) while loading "
                                                 "the pipeline (unpickling its nodes, importing their modules)",
                                                 signal=signame, exitcode=exitcode, stack=stack))
            return
        batch = unsent[:max(1, count)]
        w.unsent = dict.fromkeys(unsent[len(batch):])
        if len(batch) > 1:
            self.send_sealed(batch, f"the worker process died ({text}) pickling their results", alone=True)
            return
        producers = [s.node.name for s in self.plan.steps if set(s.node.outputs) & set(self.plan.outputs)]
        self.results.fail(batch[0], NodeCrashed(
            " / ".join(producers) or "?", batch[0], f"the worker process died ({text}) while pickling the item's "
            "result to send it back, after its nodes ran; return plain data (numbers, arrays, dicts, paths)",
            signal=signame, exitcode=exitcode, stack=stack))


def _after_return(w: _Worker, signame: str | None, text: str) -> str:
    """What a worker's crash record says of a death outside any item: the diagnosis (a crash at
    exit, in which library) and the native stack, as lines to add to the warning."""
    death = examine(w.fault_path, signame, text, "?", "", after_return=True)
    return "".join(f"\ndiagnosis: {d}" for d in death.diagnosis) + (
        f"\nnative stack:\n{death.native_stack}" if death.native_stack else "")
def _nested(err: NodeCrashed, chain: list[list[Any]], killed_for: str | None) -> str:
    """Names the crash of a worker inside a nested pipeline as an in-process failure would be: the
    path of nodes (`prep/tokenize`) and the item of each nested map on the way. Returns what
    happened, without where (the inner item's own error says that)."""
    err.node = "/".join(str(level[0]) for level in chain)
    if killed_for == "timeout" and chain[-1][3]:
        err.reason = f"node ran past its timeout of {chain[-1][3]:g} s"
    crash = err.reason or ""
    inner = [f"{level[0]!r} item {level[1]}" for level in chain[1:] if level[1] is not None]
    if inner:
        err.reason = f"{crash}, in nested map at {', '.join(inner)}"
    return crash


def _handle_logs(batch: Any, records: list[logging.LogRecord]) -> Any:
    """Log records a worker sent (`worker._Forward`), handled by this process's loggers."""
    for record in records:
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)
    return batch


def _inputs(item: Any) -> dict[str, Any] | None:
    """An item's inputs for an error message; None for one an engine passes unopened (`Pickled`)."""
    return {k: v for k, v in item.items() if k != KEYS} if isinstance(item, dict) else None


def _has_timeouts(nodes: Sequence[Any]) -> bool:
    """Whether a node, or a node of a pipeline nested in one, has a timeout for the pool to enforce."""
    return any(n.timeout or _has_timeouts(getattr(getattr(n, "pipeline", None), "nodes", ())) for n in nodes)


def _close_at_exit(ref: weakref.ref[WorkerPool]) -> None:
    pool = ref()
    if pool is not None:
        pool.close()


_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
def _forked() -> None:
    for pool in list(_pools):
        pool._forget()


os.register_at_fork(after_in_child=_forked)


def _shared_values(items: Sequence[Any]) -> list[Any]:
    """The inputs every item holds as one same object (a map's constant inputs)."""
    if len(items) < 2 or not isinstance(items[0], dict):
        return []
    first, last = items[0], items[-1]
    return [v for k, v in first.items() if last.get(k, first) is v]

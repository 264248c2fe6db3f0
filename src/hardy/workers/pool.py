"""The worker pool: long-lived worker processes shared by the maps and isolated calls of an engine.

It starts workers through a launcher (`launch.py`), hands them to the maps that need them
(`scheduling.MapRun` runs one map's loop on them), and replaces or stops them.
"""

from __future__ import annotations

import atexit
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidArgument, WorkerStartError
from ..model.executor import Executor, MapResults, ResultsSink, WorkerCounts
from ..model.sizes import parse_size
from ..plan.columns import Items
from ..plan.compiled import Plan
from ..plan.memo import Memo
from ..shipping import Unshippable, dumps, ship_items, ship_plan, transport
from . import launch
from .breakpoints import warn_if_debugged
from .calls import call
from .deaths import TASKS_PER_WORKER, out_of_processes, processes_short
from .messages import Chunk, PlanSpec
from .process import Worker, peak_rss
from .scheduling import MapRun, has_timeouts

SPARE_WAIT = 5.0  # seconds a worker start (or close) waits for the spare already on its way


class WorkerPool(Executor):
    """Long-lived worker processes that run chunks of map items and single isolated node calls.

    It is the "process" map executor and the runner of `@node(isolate=True)`. Maps and isolated
    calls from several threads share it: each claims the idle workers it has work for and hands
    them back as soon as it has none, so N threads each calling an isolated node use N workers.
    """

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
        self.start_method = launch.DEFAULT_START_METHOD
        self.recheck_fork = start_method == "fork"  # every later fork checks the hazards again ("fork!": never)
        self.started_by = threading.current_thread()  # checked now; imap's runner forks for it (`check_fork_again`)
        if start_method is not None:  # (the hazards' checks, and what they load, only for a method asked for)
            from ..safety.hazards import choose_start_method
            self.start_method = choose_start_method(start_method)
        self.preload = tuple(preload)
        self.preload_libs = tuple(preload_libs)
        self.max_tasks = max_tasks_per_worker
        self.max_memory = parse_size(max_memory_per_worker)
        self.stall_report = stall_report  # seconds: a node call running longer has its stacks logged
        if self.max_tasks is not None and self.max_tasks < 1:
            raise InvalidArgument("max_tasks_per_worker must be at least 1")
        self.env = launch.worker_environment(self.size)
        try:
            _room_for(self.size)
        except WorkerStartError:  # refused before any worker starts: the server `launch.warm` started goes
            launch.release_unused(self.start_method, self.preload, self.env)
            raise
        self._launcher: launch.Launcher | None = None
        self.workers: list[Worker | None] = [None] * self.size
        # Once a worker has died, one more is kept started (with the plan running then): the next
        # death's place is taken at once, not after a start and a plan load (`start_worker`).
        self._spare: Worker | None = None
        self._spare_wanted = False
        self._topping: threading.Thread | None = None  # starting the spare
        self._generation = 0  # counts closes: a spare started before one is stopped, not kept
        self.owners: list[MapRun | None] = [None] * self.size  # which map or call (`calls._Call`) uses each worker
        self._leaving: list[Worker] = []  # recycled workers asked to leave, not collected yet (`_collect`)
        self._started = 0
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._waiting = 0  # maps waiting for a free worker (`wait_for_a_free_worker`)
        self._plan_ids: Memo[Plan, tuple[int, bytes, bool]] = Memo(1024, weak=True)
        self._next_plan = 0
        self._last: tuple[Plan | None, Any] = (None, None)  # the plan `shipped` answered last, and its answer
        self.per_item_times: dict[int, tuple[float | None, int]] = {}  # plan id -> (seconds per item, items timed)
        self.replaced = 0
        self.recycled = 0  # of the replaced: stopped on purpose (max_tasks_per_worker, max_memory_per_worker)
        self.start_failures = 0
        atexit.register(_close_at_exit, weakref.ref(self))
        _pools.add(self)

    # --- workers ---------------------------------------------------------------------------------

    def start_worker(self, slot: int) -> Worker:
        """A worker for `slot`: the spare when one is ready or on its way (a worker that died
        had one started at once: `died`), else a fresh one."""
        topping = self._topping
        if topping is not None and topping.ident is not None:
            topping.join(SPARE_WAIT)
        spare = self._take_spare() if not self.slot_env else None
        if spare is not None:
            self.workers[slot] = spare
            return spare
        if not self.recheck_fork:
            return self._new_worker(slot)
        from ..errors import ForkRefused
        try:
            return self._new_worker(slot)
        except ForkRefused as exc:  # what the map running finished is not lost with it
            results = getattr(self.owners[slot], "results", None)
            exc.results, exc.failures = getattr(results, "values", None), getattr(results, "failures", None)
            raise

    def _take_spare(self) -> Worker | None:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and not spare.process.is_alive():  # it died idle: a fresh one instead
            spare.process.join(1)
            spare.close_files()
            return None
        return spare

    def died(self, plan_id: int, plan_msg: bytes) -> None:
        """A worker that was set up died: its replacement starts now, on its own thread, while
        the parent reads what killed it (crash file, native frames), not after."""
        self._spare_wanted = True
        self.top_up(plan_id, plan_msg)

    def top_up(self, plan_id: int, plan_msg: bytes) -> None:
        """Start the spare worker when one is wanted (a worker died) and none is ready or on its
        way, and send it the plan running now, loaded there while it waits: on a thread of its own
        (starting a worker is a few exchanges with the fork server), so that it delays no map.
        Not for workers forked from this process (start_method "fork"): the child of a fork from a
        second thread holds, forever, any lock the map's thread held at that moment; such a worker
        costs milliseconds, forked on the map's thread when it is needed."""
        if self.slot_env or isinstance(self._launcher, launch.Forker):
            return
        with self._lock:
            if (not self._spare_wanted or self._spare is not None or self._topping is not None
                    or self._launcher is None):
                return
            topping = self._topping = threading.Thread(target=self._start_spare,
                                                       args=(plan_id, plan_msg, self._generation),
                                                       name="hardy-spare-worker", daemon=True)
        try:
            topping.start()
        except RuntimeError:  # out of threads (`ulimit -u`): no spare, the next start says why if it fails too
            with self._lock:
                self._topping = None

    def _start_spare(self, plan_id: int, plan_msg: bytes, generation: int) -> None:
        try:
            w = self._new_worker(None, generation)
        except Exception:  # the pool closed, or its fork server went away: the next death starts its own
            with self._lock:
                self._topping = None
            return
        try:
            w.send(plan_msg)
            w.plans.add(plan_id)
        except OSError:
            pass
        with self._lock:
            kept = generation == self._generation and self._spare is None
            if kept:
                self._spare = w
            self._topping = None
        if not kept:  # the pool closed meanwhile
            w.stop()

    def _new_worker(self, slot: int | None, generation: int | None = None) -> Worker:
        """A fresh worker for `slot`, or the spare (`slot` None) of the pool as it was at
        `generation`: a spare never outlives a close, nor starts a fork server of its own."""
        with self._lock:
            if slot is None and (generation != self._generation or self._launcher is None):
                raise WorkerStartError("no spare worker: the pool was closed")
            launcher = self._live_launcher()
            self._started += 1
            number, generation = self._started, self._generation
        env = {**self.env, **self.slot_env[slot]} if self.slot_env and slot is not None else self.env
        try:
            w = self._launched(launcher, number, env)
        except WorkerStartError:
            if slot is None or launcher.alive:  # (a spare's failure only costs the spare: `_start_spare`)
                raise
            with self._lock:  # its fork server ended as it was asked (killed from outside): a fresh one, once,
                if generation != self._generation:  # unless it ended because the pool was closed meanwhile
                    raise
                launcher = self._live_launcher()
            w = self._launched(launcher, number, env)
        if slot is not None:
            self.workers[slot] = w
        return w

    def _launched(self, launcher: launch.Launcher, number: int, env: dict[str, str]) -> Worker:
        """A worker started by `launcher`; a fork past the process limit (EAGAIN) says so. A fork
        of this process ("fork") is refused when a hazard appeared since the pool started."""
        if self.recheck_fork and isinstance(launcher, launch.Forker):
            from ..safety.hazards import check_fork_again
            check_fork_again(self.started_by)
        try:
            return Worker(launcher, number, env, self.preload_libs)
        except BlockingIOError as exc:
            raise WorkerStartError(out_of_processes(f"a worker could not start: {exc.strerror}",
                                                    TASKS_PER_WORKER)) from None

    def _live_launcher(self) -> launch.Launcher:
        """This pool's launcher (under `_lock`), acquired now if it has none or its fork server
        died (killed from outside: a fresh one serves on)."""
        if self._launcher is not None and not self._launcher.alive:
            launch.release(self, self._launcher)
            self._launcher = None
        if self._launcher is None:
            try:
                self._launcher = launch.acquire(self, self.start_method, self.preload, self.env)
            except BlockingIOError as exc:  # EAGAIN: its fork, past the process limit
                said = out_of_processes(f"the fork server could not start: {exc.strerror}", 1)
                raise WorkerStartError(said) from None
        return self._launcher

    def ask_ahead(self, fresh: int) -> None:
        """`fresh` workers are about to start one after the other (a map's first): ask the fork
        server for them all now, so that they fork together (`launch.ForkServer.ask`). A spare
        ready or on its way takes the place of one."""
        with self._lock:
            launcher = self._live_launcher()
            fresh -= self._spare is not None or self._topping is not None
        if fresh > 1 and isinstance(launcher, launch.ForkServer):
            launcher.ask(fresh)

    def replace(self, slot: int, stop: bool) -> None:
        """Take the worker out of `slot`: `stop` (recycled, idle) asks it to leave and collects it
        later (`_collect`), so that nothing waits for its exit; otherwise it is killed."""
        self._collect()
        w = self.workers[slot]
        if w is not None:
            if stop:
                w.leave()
                with self._lock:
                    self._leaving.append(w)
            else:
                w.process.kill()
                w.process.join(1)
                w.close_files()
        self.workers[slot] = None
        self.replaced += 1
        self.recycled += stop
        self._spare_wanted |= not stop

    def _collect(self, timeout: float | None = None) -> None:
        """Close the recycled workers that have left; with `timeout` (closing), wait for the others
        that long, then kill them."""
        with self._lock:  # (maps in other threads replace workers too)
            leaving, self._leaving = self._leaving, []
        kept = []
        for w in leaving:
            if timeout is None and w.process.is_alive():
                kept.append(w)
            else:
                w.finish(timeout or 0.0)
        if kept:
            with self._lock:
                self._leaving += kept

    def counts(self, peaks: bool = True) -> WorkerCounts:
        return WorkerCounts(self._started, self.replaced - self.recycled, self.recycled,
                            {str(pid): peak_rss(pid) for pid in self.pids()} if peaks else {})

    def claim(self, run: MapRun) -> list[int]:
        """The slots `run` may use now: those it holds, plus every free one while it has work."""
        with self._lock:
            for slot, owner in enumerate(self.owners):
                if owner is None and run.has_work():
                    self.owners[slot] = run
            return [slot for slot, owner in enumerate(self.owners) if owner is run]

    def take_idle(self, plan_id: int, caller: Any) -> tuple[int, Worker] | None:
        """A free slot whose worker has answered before, is idle and holds the plan, now taken by
        the call `caller` (`calls.call`: `free` gives it back); None if there is none (the call then
        goes through the map loop, which starts or waits for one)."""
        owners = self.owners
        with self._lock:
            for slot, w in enumerate(self.workers):
                if owners[slot] is None and w is not None and plan_id in w.plans and w.started_any and not w.busy:
                    owners[slot] = caller
                    return slot, w
        return None

    def let_go(self, caller: object) -> None:
        """The slot the call `caller` took, if it still holds one, is free again (it was interrupted
        before it sent anything: `calls.call`)."""
        for slot, owner in enumerate(self.owners):
            if owner is caller:
                self.free(slot)

    def free(self, slot: int) -> None:
        """`slot`, taken by a call (`take_idle`), is free again; the maps waiting for one are told
        (none, almost always: then no lock is taken: see `wait_for_a_free_worker`)."""
        self.owners[slot] = None
        if self._waiting:
            with self._lock:
                self._freed.notify_all()

    def hand_over(self, slot: int, run: MapRun) -> None:
        """`slot`'s worker, taken by a call (`take_idle`), is now `run`'s."""
        with self._lock:
            self.owners[slot] = run

    def release(self, run: MapRun, slots: Sequence[int]) -> None:
        with self._lock:
            for slot in slots:
                if self.owners[slot] is run:
                    self.owners[slot] = None
            self._freed.notify_all()

    def wait_for_a_free_worker(self) -> None:
        with self._lock:
            self._waiting += 1  # before looking: a slot freed after this is seen, or `free` notifies
            try:
                if all(owner is not None for owner in self.owners):
                    self._freed.wait(1.0)
            finally:
                self._waiting -= 1

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w is not None and w.process.pid]

    # --- shipping plans and items ----------------------------------------------------------------

    def ship(self, plan: Plan) -> tuple[int, bytes, bool]:
        """The plan's id in this pool, the message that loads it in a worker, and whether a node of
        it has a timeout (made once per plan)."""
        with self._lock:
            shipped = self._plan_ids.get(plan)
            if shipped is None:
                self._next_plan += 1
                plan_id = self._next_plan
        if shipped is None:
            timed = has_timeouts(plan.graph.nodes)
            spec = PlanSpec(plan_id, ship_plan(plan), dated=timed or bool(self.stall_report))
            shipped = (plan_id, pickle.dumps(spec, protocol=5), timed)
            with self._lock:
                shipped = self._plan_ids.put(plan, shipped)
        return shipped

    def shipped(self, plan: Plan) -> tuple[int, bytes, bool] | None:
        """`ship`'s answer when the plan was shipped before (None if not), without a lock; the last
        plan asked for is answered first (a loop of calls asks for one plan over and over)."""
        last = self._last
        if last[0] is plan:
            found: tuple[int, bytes, bool] = last[1]
            return found
        shipped = self._plan_ids.get(plan)
        if shipped is not None:
            self._last = (plan, shipped)
        return shipped

    def chunk_message(self, plan_id: int, items: Any, chunk: Sequence[int], shared: transport.Shared,
                      log: bool = False, sealed: int = 0, singly: bool = False,
                      poison: dict[Any, Any] | None = None) -> tuple[transport.Packed | None, dict[int, Unshippable]]:
        """The chunk's message, less the items that cannot be pickled (returned apart, with why);
        `log`: the worker logs node events (observe/nodelog.py) because the parent listens;
        `shared`: the segments of the values every item of the map holds (written once);
        `sealed`: `items` are sealed (`shipping.seal`), to be opened one by one (2: and each result
        sent alone); `singly`: batched nodes are called for one item at a time (a batch that
        killed a worker, `crash.verdict.split`); `poison`: nested items that crashed a worker before
        (`crash.containment.poisoned_here`). Consecutive items with nothing else set travel shortest: (plan_id,
        the first item, their inputs), no index per item."""
        if type(chunk) is range and not (log or sealed or singly or poison):
            start, stop = chunk.start, chunk.stop
            try:
                if type(items) is Items:  # (the worker builds them: `columns.built`)
                    return transport.pack((plan_id, start, items.constants, items.name, items.column[start:stop]),
                                          dumps, shared), {}
                if type(items) is list:
                    return transport.pack((plan_id, start, items[start:stop]), dumps, shared), {}
            except Exception:  # an item that cannot travel: found and left out below
                pass
        packed: tuple[transport.Packed | None, dict[int, Unshippable]] = ship_items(
            items, chunk, lambda pairs: Chunk(plan_id, pairs, log, sealed, singly, poison).wire(),
            dump=lambda msg: transport.pack(msg, dumps, shared))
        return packed  # what `dump` returned, and the items left out

    # --- the map executor ------------------------------------------------------------------------

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        warn_if_debugged()
        MapRun(self, plan, items, results).loop()

    def run_one(self, plan: Plan, item: dict[str, Any], sink: Callable[[], MapResults]) -> dict[str, Any]:
        warn_if_debugged()
        return call(self, plan, item, sink)

    def _forget(self) -> None:
        """In a fork child: the workers are the parent's (launch.py let go of their pipes); this
        process starts its own if it maps."""
        for w in [*self.workers, self._spare, *self._leaving]:
            if w is not None:
                w.close_fds()
        self.workers, self._leaving = [None] * self.size, []
        self._spare, self._spare_wanted, self._topping = None, False, None
        self.owners = [None] * self.size
        self._launcher = None
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._waiting = 0

    def close(self) -> None:
        """Stop every worker (a map still running in another thread loses its workers), then
        give the fork server back: it stops once no other pool uses it."""
        with self._lock:
            self._generation += 1
            self._spare_wanted = False
            topping = self._topping
        if topping is not None and topping.ident is not None:  # (a spare it starts later is stopped: `_start_spare`)
            topping.join(SPARE_WAIT)
        with self._lock:
            workers = list(enumerate(self.workers))
            spare, self._spare = self._spare, None
            self.workers = [None] * self.size
            launcher, self._launcher = self._launcher, None
        stopping = [w for w in [*(w for _, w in workers), spare] if w is not None]
        for w in stopping:  # all asked first: they leave at once, not one after another
            w.leave()
        with self._lock:
            self._leaving += stopping
        self._collect(timeout=2.0)
        if launcher is not None:
            launch.release(self, launcher)
        else:  # never took one: the server `launch.warm` started for it (a first map of no items) goes
            launch.release_unused(self.start_method, self.preload, self.env)


DESCRIPTORS_PER_WORKER = 6  # this process's, per worker: its socket, its server's replies, two memfds; room


def _room_for(workers: int) -> None:
    """Raise this process's soft limit of open files to what `workers` need, within its hard
    limit (what systemd advises a program that needs many: the soft limit stays 1024 for the
    programs that `select()`); past the hard limit, one error that says so, before any worker
    starts, rather than the first call that runs out failing wherever it is. The same for the
    processes and threads this user may run (`ulimit -u`), counted over all of its programs."""
    more = 1 + TASKS_PER_WORKER * workers  # (a fork server, and each worker with its thread)
    short = processes_short(more)
    if short:
        raise WorkerStartError(f"{workers} workers need about {more} more processes and threads (a fork server, and "
                               f"{TASKS_PER_WORKER} for each worker), and {short}: use fewer workers, or raise the "
                               "limit (ulimit -u)")
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(os.listdir("/proc/self/fd")) + DESCRIPTORS_PER_WORKER * workers + 16
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise WorkerStartError(f"{workers} workers need about {need} open files in this process, and its limit is "
                               f"{hard} (ulimit -Hn): use fewer workers, or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _close_at_exit(ref: weakref.ref[WorkerPool]) -> None:
    pool = ref()
    if pool is not None:
        pool.close()


_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
def _forked() -> None:
    for pool in list(_pools):
        pool._forget()


os.register_at_fork(after_in_child=_forked)

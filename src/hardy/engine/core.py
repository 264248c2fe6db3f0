"""The Engine: the one place that decides where calls run.

`Engine` holds configuration and the executors it creates lazily (thread pools, the worker-process
pools, the stream runner), and owns isolation: an `@node(isolate=True)` call is a one-item map on
its pool. Every executor writes to a `Results` sink (results.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..collector import paused
from ..crash.containment import contained, deadlined
from ..errors import InvalidArgument, InvalidArgumentType, NodeDefinitionError
from ..model import arguments
from ..model.executor import Executor, IsolatedCall, WorkerCounts
from ..model.node import Node

if TYPE_CHECKING:
    from ..cache.keys import PlanCache
    from ..plan.compiled import Plan
    from .results import Results

_NODE_EXECUTORS = ("sequential", "threaded", "async")
_MAP_EXECUTORS = ("sequential", "threaded", "async", "process")


_START_METHODS = (None, "forkserver", "spawn", "fork", "fork!")


def _check_engine(node_executor: Any, map_executor: Any, workers: Any, start_method: Any, max_tasks: Any,
                  max_memory: Any, cache: Any) -> None:
    """One sentence per wrong Engine argument, raised where the Engine is made."""
    if node_executor not in _NODE_EXECUTORS:
        raise InvalidArgument(
            f"Engine(node_executor={node_executor!r}) is not one of {_NODE_EXECUTORS}; "
            "worker processes are chosen per map (map_executor='process') or per node (@node(isolate=True)).")
    if isinstance(map_executor, str) and map_executor not in _MAP_EXECUTORS:
        raise InvalidArgument(f"Engine(map_executor={map_executor!r}) is not one of {_MAP_EXECUTORS} "
                              "or an executor object (DaskExecutor(), RayExecutor(), ...).")
    if not isinstance(map_executor, (str, Executor)):
        raise InvalidArgumentType(f"Engine(map_executor={map_executor!r:.80}) is not one of {_MAP_EXECUTORS} "
                                  "or an executor object (DaskExecutor(), RayExecutor(), ...).")
    arguments.whole_number("Engine", "workers", workers, 1, optional=True)
    if start_method not in _START_METHODS:
        raise InvalidArgument(f"Engine(start_method={start_method!r}) is not one of {_START_METHODS}; "
                              "leave it out for the safe default (forkserver).")
    arguments.whole_number("Engine", "max_tasks_per_worker", max_tasks, 1, optional=True)
    arguments.size("Engine", "max_memory_per_worker", max_memory)
    if cache is not None and not _is_cache(cache):
        raise InvalidArgumentType(f"Engine(cache={cache!r:.80}) is not a cache; pass DiskCache(path) or None.")


def _is_cache(cache: object) -> bool:
    """Whether `cache` is a `PlanCache`, whose module (the key formulas) loads here or with a first
    plan: after a first map has launched its fork server."""
    from ..cache.keys import PlanCache
    return isinstance(cache, PlanCache)


def _check_reports(report: Any, report_dir: Any) -> None:
    arguments.flag("Engine", "report", report)
    arguments.path("Engine", "report_dir", report_dir, optional=True)


def needs_gpu(node: Node) -> bool:
    """Where the local pool runs a node: any share of a GPU (`@node(gpus=0.5)`) means a GPU worker,
    whose share of its GPU is set by `workers_per_gpu`."""
    if node.gpus > 1:
        raise NodeDefinitionError(
            f"node {node.name!r} asks for gpus={node.gpus:g}; a local GPU worker holds one GPU (or a share of "
            "one, with workers_per_gpu). Split the work over items, or use daft_engine() for multi-GPU tasks.")
    return node.gpus > 0


_MAKING = threading.RLock()  # held while an engine makes its executor or a pool (`Engine.executor`)


def _made_afresh() -> None:
    global _MAKING
    _MAKING = threading.RLock()  # (another thread may have held it at a fork)


os.register_at_fork(after_in_child=_made_afresh)


class Engine:
    """Where nodes and map items execute.

    node_executor: how independent nodes of one run execute ("sequential", "threaded", "async").
    map_executor: how the items of a map execute: "process" (the default: crash-containing worker
    processes, which also run `run()`'s one item), or in this process "sequential", "threaded",
    "async" (faster for tiny nodes, but a segfault there ends the caller), or an executor object
    such as a Dask or Ray executor.
    workers: threads, concurrent coroutines or worker processes (default: by executor).
    The remaining options configure worker processes (see `hardy.workers`): `preload` modules are
    imported once in the fork server; `preload_libs` (directories or package names) have their
    shared libraries loaded in dependency order in every worker (`hardy.native.preload`).
    `report=True` records a run report of every call (`Pipeline.report()`); `report_dir` (or the
    environment variable HARDY_REPORT_DIR, read here) also writes each one there as JSON.
    Recording instruments node calls like a callback does, so it is off by default.
    keep_failed_inputs: keep the inputs of a map's failed items beside its report, signed, for
    `hardy replay` (`hardy.crash.kept`). None (the default): when reports are written to a
    directory; True: also without one, a map with failures then writes its report to
    `~/.local/state/hardy/reports` ($XDG_STATE_HOME) and logs where; False: never.
    gpus: GPU workers for `@node(gpus=...)` nodes ("all", a count or indices such as [0, 1]),
    `workers_per_gpu` on each GPU, each started with its CUDA_VISIBLE_DEVICES; the other nodes
    run on `workers` CPU workers, which see no GPU (`docs/gpu.md`).
    stall_report: seconds after which a node call still running in a worker process has every
    thread's stack logged (py-spy, `hardy[forensics]`), once per call, without stopping it.
    """

    def __init__(self, node_executor: str = "sequential", map_executor: str | Executor = "process",
                 workers: int | None = None, *, start_method: str | None = None,
                 preload: Sequence[str] = (), preload_libs: Sequence[str] = (),
                 max_tasks_per_worker: int | None = None, max_memory_per_worker: int | str | None = None,
                 cache: PlanCache | None = None, report: bool = False, report_dir: str | os.PathLike[str] | None = None,
                 gpus: str | int | Sequence[int] | None = None, workers_per_gpu: int = 1,
                 stall_report: float | None = None, keep_failed_inputs: bool | None = None):
        _check_engine(node_executor, map_executor, workers, start_method, max_tasks_per_worker,
                      max_memory_per_worker, cache)
        _check_reports(report, report_dir)
        stall_report = arguments.seconds("Engine", "stall_report", stall_report, optional=True)
        if keep_failed_inputs is not None:
            arguments.flag("Engine", "keep_failed_inputs", keep_failed_inputs)
        self.keep_failed_inputs = keep_failed_inputs
        self.node_executor = node_executor
        self.map_executor = map_executor
        self.workers = workers
        self.process_options: dict[str, Any] = dict(
            start_method=start_method, preload=arguments.names("Engine", "preload", preload),
            preload_libs=arguments.names("Engine", "preload_libs", preload_libs),
            max_tasks_per_worker=max_tasks_per_worker, max_memory_per_worker=max_memory_per_worker,
            stall_report=stall_report)
        self.cache = cache
        self.report_dir = report_dir or os.environ.get("HARDY_REPORT_DIR") or None
        self.reporting = report or self.report_dir is not None
        arguments.whole_number("Engine", "workers_per_gpu", workers_per_gpu, 1)
        self.gpu_slots: list[str] = []  # CUDA_VISIBLE_DEVICES of each GPU worker
        if gpus:
            from ..safety.gpus import gpu_slots
            self.gpu_slots = gpu_slots(gpus, workers_per_gpu)
        self._map_executor: Executor | None = None if isinstance(map_executor, str) else map_executor
        self._node_pool: Any = None
        self._process_pool: Any = None
        self._gpu_pool: Any = None
        self._window_runner: Any = None
        # every node runs in this process, isolated ones and nested pipelines too, timeouts not
        # enforced: the engine `NodeError.debug()` runs an item again on, under pdb
        self.in_process = False

    def __getstate__(self) -> dict[str, Any]:
        # Configuration travels (a nested pipeline inside a worker); pools and threads do not.
        state = self.__dict__.copy()
        # A copy inside a worker records nothing: the caller's report collects the worker's events.
        state.update(_map_executor=None, _node_pool=None, _process_pool=None, _gpu_pool=None, _window_runner=None,
                     reporting=False, report_dir=None)
        if not isinstance(self.map_executor, str):
            state["map_executor"] = "sequential"
        return state

    def __repr__(self) -> str:
        gpus = f", gpu_slots={self.gpu_slots}" if self.gpu_slots else ""
        return (f"Engine(node_executor={self.node_executor!r}, map_executor={self.map_executor!r}, "
                f"workers={self.workers}{gpus})")

    # --- what plans look like --------------------------------------------------------------------

    def plan_mode(self, for_map: bool) -> str:
        if self.node_executor == "async" or (for_map and self.executor.mode == "async"):
            return "async"
        return self.node_executor

    @property
    def runs_in_workers(self) -> bool:
        """Whether `run()` sends its one item to a worker process, as `map` does its items: on the
        local process executor, outside a worker (inside one, everything runs in that worker). A
        "threaded" or "async" node_executor runs a call's independent nodes concurrently in this
        process, which is what it was chosen for, so `run()` stays here with it."""
        return self.map_executor == "process" and self.node_executor == "sequential" and not contained()

    def ships(self, for_map: bool) -> bool:
        """Whether a plan (of a map, or of a `run()` when `for_map` is False) runs in other
        processes: those plans travel, and must be checked for changes at each call. Read from
        the name for a named executor, never by making it: a streamed map's clean-up asks this
        after `close()` (a generator finalised at interpreter exit), where making the executor
        would start a new fork server and pool that nothing closes."""
        if contained():
            return False
        if not for_map:
            return self.runs_in_workers
        if isinstance(self.map_executor, str):
            return self.map_executor == "process"  # (what `_make_executor` makes of it runs in workers)
        return self.executor.enforces_timeouts

    def timeout_runner(self, for_map: bool) -> str | None:
        """What calls nodes in this process, where a node's timeout could not stop it (see
        `hardy.model.policy`); None when calls run where timeouts are enforced: in worker processes,
        including nested pipelines inside a worker (the worker posts their deadlines)."""
        if contained() or self.in_process or (for_map or self.runs_in_workers) and self.executor.enforces_timeouts:
            return None
        return f"map_executor={self.map_executor!r}" if for_map else "Pipeline.run"

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one node call on the engine's node thread pool (the "threaded" node executor)."""
        if self._node_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._node_pool = ThreadPoolExecutor(self.workers or min(32, (os.cpu_count() or 1) + 4),
                                                 thread_name_prefix="hardy-node")
        return self._node_pool.submit(fn, *args, **kwargs)

    def node_function(self, node: Node) -> Callable[..., Any]:
        """The callable a plan uses for `node`: the function itself, or a call into a worker."""
        if contained():  # nested in a worker: a timed node posts its deadline for the parent to enforce
            return deadlined(node.func, node.timeout) if node.timeout and not node.is_async else node.func
        if node.isolate and not self.in_process:
            return self._isolated(node)
        return node.func

    def _isolated(self, node: Node) -> IsolatedCall:
        """`node` as a function whose every call is a one-item map on this engine's worker pool
        (@node(isolate=True)): crash reports, retries and timeouts are the pool's, written once."""
        from .isolated import AsyncWorkerCall, WorkerCall
        return (AsyncWorkerCall if node.is_async else WorkerCall)(node, lambda: self._pool_for(needs_gpu(node)))

    # --- executors -------------------------------------------------------------------------------

    @property
    def executor(self) -> Executor:
        """The map executor built from `map_executor` (made on first use, once: the first calls of
        several threads meet here)."""
        if self._map_executor is None:
            with _MAKING:
                if self._map_executor is None:
                    self._map_executor = self._make_executor()
        return self._map_executor

    def _make_executor(self) -> Executor:
        spec = self.map_executor
        if spec == "process" and not contained():  # (inside a worker already, a crash costs one item: sequential)
            if self.gpu_slots:
                from ..parts.stages import StagedExecutor
                return StagedExecutor(needs_gpu, self._pool_for, enforces_timeouts=True)
            pool: Executor = self.process_pool()
            return pool
        # (imported below the process branch: a first map's fork server launches before the plans' machinery loads)
        from .in_process import AsyncExecutor, SequentialExecutor, ThreadedExecutor
        if spec == "threaded":
            return ThreadedExecutor(self.workers)
        if spec == "async":
            return AsyncExecutor(self.workers)
        return SequentialExecutor()

    def process_pool(self) -> Any:
        """The CPU workers; beside GPU workers they see no GPU (CUDA_VISIBLE_DEVICES="")."""
        with _MAKING:  # (once, whichever thread comes first)
            return self._process_pool or self._make_process_pool()

    def _make_process_pool(self) -> Any:
        if self._process_pool is None:
            size = self.workers or os.cpu_count() or 1
            with paused():  # (the launch's and the pool's modules: 17 to 19 collections walked them, now one)
                if self.process_options["start_method"] is None:
                    # its fork server boots while the pool is imported and the plan shipped
                    from ..workers import launch
                    launch.warm(tuple(self.process_options["preload"]), size)
                from ..workers.pool import WorkerPool
                hidden = [{"CUDA_VISIBLE_DEVICES": ""}] * size if self.gpu_slots else ()
                self._process_pool = WorkerPool(workers=self.workers, slot_env=hidden, **self.process_options)
        return self._process_pool

    def gpu_pool(self) -> Any:
        """The GPU workers: one per slot, each seeing its own GPU."""
        with _MAKING:
            return self._gpu_pool or self._make_gpu_pool()

    def _make_gpu_pool(self) -> Any:
        if self._gpu_pool is None:
            from ..workers.pool import WorkerPool
            self._gpu_pool = WorkerPool(slot_env=[{"CUDA_VISIBLE_DEVICES": d} for d in self.gpu_slots],
                                        **self.process_options)
        return self._gpu_pool

    def _pool_for(self, gpu: bool) -> Any:
        """GPU nodes go to GPU workers when the engine has some; without, to the CPU workers
        (gpus=0 runs a GPU pipeline on CPU)."""
        return self.gpu_pool() if gpu and self.gpu_slots else self.process_pool()

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: Results) -> None:
        self.executor.run_items(plan, items, results)

    def run_one(self, plan: Plan, values: dict[str, Any], name: str, events: Any = None) -> dict[str, Any]:
        """`run()`'s item in a worker process (see `runs_in_workers`): its outputs, or its error
        raised (a crash, a timeout, an exception), with the same classification as a map's. Its
        results sink (made only if a map's loop needs one: unwatched, a warm idle worker answers
        the short way, `workers.calls`) delivers the node events that `events` listens to."""
        def sink() -> Results:
            from .results import OneRun
            return OneRun(name, events)
        if events is not None:
            return Executor.run_one(self.executor, plan, values, sink)
        return self.executor.run_one(plan, values, sink)

    def window_runner(self) -> Any:
        """The thread that runs this engine's streamed maps (`Pipeline.imap`), one window at a time."""
        if self._window_runner is None:
            from .streaming import WindowRunner
            self._window_runner = WindowRunner(self)
        return self._window_runner

    def worker_counts(self, peaks: bool = True) -> WorkerCounts:
        """Worker processes started, died and recycled so far, and (`peaks`) the peak memory of those alive."""
        # this engine's pool, and the ones an engine's executor (Dask, Ray) keeps on that engine's workers
        total = WorkerCounts()  # every map asks twice, for its light report: cheap when there are none
        pool, executor = self._process_pool, self._map_executor
        for source in (pool, executor if executor is not pool else None):
            if source is not None:
                counts = source.counts(peaks)
                if counts is not None:
                    total += counts
        return total

    def close(self) -> None:
        """Stop worker processes and threads. Engines also close at interpreter exit. A streamed
        map still running ends (its iterator raises `EngineClosed`); its workers are stopped first,
        so that closing never waits for the items they were running."""
        runner, self._window_runner = self._window_runner, None
        if runner is not None:
            runner.close()
        if self._map_executor is not None and self._map_executor not in (self._process_pool, self._gpu_pool):
            self._map_executor.close()
        for pool in (self._process_pool, self._gpu_pool):
            if pool is not None:
                pool.close()
        self._process_pool = self._gpu_pool = None
        if self._node_pool is not None:
            self._node_pool.shutdown(wait=True)
            self._node_pool = None
        if isinstance(self.map_executor, str):
            self._map_executor = None
        if runner is not None:
            runner.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

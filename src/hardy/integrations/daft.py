"""`DaftEngine`: a map as one Daft query whose UDFs run the compiled plan in Daft's worker
processes (`pip install "hardy[daft]"`).

    from hardy.integrations.daft import DaftEngine
    Pipeline(nodes=[...], engine=DaftEngine())                           # Daft's native runner here
    Pipeline(nodes=[...], engine=DaftEngine(gpus=1, max_concurrency=2))  # Daft's resources per worker
    Pipeline(nodes=[...], engine=DaftEngine(node_resources={"embed": {"gpus": 1}}))  # a node's own
    Pipeline(nodes=[...], engine=DaftEngine(address="ray://head:10001"))  # Daft on a Ray cluster

How a map becomes a query: the items are cut into rows, each row one pickled chunk in a binary
column (at least 4 rows per UDF process that can run at once, at most ROW_ITEMS items each: a row
is one call of the UDF, the unit Daft spreads over its processes), and a `@daft.cls(use_process=True)`
UDF runs each chunk through the same compiled plan as every other engine (results, per-item errors,
cache keys and cache writes identical; `integrations/remote.py`). Python values travel as binary, an
Arrow type, so Daft's process workers are really used (Daft isolates only UDFs whose columns are
Arrow types: seed 003's `force_spawn_method`, by construction). The UDF instance, one per Daft
worker process, compiles its plan and builds the `@stateful` resources its nodes use, once, in its
constructor.

One UDF runs the whole plan unless `node_resources` gives nodes their own Daft resources: the plan
is then cut into stages where the resources change, each stage a UDF of its own running a keyed
sub-plan (every node keyed exactly as in the whole plan, so the cache is shared with every other
engine), and items carry their values from stage to stage. Why not one UDF per node always: Daft
0.7 starts a fresh Python process for every process-isolated UDF in every query (~0.15 s, mostly
importing Daft), one after another along the query, so each UDF costs that per map.

A UDF process that crashes fails the whole query. hardy then bisects the items (the halves that
succeed deliver their results) down to the item that crashes, retries it per the nodes' `retries`,
and runs its nodes one per query to name the node: that item becomes a NodeCrashed carrying the
Python stack the dying process wrote; every other item completes. UDFs run with Daft's retries off
(`max_retries=0`): on Ray, Daft would otherwise restart a crashing actor four times per query.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import sys
import tempfile
from typing import Any, Mapping, Sequence

import cloudpickle

from ..crash import read_stack
from ..engine.core import Engine
from ..errors import did_you_mean
from ..plan import Plan
from ..shipping import dumps, run_items_here, ship_items, ship_plan
from ..stages import cut, merge
from ..stateful import Resource
from .remote import RemoteExecutor, plan_for, require, run_step_remote

daft = require("daft", "daft")

ROW_ITEMS = 2500  # items per Daft row at most; a row is one call of the UDF, Daft's unit of spreading work


def DaftEngine(address: str | None = None, *, gpus: float = 0, cpus: float | None = None,
               max_concurrency: int | None = None, node_resources: Mapping[str, Mapping[str, Any]] | None = None,
               ship_modules: Sequence[str] = (), **engine_options: Any) -> Engine:
    """An Engine whose maps run as Daft queries (see the module docstring). `gpus`, `cpus` and
    `max_concurrency` are Daft's resource requests for each UDF worker process; `node_resources`
    gives named nodes their own (`{"embed": {"gpus": 1}}`), and so their own UDF."""
    return Engine(map_executor=DaftExecutor(address, gpus=gpus, cpus=cpus, max_concurrency=max_concurrency,
                                            node_resources=node_resources, ship_modules=ship_modules),
                  **engine_options)


class _Stage:
    """The UDF class: one instance per Daft worker process (see the module docstring)."""

    def __init__(self, spec: bytes, last: bool, paths: list[str], resources: bytes):
        _prepare_worker(paths)
        self.plan, self.last = plan_for(spec), last
        for resource in cloudpickle.loads(resources):
            resource.instance  # built here, once per worker, like any @daft.cls model

    @daft.method.batch(return_dtype=daft.DataType.binary(), batch_size=1)
    def run(self, states: Any) -> list[bytes]:
        return [dumps(run_stage(self.plan, pickle.loads(raw), self.last)) for raw in states.to_pylist()]


def run_stage(plan: Plan, rows: list[tuple[int, bool, Any]], last: bool) -> list[tuple[int, bool, Any]]:
    """One stage over a row of (index, ok, values so far or the NodeError): failed items pass
    through; the last stage leaves each item's outputs, the others its values so far plus theirs."""
    done = iter(run_items_here(plan, [(i, values) for i, ok, values in rows if ok]))
    out = []
    for i, ok, values in rows:
        if ok:
            _, ok, result = next(done)
            values = merge(values, result, last) if ok else result
        out.append((i, ok, values))
    return out


def _call_here(calls: Any) -> list[bytes]:
    """The one-off UDF: each row a pickled (paths, stack file, pickled (fn, args)); the pickled
    result or exception."""
    out = []
    for raw in calls.to_pylist():
        paths, stack_file, call = pickle.loads(raw)
        _prepare_worker(paths, stack_file)
        fn, args = cloudpickle.loads(call)
        try:
            out.append(cloudpickle.dumps((True, fn(*args))))
        except Exception as exc:
            out.append(cloudpickle.dumps((False, exc)))
    return out


_STACK_FILE: list[Any] = []  # the open file faulthandler writes to (it must stay open)


def _prepare_worker(paths: list[str], stack_file: str | None = None) -> None:
    """In a Daft UDF process: the driver's import paths (Daft starts UDF processes with
    `python -m`, which does not carry sys.path over, so a pipeline's own modules would not import);
    a crash's Python stack, in a file the driver reads (Daft drops a dead UDF process's output);
    and a process that leaves without the interpreter's teardown."""
    import faulthandler
    sys.path.extend(p for p in paths if p not in sys.path)
    if stack_file:
        _STACK_FILE[:] = [open(stack_file, "w")]
        faulthandler.enable(file=_STACK_FILE[0])
    else:
        faulthandler.enable()
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(main, "name", None) == "daft.execution.udf_worker":
        atexit.register(_leave_quietly)


def _leave_quietly() -> None:
    """Runs after the atexit handlers registered later (the user's) and skips the rest of the
    interpreter's teardown: where native libraries crash after the work is done (seed 000; Daft
    itself, 4 runs in 20), and ~20 ms of every process UDF in every query."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _udf_options(where: str, options: dict[str, Any]) -> dict[str, Any]:
    """Daft's resource options, checked here rather than deep inside Daft's planner."""
    unknown = set(options) - {"gpus", "cpus", "max_concurrency"}
    if unknown:
        raise ValueError(f"{where}: unknown option {sorted(unknown)[0]!r}; DaftEngine understands gpus, cpus and "
                         "max_concurrency (Daft's resource requests for a UDF's worker processes).")
    return {k: v for k, v in options.items() if v}


_DAFT_LOG = logging.getLogger("daft_local_execution")
_UDF_DIED = "UDF process closed the connection unexpectedly"  # how Daft says a UDF process died


class _QuietCrashes(logging.Filter):
    """Daft logs an ERROR for every query that fails; while hardy bisects a crash that is a dozen
    lines for one item, which hardy reports once, as that item's NodeCrashed."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Error when running pipeline node")
                    and message.endswith((" hardy", " _call_here")))


class DaftExecutor(RemoteExecutor):
    """The map executor behind DaftEngine."""

    engine = "Daft"

    def __init__(self, address: str | None = None, *, gpus: float = 0, cpus: float | None = None,
                 max_concurrency: int | None = None, node_resources: Mapping[str, Mapping[str, Any]] | None = None,
                 ship_modules: Sequence[str] = ()):
        super().__init__(ship_modules)
        self.address = address
        self.resources = _udf_options("DaftEngine", {"gpus": gpus, "cpus": cpus, "max_concurrency": max_concurrency})
        self.node_resources = {name: _udf_options(f"node_resources[{name!r}]", dict(options))
                               for name, options in (node_resources or {}).items()}
        self._ready = False
        self._stacks: str | None = None

    def _start(self) -> None:
        if self._ready:
            return
        if not any(isinstance(f, _QuietCrashes) for f in _DAFT_LOG.filters):
            _DAFT_LOG.addFilter(_QuietCrashes())
        # Every process UDF imports Daft again, and each import pings Daft's telemetry (~30 ms a
        # query, and a thread that waits on the network); the user's own setting wins.
        os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")
        # Daft's runner is fixed per process by the first query; left to itself, Daft would pick Ray
        # whenever this process has joined a Ray cluster, for any reason.
        if self.address:
            daft.set_runner_ray(address=None if self.address == "auto" else self.address, noop_if_initialized=True)
        else:
            try:
                daft.set_runner_native()
            except daft.exceptions.DaftCoreException:
                pass  # a runner is set already (by the user, or an earlier map): it stays
        self._ready = True

    def _run_map(self, plan: Plan, spec: bytes, items: Sequence[dict[str, Any]], results: Any) -> None:
        udfs = []
        stages = self._stages(plan)
        first = items[0] if items else {}
        for n, (options, stage) in enumerate(stages):
            used = {v for step in stage.steps for _, v in step.args}
            resources = [v for name, v in first.items() if name in used and isinstance(v, Resource)]
            udf_class = daft.cls(_Stage, use_process=True, name_override="hardy", max_retries=0, **options)
            stage_spec = spec if stage is plan else ship_plan(stage)
            udfs.append(udf_class(stage_spec, n == len(stages) - 1, self._paths(), dumps(resources)))
        for i in range(len(items)):
            results.started(i)
        self._run(plan, spec, udfs, items, list(range(len(items))), results)

    def _stages(self, plan: Plan) -> list[tuple[dict[str, Any], Plan]]:
        """The plan cut where the UDF options change (`hardy.stages.cut`, shared with the local
        pool's GPU workers): one stage is the plan itself; several are keyed plans."""
        unknown = set(self.node_resources) - {n.name for n in plan.graph.nodes}
        if unknown:
            name = sorted(unknown)[0]
            raise ValueError(f"DaftEngine(node_resources=...) names node {name!r}, which is not in this pipeline"
                             f"{did_you_mean(name, [n.name for n in plan.graph.nodes])}.")
        return [(self.resources if options is None else options, stage) for options, stage in cut(plan, self._options)]

    def _options(self, node: Any) -> dict[str, Any]:
        """A node's UDF options: its `node_resources` entry, else the engine's with the node's own
        `@node(gpus=)`."""
        if node.name in self.node_resources:
            return self.node_resources[node.name]
        gpus = getattr(node, "gpus", 0)
        return {**self.resources, "gpus": gpus} if gpus else self.resources

    def _run(self, plan: Plan, spec: bytes, udfs: list[Any], items: Sequence[dict[str, Any]], indices: list[int],
             results: Any) -> None:
        if not indices or results.stop:
            return
        attempts = 1 + max((s.node.retries for s in plan.steps), default=0) if len(indices) == 1 else 1
        size = max(1, min(ROW_ITEMS, -(-len(indices) // (4 * self._workers()))))
        rows = [ship_items(items, indices[s:s + size], wrap=lambda chunk: [(i, True, item) for i, item in chunk])
                for s in range(0, len(indices), size)]
        for _ in range(attempts):
            state = daft.col("state")
            for udf in udfs:
                state = udf.run(state)
            df = daft.from_pydict({"state": daft.Series.from_pylist(rows, name="state", dtype=daft.DataType.binary())})
            try:
                out = df.select(state.alias("state")).to_pydict()["state"]
            except Exception as exc:
                if not self._is_crash(exc):
                    raise self._translate(exc) from exc
                continue
            for raw in out:
                self._deliver(pickle.loads(raw), results)
            return
        if len(indices) > 1:  # bisect: the half without the crash delivers its results
            mid = len(indices) // 2
            self._run(plan, spec, udfs, items, indices[:mid], results)
            self._run(plan, spec, udfs, items, indices[mid:], results)
        else:
            results.fail(indices[0], self._diagnose(plan, spec, items[indices[0]], indices[0]))

    def _workers(self) -> int:
        """How many UDF processes can run at once: at least 4 rows each, so that none idles."""
        if self.resources.get("max_concurrency"):
            return self.resources["max_concurrency"]
        ray = sys.modules.get("ray")
        if self.address and ray is not None and ray.is_initialized():
            return max(1, int(ray.cluster_resources().get("CPU", 1)))
        return os.cpu_count() or 1

    def _paths(self) -> list[str]:
        """The driver's import paths, for UDF processes on this machine (a Ray cluster's workers
        have their own: install the code there, or `ship_modules=`)."""
        return [] if self.address else [p for p in sys.path if p]

    def _call(self, fn: Any, *args: Any) -> Any:
        return self._call_with(self.resources, fn, *args)

    def _call_step(self, handle: Any, k: int, values: dict[str, Any], node: Any) -> Any:
        return self._call_with(self._options(node), run_step_remote, handle, k, values)

    def _call_with(self, options: dict[str, Any], fn: Any, *args: Any) -> Any:
        one_off = {k: v for k, v in options.items() if k != "max_concurrency"}  # one row, one process
        udf = daft.func.batch(return_dtype=daft.DataType.binary(), use_process=True, max_retries=0,
                              **one_off)(_call_here)
        call = pickle.dumps((self._paths(), self._stack_file(), cloudpickle.dumps((fn, args))))
        df = daft.from_pydict({"call": daft.Series.from_pylist([call], name="call", dtype=daft.DataType.binary())})
        ok, value = cloudpickle.loads(df.select(udf(daft.col("call"))).to_pydict()["call"][0])
        if not ok:
            raise value
        return value

    def _stack_file(self) -> str | None:
        """Where a diagnosis call's process writes its stack if it dies (on this machine only)."""
        if self.address:
            return None
        if self._stacks is None:
            self._stacks = tempfile.mkdtemp(prefix="hardy-daft-")
        return os.path.join(self._stacks, "call.txt")

    def _crash_report(self, exc: BaseException) -> tuple[str, str]:
        # Daft's message: the UDF process's empty output after it, or (on Ray) a remote traceback around it
        said = _UDF_DIED if _UDF_DIED in str(exc) else (str(exc).splitlines() or [type(exc).__name__])[0]
        stack_file = self._stack_file()
        return said, read_stack(stack_file) if stack_file else ""

    def _is_crash(self, exc: BaseException) -> bool:
        return _UDF_DIED in str(exc)

    def close(self) -> None:
        if self._stacks is not None:
            shutil.rmtree(self._stacks, ignore_errors=True)
            self._stacks = None

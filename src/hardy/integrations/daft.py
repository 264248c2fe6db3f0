"""`daft_engine()`: a map as one Daft query whose UDFs run the compiled plan in Daft's worker
processes (`pip install "hardy[daft]"`).

    from hardy.integrations.daft import daft_engine
    Pipeline(nodes=[...], engine=daft_engine())                           # Daft's native runner here
    Pipeline(nodes=[...], engine=daft_engine(gpus=1, max_concurrency=2))  # Daft's resources per worker
    Pipeline(nodes=[...], engine=daft_engine(node_resources={"embed": {"gpus": 1}}))  # a node's own
    Pipeline(nodes=[...], engine=daft_engine(address="ray://head:10001"))  # Daft on a Ray cluster

How a map becomes a query: the items are cut into rows, each row one pickled chunk in a binary
column (at least 4 rows per UDF process that can run at once, at most ROW_ITEMS items each: a row
is one call of the UDF, the unit Daft spreads over its processes), and a `@daft.cls(use_process=True)`
UDF runs each chunk through the same compiled plan as every other engine (results, per-item errors,
cache keys and cache writes identical), in hardy's worker process under the UDF process
(`integrations/remote.py`: crashes and timeouts cost one item, as with map_executor="process").
Python values travel as binary, an Arrow type, so Daft's process workers are really used (Daft
isolates only UDFs whose columns are Arrow types: what HyperNodes' `force_spawn_method` was for).
The UDF instance, one per Daft worker process, compiles its plan once; `@stateful` resources are
built once in the hardy worker that runs the nodes.

One UDF runs the whole plan unless `node_resources` (or `@node(gpus=)`) gives nodes their own Daft resources: the plan
is then cut into stages where the resources change, each stage a UDF of its own running a keyed
sub-plan (every node keyed exactly as in the whole plan, so the cache is shared with every other
engine), and items carry their values from stage to stage. Why not one UDF per node always: Daft
0.7 starts a fresh Python process for every process-isolated UDF in every query (~0.15 s, mostly
importing Daft), one after another along the query, so each UDF costs that per map.

A crashing item does not fail the query (a dead UDF process fails a whole Daft query, which would
leave hardy to bisect the items, running innocents again): the UDF process survives it. UDFs run
with Daft's retries off (`max_retries=0`): on Ray, Daft would otherwise restart a crashing actor
four times per query.
"""

from __future__ import annotations

import _thread
import atexit
import os
import pickle
import select
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.core import Engine
from ..errors import InvalidArgument, NodeCrashed, did_you_mean
from ..model.executor import ResultsSink
from ..parts.stages import cut, merge
from ..plan.compiled import Plan
from ..shipping import Pickled, context, dumps, item_error, ship_each, ship_plan
from ..shipping.context import Travelling
from ..workers.lifeline import end_descendants
from ..workers.replies import handle_logs
from .remote import RemoteExecutor, plan_for, require, run_contained

daft = require("daft", "daft")

ROW_ITEMS = 2500  # items per Daft row at most; a row is one call of the UDF, Daft's unit of spreading work


def daft_engine(address: str | None = None, *, gpus: float = 0, cpus: float | None = None,
                max_concurrency: int | None = None, node_resources: Mapping[str, Mapping[str, Any]] | None = None,
                ship_modules: Sequence[str] = (), **engine_options: Any) -> Engine:
    """An Engine whose maps run as Daft queries (see the module docstring): a function that builds
    one, named for what it returns (HyperNodes' `DaftEngine` class lives in `hardy.compat.hypernodes`).
    `gpus`, `cpus` and `max_concurrency` are Daft's resource requests for each UDF worker process; `node_resources`
    gives named nodes their own (`{"embed": {"gpus": 1}}`), and so their own UDF."""
    return Engine(map_executor=DaftExecutor(address, gpus=gpus, cpus=cpus, max_concurrency=max_concurrency,
                                            node_resources=node_resources, ship_modules=ship_modules),
                  **engine_options)


class _Stage:
    """The UDF class: one instance per Daft worker process (see the module docstring)."""

    def __init__(self, spec: bytes, last: bool, paths: list[str], log: bool = False,
                 caller: Travelling | None = None):
        _prepare_worker(paths)
        if caller is not None:
            caller.take_import_path()
        self.plan, self.last, self.log, self.caller = plan_for(spec), last, log, caller

    @daft.method.batch(return_dtype=daft.DataType.binary(), batch_size=1)  # type: ignore[untyped-decorator]
    def run(self, states: Any) -> list[bytes]:
        """Each row's state: (its items' rows, the log records and warnings of its stages so far,
        for the caller: `remote.kept_logs`; a UDF process is never the caller's)."""
        out = []
        for raw in states.to_pylist():
            rows, logs = pickle.loads(raw)
            out.append(dumps((run_stage(self.plan, rows, self.last, self.log, self.caller, logs), logs)))
        return out


def run_stage(plan: Plan, rows: list[tuple[Any, ...]], last: bool, log: bool = False,
              caller: Travelling | None = None, logs: list[Any] | None = None) -> list[tuple[Any, ...]]:
    """One stage over a row of (index, ok, values so far or the NodeError[, node records so far]):
    failed items pass through; the last stage leaves each item's outputs, the others its values so
    far plus theirs. With `log`, each stage adds its records (nodelog.py) to the item's; `caller`:
    the caller's environment, working directory and argv (`shipping.context`); `logs`: where the
    stage's log records and warnings are kept for the caller (`remote.kept_logs`)."""
    done = iter(run_contained(plan, [(i, Pickled(values) if type(values) is bytes else values)
                                     for i, ok, values, *_ in rows if ok], log, caller, logs))
    out = []
    for i, ok, values, *records in rows:
        if ok:
            _, ok, result, *more = next(done)
            if ok and not last and type(values) is bytes:  # the item as shipped: read only once it ran
                values = pickle.loads(values)
            values = merge(values, result, last) if ok else result
            records = [[*(records[0] if records else []), *more[0]]] if more else records
        out.append((i, ok, values, *records))
    return out


def _prepare_worker(paths: list[str]) -> None:
    """In a Daft UDF process: the driver's import paths (Daft starts UDF processes with
    `python -m`, which does not carry sys.path over, so a pipeline's own modules would not import),
    a process that leaves without the interpreter's teardown, and one that ends with its driver."""
    sys.path.extend(p for p in paths if p not in sys.path)
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(main, "name", None) == "daft.execution.udf_worker":
        atexit.register(_leave_quietly)
        _follow_driver()


def _follow_driver() -> None:
    """End this UDF process, and hardy's fork server and workers under it, once the driver that
    started it (its parent) is gone: Daft leaves them running a node that never returns after a
    Ctrl-C that ended the driver. Not `PR_SET_PDEATHSIG` (`workers/lifeline.py`): it follows the
    parent *thread*, and Daft starts UDF processes from its own query threads, which may end before the
    driver. A pidfd on the driver, which becomes readable as it ends, waited on in a thread."""
    driver = os.getppid()
    try:
        fd = os.pidfd_open(driver)
    except (OSError, AttributeError):  # not Linux 5.3+: Daft's own teardown alone
        return
    if os.getppid() != driver:  # it ended before the pidfd was taken (this process was adopted)
        _orphaned()

    def wait() -> None:
        select.select([fd], [], [])
        _orphaned()

    _thread.start_new_thread(wait, ())


def _orphaned() -> None:
    """The driver is gone: every process under this one (`lifeline.end_descendants`), then this."""
    end_descendants(os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


def _leave_quietly() -> None:
    """Runs after the atexit handlers registered later (the user's) and skips the rest of the
    interpreter's teardown: where native libraries crash after the work is done (torch beside cuML did; Daft
    itself, 4 runs in 20), and ~20 ms of every process UDF in every query."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _udf_options(where: str, options: dict[str, Any]) -> dict[str, Any]:
    """Daft's resource options, checked here rather than deep inside Daft's planner."""
    unknown = set(options) - {"gpus", "cpus", "max_concurrency"}
    if unknown:
        raise InvalidArgument(f"{where}: unknown option {sorted(unknown)[0]!r}; daft_engine() understands gpus, "
                              "cpus and max_concurrency (Daft's resource requests for a UDF's worker processes).")
    return {k: v for k, v in options.items() if v}


_UDF_DIED = "UDF process closed the connection unexpectedly"  # how Daft says a UDF process died


class DaftExecutor(RemoteExecutor):
    """The map executor behind daft_engine()."""

    engine = "Daft"

    def __init__(self, address: str | None = None, *, gpus: float = 0, cpus: float | None = None,
                 max_concurrency: int | None = None, node_resources: Mapping[str, Mapping[str, Any]] | None = None,
                 ship_modules: Sequence[str] = ()):
        super().__init__(ship_modules)
        self.address = address
        self.resources = _udf_options("daft_engine()", {"gpus": gpus, "cpus": cpus, "max_concurrency": max_concurrency})
        self.node_resources = {name: _udf_options(f"node_resources[{name!r}]", dict(options))
                               for name, options in (node_resources or {}).items()}
        self._ready = False
        self._matched = False  # whether a pipeline this engine ran had a node `node_resources` names

    def _start(self) -> None:
        if self._ready:
            return
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

    def _run_map(self, plan: Plan, spec: bytes, items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        udfs = []
        stages = self._stages(plan)
        caller = context.current().travelling()
        for n, (options, stage) in enumerate(stages):
            udf_class = daft.cls(_Stage, use_process=True, name_override="hardy", max_retries=0, **options)
            stage_spec = spec if stage is plan else ship_plan(stage, everything=True)
            udfs.append(udf_class(stage_spec, n == len(stages) - 1, self._paths(), results.log_nodes, caller))
        for i in range(len(items)):
            results.started(i)
        self._run(plan, udfs, items, results)

    def _stages(self, plan: Plan) -> list[tuple[dict[str, Any], Plan]]:
        """The plan cut where the UDF options change (`hardy.parts.stages.cut`, shared with the local
        pool's GPU workers): one stage is the plan itself; several are keyed plans."""
        self._check_names(plan)
        return [(self.resources if options is None else options, stage) for options, stage in cut(plan, self._options)]

    def _check_names(self, plan: Plan) -> None:
        """`node_resources` against this pipeline's nodes. One engine serves several pipelines, so a
        name absent from this one is another's, ignored here; but where neither this pipeline nor
        any earlier one on this engine has any of the names, they are taken for a typo (the
        resources would never apply) and the first is refused."""
        names = {n.name for n in plan.graph.nodes}
        if not self.node_resources or self._matched or not names.isdisjoint(self.node_resources):
            self._matched = self._matched or bool(self.node_resources)
            return
        name = sorted(self.node_resources)[0]
        raise InvalidArgument(f"daft_engine(node_resources=...) names node {name!r}, which is not in this pipeline"
                              f"{did_you_mean(name, sorted(names))}, and no pipeline this engine ran before has any "
                              "node it names: correct the name (an engine used for several pipelines takes a name "
                              "absent from one for another's once a pipeline it ran had one of them).")

    def _options(self, node: Any) -> dict[str, Any]:
        """A node's UDF options: its `node_resources` entry, else the engine's with the node's own
        `@node(gpus=)`."""
        if node.name in self.node_resources:
            return self.node_resources[node.name]
        return {**self.resources, "gpus": node.gpus} if node.gpus else self.resources

    def _run(self, plan: Plan, udfs: list[Any], items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        """The map as one query; should a UDF process itself die (Daft's own out-of-memory kill), once
        more, then its items fail naming Daft's report."""
        size = max(1, min(ROW_ITEMS, -(-len(items) // (4 * self._workers()))))
        rows: dict[int, bytes] = {}  # each row's pickle by its first item
        for s in range(0, len(items), size):  # an item that cannot be pickled fails here, alone
            blobs, bad = ship_each(items, range(s, min(len(items), s + size)))
            for i, why in bad.items():
                results.fail(i, item_error(plan, i, why))
            if blobs:  # each item's own pickle, opened only in hardy's worker (`shipping.Pickled`)
                rows[blobs[0][0]] = pickle.dumps(([(i, True, blob) for i, blob in blobs], []), protocol=5)
        if not rows:
            return
        for attempt in range(2):
            try:
                self._query(udfs, rows, items, results)
            except Exception as exc:
                if not self._is_crash(exc):
                    translated = self.translate(exc)  # (chained to `exc` unless it is `exc`)
                    raise translated from translated.__cause__
                if attempt:
                    for row in rows.values():
                        for i, *_ in pickle.loads(row)[0]:
                            results.fail(i, NodeCrashed("?", i, f"a Daft UDF process running the map died, "
                                                                f"twice: {_UDF_DIED}"))
                continue
            results.raise_ending()
            return

    def _query(self, udfs: list[Any], rows: dict[int, bytes], items: Sequence[dict[str, Any]],
               results: ResultsSink) -> None:
        """The rows through the UDFs as one query, each row's items delivered as it comes out and
        taken from `rows` (keyed by its first item): a Ctrl-C keeps what finished, and a query
        run again after a UDF process died runs only the rows it had not finished. Daft's own
        Ctrl-C handler stops the query; the iterator is closed here before the interrupt goes on,
        so that no query thread is still running as the interpreter exits (Daft aborts then)."""
        state = daft.col("state")
        for udf in udfs:
            state = udf.run(state)
        column = daft.Series.from_pylist(list(rows.values()), name="state", dtype=daft.DataType.binary())
        out = daft.from_pydict({"state": column}).select(state.alias("state")).iter_rows(results_buffer_size=None)
        try:
            for row in out:
                done, logs = pickle.loads(row["state"])
                del rows[done[0][0]]
                handle_logs(None, logs)  # (before the row's results, as the process executor does)
                self.deliver(done, results, items)
        finally:
            out.close()
        if rows:  # Daft took a Ctrl-C itself ("Received Ctrl-C, shutting down execution engine"): the
            raise KeyboardInterrupt  # query ends early without an error, its Python never hears of it

    def _workers(self) -> int:
        """How many UDF processes can run at once: at least 4 rows each, so that none idles."""
        if self.resources.get("max_concurrency"):
            concurrency: int = self.resources["max_concurrency"]
            return concurrency
        ray = sys.modules.get("ray")
        if self.address and ray is not None and ray.is_initialized():
            return max(1, int(ray.cluster_resources().get("CPU", 1)))
        return os.cpu_count() or 1

    def _paths(self) -> list[str]:
        """The driver's import paths, for UDF processes on this machine (a Ray cluster's workers
        have their own: install the code there, or `ship_modules=`)."""
        return [] if self.address else [p for p in sys.path if p]

    def _is_crash(self, exc: BaseException) -> bool:
        return _UDF_DIED in str(exc)

    def close(self) -> None:
        pass

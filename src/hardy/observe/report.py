"""Run reports: what one `run`/`map` did, per node, per item and per worker.

A `Recorder` is one more callback: it only exists when the engine records reports
(`Engine(report=True)`, `report_dir=` or `HARDY_REPORT_DIR`), so a pipeline that records nothing
keeps its uninstrumented plans. Node statistics come from node events (wherever the node ran:
worker processes and remote engines send theirs back with their results); item timings, the
worker of each item and failures come from the map's `Results` sink, which sees exactly the
items of the top-level call (a nested map's items are not the caller's items).

The report is plain data (`to_dict()` is JSON); the terminal table and the HTML page are
renderings of that data (`report_views.py`), so `hardy report run.json` renders a report written
by another process.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, UntrustedCacheError
from ..model.executor import WorkerCounts
from ..tracebacks import outside_hardy
from .callbacks import CallbackContext, PipelineCallback
from .report_views import FAILURES_SHOWN, rich_tables, to_html

if TYPE_CHECKING:
    from pathlib import Path  # (imported where used: pathlib costs `import hardy` 3 ms)

    from ..errors import NodeError

TIMELINE_LIMIT = 5000  # items drawn on the timeline: the first ones; counts and statistics cover all
REPORT_LIMIT = 256 << 20  # bytes of a report file `load` reads, at most (the stacks of the first FAILURES_SHOWN
# failures, TIMELINE_LIMIT rows, and about 300 bytes for each other failed item: a million failed items fit)
FORMAT = 1


class _NodeStats:
    __slots__ = ("calls", "cached", "failures", "times", "batch_sizes", "batch_times")

    def __init__(self) -> None:
        self.calls = self.cached = self.failures = 0
        self.times = array("d")  # per item (a batched node's: each item's share of its call)
        self.batch_sizes, self.batch_times = array("q"), array("d")  # per call of a batched node


class LiveReport:
    """The bookkeeping of the call being recorded."""

    def __init__(self, pipeline: str, kind: str, items: int, engine: str):
        self.pipeline, self.kind, self.items, self.engine = pipeline, kind, items, engine
        self.wall_start = time.time()
        self.t0 = time.perf_counter()
        self.nodes: dict[str, _NodeStats] = {}
        self.started: dict[int, tuple[float, str]] = {}
        self.ended: dict[int, float] = {}
        self.timeline: list[tuple[int, str, float, float, bool]] = []
        self.node_pids: dict[str, set[int]] = {}  # the worker processes each node ran in
        self.lock = threading.Lock()
        self.workers_before = WorkerCounts()
        self.inputs: list[dict[str, Any]] | None = None  # a map's items: failed ones are kept beside a report file
        self.wall = 0.0

    def node(self, name: str) -> _NodeStats:
        stats = self.nodes.get(name)
        if stats is None:
            with self.lock:
                stats = self.nodes.setdefault(name, _NodeStats())
        return stats

    def item_start(self, i: int, worker: Any) -> None:
        name = threading.current_thread().name if worker is None else f"pid {worker}"
        self.started[i] = (time.perf_counter() - self.t0, name)

    def item_ran(self, i: int, start_ns: int, end_ns: int, pid: int) -> None:
        """When and where item i really ran (logged by its worker): replaces the dispatch time."""
        self.started[i] = (start_ns / 1e9 - self.wall_start, f"pid {pid}")
        self.ended[i] = end_ns / 1e9 - self.wall_start

    def nodes_ran(self, names: Iterable[str], pid: int) -> None:
        """Worker `pid` ran `names` (once per batch of its results): the nodes' peak worker RSS."""
        for name in names:
            self.node_pids.setdefault(name, set()).add(pid)

    def item_end(self, i: int, ok: bool) -> None:
        begun = self.started.pop(i, None)
        end = self.ended.pop(i, None) if self.ended else None
        if begun is not None and len(self.timeline) < TIMELINE_LIMIT:
            self.timeline.append((i, begun[1], begun[0], time.perf_counter() - self.t0 if end is None else end, ok))


class Recorder(PipelineCallback):
    """Collects the events of each top-level call of one pipeline into a `RunReport`."""

    def __init__(self) -> None:
        self._last: RunReport | None = None
        self._pending: tuple[Any, ...] | None = None  # a light report's parts, built when asked for
        self.live: LiveReport | None = None
        self._dag: tuple[str | None, list[str]] | None = None

    @property
    def last(self) -> RunReport | None:
        """The last call's report; a light one is built here, on demand, from what its call kept."""
        if self._pending is not None:
            pipeline, live, failures, workers, succeeded = self._pending
            self._pending = None
            live.engine = repr(pipeline.engine)
            svg, names = self._drawing(pipeline)
            self._last = RunReport(_build(live, failures, workers, svg, names, succeeded))
        return self._last

    def begin(self, pipeline: Any, kind: str, items: int, light: bool = False) -> LiveReport:
        """`light`: a map's report without node statistics (no callback instruments its nodes), kept
        for every map: items, failures, workers, wall time, for a cost of microseconds per map."""
        live = LiveReport(pipeline.name, kind, items, "" if light else repr(pipeline.engine))  # light: named when built
        live.workers_before = pipeline.engine.worker_counts(peaks=not light)
        if not light:
            self.live = live
        return live

    def end(self, pipeline: Any, failures: dict[int, NodeError], succeeded: int | None = None,
            light: LiveReport | None = None) -> RunReport | None:
        """The report of the call that ends; `succeeded`: how many items did (a map stopped at its
        first failure leaves some unrun: neither succeeded nor failed); `light`: the light report
        `begin` started, completed when asked for (`last`). Nothing here may cost the call its
        results: a drawing or a report file that cannot be made is left out, with a warning."""
        live = light or self.live
        assert live is not None
        self.live = None
        live.wall = time.perf_counter() - live.t0
        engine = pipeline.engine
        now = engine.worker_counts(peaks=light is None)
        workers = now.since(live.workers_before).as_dict()
        succeeded = live.items - len(failures) if succeeded is None else succeeded
        if light is not None:
            self._pending = (pipeline, live, dict(failures), workers, succeeded)
            folder = _folder(engine, failures)
            if folder is not None:  # keep_failed_inputs=True: the light report is written, with the inputs
                last = self.last
                assert last is not None
                _write(last, folder, pipeline, live, failures)
            return None
        self._pending = None
        svg, names = self._drawing(pipeline)
        report = RunReport(_build(live, failures, workers, svg, names, succeeded))
        self._last = report
        folder = _folder(engine, failures)
        if folder is not None:
            _write(report, folder, pipeline, live, failures)
        return report

    def _drawing(self, pipeline: Any) -> tuple[str | None, list[str]]:
        """The pipeline's DAG as SVG (once per pipeline: its structure never changes); None without
        the viz extra, where the page lists the nodes instead."""
        if self._dag is None:
            names = [n.name for n in pipeline.graph.order]
            try:
                drawn = pipeline.visualize(depth=None).svg
                svg: str | None = drawn[drawn.index("<svg"):]  # without Graphviz's XML prolog and DOCTYPE
            except Exception:  # no viz extra, or Graphviz refusing a name: the page lists the nodes
                svg = None
            self._dag = (svg, names)
        return self._dag

    # node events (from any thread, process or engine: see module docstring)

    def _name(self, node_id: str, ctx: CallbackContext) -> str:
        path = ctx.hierarchy_path[1:] if ctx.depth > 1 else []
        return "/".join([*path, node_id])

    def on_node_end(self, node_id: str, outputs: dict[str, Any], duration: float, ctx: CallbackContext) -> None:
        if self.live is not None:
            stats = self.live.node(self._name(node_id, ctx))
            stats.calls += 1
            stats.times.append(duration)

    def on_node_cached(self, node_id: str, signature: str, ctx: CallbackContext) -> None:
        if self.live is not None:
            self.live.node(self._name(node_id, ctx)).cached += 1

    def on_batch_end(self, node_id: str, size: int, duration: float, ctx: CallbackContext) -> None:
        if self.live is not None:
            stats = self.live.node(self._name(node_id, ctx))
            stats.batch_sizes.append(size)
            stats.batch_times.append(duration)

    def on_error(self, node_id: str, error: Exception, ctx: CallbackContext) -> None:
        if self.live is not None:
            stats = self.live.node(self._name(node_id, ctx))
            stats.calls += 1
            stats.failures += 1


def _folder(engine: Any, failures: dict[int, NodeError]) -> Path | None:
    """Where the report is written: the engine's report directory, else with failures and
    `keep_failed_inputs=True` the user's own (`crash.kept.default_folder`), else nowhere."""
    if engine.report_dir:
        from pathlib import Path
        return Path(engine.report_dir)
    if failures and engine.keep_failed_inputs:
        from ..crash.kept import default_folder
        try:
            return default_folder(create=True)
        except (OSError, UntrustedCacheError) as exc:  # (HOME=/nonexistent, a read-only mount): the results stay
            warnings.warn(f"hardy: the inputs of {len(failures)} failed item(s) could not be kept: {default_folder()} "
                          f"cannot be made ({exc}); set XDG_STATE_HOME to a folder you can write, or give "
                          "Engine(report_dir=...)", RuntimeWarning, stacklevel=outside_hardy())
    return None


def _write(report: RunReport, folder: Path, pipeline: Any, live: LiveReport, failures: dict[int, NodeError]) -> None:
    """The report's JSON in `folder`, the failed items' inputs beside it. Nothing here may cost the
    call its results: a report that cannot be written is a warning (a full disk, a read-only mount)."""
    path = folder / f"{_slug(live.pipeline)}-{_stamp(live.wall_start)}.json"
    items = live.inputs if failures and pipeline.engine.keep_failed_inputs is not False else None
    kept: list[int] = []
    try:
        if items is not None:
            kept = _keep_failed_inputs(report, path, pipeline, items, failures)
        report.save(path)
        report.path = path
    except (OSError, ValueError, UntrustedCacheError) as exc:
        if items is not None:  # inputs no report names: `hardy replay` starts from the report
            _unkeep(report, path)
        warnings.warn(f"hardy: the run report could not be written to {path} ({exc}); "
                      "pipeline.report() still has it", RuntimeWarning, stacklevel=outside_hardy())
        return
    if kept:  # (said once the report that names them is written)
        import logging  # (here: `import hardy` stays light)
        log = logging.getLogger("hardy.report")
        log.warning("inputs of %d failed item(s) of pipeline %r kept; run one again with: hardy replay %s --item %d",
                    len(kept), pipeline.name, path, kept[0])


def _keep_failed_inputs(report: RunReport, path: Path, pipeline: Any, items: list[dict[str, Any]],
                        failures: dict[int, NodeError]) -> list[int]:
    """The inputs of the first failed items, beside the report, for `hardy replay` (crash/kept.py);
    each failure of the report says where its inputs are, or why they were not kept. The items
    kept, for the log line that says how to replay the first one."""
    from ..crash.kept import FAILURES_KEPT, keep
    from ..shipping.pickling import pickled_by_value
    wanted = sorted(failures)[:FAILURES_KEPT]
    kept = keep(path, pipeline, {i: items[i] for i in wanted if i < len(items)}, pickled_by_value)
    for failure in report.data["failures"]:
        if failure["item"] in kept:
            failure["kept_inputs"] = kept[failure["item"]]
    return [i for i, said in kept.items() if not said.startswith("not kept")]


def _unkeep(report: RunReport, path: Path) -> None:
    """The inputs kept beside `path`, whose report could not be written, removed (`crash.kept.discard`):
    no folder is left that nothing refers to, and the report in memory says so."""
    from ..crash.kept import discard
    discard(path)
    for failure in report.data["failures"]:
        if "kept_inputs" in failure and not failure["kept_inputs"].startswith("not kept"):
            failure["kept_inputs"] = "not kept: the run report could not be written"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:60] or "pipeline"


def _stamp(t: float) -> str:
    import datetime
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def _p95(times: array[float]) -> float:
    if not times:
        return 0.0
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def _failure(i: int, err: NodeError, with_stack: bool = True) -> dict[str, Any]:
    """`with_stack`: keep its stack (a map where everything failed would otherwise make a report of
    a kilobyte per item: the first failures' stacks tell what the rest do)."""
    return {"item": i, **err.reported(), "exitcode": getattr(err, "exitcode", None),
            "stack": failure_stack(err) if with_stack else "", "diagnosis": list(getattr(err, "diagnosis", ()))}


def failure_stack(err: NodeError) -> str:
    """Where a failure happened, as text: the traceback of what the node raised (from the worker it
    ran in), a timeout's stacks of every thread, or a crash's native stack and Python stack."""
    import traceback
    cause = err.__cause__
    stack = getattr(err, "stack", "") or (
        "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)) if cause else "")
    every: str = getattr(err, "stacks", "")  # a timeout's: every thread, native frames with py-spy
    native: str = getattr(err, "native_stack", "")  # a crash's
    if every:
        return every
    if native:
        return f"native stack:\n{native}\nPython stack:\n{stack}"
    return stack


def _batches(s: _NodeStats) -> dict[str, Any]:
    """A batched node's calls: how many, their sizes and their times (nothing for other nodes)."""
    if not s.batch_sizes:
        return {}
    n = len(s.batch_sizes)
    return {"batches": {"calls": n, "items": sum(s.batch_sizes), "size_mean": sum(s.batch_sizes) / n,
                        "size_min": min(s.batch_sizes), "size_max": max(s.batch_sizes),
                        "total_s": sum(s.batch_times), "mean_s": sum(s.batch_times) / n,
                        "p95_s": _p95(s.batch_times)}}


def _build(live: LiveReport, failures: dict[int, NodeError], workers: dict[str, Any], svg: str | None,
           names: list[str], succeeded: int) -> dict[str, Any]:
    import datetime
    wall = live.wall
    peaks = workers["peak_rss"]
    nodes = [{"name": name, "calls": s.calls, "cached": s.cached, "failures": s.failures,
              "total_s": sum(s.times), "mean_s": sum(s.times) / len(s.times) if s.times else 0.0,
              "p95_s": _p95(s.times),
              "peak_rss": max((peaks.get(str(pid), 0) for pid in live.node_pids.get(name, ())), default=0) or None,
              **_batches(s)}
             for name, s in live.nodes.items()]
    return {
        "format": FORMAT, "pipeline": live.pipeline, "kind": live.kind, "engine": live.engine,
        "started_at": datetime.datetime.fromtimestamp(live.wall_start, datetime.timezone.utc).isoformat(),
        "wall_s": wall, "items": live.items, "failed": len(failures), "succeeded": succeeded,
        "items_per_s": live.items / wall if wall > 0 else 0.0,
        "nodes": nodes,
        "failures": [_failure(i, failures[i], k < FAILURES_SHOWN) for k, i in enumerate(sorted(failures))],
        "workers": workers, "timeline": [list(t) for t in sorted(live.timeline)],
        "dag": {"svg": svg, "nodes": names},
    }


class RunReport:
    """The report of one call. `print(report)` shows tables, `.save("run.html"|"run.json")` writes
    a self-contained page or the JSON, `.to_dict()` is the data itself."""

    def __init__(self, data: dict[str, Any]):
        self.data = data
        self.path: Path | None = None  # the file a report directory got (`hardy run` says where), once written

    @classmethod
    def load(cls, path: str | Path) -> RunReport:
        """The report in the JSON file `path`, checked against the schema of what hardy writes
        (`report_schema.py`): raises `InvalidArgument` naming the first field that is not, and
        `OSError` for a file that cannot be read. Whoever wrote the file, what loads renders as text:
        a FIFO, a device, a sparse file or one past `REPORT_LIMIT` bytes is refused before anything
        is read (`InvalidArgument`), so no report can hang the reader or fill its memory."""
        import errno
        import json
        import os
        import stat

        from ..cache.store import unreadable
        from .report_schema import check
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait for a writer
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"{path} is not a regular file (a FIFO, a socket or a device): not read; "
                                      "a run report is a JSON file")
            why = unreadable(st, REPORT_LIMIT)
            if why:
                raise InvalidArgument(f"{path} is not a hardy run report: {why}; not read")
            raw = f.read()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
            data = None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InvalidArgument(f"{path} is not a hardy run report (written by Engine(report_dir=...) or "
                                  "report.save('run.json')).")
        check(data, str(path))
        return cls(data)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def save(self, path: str | Path) -> Path:
        """Writes .html (one file, viewable offline) or .json, by the file's suffix."""
        from pathlib import Path
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".html", ".json"):
            raise InvalidArgument(f"cannot save a run report as {path.name!r}: use a .html or .json file name.")
        path.parent.mkdir(parents=True, exist_ok=True)
        import json

        from ..cache.folders import open_named
        text = to_html(self.data) if suffix == ".html" else json.dumps(self.data, indent=1)
        # a message may hold what no UTF-8 can (a file name's undecodable bytes): shown escaped. Written
        # whole, through the folder's descriptor, to a fresh name renamed into place: a reader never sees
        # half a report, and a link another user planted in a shared report folder is replaced, not followed
        with open_named(str(path.parent), private=False) as folder:
            folder.write(path.name, text.encode("utf-8", errors="backslashreplace"), mode=None)
        return path

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from rich_tables(self.data)

    def __str__(self) -> str:
        import io

        from rich.console import Console
        console = Console(width=120, record=True, file=io.StringIO(), color_system=None)
        console.print(self)
        return console.export_text()

    def __repr__(self) -> str:
        d = self.data
        return (f"<RunReport {d['kind']} of {d['pipeline']!r}: {d['succeeded']}/{d['items']} items ok, "
                f"{d['wall_s']:.3f} s>")

    def _repr_html_(self) -> str:
        return to_html(self.data)

"""OpenTelemetry spans, collected by the SDK's in-memory exporter: nesting under the caller's span,
cache hits, threads, nested pipelines, and items that ran (and crashed) in worker processes."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("opentelemetry.sdk", reason='needs the otel extra: pip install -e ".[otel]"')
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

from hardy import DiskCache, Engine, MapError, Pipeline, node  # noqa: E402
from hardy.observe import OpenTelemetryCallback  # noqa: E402
from test_report import prepare, score  # noqa: E402  (x=3 raises ValueError, x=7 segfaults its worker)

pytestmark = pytest.mark.usefixtures("in_process_default")  # spans of calls made in this process


@pytest.fixture()
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _tree(exporter: InMemorySpanExporter) -> tuple[dict[int, object], dict[int, list]]:
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    children: dict[int, list] = {}
    for s in spans:
        children.setdefault(s.parent.span_id if s.parent else 0, []).append(s)
    return by_id, children


def test_a_run_nests_under_the_callers_span(traced):
    provider, exporter = traced
    p = Pipeline([prepare, score], callbacks=[OpenTelemetryCallback(provider)], name="scoring")
    with provider.get_tracer("app").start_as_current_span("request") as request:
        p.run(inputs={"x": 1})
    by_id, children = _tree(exporter)
    [run] = children[request.get_span_context().span_id]
    assert run.name == "hardy.run scoring"
    assert [s.name for s in children[run.context.span_id]] == ["hardy.node prepare", "hardy.node score"]
    assert all(s.attributes["hardy.worker.pid"] == os.getpid() for s in children[run.context.span_id])


def test_an_isolated_nodes_span_names_the_worker_it_ran_in(traced):
    provider, exporter = traced
    p = Pipeline([prepare, node(output_name="b", isolate=True)(score.func)], callbacks=[OpenTelemetryCallback(provider)])
    p.run(inputs={"x": 1})
    pids = {s.name: s.attributes["hardy.worker.pid"] for s in exporter.get_finished_spans() if "node" in s.name}
    assert pids["hardy.node prepare"] == os.getpid() and pids["hardy.node score"] not in (None, os.getpid())


def test_map_items_nodes_cache_hits_and_errors(traced, tmp_path):
    provider, exporter = traced
    p = Pipeline([prepare, score], callbacks=[OpenTelemetryCallback(provider)], name="scoring",
                 cache=DiskCache(tmp_path / "c"), engine=Engine(map_executor="threaded", workers=3))
    for _ in range(2):
        p.map(inputs={"x": [1, 2, 3]}, map_over="x", on_error="continue")
    by_id, children = _tree(exporter)
    maps = [s for s in by_id.values() if s.name == "hardy.map scoring"]
    assert len(maps) == 2 and all(m.parent is None for m in maps)
    for m, cached in zip(maps, (False, True)):
        items = children[m.context.span_id]
        assert sorted(s.attributes["hardy.item"] for s in items) == [0, 1, 2]
        failed = next(s for s in items if s.attributes["hardy.item"] == 2)
        assert failed.status.status_code == StatusCode.ERROR and "ValueError" in failed.status.description
        ok = next(s for s in items if s.attributes["hardy.item"] == 0)
        nodes = children[ok.context.span_id]
        assert [(s.name, s.attributes["hardy.cache_hit"]) for s in nodes] == [
            ("hardy.node prepare", cached), ("hardy.node score", cached)]


def test_nested_pipeline_map_spans(traced):
    provider, exporter = traced
    inner = Pipeline([prepare], name="inner")
    outer = Pipeline([inner.as_node(name="each", map_over="x")], callbacks=[OpenTelemetryCallback(provider)],
                     name="outer")
    assert outer.run(inputs={"x": [1, 2]}) == {"a": [2, 3]}
    by_id, children = _tree(exporter)
    [run] = children[0]
    [each] = children[run.context.span_id]
    [nested] = children[each.context.span_id]
    [inner_map] = children[nested.context.span_id]
    assert (run.name, each.name, nested.name, inner_map.name) == (
        "hardy.run outer", "hardy.node each", "hardy.pipeline inner", "hardy.map inner")
    items = children[inner_map.context.span_id]
    assert [[n.name for n in children[i.context.span_id]] for i in items] == [["hardy.node prepare"]] * 2


def test_items_from_worker_processes_carry_pid_and_signal(traced):
    provider, exporter = traced
    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline([prepare, score], callbacks=[OpenTelemetryCallback(provider)], name="scoring", engine=engine)
        p.map(inputs={"x": list(range(10))}, map_over="x", on_error="continue")
    by_id, children = _tree(exporter)
    [m] = [s for s in by_id.values() if s.name == "hardy.map scoring"]
    items = {s.attributes["hardy.item"]: s for s in children[m.context.span_id]}
    assert sorted(items) == list(range(10))
    assert {s.attributes["hardy.worker.pid"] for s in items.values()}.isdisjoint({os.getpid()})
    crashed = items[7]
    assert crashed.status.status_code == StatusCode.ERROR and crashed.attributes["hardy.signal"] == "SIGSEGV"
    for i, item in items.items():  # node spans came back from the workers, timed there
        nodes = children[item.context.span_id]
        if i == 7:  # the worker died in score: its span comes from the parent, with the signal
            assert [(n.name, n.attributes["hardy.signal"]) for n in nodes] == [("hardy.node score", "SIGSEGV")]
            continue
        assert [n.name for n in nodes] == ["hardy.node prepare", "hardy.node score"]
        assert {n.attributes["hardy.worker.pid"] for n in nodes} == {item.attributes["hardy.worker.pid"]}
        first, second = nodes
        assert first.start_time <= first.end_time <= second.start_time <= second.end_time
        assert (second.status.status_code == StatusCode.ERROR) == (i == 3)


@node(output_name="y", retries=1)
def crash_once(x: int, marker: str) -> int:
    if x == 2 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return x


def test_a_retried_item_says_so(traced, tmp_path):
    provider, exporter = traced
    with Engine(map_executor="process", workers=2) as engine:
        p = Pipeline([crash_once], callbacks=[OpenTelemetryCallback(provider)], engine=engine)
        out = p.map(inputs={"x": [0, 1, 2, 3], "marker": str(tmp_path / "crashed")}, map_over="x")
    assert [o["y"] for o in out] == [0, 1, 2, 3]
    spans = exporter.get_finished_spans()
    items = {s.context.span_id: s for s in spans if s.name.startswith("hardy.item")}
    attempts: dict[int, list] = {}  # item -> its node spans: (retry, signal, pid), in the order they ended
    for n in (s for s in spans if s.name == "hardy.node crash_once"):
        item = items[n.parent.span_id]
        attempts.setdefault(item.attributes["hardy.item"], []).append(
            (n.attributes["hardy.retry"], n.attributes.get("hardy.signal"), n.attributes["hardy.worker.pid"]))
    assert {i: [a[:2] for a in runs] for i, runs in attempts.items()} == {
        0: [(0, None)], 1: [(0, None)], 2: [(0, "SIGSEGV"), (1, None)], 3: [(0, None)]}  # the attempt that died too
    (_, _, dead), (_, _, replacement) = attempts[2]
    assert dead != replacement and {i.attributes["hardy.item"]: i.attributes["hardy.worker.pid"]
                                    for i in items.values()}[2] == replacement  # the item ran in the replacement


@pytest.mark.parametrize("stop", ["close", "raise"])
def test_an_imap_stopped_early_ends_its_spans(traced, stop):
    provider, exporter = traced
    p = Pipeline([prepare, score], callbacks=[OpenTelemetryCallback(provider)], name="streamed")
    stream = p.imap(inputs={"x": list(range(5))}, map_over="x", on_error="raise" if stop == "raise" else "continue")
    if stop == "close":
        next(stream)
        stream.close()
    else:
        with pytest.raises(MapError):
            list(stream)
    p.run(inputs={"x": 1})
    spans = exporter.get_finished_spans()
    [streamed] = [s for s in spans if s.name == "hardy.map streamed"]
    [run] = [s for s in spans if s.name == "hardy.run streamed"]
    assert run.parent is None  # a trace of its own: not under a map span left open
    assert all(s.parent.span_id == streamed.context.span_id for s in spans if s.name.startswith("hardy.item"))

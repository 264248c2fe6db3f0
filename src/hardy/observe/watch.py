"""The one route by which a call of a pipeline is observed.

A `Watch` holds everything that observes one call (`run`, `map`, or one window of an `imap`):
its progress bar, the callbacks' events and the run report being recorded. `Pipeline` makes one
per call and hands it to the results sink (`engine/results.py`), which tells it of each item's
start and end wherever the item ran; the call itself runs inside `around` (`run` for a `run()`,
`streamed` for an `imap`), which opens the pipeline's events (and a map's start and end). Nothing
else observes a call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..crash.containment import contained
from ..errors import Failed, MapError, NodeError
from .callbacks import in_call
from .events import Events
from .progress import MapProgress

if TYPE_CHECKING:
    from .callbacks import PipelineCallback
    from .report import LiveReport, Recorder


@dataclass
class Watch:
    """`report`: the full run report being recorded (Engine(report=True)); `light`: the light one
    every top-level map keeps instead; `recorder`: the pipeline's, which completes either."""

    progress: MapProgress
    events: Events | None = None
    report: LiveReport | None = None
    light: LiveReport | None = None
    recorder: Recorder | None = None

    @classmethod
    def begin(cls, pipeline: Any, kind: str, n: int, bar: MapProgress, items: Sequence[dict[str, Any]] | None,
              observers: Sequence[PipelineCallback], recorder: Recorder) -> Watch:
        """What observes a call of `pipeline` (`kind`: "run", "map" or "imap", of `n` items): `bar`,
        the events of the callbacks `observers` (reading `items`), and the run report `recorder`
        records for a top-level call (Engine(report=True)), or for a map the light one every map keeps."""
        events = None
        if observers:
            events = Events(observers, pipeline.name, items) if items is not None else Events(observers)
        top = not in_call() and not contained()
        engine = pipeline.engine
        report = recorder.begin(pipeline, kind, n) if engine.reporting and top else None
        if report is not None and kind == "map":
            report.inputs = list(items or ())
        light = recorder.begin(pipeline, kind, n, light=True) if report is None and top and kind == "map" else None
        if light is not None and engine.keep_failed_inputs:
            light.inputs = list(items or ())  # kept beside its report if an item fails
        return cls(bar, events, report, light, recorder)

    @classmethod
    def quiet(cls, n: int, name: str) -> Watch:
        """Nothing observes: a sink inside an isolated call, a remote chunk or a worker."""
        return cls(MapProgress(n, name, False))

    def window(self, events: Events | None) -> Watch:
        """One window of a stream: its own events (they read its items), the stream's bar and report."""
        return Watch(self.progress, events, self.report)

    def around(self, pipeline_id: str, inputs: dict[str, Any], call: Callable[[], Any],
               node_ids: Sequence[str], items: int | None) -> Any:
        """`call()` inside the pipeline's events: a run (`items` None) announces itself, a map of
        `items` items (they announce themselves) has its start and end."""
        if self.events is None:
            return call()
        if items is None:
            return self.events.pipeline(pipeline_id, inputs, call, node_ids)
        events = self.events

        def mapped() -> dict[str, Any]:
            events.emit("on_map_start", items)
            start = time.perf_counter()
            call()
            events.emit("on_map_end", time.perf_counter() - start)
            return {}
        return events.pipeline(pipeline_id, inputs, mapped, node_ids, announce=False)

    def finish(self, pipeline: Any, failures: dict[int, NodeError], succeeded: int | None = None) -> None:
        """The call ended (also by raising or an interruption): its report is complete."""
        if self.recorder is not None and (self.report is not None or self.light is not None):
            self.recorder.end(pipeline, failures, succeeded, self.light)

    def run(self, pipeline: Any, inputs: dict[str, Any], call: Callable[[], dict[str, Any]],
            node_ids: Sequence[str]) -> dict[str, Any]:
        """`call()`, one `run()` of `pipeline`, observed: inside its events (`around`), and as the
        one item of its run report, which is complete when the call returns or raises."""
        if self.report is None:
            out: dict[str, Any] = self.around(pipeline.name, inputs, call, node_ids, None)
            return out
        self.report.item_start(0, None)
        try:
            out = self.around(pipeline.name, inputs, call, node_ids, None)
        except NodeError as err:
            self.report.item_end(0, False)
            self.finish(pipeline, {0: err})
            raise
        self.report.item_end(0, True)
        self.finish(pipeline, {})
        return out

    def streamed(self, pipeline_id: str, inputs: dict[str, Any], outcomes: Iterator[Any],
                 node_ids: Sequence[str], items: int | None) -> Iterator[Any]:
        """An `imap`'s `outcomes` inside the pipeline's events, with a map's start and end (`outcomes`
        itself when no callback listens)."""
        if self.events is None:
            return outcomes
        return self._streamed(self.events, pipeline_id, inputs, outcomes, node_ids, items)

    @staticmethod
    def _streamed(events: Events, pipeline_id: str, inputs: dict[str, Any], outcomes: Iterator[Any],
                  node_ids: Sequence[str], items: int | None) -> Iterator[Any]:
        with events.opened(pipeline_id, inputs, node_ids, announce=False):
            events.emit("on_map_start", items)
            start = time.perf_counter()
            try:
                yield from outcomes
            finally:  # also when the consumer stops early, or a failure raises: as a map's end
                events.emit("on_map_end", time.perf_counter() - start)

    def recorded(self, pipeline: Any, outcomes: Iterator[Any]) -> Iterator[Any]:
        """An `imap`'s `outcomes`, noting the failures among them for the run report, which is
        complete when the stream ends, raises or is closed (the report then covers the items handed
        out)."""
        failures: dict[int, NodeError] = {}
        seen = 0
        try:
            for value in outcomes:
                outcome = value[1] if type(value) is tuple else value  # imap(indexed=True)'s pairs
                if type(outcome) is Failed:
                    failures[seen if outcome.error.item is None else outcome.error.item] = outcome.error
                seen += 1
                yield value
        except MapError as exc:
            failures.update(exc.failures)
            seen += len(exc.failures)
            raise
        finally:
            if self.report is not None:
                self.report.items = seen
            self.finish(pipeline, failures)

"""The one route by which a call of a pipeline is observed.

A `Watch` holds everything that observes one call (`run`, `map`, or one window of an `imap`):
its progress bar, the callbacks' events and the run report being recorded. `Pipeline` makes one
per call and hands it to the results sink (`engine/results.py`), which tells it of each item's
start and end wherever the item ran; the call itself runs inside `around`, which opens the
pipeline's events (and a map's start and end). Nothing else observes a call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .progress import MapProgress

if TYPE_CHECKING:
    from ..errors import NodeError
    from .events import Events
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

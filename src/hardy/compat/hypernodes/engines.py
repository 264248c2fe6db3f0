"""`hypernodes.engines`: HyperNodes' engines as hardy Engines.

An engine carries HyperNodes' `cache=` and `callbacks=`; a compat Pipeline reports to its
engine's callbacks. Work runs through hardy's executors: `DaskEngine` on a Dask cluster
(hardy's DaskExecutor), `DaftEngine` as Daft queries (hardy's `daft_engine()`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...engine import Engine
from ...observe import PipelineCallback

_EXECUTORS = {"sequential": "sequential", "async": "async", "threaded": "threaded", "parallel": "process"}
_DAFT_OPTIONS = ("gpus", "cpus", "max_concurrency")


def _reporting(engine: Engine, callbacks: Sequence[PipelineCallback] | None, name: str) -> Engine:
    """`engine` with HyperNodes' callbacks and name (which a callback's `supported_engines` lists)."""
    engine.callbacks = list(callbacks or [])  # type: ignore[attr-defined]
    engine.hypernodes_name = name  # type: ignore[attr-defined]
    return engine


def check_callbacks(callbacks: Sequence[PipelineCallback], engine: Engine) -> None:
    """HyperNodes refuses to run with a callback whose `supported_engines` leaves the engine out."""
    name = getattr(engine, "hypernodes_name", type(engine).__name__)
    for cb in callbacks:
        supported = getattr(cb, "supported_engines", None)
        if supported and name not in supported:
            raise ValueError(f"Callback {type(cb).__name__} is not compatible with engine {name}. "
                             f"Supported engines: {supported}")


class SeqEngine(Engine):
    """HyperNodes' default engine: nodes and map items one after another, in this process."""

    def __init__(self, cache: Any = None, callbacks: Sequence[PipelineCallback] | None = None):
        super().__init__(map_executor="sequential", cache=cache)
        _reporting(self, callbacks, "SeqEngine")


def HypernodesEngine(node_executor: str = "sequential", map_executor: str = "sequential",
                     max_workers: int | None = None, cache: Any = None,
                     callbacks: Sequence[PipelineCallback] | None = None) -> Engine:
    """HyperNodes' older engine: `node_executor` / `map_executor` in sequential|async|threaded|parallel;
    "parallel" maps run in hardy's crash-containing worker processes."""
    node_mode = _EXECUTORS.get(node_executor, node_executor)
    if node_mode == "process":  # hardy isolates single nodes with @node(isolate=True) instead
        node_mode = "sequential"
    engine = Engine(node_executor=node_mode, map_executor=_EXECUTORS.get(map_executor, map_executor),
                    workers=max_workers, cache=cache)
    return _reporting(engine, callbacks, "HypernodesEngine")


def DaskEngine(scheduler: str = "threads", num_workers: int | None = None, workload_type: str = "mixed",
               npartitions: int | None = None, cache: Any = None,
               callbacks: Sequence[PipelineCallback] | None = None) -> Engine:
    """Maps run on a local Dask cluster of `num_workers` processes. `scheduler`, `workload_type` and
    `npartitions` are accepted for compatibility; hardy sizes its Dask tasks from measured item times."""
    from ...integrations.dask import DaskExecutor
    return _reporting(Engine(map_executor=DaskExecutor(workers=num_workers), cache=cache), callbacks, "DaskEngine")


def DaftEngine(use_batch_udf: bool = True, default_daft_config: Mapping[str, Any] | None = None,
               cache: Any = None, callbacks: Sequence[PipelineCallback] | None = None,
               force_spawn_method: bool = True) -> Engine:
    """Maps run as Daft queries (hardy's `daft_engine()`). `default_daft_config`'s gpus, cpus and
    max_concurrency become the UDF's resource requests; hardy's UDF always runs in its own process
    (crash isolation), so `use_process` and `use_batch_udf` are accepted and have nothing to change.
    `force_spawn_method` (older HyperNodes) is accepted: hardy never forks a process holding torch."""
    from ...integrations.daft import daft_engine
    config = dict(default_daft_config or {})
    options = {k: config[k] for k in _DAFT_OPTIONS if k in config}
    return _reporting(daft_engine(cache=cache, **options), callbacks, "DaftEngine")


__all__ = ["SeqEngine", "DaskEngine", "DaftEngine", "HypernodesEngine"]

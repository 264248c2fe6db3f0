"""HyperNodes 0.4 names on top of hardy: switch with `from hardy.compat.hypernodes import ...`.

Everything here is hardy itself under HyperNodes' names and signatures; there is no second
implementation. HyperNodes' "parallel" executor (loky processes) maps to hardy's crash-containing
"process" executor.
"""

from __future__ import annotations

from ..engine import Engine
from ..errors import CycleError, HardyError, MissingInputError, NodeError
from ..node import Node, node
from ..observe import CallbackContext, PipelineCallback
from ..pipeline import Pipeline

HyperNodesError = HardyError
DependencyError = MissingInputError
ExecutionError = NodeError

_EXECUTORS = {"sequential": "sequential", "async": "async", "threaded": "threaded", "parallel": "process"}


def HypernodesEngine(node_executor: str = "sequential", map_executor: str = "sequential",
                     max_workers: int | None = None) -> Engine:
    """HyperNodes' engine: `node_executor` / `map_executor` in sequential|async|threaded|parallel."""
    node_mode = _EXECUTORS.get(node_executor, node_executor)
    if node_mode == "process":  # hardy isolates single nodes with @node(isolate=True) instead
        node_mode = "sequential"
    return Engine(node_executor=node_mode, map_executor=_EXECUTORS.get(map_executor, map_executor),
                  workers=max_workers)


def SeqEngine() -> Engine:
    """HyperNodes' sequential engine."""
    return Engine()


__all__ = ["Pipeline", "node", "Node", "SeqEngine", "HypernodesEngine", "PipelineCallback",
           "CallbackContext", "HyperNodesError", "CycleError", "DependencyError", "ExecutionError"]

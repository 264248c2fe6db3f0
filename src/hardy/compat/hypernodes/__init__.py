"""HyperNodes 0.4.8 on top of hardy: switch with `from hardy.compat.hypernodes import ...`.

Every name and submodule of HyperNodes' public API (`engines`, `cache`, `callbacks`, `telemetry`)
is here, with HyperNodes' signatures and behaviour; all of it is an adapter over hardy's core, so
there is no second execution path. Where hardy deliberately behaves differently, the difference
and its reason are in docs/hypernodes.md.
"""

from __future__ import annotations

from typing import Protocol

from ...api.visualize import STYLES as DESIGN_STYLES
from ...api.visualize import Theme as GraphvizTheme
from ...errors import CycleError, GraphError, HardyError, NodeError
from ...model.node import Node
from ...model.stateful import stateful
from ...observe import CallbackContext, PipelineCallback
from .cache import DiskCache
from .engines import DaskEngine, HypernodesEngine, SeqEngine
from .pipeline import DualNode, Pipeline, node
from .pipeline_node import PipelineNode

HyperNodesError = HardyError
DependencyError = GraphError  # duplicate outputs, self-dependencies (HyperNodes: DependencyError)
ExecutionError = NodeError

__version__ = "0.4.8"  # the HyperNodes release whose API this follows


class HyperNode(Protocol):
    """What a pipeline accepts as a node (HyperNodes' structural protocol)."""

    name: str
    cache: bool

    @property
    def root_args(self) -> tuple[str, ...]: ...

    @property
    def output_name(self) -> str | tuple[str, ...]: ...


def __getattr__(name: str) -> object:
    # As in HyperNodes, DaftEngine is importable from the package when daft is installed; it is
    # loaded on first use so that importing this module stays fast.
    if name == "DaftEngine":
        from .engines import DaftEngine
        return DaftEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["node", "stateful", "DualNode", "HyperNode", "Node", "Pipeline", "PipelineNode", "SeqEngine",
           "DaskEngine", "HypernodesEngine", "DiskCache", "PipelineCallback", "CallbackContext",
           "GraphvizTheme", "DESIGN_STYLES", "HyperNodesError", "CycleError", "DependencyError",
           "ExecutionError", "__version__"]

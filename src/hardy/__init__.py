"""hardy: pipelines of plain Python functions that survive native crashes.

    from hardy import node, Pipeline, Engine

The public surface is re-exported here; everything else is an implementation detail.
"""

from .engine import Engine
from .errors import (
    CycleError,
    DuplicateOutputError,
    Failed,
    GraphError,
    HardyError,
    InvalidArgument,
    InvalidArgumentType,
    MapError,
    MapInterrupted,
    MissingInputError,
    NodeCrashed,
    NodeError,
    NodeTimeout,
    UnknownInputError,
    UnknownOutputError,
)
from .node import Node, node
from .observe import CallbackContext, PipelineCallback
from .pipeline import Pipeline, PipelineNode
from .stateful import stateful

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The cache (sqlite3, pickle, hmac) and Daft load on first use, keeping `import hardy` fast;
    # DaftEngine stays out of __all__ so that `import *` works without the daft extra.
    if name == "DiskCache":
        from .cache import DiskCache
        return DiskCache
    if name == "DaftEngine":
        from .integrations.daft import DaftEngine
        return DaftEngine
    raise AttributeError(f"module 'hardy' has no attribute {name!r}")

__all__ = [
    "node", "Node", "Pipeline", "PipelineNode", "Engine", "Failed", "stateful", "DiskCache",
    "PipelineCallback", "CallbackContext",
    "HardyError", "InvalidArgument", "InvalidArgumentType", "GraphError", "CycleError", "DuplicateOutputError",
    "MissingInputError",
    "UnknownInputError", "UnknownOutputError", "NodeError", "NodeCrashed", "NodeTimeout", "MapError", "MapInterrupted",
    "__version__",
]

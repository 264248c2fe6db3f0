"""hardy: pipelines of plain Python functions that survive native crashes.

    from hardy import node, Pipeline, Engine

The public surface is re-exported here; everything else is an implementation detail.
"""

from .engine import Engine
from .errors import (
    BatchShapeError,
    CacheUnavailable,
    CudaError,
    CycleError,
    DebuggerUnavailable,
    DuplicateNodeError,
    DuplicateOutputError,
    EngineClosed,
    Failed,
    GpuOutOfMemory,
    GraphError,
    HardyError,
    HazardError,
    InvalidArgument,
    InvalidArgumentType,
    LazyOutputError,
    MapError,
    MapInputError,
    MapInterrupted,
    MissingInputError,
    NodeCrashed,
    NodeDefinitionError,
    NodeError,
    NodeTimeout,
    NoGpuError,
    OutputCountError,
    PicklingError,
    RemoteError,
    ReplayError,
    ReplicaError,
    SelfDependencyError,
    ShippingError,
    UnencodableOutput,
    UnhashableError,
    UnknownInputError,
    UnknownInputWarning,
    UnknownOutputError,
    UntrustedCacheError,
    WheelError,
    WorkerImportError,
    WorkerStartError,
)
from .nesting import PipelineNode
from .node import Node, node
from .observe import CallbackContext, PipelineCallback
from .pipeline import Pipeline
from .stateful import stateful

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The cache (sqlite3, pickle, hmac) and Daft load on first use, keeping `import hardy` fast;
    # daft_engine() stays out of __all__ so that `import *` works without the daft extra.
    if name == "DiskCache":
        from .cache import DiskCache
        return DiskCache
    if name == "daft_engine":
        from .integrations.daft import daft_engine
        return daft_engine
    raise AttributeError(f"module 'hardy' has no attribute {name!r}")

__all__ = [
    "node", "Node", "Pipeline", "PipelineNode", "Engine", "Failed", "stateful", "DiskCache",
    "PipelineCallback", "CallbackContext",
    # every error hardy raises (hardy/errors.py)
    "HardyError", "InvalidArgument", "InvalidArgumentType", "NodeDefinitionError", "GraphError", "CycleError",
    "DuplicateOutputError", "SelfDependencyError", "DuplicateNodeError", "MissingInputError", "UnknownInputError",
    "UnknownInputWarning", "UnknownOutputError", "MapInputError", "NodeError", "OutputCountError", "NodeCrashed",
    "NodeTimeout", "UnencodableOutput", "ShippingError", "LazyOutputError", "CudaError", "GpuOutOfMemory",
    "NoGpuError", "MapError", "MapInterrupted", "EngineClosed", "DebuggerUnavailable", "RemoteError", "HazardError",
    "WorkerStartError", "PicklingError", "ReplicaError", "WorkerImportError", "UnhashableError", "BatchShapeError",
    "UntrustedCacheError", "CacheUnavailable", "ReplayError", "WheelError",
    "__version__",
]

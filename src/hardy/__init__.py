"""hardy: pipelines of plain Python functions that survive native crashes.

    from hardy import node, Pipeline, Engine

Here is what a script writes (node, Pipeline, Engine, DiskCache, ...) and the errors a caller
catches around a run (a node's error, crash or timeout; a map's; a GPU's); every error hardy
raises, these included, is importable from `hardy.errors`. The rest of the package is
implementation.
"""

from . import system  # noqa: F401  # first: on any platform but Linux, import stops here, saying why
from .api.nesting import PipelineNode
from .api.pipeline import Pipeline
from .engine import Engine
from .errors import (
    CudaError,
    Failed,
    GpuOutOfMemory,
    HardyError,
    MapError,
    MapInterrupted,
    NodeCrashed,
    NodeError,
    NodeTimeout,
)
from .model.node import Node, node
from .model.stateful import stateful
from .observe import CallbackContext, PipelineCallback

__version__ = "0.1.0"

# Errors that used to be importable from `hardy` too; they describe a mistake to fix rather than
# an outcome to catch, and live in `hardy.errors` only. `hardy.X` still resolves, with a warning.
MOVED_TO_ERRORS = frozenset({
    "BatchShapeError", "CacheUnavailable", "CycleError", "DebuggerUnavailable", "DuplicateNodeError",
    "DuplicateOutputError", "EngineClosed", "GraphError", "HazardError", "InvalidArgument", "InvalidArgumentType",
    "LazyOutputError", "MapInputError", "MissingInputError", "NodeDefinitionError", "NoGpuError",
    "OutputCountError", "PicklingError", "RemoteError", "ReplayError", "ReplicaError", "SelfDependencyError",
    "ShippingError", "UnencodableOutput", "UnhashableError", "UnknownInputError", "UnknownInputWarning",
    "UnknownOutputError", "UntrustedCacheError", "WheelError", "WorkerImportError", "WorkerStartError",
})


def __getattr__(name: str) -> object:
    # The cache (sqlite3, pickle, hmac) and Daft load on first use, keeping `import hardy` fast;
    # daft_engine() stays out of __all__ so that `import *` works without the daft extra.
    if name == "DiskCache":
        from .cache import DiskCache
        return DiskCache
    if name == "daft_engine":
        from .integrations.daft import daft_engine
        return daft_engine
    if name in MOVED_TO_ERRORS:
        import warnings

        from . import errors
        warnings.warn(f"hardy.{name} has moved: write `from hardy.errors import {name}` (the old name will go)",
                      DeprecationWarning, stacklevel=2)
        return getattr(errors, name)
    raise AttributeError(f"module 'hardy' has no attribute {name!r}")

__all__ = [
    "node", "Node", "Pipeline", "PipelineNode", "Engine", "Failed", "stateful", "DiskCache",
    "PipelineCallback", "CallbackContext",
    # the errors a caller catches around a run; every error is in hardy.errors
    "HardyError", "NodeError", "NodeCrashed", "NodeTimeout", "MapError", "MapInterrupted", "CudaError",
    "GpuOutOfMemory",
    "__version__",
]

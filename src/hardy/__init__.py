"""hardy: pipelines of plain Python functions that survive native crashes.

    from hardy import node, Pipeline, Engine

Here is what a script writes (node, Pipeline, Engine, DiskCache, ...) and the errors a caller
catches around a run (a node's error, crash or timeout; a map's; a GPU's); every error hardy
raises, these included, is importable from `hardy.errors`. The rest of the package is
implementation.
"""

from typing import TYPE_CHECKING

from . import system  # noqa: F401  # first: on any platform but Linux, import stops here, saying why
from .errors import (
    CudaError,
    Failed,
    ForkRefused,
    GpuOutOfMemory,
    HardyError,
    MapError,
    MapInterrupted,
    NodeCrashed,
    NodeError,
    NodeTimeout,
)

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and editors
    from .api.nesting import PipelineNode
    from .api.pipeline import Pipeline
    from .cache import DiskCache
    from .engine import Engine
    from .model.node import Node, node
    from .model.stateful import stateful
    from .observe.callbacks import CallbackContext, PipelineCallback

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


# The names a script uses load on first use (PEP 562): a fork server imports hardy's worker modules,
# which never need the pipeline API, and a first map waits for that server to boot. They load
# together (they share most of their modules), with the cyclic garbage collector paused: an import
# allocates thousands of objects that nothing frees, and the collections they trigger walk every
# object alive (several ms in all).
API = ("Pipeline", "PipelineNode", "Engine", "node", "Node", "stateful", "PipelineCallback", "CallbackContext")


def __getattr__(name: str) -> object:
    # The cache (sqlite3, pickle, hmac) and Daft load on their own first use; daft_engine() stays
    # out of __all__ so that `import *` works without the daft extra.
    if name in API:
        globals().update(_api())
        return globals()[name]
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


def __dir__() -> list[str]:
    return sorted({*globals(), *API, "DiskCache"})


def _api() -> dict[str, object]:
    from .collector import paused
    with paused():  # (modules: objects that live as long as the process)
        from .api.nesting import PipelineNode
        from .api.pipeline import Pipeline
        from .engine import Engine
        from .model.node import Node, node
        from .model.stateful import stateful
        from .observe.callbacks import CallbackContext, PipelineCallback
    return {"Pipeline": Pipeline, "PipelineNode": PipelineNode, "Engine": Engine, "node": node, "Node": Node,
            "stateful": stateful, "PipelineCallback": PipelineCallback, "CallbackContext": CallbackContext}


__all__ = [
    "node", "Node", "Pipeline", "PipelineNode", "Engine", "Failed", "stateful", "DiskCache",
    "PipelineCallback", "CallbackContext",
    # the errors a caller catches around a run; every error is in hardy.errors
    "HardyError", "NodeError", "NodeCrashed", "NodeTimeout", "MapError", "MapInterrupted", "CudaError",
    "GpuOutOfMemory", "ForkRefused",
    "__version__",
]

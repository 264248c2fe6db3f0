"""Where calls run: the Engine, the results sink, and the in-process executors.

Each name loads with its module on first use (`hardy.lazy`): a script's `from hardy import ...`
needs the Engine alone, and a first map starts its fork server before the executors and the
results sink load (with the plans' machinery they stand on)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports
from ..model.executor import Executor

if TYPE_CHECKING:
    from .core import Engine
    from .in_process import AsyncExecutor, SequentialExecutor, ThreadedExecutor, run_chunk
    from .results import Results

__all__ = ["Engine", "Results", "Executor", "SequentialExecutor", "ThreadedExecutor", "AsyncExecutor",
           "run_chunk"]
__getattr__, __dir__ = exports(__name__, {
    "Engine": "core", "Results": "results", "SequentialExecutor": "in_process", "ThreadedExecutor": "in_process",
    "AsyncExecutor": "in_process", "run_chunk": "in_process"})

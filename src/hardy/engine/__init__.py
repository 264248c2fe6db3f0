"""Where calls run: the Engine, the results sink, and the in-process executors."""

from ..model.executor import Executor
from .core import Engine
from .in_process import AsyncExecutor, SequentialExecutor, ThreadedExecutor, run_chunk
from .results import Results

__all__ = ["Engine", "Results", "Executor", "SequentialExecutor", "ThreadedExecutor", "AsyncExecutor",
           "run_chunk"]

"""Where calls run: the Engine, the results sink, and the in-process executors."""

from .core import Engine
from .executors import AsyncExecutor, Executor, SequentialExecutor, ThreadedExecutor, run_chunk
from .results import Results

__all__ = ["Engine", "Results", "Executor", "SequentialExecutor", "ThreadedExecutor", "AsyncExecutor",
           "run_chunk"]

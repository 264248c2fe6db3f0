"""Crash-containing worker processes.

Data flow (parent = the process calling map; one duplex pipe per worker, no shared lock, so a
dying worker can never leave something locked that the others need):

    parent (pool.py)                                   worker (worker.py)
    ───────────────                                    ──────────────────
    ("plan", id, spec)   ── once per worker per plan ──►  compile the plan locally
    ("chunk", id, items) ── one chunk at a time ───────►  for each item:
                                                            status[item] = i   (shared mmap)
                                                            status[step] = k, start time
                                                            run the compiled plan
    results.ok / fail    ◄── ("results", [...], done) ──  batched every ≥5 ms, and at chunk end
    sentinel readable    ◄── the worker died ──────────   faulthandler → its own file
      → read status + faulthandler file: the item, node, signal and Python stack
      → that item fails (or is retried); unsent items are re-queued; the worker is replaced
    ("stop",)            ── on close / recycling ──────►  flush, os._exit(0): no native finaliser runs
"""

from typing import Any

__all__ = ["WorkerPool"]


def __getattr__(name: str) -> Any:
    # Lazy: fork servers and workers import hardy.workers.* without the parent-side pool.
    if name == "WorkerPool":
        from .pool import WorkerPool
        return WorkerPool
    raise AttributeError(name)

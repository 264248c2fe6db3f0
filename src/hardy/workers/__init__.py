"""Crash-containing worker processes.

Data flow (parent = the process calling map; one socket pair per worker, no shared lock, so a
dying worker can never leave something locked that the others need):

    parent (pool.py, scheduling.py, calls.py)          worker (worker.py, chunks.py), forked
    ───────────────────────────────                    ──────────────────
    Setup(environ, sys.path, cwd, argv)  ── once ────►  set up; never imports the parent's __main__
    Context(changed state) ── when a call's differs ─►  the caller's environment, cwd, argv, sys.path now
    PlanSpec(plan_id, spec, dated) ── once per worker, plan ►  its user modules made the caller's
                                                          (stamps: shipping/replica.py), then the plan
                                                          compiled
    Values(objects)    ◄── Header(need) + names ────   only when big module state differs (it asks)
    Chunk(plan_id, items, ...) ── one at a time ─────►  (modules made the plan's again if another
      short forms (Chunk.wire): (plan_id, pairs);         plan changed them) then for each item:
      consecutive items (plan_id, first, inputs);         status.item = i   (shared mmap)
      a map over one list (plan_id, first,                status.step = k, written by the plan's own
      constants, name, values: plan/columns.py)           code (and its start time, if `dated`)
                                                          run the compiled plan
    results.ok / fail  ◄── Header + pickled batch ───  batched every ≥5 ms, and at chunk end; a batch
      (Header.outputs: the outputs alone)                 whose items all succeeded: their outputs alone
    Resend(items)      ── a batch was unreadable ────►  those items again, one pickle each
    exit status        ◄── from the fork server ─────   the worker died (its group, and every process it
                                                          adopted, is killed: lifeline.py)
      → read status (the item, the step) and the fault record, once (deaths.py); the crash
        package says what the death means (hardy/crash: the walk)
      → that item fails (or is retried; it runs again, unblamed, when the crash was in a Python
        thread it did not start); unsent items are re-queued; the worker is replaced
    Stop()             ── on close / recycling ──────►  flush, end the processes under it, os._exit(0):
                                                          no native finaliser runs (a node's os._exit or
                                                          exit() from C sends its unsent results first)

The messages are the small records of `messages.py`; the status words, `status.py`; a worker's
replies (result batches, resends, last words), `replies.py`. `run()` on a warm engine goes the
short way (`calls.py`): its one item to an idle worker that holds the plan, its outputs back, one
message each way and no map loop; any other answer is handed, where the call stands, to a map
loop (`scheduling.MapRun`). Messages are framed as multiprocessing's Connection frames them, and
read and written with os.read and os.write (`shipping.transport.read_frame`, `write_frame`).

Chunks and result batches carry big array buffers (≥ 1 MiB) out of band: a memfd segment whose
descriptor follows the message on the same socket, mapped by the receiver (`hardy.shipping.transport`).

How workers start and why nothing outlives the parent: `launch.py`, `server.py`, `lifeline.py`.
"""

from typing import Any

__all__ = ["WorkerPool"]


def __getattr__(name: str) -> Any:
    # Lazy: fork servers and workers import hardy.workers.* without the parent-side pool.
    if name == "WorkerPool":
        from .pool import WorkerPool
        return WorkerPool
    raise AttributeError(name)

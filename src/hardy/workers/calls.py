"""One call on a warm worker, the short way: `run()`'s item (or an isolated node's call) sent to an
idle worker that holds the plan, in one message, and its outputs read back from one.

The floor for a call that runs in another process is one round trip: a message each way, and
each side woken once. `call` adds to it what containment needs and nothing else: no scheduling
loop, no thread, no results sink, no selector made per call. Everything else goes through the map
loop (`scheduling.MapRun`), which starts, waits for and loads workers, watches deadlines and
memory, and classifies failures and deaths. A call that finds no idle worker holding its plan, or
whose plan has limits to watch, is a one-item map from the start; a call whose answer is not a
plain result (a question while the plan loads, log records, a failure, big buffers, a death, an
interruption) is handed, where it stands, to a map loop that finishes it (`MapRun.adopt`), so
that every outcome is the map's, written once.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..model.executor import outcome
from ..plan.compiled import Plan
from ..shipping import context, dumps, transport
from . import status as words
from .messages import HEADER_SIZE, plain_outputs
from .process import Unsent
from .scheduling import MapRun

if TYPE_CHECKING:
    from ..model.executor import MapResults
    from .pool import WorkerPool
    from .process import Worker


class _Call:
    """The owner of the slot a call takes (`WorkerPool.take_idle`), one per call: an exception
    raised between two of its first bytecodes (a Ctrl-C, a signal handler's), before anything was
    sent, finds that slot by it and gives it back (`WorkerPool.let_go`), where it would have stayed
    taken, and the next calls waited for it forever."""

    __slots__ = ()


def call(pool: WorkerPool, plan: Plan, item: dict[str, Any], sink: Callable[[], MapResults]) -> dict[str, Any]:
    """`item`'s outputs through `plan` on one of `pool`'s workers, or its error raised, as a
    one-item map gives them; `sink()` makes the results sink, when a map loop needs one."""
    caller = _Call()
    try:
        return _call(pool, plan, item, sink, caller)
    except BaseException:
        pool.let_go(caller)
        raise


def _call(pool: WorkerPool, plan: Plan, item: dict[str, Any], sink: Callable[[], MapResults],
          caller: _Call) -> dict[str, Any]:
    shipped = pool.shipped(plan)
    if (shipped is None or shipped[2] or pool.max_memory is not None or pool.stall_report
            or (taken := pool.take_idle(shipped[0], caller)) is None):  # first call, limits, or no idle worker
        return _mapped(pool, plan, item, sink())
    slot, w = taken
    state = context.current()  # (outside the `try`s below: one that raises gives the slot back in `call`)
    try:
        message = transport.pack((shipped[0], [(0, item)]), dumps)  # (a `Chunk` of nothing but its item)
    except Exception:  # an input that cannot travel: the map loop names it
        pool.free(slot)
        return _mapped(pool, plan, item, sink())
    try:
        w.plan, w.unsent, w.chunk_size = plan, Unsent(range(1)), 1  # (here: an interruption now replaces it)
        w.idle()
        w.follow(state)
        w.send(message)
        data = w.wait(transport.SPIN)
    except OSError:  # it died as we wrote
        message.close()  # (its segments, if it was not sent)
        data = None
    except BaseException as exc:  # interrupted (Ctrl-C): the map loop asks for its last words and replaces it
        message.close()
        _interrupted(_adopted(pool, plan, item, sink(), slot, w), exc)
        raise
    if data is not None and plain_outputs(data) and not transport.packed(data, HEADER_SIZE):
        try:
            outputs = pickle.loads(memoryview(data)[HEADER_SIZE:])
        except Exception:  # unreadable here: the map loop asks for it again
            outputs = None
        if outputs is not None and len(outputs) == 1:
            w.plan, w.unsent = None, Unsent()
            w.tasks += 1
            pool.start_failures = 0
            if pool.max_tasks and w.tasks >= pool.max_tasks:  # recycled
                pool.replace(slot, stop=True)
            pool.free(slot)
            out: dict[str, Any] = outputs[0]
            return out
    results = sink()
    run = _adopted(pool, plan, item, results, slot, w)
    _resume(run, slot, w, data)
    run.loop()
    return outcome(results)


def _adopted(pool: WorkerPool, plan: Plan, item: dict[str, Any], results: MapResults, slot: int,
             w: Worker) -> MapRun:
    """A map loop for the call in flight on worker `w`: its one item is out, `w` holds it in
    `slot`, which the loop now owns."""
    run = MapRun(pool, plan, [item], results)
    run.next_fresh = 1
    pool.hand_over(slot, run)
    return run


def _resume(run: MapRun, slot: int, w: Worker, data: bytes | None) -> None:
    """The adopted call goes on from `data`, what `w` sent (None: it died, or its pipe did)."""
    if data is None and int(w.status.item) == words.IDLE:
        w.process.join(1)
        if not w.process.is_alive():  # before it read the call: as the map loop finds one dead
            run.deaths.while_idle(slot, w)
            return
    alive = data is not None
    if data is not None:
        try:
            alive = not run.take(w, data) or run.receive(w)
        except (EOFError, OSError):  # it died while passing its shared memory
            alive = False
    if not alive:
        run.deaths.on_death(w)


def _interrupted(run: MapRun, exc: BaseException) -> None:
    """The caller was interrupted while the adopted call ran: as the map loop stops when it is
    (the busy worker's last words asked for, then it is replaced)."""
    try:
        run.interrupted(exc)
    finally:
        run.shared.close()
        run.pool.release(run, range(run.pool.size))


def _mapped(pool: WorkerPool, plan: Plan, item: dict[str, Any], results: MapResults) -> dict[str, Any]:
    MapRun(pool, plan, [item], results).loop()
    return outcome(results)

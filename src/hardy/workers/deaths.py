"""The pool's side of a worker's death: which item was in flight, and the queues it goes back to.

`MapRun` (scheduling.py) calls `on_death` for every worker that died or was killed while it held
items. This reads the worker's status words (which item, which step) and its fault record, once
(`crash.autopsy.ended`), asks the crash package what the death means for the item in flight
(`crash.verdict.charge`) and applies the verdict to the map's queues. The walk from a death to
the user's message is in `hardy/crash/__init__.py`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..crash import verdict
from ..crash.autopsy import Ending, ended, examine, outside_items
from ..errors import NodeCrashed, NodeError, ShippingError, WorkerStartError
from ..model.policy import delay
from ..plan.compiled import KEYS, Plan
from ..shipping import Pickled, described, globals_in, readers
from . import status as words
from .process import Worker

if TYPE_CHECKING:
    from ..model.executor import ResultsSink
    from .pool import WorkerPool

log = logging.getLogger("hardy.workers")

MAX_THREAD_RERUNS = 3  # times an item runs again after crashes in threads it did not start, before it fails
RERUN, CHARGE = "rerun", "charge"  # what a crash in a thread the work in flight did not start means (`not_its_thread`)


class Deaths:
    """The part of a map's run (`scheduling.MapRun`) that handles worker deaths. Its inputs: the
    pool and the map (its plan, as shipped; its items; the results sink), when the map began and
    how to take in what a dying worker sent (`receive`); the queues it shares with the scheduling
    loop, which sends their items: `retry` (chunks to send again, first first), `due` (when an
    item's backoff ends), `attempts` (failed runs per item), `sealed` and `singly` (how a chunk is
    sent again) and `poison` (inner items of nested maps to fail, per nested map)."""

    def __init__(self, pool: WorkerPool, plan: Plan, shipped: tuple[int, bytes], items: Sequence[Any],
                 results: ResultsSink, began: float, receive: Callable[[Worker], bool], *, retry: deque[list[int]],
                 due: dict[int, float], attempts: dict[int, int], sealed: dict[int, int], singly: set[int],
                 poison: dict[tuple[Any, ...], dict[int | None, NodeError]]):
        self.pool, self.plan, self.items, self.results, self.began = pool, plan, items, results, began
        self.plan_id, self.plan_msg = shipped
        self.receive = receive
        self.retry, self.due, self.attempts, self.sealed, self.singly = retry, due, attempts, sealed, singly
        self.poison = poison
        self.blameless: dict[int, int] = {}  # items run again after crashes in others' threads (`not_its_thread`)

    def send_sealed(self, chunk: list[int], why: str, alone: bool = False) -> None:
        """A chunk that could not be unpickled in the worker, or whose unpickling killed it, or
        that killed it while its results were pickled: sent again (first) sealed, so that each
        item's inputs are opened one by one (`alone`: and each result is sent alone), and the item
        at fault fails alone (`chunks.open_item`, `died_between_items`). A sealed chunk that fails so
        (nothing an item holds can make it) fails its items: no loop."""
        if self.sealed.get(chunk[0], 0) >= 1 + alone:
            for i in chunk:
                self.results.fail(i, ShippingError(readers(self.plan, None), None, i, f"its chunk could not be "
                                                   f"unpickled in the worker process, even sealed: {why}"))
            return
        self.sealed.update(dict.fromkeys(chunk, 1 + alone))
        size = -(-len(chunk) // (2 * self.pool.size))  # in pieces, for every worker to share: it runs last
        self.retry.extendleft(reversed([chunk[k:k + size] for k in range(0, len(chunk), size)]))

    def split(self, w: Worker, end: Ending) -> int | None:
        """A worker died in a batched node's call: `verdict.split` says which of the items it had
        not answered go back, and how; returns the culprit, when the batch was one item."""
        culprit, suspects, rest = verdict.split(list(w.unsent), w.group)
        if culprit is not None:
            return culprit
        w.unsent = {}
        log.info("a batch of %d items died (%s: %s); running them again one item per call", len(suspects),
                 end.signal, end.reason)
        self.singly.add(suspects[0])
        self.retry.appendleft(suspects)
        if rest:
            self.retry.append(rest)
        return None

    def charge(self, w: Worker, end: Ending, i: int, step: int) -> None:
        """Item i was in flight when worker `w` died: it fails, or runs again (its node's retries;
        or, when it crashed inside a nested map, with that inner item failed), as `verdict.charge`
        says."""
        steps = self.plan.steps
        node = steps[step].node if 0 <= step < len(steps) else (steps[0].node if len(steps) == 1 else None)
        thread = end.record.thread if not end.killed_for else None
        times = self.blameless.get(i, 0)
        said = "" if thread is None else f", in thread {thread['name']!r} ({self.started_by(thread)})" + (
            f", {times} time(s) while this item ran" if times else "")  # its own, or one that kept coming
        found = verdict.charge(end, i, node, _inputs(self.items[i]), self.attempts.get(i, 0), self.poison, said)
        err = found.error
        if found.poison is not None:
            key, item, inner = found.poison
            self.poison.setdefault(key, {})[item] = inner
            what = f"item {item}" if item is not None else "a batch call"
            log.warning("node %r crashed on %s of a nested map (%s): running the enclosing item %d again %s",
                        inner.node, what, inner.reason, i, "without it" if item is not None else "one item per call")
            self.retry.appendleft([i])
            return
        self.attempts[i] = self.attempts.get(i, 0) + 1
        if not found.retry:
            self.results.fail(i, err, worker=w.process.pid)
            return
        retries = node.retries if node else 0
        log.warning("node %r, item %d: %s; retrying (%d of %d)", err.node, i, found.said, self.attempts[i], retries)
        self.retry.appendleft([i])
        self.results.retried(i, err, w.process.pid)
        if node is not None and node.backoff:  # retries > 0: there is a node
            self.due[i] = time.monotonic() + delay(node.backoff, self.attempts[i])

    def on_death(self, w: Worker) -> None:
        pool = self.pool
        slot = pool.workers.index(w) if w in pool.workers else None
        if slot is None:
            return
        if w.status.ready == 1.0:  # (one that dies setting up would fail again)
            pool.died(self.plan_id, self.plan_msg)
        self.receive(w)  # results it sent before dying are kept
        w.process.join(1)
        end = ended(w.fault_path, w.process.exitcode, w.killed_for, w.kill_detail, w.hang)
        item, step = int(w.status.item), int(w.status.step)
        foreign = self.not_its_thread(w, end, item)
        in_flight = item if item in w.unsent and not foreign else None
        if item == words.BATCH and w.unsent and not foreign:
            in_flight = self.split(w, end)
        crash = (end.signal, end.reason, w.process.exitcode, end.record.stack)
        if foreign == RERUN:
            pass  # its items go back below, none blamed (`not_its_thread` said why)
        elif foreign:  # it kept meeting such crashes: the item it holds first is charged, whatever it did
            first = item if item in w.unsent else next(iter(w.unsent))
            del w.unsent[first]
            self.charge(w, end, first, step if first == item else -1)
        elif in_flight is not None and step <= words.OPENING:  # unpickling one input of a sealed item
            del w.unsent[in_flight]
            self.died_opening(in_flight, words.OPENING - step, crash)
        elif in_flight is not None:
            del w.unsent[in_flight]
            self.charge(w, end, in_flight, step)
        elif item == words.BATCH:
            pass  # a batch it died in is queued again one item per call (`split`)
        elif item in (words.READING, words.SENDING, words.LOADING) and w.unsent:
            self.died_between_items(w, item, step, crash)
        elif w.status.ready != 1.0:  # (preload= modules load in the fork server, which says so)
            pool.start_failures += 1
            if pool.start_failures >= 3:  # dies setting up: retrying would loop forever
                pool.replace(slot, stop=False)
                raise WorkerStartError(
                    f"worker processes die while setting up, before reading any work ({end.reason}; 3 in a row). A "
                    f"library in preload_libs= or the worker environment fails to load: see the worker's "
                    f"error above. {end.record.stack}".strip())
        elif w.process.exitcode == words.RETIRED:
            log.info("worker %d retired %s; a fresh one takes its place", w.number,
                     f"because {end.record.exit_how}" if end.record.exit_how else "after a CUDA error")
        else:
            log.warning("a worker died with no item in flight (%s); its results were already kept%s", end.reason,
                        after_return(end, self.plan, self.began))
        if w.unsent:  # innocent items whose results had not been sent yet: run them again
            self.retry.append(list(w.unsent))
        w.unsent = {}
        w.plan = None
        pool.replace(slot, stop=False)

    def not_its_thread(self, w: Worker, end: Ending, item: int) -> str:
        """Whether the worker died in a Python thread that the work in flight did not start (a
        prefetch or I/O thread of an earlier item's node, one started while the plan loaded): RERUN
        when its items then run again, none blamed (a warning names the thread and the item whose
        node started it); CHARGE for an item that keeps dying so, after MAX_THREAD_RERUNS (`charge`
        names the thread), so this never loops; "" when the crash is the work's own: in the main
        thread, in a thread running the plan's code or in a native thread (an OpenMP team), as
        `crash.record.thread_line` tells, or in a thread the item in flight started."""
        thread = end.record.thread
        if thread is None or w.killed_for or not w.unsent:
            return ""
        started = thread.get("started") or [words.IDLE, -1, 0.0, 0.0]
        if started[3] >= self.began and (item >= 0 and started[0] == item or item == words.BATCH and started[0] == item
                                         and started[2] == w.status.step_start):
            return ""  # a thread the item (or the batch call) running now started: its own
        first = item if item in w.unsent else next(iter(w.unsent))
        self.blameless[first] = self.blameless.get(first, 0) + 1
        if self.blameless[first] > MAX_THREAD_RERUNS:
            return CHARGE
        steps, step = self.plan.steps, int(started[1]) if started[3] >= self.began else -1
        death = examine(end.record, end.signal, end.reason, steps[step].node.name if 0 <= step < len(steps) else "?",
                        end.record.threads)
        log.warning("a worker died in thread %r (%s), not in the work in flight: %s. Item(s) %s run again, not "
                    "blamed (%d of %d)%s", thread["name"], self.started_by(thread), death.reason,
                    ", ".join(map(str, w.unsent)), self.blameless[first], MAX_THREAD_RERUNS,
                    f"\nnative stack:\n{death.native_stack}" if death.native_stack else "")
        return RERUN

    def started_by(self, thread: dict[str, Any]) -> str:
        return started_by(thread, self.plan, self.began)

    def died_opening(self, i: int, k: int, crash: tuple[str | None, str, int | None, str]) -> None:
        """Item i's input k killed the worker as it was unpickled there (a sealed chunk's)."""
        signame, text, exitcode, stack = crash
        item, name = self.items[i], None
        if isinstance(item, Pickled):
            what = f"input (types in it: {', '.join(globals_in(item.blob)) or 'builtins only'})"
        else:
            name = list(item)[k] if k < len(item) else "?"
            what = f"input {name!r} ({described(item.get(name))})"
        self.results.fail(i, NodeCrashed(readers(self.plan, name), i, f"the worker process died ({text}) while "
                                         f"unpickling its {what}, before the node ran", signal=signame,
                                         exitcode=exitcode, stack=stack))

    def died_between_items(self, w: Worker, doing: int, count: int,
                           crash: tuple[str | None, str, int | None, str]) -> None:
        """The worker died with no node running: unpickling a chunk (READING: it is sent again
        sealed), pickling a batch of `count` results (SENDING: those items run again sealed, each
        result sent alone; an item alone fails), or loading the pipeline (LOADING: the chunk's
        items fail, as when loading raises). `w.unsent` keeps the innocent items."""
        unsent = list(w.unsent)
        signame, text, exitcode, stack = crash
        if doing == words.READING:
            w.unsent = {}
            self.send_sealed(unsent, f"the worker process died ({text}) unpickling it")
            return
        if doing == words.LOADING:
            w.unsent = {}
            for i in unsent:
                self.results.fail(i, NodeCrashed("<pipeline>", i, f"the worker process died ({text}) while loading "
                                                 "the pipeline (unpickling its nodes, importing their modules)",
                                                 signal=signame, exitcode=exitcode, stack=stack))
            return
        batch = unsent[:max(1, count)]
        w.unsent = dict.fromkeys(unsent[len(batch):])
        if len(batch) > 1:
            self.send_sealed(batch, f"the worker process died ({text}) pickling their results", alone=True)
            return
        producers = [s.node.name for s in self.plan.steps if set(s.node.outputs) & set(self.plan.outputs)]
        self.results.fail(batch[0], NodeCrashed(
            " / ".join(producers) or "?", batch[0], f"the worker process died ({text}) while pickling the item's "
            "result to send it back, after its nodes ran; return plain data (numbers, arrays, dicts, paths)",
            signal=signame, exitcode=exitcode, stack=stack))


def started_by(thread: dict[str, Any], plan: Plan | None, began: float) -> str:
    """Who started a thread, as `crash.record.thread_line` noted it: `started by item 0, in node 'f'` of
    `plan`, the map that began at `began` (monotonic); of an earlier map or run, item and node are
    that one's, so the node is not named."""
    item, step, _, when = thread.get("started") or [words.IDLE, -1, 0.0, 0.0]
    steps = plan.steps if plan is not None and when >= began else ()
    node = f", in node {steps[int(step)].node.name!r}" if 0 <= step < len(steps) else ""
    earlier = "" if when >= began else " of an earlier map or run on this worker"
    if item >= 0:
        return f"started by item {int(item)}{earlier}{node}"
    if item == words.BATCH:
        return f"started by a batch call{earlier}{node}"
    return "started outside any item (while the worker loaded a pipeline, or between items)"


def after_return(end: Ending, plan: Plan | None = None, began: float = 0.0) -> str:
    """What a worker's fault record says of a death outside any item (`crash.autopsy.outside_items`),
    with who started the thread it died in, as lines to add to the warning."""
    thread = end.record.thread
    return outside_items(end, started_by(thread, plan, began) if thread else "")


def _inputs(item: Any) -> dict[str, Any] | None:
    """An item's inputs for an error message; None for one an engine passes unopened (`Pickled`)."""
    return {k: v for k, v in item.items() if k != KEYS} if isinstance(item, dict) else None

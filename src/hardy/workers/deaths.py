"""What a worker's death means for a map: which item was in flight, what killed it, and what runs
again. `MapRun` (scheduling.py) calls `on_death` for every worker that died or was killed while
it held items; the rest of this class decides each item's fate from the worker's status words
and crash file (see the data-flow picture in `hardy/workers/__init__.py`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..crash import BATCH, describe_exit, read_marked, read_nesting, read_stack
from ..errors import NodeCrashed, NodeError, NodeTimeout, ShippingError, WorkerStartError
from ..forensics.frames import examine
from ..plan import KEYS, Plan
from ..policy import delay
from ..shipping import Pickled, described, globals_in, readers
from . import status as words
from .process import Worker

if TYPE_CHECKING:
    from .pool import WorkerPool

log = logging.getLogger("hardy.workers")

MAX_NESTED_CRASHES = 100  # inner items of one nested map that may crash workers before its outer item fails
MAX_THREAD_RERUNS = 3  # times an item runs again after crashes in threads it did not start, before it fails
RERUN, CHARGE = "rerun", "charge"  # what a crash in a thread the work in flight did not start means (`not_its_thread`)


class Deaths:
    """The part of a map's run (`scheduling.MapRun`) that handles worker deaths."""

    pool: WorkerPool
    plan: Plan
    plan_id: int
    plan_msg: bytes
    items: Sequence[Any]
    results: Any
    retry: deque[list[int]]
    due: dict[int, float]
    attempts: dict[int, int]
    sealed: dict[int, int]
    singly: set[int]
    poison: dict[tuple[Any, ...], dict[int | None, NodeError]]
    blameless: dict[int, int]
    began: float
    receive: Callable[[Worker], bool]

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

    def split(self, w: Worker, signame: str | None, text: str) -> int | None:
        """A worker died in a batched node's call (docs/batching.md): its batch is the first group
        of the items it had not answered (those before had their results sent, last words
        included). A batch of one is the culprit, returned to fail (or retry) as any item in
        flight. A bigger batch goes back as one chunk
        whose batched calls take one item each: the culprit kills the worker running it (every
        item before it sent its result), and is then a batch of one. Why not halves: each level
        of a bisection costs a worker death and start (~0.2 s with torch imported), so 64 items
        cost 7 deaths where this costs 2, and an innocent item alone costs only its own call.
        The items after the batch, which never reached the call, go back as one chunk."""
        unsent = list(w.unsent)
        suspects, rest = unsent[:w.group], unsent[w.group:]
        if len(suspects) == 1:
            return suspects[0]  # the items after it stay unsent: they go back as a chunk
        w.unsent = {}
        log.info("a batch of %d items died (%s: %s); running them again one item per call", len(suspects),
                 signame, text)
        self.singly.add(suspects[0])
        self.retry.appendleft(suspects)
        if rest:
            self.retry.append(rest)
        return None

    def charge(self, w: Worker, i: int, step: int, signame: str | None, text: str) -> None:
        """Item i was in flight when worker `w` died: it fails, or runs again (its node's retries;
        or, when it crashed inside a nested map, with that inner item failed: `crash.poisoned_here`)."""
        steps = self.plan.steps
        node = steps[step].node if 0 <= step < len(steps) else (steps[0].node if len(steps) == 1 else None)
        stack, chain = read_stack(w.fault_path), read_nesting(w.fault_path)
        cls = NodeTimeout if w.killed_for == "timeout" else NodeCrashed
        named = "/".join(str(level[0]) for level in chain) if len(chain) > 1 else node.name if node else "?"
        thread, how = read_marked(w.fault_path) if not w.killed_for else (None, "")
        if how and signame is None:  # it left on a node's word: which (os._exit, exit() from C)
            text = f"{text.partition(' (')[0]}: {how}"
        death = examine(w.fault_path, signame, text, named, stack, w.hang if w.killed_for == "timeout" else None)
        text = death.reason
        if thread is not None:  # a Python thread's crash: its own, or one that kept coming (`not_its_thread`)
            times = self.blameless.get(i, 0)
            text += f", in thread {thread['name']!r} ({self.started_by(thread)})" + (
                f", {times} time(s) while this item ran" if times else "")
        err = cls(node.name if node else "?", i, text, signal=signame, exitcode=w.process.exitcode, stack=stack,
                  native_frames=death.frames, native_stack=death.native_stack, diagnosis=death.diagnosis,
                  inputs=_inputs(self.items[i]))
        if isinstance(err, NodeTimeout):
            err.stacks = death.stacks
        err.threads = read_stack(w.fault_path, every_thread=True)
        if len(chain) > 1 and self.rerun_without(i, chain, err, _nested(err, chain, w.killed_for)):
            return
        self.attempts[i] = self.attempts.get(i, 0) + 1
        retries = node.retries if node else 0
        if self.attempts[i] <= retries:
            log.warning("node %r, item %d: %s; retrying (%d of %d)", err.node, i, text, self.attempts[i], retries)
            self.retry.appendleft([i])
            self.results.retried(i, err, w.process.pid)
            if node is not None and node.backoff:  # retries > 0: there is a node
                self.due[i] = time.monotonic() + delay(node.backoff, self.attempts[i])
        else:
            self.results.fail(i, err, worker=w.process.pid)

    def rerun_without(self, i: int, chain: list[list[Any]], err: NodeCrashed, crash: str) -> bool:
        """Item i crashed inside a nested map whose pipeline node keeps going (on_error="continue"):
        run item i again with that inner item failed as it crashed, so that only it is lost, as
        in-process. A crash in a batched node's call over several inner items names none of them:
        item i runs again with that map's batch calls taking one item each (`crashed[None]`),
        so that a second crash names it. False when no such map encloses the crash (the item
        itself fails)."""
        for k in range(len(chain) - 1, 0, -1):
            item = chain[k][1]
            if chain[k - 1][2] != "continue" or (item is None and chain[k][2] != BATCH):
                continue
            key = tuple((level[0], level[1]) for level in chain[:k])
            crashed = self.poison.setdefault(key, {})
            if item in crashed or len(crashed) >= MAX_NESTED_CRASHES:
                return False
            inner = copy.copy(err)
            inner.node = "/".join(str(level[0]) for level in chain[k:])
            inner.inputs_summary = ""  # the inner item's inputs are not the outer item's
            inner.reason = crash
            crashed[item] = inner
            what = f"item {item}" if item is not None else "a batch call"
            log.warning("node %r crashed on %s of a nested map (%s): running the enclosing item %d again %s",
                        inner.node, what, crash, i, "without it" if item is not None else "one item per call")
            self.retry.appendleft([i])
            return True
        return False

    def on_death(self, w: Worker) -> None:
        pool = self.pool
        slot = pool.workers.index(w) if w in pool.workers else None
        if slot is None:
            return
        if w.status[words.READY] == 1.0:  # (one that dies setting up would fail again)
            pool.died(self.plan_id, self.plan_msg)
        self.receive(w)  # results it sent before dying are kept
        w.process.join(1)
        signame, text = describe_exit(w.process.exitcode)
        if w.killed_for:
            signame, text = "SIGKILL", w.kill_detail
        item, step = int(w.status[words.ITEM]), int(w.status[words.STEP])
        foreign = self.not_its_thread(w, item, signame, text)
        in_flight = item if item in w.unsent and not foreign else None
        if item == words.BATCH and w.unsent and not foreign:
            in_flight = self.split(w, signame, text)
        if foreign == RERUN:
            pass  # its items go back below, none blamed (`not_its_thread` said why)
        elif foreign:  # it kept meeting such crashes: the item it holds first is charged, whatever it did
            first = item if item in w.unsent else next(iter(w.unsent))
            del w.unsent[first]
            self.charge(w, first, step if first == item else -1, signame, text)
        elif in_flight is not None and step <= words.OPENING:  # unpickling one input of a sealed item
            del w.unsent[in_flight]
            self.died_opening(in_flight, words.OPENING - step, (signame, text, w.process.exitcode,
                                                                        read_stack(w.fault_path)))
        elif in_flight is not None:
            del w.unsent[in_flight]
            self.charge(w, in_flight, step, signame, text)
        elif item == words.BATCH:
            pass  # a batch it died in is queued again in halves (`split`)
        elif item in (words.READING, words.SENDING, words.LOADING) and w.unsent:
            self.died_between_items(w, item, step, (signame, text, w.process.exitcode, read_stack(w.fault_path)))
        elif w.status[words.READY] != 1.0:  # (preload= modules load in the fork server, which says so)
            pool.start_failures += 1
            if pool.start_failures >= 3:  # dies setting up: retrying would loop forever
                pool.replace(slot, stop=False)
                raise WorkerStartError(
                    f"worker processes die while setting up, before reading any work ({text}; 3 in a row). A "
                    f"library in preload_libs= or the worker environment fails to load: see the worker's "
                    f"error above. {read_stack(w.fault_path)}".strip())
        elif w.process.exitcode == words.RETIRED:
            log.info("worker %d retired %s; a fresh one takes its place", w.number,
                     f"because {how}" if (how := read_marked(w.fault_path)[1]) else "after a CUDA error")
        else:
            log.warning("a worker died with no item in flight (%s); its results were already kept%s", text,
                        after_return(w, signame, text, self.plan, self.began))
        if w.unsent:  # innocent items whose results had not been sent yet: run them again
            self.retry.append(list(w.unsent))
        w.unsent = {}
        w.plan = None
        pool.replace(slot, stop=False)

    def not_its_thread(self, w: Worker, item: int, signame: str | None, text: str) -> str:
        """Whether the worker died in a Python thread that the work in flight did not start (a
        prefetch or I/O thread of an earlier item's node, one started while the plan loaded): RERUN
        when its items then run again, none blamed (a warning names the thread and the item whose
        node started it); CHARGE for an item that keeps dying so, after MAX_THREAD_RERUNS (`charge`
        names the thread), so this never loops; "" when the crash is the work's own: in the main
        thread, in a thread running the plan's code or in a native thread (an OpenMP team), as
        `crash.thread_line` tells, or in a thread the item in flight started."""
        thread, _ = read_marked(w.fault_path)
        if thread is None or w.killed_for or not w.unsent:
            return ""
        started = thread.get("started") or [words.IDLE, -1, 0.0, 0.0]
        if started[3] >= self.began and (item >= 0 and started[0] == item or item == words.BATCH and started[0] == item
                                         and started[2] == w.status[words.STEP_START]):
            return ""  # a thread the item (or the batch call) running now started: its own
        first = item if item in w.unsent else next(iter(w.unsent))
        self.blameless[first] = self.blameless.get(first, 0) + 1
        if self.blameless[first] > MAX_THREAD_RERUNS:
            return CHARGE
        steps, step = self.plan.steps, int(started[1]) if started[3] >= self.began else -1
        death = examine(w.fault_path, signame, text, steps[step].node.name if 0 <= step < len(steps) else "?",
                        read_stack(w.fault_path, every_thread=True))
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
    """Who started a thread, as `crash.thread_line` noted it: `started by item 0, in node 'f'` of
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


def after_return(w: Worker, signame: str | None, text: str, plan: Plan | None = None, began: float = 0.0) -> str:
    """What a worker's crash record says of a death outside any item: the thread it died in (a
    Python thread a node started), the diagnosis (a crash at exit, in which library) and the
    native stack, as lines to add to the warning."""
    thread, _ = read_marked(w.fault_path)
    death = examine(w.fault_path, signame, text, "?", "", after_return=True)
    return (f"\nin thread {thread['name']!r} ({started_by(thread, plan, began)})" if thread else "") + "".join(
        f"\ndiagnosis: {d}" for d in death.diagnosis) + (
        f"\nnative stack:\n{death.native_stack}" if death.native_stack else "")


def _nested(err: NodeCrashed, chain: list[list[Any]], killed_for: str | None) -> str:
    """Names the crash of a worker inside a nested pipeline as an in-process failure would be: the
    path of nodes (`prep/tokenize`) and the item of each nested map on the way. Returns what
    happened, without where (the inner item's own error says that)."""
    err.node = "/".join(str(level[0]) for level in chain)
    if killed_for == "timeout" and chain[-1][3]:
        err.reason = f"node ran past its timeout of {chain[-1][3]:g} s"
    crash = err.reason or ""
    inner = [f"{level[0]!r} item {level[1]}" for level in chain[1:] if level[1] is not None]
    if inner:
        err.reason = f"{crash}, in nested map at {', '.join(inner)}"
    return crash


def _inputs(item: Any) -> dict[str, Any] | None:
    """An item's inputs for an error message; None for one an engine passes unopened (`Pickled`)."""
    return {k: v for k, v in item.items() if k != KEYS} if isinstance(item, dict) else None

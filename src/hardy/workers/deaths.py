"""The pool's side of a worker's death: which item was in flight, and the queues it goes back to.

`MapRun` (scheduling.py) calls `on_death` for every worker that died or was killed while it held
items, and `while_idle` for one that died with nothing to do. This reads the worker's status words
(which item, which step) and its fault record, once (`crash.autopsy.ended`), asks the crash package
what the death means (`crash.blame` for a thread the work did not start, `crash.verdict` for the
item in flight, a batched call or a death between items) and applies the answers: the results
sink fails or retries items, the map's queues take back the innocent ones, the pool replaces the
worker. It decides nothing about a death itself. The walk from a death to the user's message is
in `hardy/crash/__init__.py`.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..crash import blame, verdict
from ..crash.autopsy import Ending, ended
from ..errors import NodeError, NodeInterrupted, WorkerStartError
from ..model.policy import delay
from ..plan.compiled import KEYS, Plan
from ..shipping import Pickled, described, globals_in, readers
from ..tracebacks import debugger_quit, landed
from . import status as words
from .process import Unsent, Worker

if TYPE_CHECKING:
    from ..model.executor import ResultsSink
    from ..model.node import Node
    from .pool import WorkerPool

log = logging.getLogger("hardy.workers")

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
        self.map = blame.Map(tuple(s.node.name for s in plan.steps), began)  # what a thread's record refers to

    def send_sealed(self, chunk: list[int], why: str, alone: bool = False) -> None:
        """A chunk that could not be unpickled in the worker, or whose unpickling or results killed
        it: sent again (first) sealed, or its items fail when it was sealed so already, as
        `verdict.reseal` says."""
        failed = verdict.reseal(chunk, self.sealed, alone, readers(self.plan, None), why)
        for i, err in failed:
            self.results.fail(i, err)
        if failed:
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
        w.unsent = Unsent()
        log.info("a batch of %d items died (%s: %s); running them again one item per call", len(suspects),
                 end.signal, end.reason)
        self.singly.add(suspects[0])
        self.retry.appendleft(suspects)
        if rest:
            self.retry.append(rest)
        return None

    def node_at(self, step: int) -> Node | None:
        """The node of the plan's step `step` (the status words' word; a one-node plan's alone)."""
        steps = self.plan.steps
        return steps[step].node if 0 <= step < len(steps) else (steps[0].node if len(steps) == 1 else None)

    def charge(self, w: Worker, end: Ending, i: int, step: int) -> None:
        """Item i was in flight when worker `w` died: it fails, or runs again (its node's retries;
        or, when it crashed inside a nested map, with that inner item failed), as `verdict.charge`
        says."""
        node = self.node_at(step)
        found = verdict.charge(end, i, node, item_inputs(self.items[i]), self.attempts.get(i, 0), self.poison, self.map,
                               self.blameless.get(i, 0))
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
        in_flight = item if item in w.unsent and foreign is None else None
        interrupted = foreign is None and end.record.interrupted is not None and (
            in_flight is not None or item == words.BATCH and bool(w.unsent))  # a node raised KeyboardInterrupt
        if item == words.BATCH and w.unsent and foreign is None and not interrupted:
            in_flight = self.split(w, end)
        if foreign is not None and foreign.rerun:
            pass  # its items go back below, none blamed (`not_its_thread` said why)
        elif foreign is not None:  # it kept meeting such crashes: the item it holds first is charged
            del w.unsent[foreign.first]
            self.charge(w, end, foreign.first, step if foreign.first == item else -1)
        elif interrupted:  # it stops the call (`Results.fail`), the item (or the batch's first) unrun
            i = in_flight if in_flight is not None else next(iter(w.unsent))
            del w.unsent[i]
            node = self.node_at(step)
            self.results.fail(i, node_interrupted(end, node.name if node else "?", i))
        elif in_flight is not None and step <= words.OPENING:  # unpickling one input of a sealed item
            del w.unsent[in_flight]
            self.died_opening(end, in_flight, words.OPENING - step)
        elif in_flight is not None:
            del w.unsent[in_flight]
            self.charge(w, end, in_flight, step)
        elif item == words.BATCH:
            pass  # a batch it died in is queued again one item per call (`split`)
        elif item in (words.READING, words.SENDING, words.LOADING) and w.unsent:
            self.died_between_items(w, end, item, step)
        elif w.status.ready != 1.0:  # (preload= modules load in the fork server, which says so)
            pool.start_failures += 1
            if pool.start_failures >= 3:  # dies setting up: retrying would loop forever
                pool.replace(slot, stop=False)
                short = processes_short(TASKS_PER_WORKER)  # (a worker's thread could not start: EAGAIN)
                raise WorkerStartError(
                    "worker processes die while setting up, before reading any work (3 in a row): they run out of "
                    f"processes: {short}: use fewer workers (Engine(workers=...)), or raise the limit (ulimit -u)"
                    if short else self.setup_failure(w, end))
        elif w.process.exitcode == words.RETIRED:
            log.info("worker %d retired %s; a fresh one takes its place", w.number,
                     f"because {end.record.exit_how}" if end.record.exit_how else "after a CUDA error")
        else:
            log.warning("a worker died with no item in flight (%s); its results were already kept%s", end.reason,
                        blame.after_return(end, self.map))
        if w.unsent:  # innocent items whose results had not been sent yet: run them again
            self.retry.append(list(w.unsent))
        w.unsent = Unsent()
        w.plan = None
        pool.replace(slot, stop=False)

    def setup_failure(self, w: Worker, end: Ending) -> str:
        """Why workers die setting up: the error `preload_libs=` raises with their environment (met
        again in a fresh interpreter: a worker leaves before its crash file is open), else how
        they exited. No node ran: an exit code is not a node's sys.exit."""
        code = w.process.exitcode
        how = end.reason if code is None or code < 0 else f"a worker exited with code {code}"
        said = None
        if self.pool.preload_libs:
            from ..native.libs import preload_failure
            said = preload_failure(self.pool.preload_libs, {**w.context.environ, **w.overlay}, w.context.sys_path,
                                   w.context.cwd)
        if said:
            return (f"worker processes die while setting up, before reading any work ({how}; 3 in a row): "
                    f"preload_libs={list(self.pool.preload_libs)} fails to load there: {said}")
        return (f"worker processes die while setting up, before reading any work ({how}; 3 in a row). A library in "
                f"preload_libs= or the worker environment fails to load: see the worker's error above. "
                f"{end.record.stack}").strip()

    def not_its_thread(self, w: Worker, end: Ending, item: int) -> blame.Elsewhere | None:
        """What a death in a Python thread the work in flight did not start means, as
        `blame.elsewhere` says (None: the crash is the work's own); counted, and warned of when
        the worker's items run again, none blamed."""
        found = blame.elsewhere(end, item, w.status.step_start, list(w.unsent), self.blameless, self.map)
        if found is not None:
            self.blameless[found.first] = found.times
            if found.rerun:
                log.warning("%s", found.warning)
        return found

    def died_opening(self, end: Ending, i: int, k: int) -> None:
        """Item i's input k killed the worker as it was unpickled there (a sealed chunk's): it
        fails with `verdict.opening`'s error, which names the input."""
        item, name = self.items[i], None
        if isinstance(item, Pickled):
            what = f"input (types in it: {', '.join(globals_in(item.blob)) or 'builtins only'})"
        else:
            name = list(item)[k] if k < len(item) else "?"
            what = f"input {name!r} ({described(item.get(name))})"
        self.results.fail(i, verdict.opening(end, i, readers(self.plan, name), what))

    def died_between_items(self, w: Worker, end: Ending, doing: int, count: int) -> None:
        """The worker died with no node running, `doing` (a status word): its chunk is sent again
        sealed or its items fail, as `verdict.between_items` says; `w.unsent` keeps the innocent."""
        producers = [s.node.name for s in self.plan.steps if set(s.node.outputs) & set(self.plan.outputs)]
        found = verdict.between_items(end, doing, count, list(w.unsent), " / ".join(producers))
        w.unsent = Unsent(found.unsent)
        if found.seal:
            self.send_sealed(found.seal, found.why, alone=found.alone)
        for i, err in found.failed:
            self.results.fail(i, err)

    def while_idle(self, slot: int, w: Worker) -> None:
        """`w` died while it had nothing to do: it is replaced, and nothing it was handed is blamed."""
        end = ended(w.fault_path, w.process.exitcode)
        log.warning("worker %d died while idle (%s); replacing it%s", w.number, end.reason,
                    blame.after_return(end, self.map))
        if w.unsent:  # (handed just as it died, never read: it goes first to the next worker)
            self.retry.appendleft(list(w.unsent))
        w.plan, w.unsent = None, Unsent()
        self.pool.replace(slot, stop=False)


def node_interrupted(end: Ending, node: str, i: int) -> NodeInterrupted:
    """Item i's node raised KeyboardInterrupt, which ended its worker: the error that interrupts the
    call (`Results.fail`), its cause that exception as it came back (`replies._travelling_interrupt`:
    its class, or a stand-in where this process cannot make it again, its message and the node's
    frames), as in-process; its text alone where it did not pickle or cannot be read here."""
    err = NodeInterrupted(node, None, i, end.record.interrupted)
    try:
        sent = pickle.loads(end.record.interrupt) if end.record.interrupt else None
    except Exception as exc:  # (a class this process cannot import)
        if debugger_quit(exc):
            raise
        sent = None
    if sent is not None:
        err.__cause__ = landed(*sent)
    return err


TASKS_PER_WORKER = 2  # processes and threads a worker takes: itself, and its thread watching the parent (lifeline.py)


def processes_short(more: int) -> str | None:
    """Why `more` processes and threads may not start for this user, or None where they fit. Its
    limit (RLIMIT_NPROC, `ulimit -u`) counts every process and thread of its real uid, and a fork
    or a thread's start past it fails with EAGAIN. Nothing is counted where the limit is not set,
    where the whole machine runs too few tasks to reach it (/proc/loadavg says how many), or where
    it does not apply (root, CAP_SYS_RESOURCE, CAP_SYS_ADMIN): else this user's, from /proc."""
    import resource
    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if limit == resource.RLIM_INFINITY or _tasks_of(None) + more <= limit or _exempt():
        return None
    running = _tasks_of(os.getuid())
    if running + more <= limit:
        return None
    return f"this user may run {limit} processes and threads at once (ulimit -u), and runs {running}"


def out_of_processes(what: str, more: int) -> str:
    """The error of a fork or a thread's start that failed with EAGAIN (`what`): the process limit
    named, with this user's numbers where they show it (`processes_short`), and the fix."""
    why = processes_short(more) or ("the processes and threads this user or container may run are used up "
                                    "(ulimit -u, a container's pids limit)")
    return f"{what}: {why}: use fewer workers (Engine(workers=...)), or raise the limit (ulimit -u)"


def _tasks_of(uid: int | None) -> int:
    """The processes and threads of real uid `uid` (None: of the whole machine, one read of
    /proc/loadavg; a large number where it cannot be read), as RLIMIT_NPROC counts them."""
    if uid is None:
        try:
            with open("/proc/loadavg") as f:
                return int(f.read().split()[3].partition("/")[2])
        except (OSError, ValueError, IndexError):
            return 1 << 30
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("Uid:", "Threads:")))
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, ValueError, KeyError):  # (ended meanwhile)
            continue
    return count


def _exempt() -> bool:
    """Whether RLIMIT_NPROC does not apply to this process: root's, or CAP_SYS_RESOURCE or
    CAP_SYS_ADMIN in effect."""
    if os.getuid() == 0:
        return True
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, ValueError, StopIteration):
        return False
    return bool(caps & (1 << 21 | 1 << 24))  # CAP_SYS_ADMIN, CAP_SYS_RESOURCE


def item_inputs(item: Any) -> dict[str, Any] | None:
    """An item's inputs for an error message; None for one an engine passes unopened (`Pickled`)."""
    return {k: v for k, v in item.items() if k != KEYS} if isinstance(item, dict) else None


def with_inputs(err: NodeError, item: Any) -> NodeError:
    """`err`, naming its item's inputs where the worker could not: it fails an item whose output
    cannot be pickled back once its batch is packed, when the item's inputs are long gone. Not the
    inputs of an item of a nested map, which are not this map's item's (`nested`)."""
    if not err.inputs_summary and not err.nested and (inputs := item_inputs(item)):
        from ..wording import summarize
        err.inputs_summary = summarize(inputs)
    return err

"""The scheduling loop of one map on the worker pool: dispatch chunks, watch for deaths, classify
them, replace the dead.

See the data-flow picture in `hardy/workers/__init__.py`. The loop runs in the calling thread,
waiting on every busy worker's pipe *and* its process sentinel, so a death is noticed the moment
it happens (no heartbeat, no polling of exit codes). Per-node deadlines and memory limits are
checked on the same loop, every `TICK` seconds while a limited node is in flight.
"""

from __future__ import annotations

import logging
import pickle
import select
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..crash.record import FaultRecord
from ..crash.record import read as read_record
from ..crash.stacks import hang_stacks
from ..errors import (
    GpuOutOfMemory,
    NodeError,
)
from ..model.policy import delay
from ..parts.batching import batched
from ..plan.compiled import Plan
from ..shipping import (
    check_constants,
    context,
    dumps,
    globals_in,
    item_error,
    seal,
    transport,
)
from ..shipping.payload import dump_values
from ..shipping.replica import replica
from ..tracebacks import debugger_quit, landed_in_worker
from . import status as words
from .deaths import Deaths, with_inputs
from .messages import HEADER_SIZE, Header, Resend, Values
from .process import STACK_GRACE, Unsent, Worker, rss
from .replies import handle_logs

if TYPE_CHECKING:
    from ..model.executor import ResultsSink
    from ..observe.nodelog import NodeLogBatch
    from .pool import WorkerPool

log = logging.getLogger("hardy.workers")

TICK = 0.05            # seconds between deadline / memory checks while limits apply
CHUNK_TARGET = 0.05    # seconds of work per chunk, once the per-item time is known
CHUNK_LEAST = 0.005    # seconds of work below which a chunk is not cut smaller (`next_chunk`)
# seconds of work in a worker's equal share of a short map from which its chunks are cut down to a
# third of the share: the parent takes one chunk's results (a dict per item, made here) while the
# worker runs the next, and the last chunks, small, leave the parent little to take once the
# workers are done (against halves: a 10,000-item map 7% faster, taking turns; fifths and eighths
# 3 to 7% slower than thirds). Between a 5,000-item map (halves 5% faster) and a 10,000-item one
# (thirds 5% faster, 7 to 15% in medians), at 0.2 µs an item: at 1 ms, the 10,000-item map's share
# straddled it and went in halves or thirds from one process to the next
CHUNK_THIRDS = 0.0007
STOP_POLL = 0.1       # seconds: how soon a run another thread stops (`results.stop`) notices


class MapRun:
    """One map (or one isolated call) through the pool: the scheduling loop and its bookkeeping."""

    def __init__(self, pool: WorkerPool, plan: Plan, items: Sequence[Any], results: ResultsSink):
        self.pool, self.plan, self.items, self.results = pool, plan, items, results
        self.plan_id, self.plan_msg, timed = pool.ship(plan)
        self.next_fresh = 0
        self.retry: deque[list[int]] = deque()
        self.due: dict[int, float] = {}  # item -> when its backoff delay (hardy.model.policy) ends
        self.attempts: dict[int, int] = {}
        self.sealed: dict[int, int] = {}  # items sent again sealed (`send_sealed`), and how
        # seconds per item, learnt from the chunks of this plan so far, and from how many items
        self.per_item, self.timed = pool.per_item_times.get(self.plan_id, (None, 0))
        group = batched(plan)
        self.group = group.group if group is not None else 0  # a batched plan's chunks: whole groups
        self.singly: set[int] = set()  # first items of chunks whose batched calls take one item (`split`)
        self.limited = pool.max_memory is not None or bool(pool.stall_report) or timed
        self.stalled: dict[int, tuple[int, int, float]] = {}  # worker number -> the call whose stacks were logged
        self.poison: dict[tuple[Any, ...], dict[int | None, NodeError]] = {}  # see `crash.containment.poisoned_here`
        self.began = time.monotonic()  # (a thread started before was started by an earlier map's item)
        self.deaths = Deaths(pool, plan, (self.plan_id, self.plan_msg), items, results, self.began,
                             _weakly(self.receive), retry=self.retry, due=self.due, attempts=self.attempts,
                             sealed=self.sealed, singly=self.singly, poison=self.poison)
        self.log = results.log_nodes
        if items and isinstance(items[0], dict):  # a constant input that cannot travel: before anything starts
            check_constants(items)
        self.shared = transport.Shared(_shared_values(items), dumps)
        # the caller's environment, working directory, argv and sys.path (an engine's chunk brings its caller's)
        self.context = results.context or context.current()

    def next_chunk(self, w: Worker) -> Sequence[int] | None:
        """The next chunk for `w`: a retry whose backoff is over, or the next fresh items (a range)."""
        now = time.monotonic()
        for chunk in self.retry:  # the first one not waiting out a backoff delay
            if self.due.get(chunk[0], 0.0) <= now:
                self.retry.remove(chunk)
                self.due.pop(chunk[0], None)
                return chunk
        remaining = len(self.items) - self.next_fresh
        if remaining <= 0:
            return None
        spread = -(-remaining // (2 * self.pool.size))  # chunks shrink toward the end: no worker waits on a long one
        if self.per_item is None:
            size = min(self.probe, spread)  # probe: learn the per-item time first
        else:
            per_item = max(self.per_item, 1e-7)
            # but, once the time per item is known from a few items a worker, none is cut below
            # CHUNK_LEAST of work, nor below an equal share of the map a worker (a third of a share
            # when that is CHUNK_THIRDS of work or more): under that, the round trip of one more
            # chunk costs more than the wait it saves
            share = -(-len(self.items) // self.pool.size)
            if share * per_item >= CHUNK_THIRDS:
                share = -(-share // 3)
            least = 0 if self.timed < 2 * self.pool.size else min(int(CHUNK_LEAST / per_item), share)
            size = min(int(CHUNK_TARGET / per_item), max(spread, least), remaining)
        size = max(1, size)
        if self.group:
            size = min(remaining, -(-size // self.group) * self.group)
        if self.pool.max_tasks:
            size = max(1, min(size, self.pool.max_tasks - w.tasks))
        fresh = range(self.next_fresh, self.next_fresh + size)
        self.next_fresh += size
        return fresh

    @property
    def probe(self) -> int:
        """Items in a chunk while the time per item is unknown."""
        return 1 if len(self.items) < 64 else 4

    def backoff_left(self) -> float:
        """Seconds until a retry may run, when there is no fresh item and every retry waits."""
        if self.next_fresh < len(self.items) or not self.retry:
            return 0.0
        now = time.monotonic()
        return max(0.0, min(self.due.get(chunk[0], 0.0) for chunk in self.retry) - now)

    def has_work(self) -> bool:
        return not self.results.stop and (bool(self.retry) or self.next_fresh < len(self.items))

    def assign(self) -> None:
        """Give a chunk to every idle worker this run holds; hand back those it has no work for."""
        pool = self.pool
        unneeded = []
        slots = pool.claim(self)
        if self.per_item is None:  # a map's first workers (each gets a probe chunk, whole groups): asked together
            empty = sum(pool.workers[slot] is None for slot in slots)
            if empty > 1:
                pool.ask_ahead(min(empty, (len(self.items) - self.next_fresh) // max(self.probe, self.group)))
        for slot in slots:
            w = pool.workers[slot]
            if w is not None and w.busy:
                continue
            if not self.has_work():
                unneeded.append(slot)
                continue
            if w is not None and not w.process.is_alive():
                self.deaths.while_idle(slot, w)
                w = None
            if w is None:
                w = pool.start_worker(slot)
            fresh = self.next_fresh
            chunk, data = self.shippable_chunk(w)
            if data is None:
                unneeded.append(slot)
                continue
            singly = chunk[0] in self.singly
            w.plan = self.plan
            w.group = 1 if singly else self.group
            w.unsent = Unsent(chunk)
            w.chunk_size = len(chunk)
            self.results.handed(chunk, w.process.pid, again=self.next_fresh == fresh)
            try:
                w.idle()
                w.follow(self.context)  # first: the plan's modules are imported with the caller's sys.path
                if self.plan_id not in w.plans:
                    w.send(self.plan_msg)
                    w.plans.add(self.plan_id)
                w.send(data)
            except OSError:  # it died just now: its chunk goes back to the queue
                data.close()
                self.deaths.on_death(w)
        if unneeded:
            pool.release(self, unneeded)
        pool.top_up(self.plan_id, self.plan_msg)

    def shippable_chunk(self, w: Worker) -> tuple[Sequence[int], transport.Packed | None]:
        """The next chunk for `w` and its message; items that cannot be pickled fail here, alone."""
        while True:
            chunk = self.next_chunk(w)
            if not chunk:
                return [], None
            poison = {k: v for k, v in self.poison.items() if k[0][1] in chunk} if self.poison else None
            if chunk[0] in self.sealed:
                data, bad = self.pool.chunk_message(self.plan_id, {i: seal(self.items[i]) for i in chunk}, chunk,
                                             self.shared, self.log, sealed=self.sealed[chunk[0]],
                                             singly=chunk[0] in self.singly, poison=poison)
            else:
                data, bad = self.pool.chunk_message(self.plan_id, self.items, chunk, self.shared, self.log,
                                             singly=chunk[0] in self.singly, poison=poison)
            for i, why in bad.items():
                self.results.fail(i, item_error(self.plan, i, why))
            if data is not None:
                return [i for i in chunk if i not in bad] if bad else chunk, data
            if not self.has_work():
                return [], None

    def mine(self) -> list[Worker]:
        pool = self.pool
        return [w for w, owner in zip(pool.workers, pool.owners) if owner is self and w is not None]

    def loop(self) -> None:
        pool = self.pool
        try:
            while True:
                if self.results.stop:  # on_error="raise" failed an item: the rest is not awaited
                    self.cancel()
                    self.results.raise_ending()  # (a worker refused the pipeline: one error for the call)
                    return
                self.assign()
                busy = [w for w in self.mine() if w.busy]
                if not busy:
                    if not self.has_work():
                        return
                    backoff = self.backoff_left()
                    if backoff:  # only retries waiting out their backoff delay (hardy.model.policy)
                        time.sleep(backoff)
                    else:
                        pool.wait_for_a_free_worker()  # other threads' maps or calls hold them all
                    continue
                # woken every STOP_POLL at least: another thread may stop this run (a streamed map closed)
                self.on_ready(busy, TICK if self.limited or self.due else STOP_POLL)
                if self.limited:
                    self.check_limits(busy)
        except BaseException as exc:
            # Interrupted (Ctrl-C, a PicklingError): workers still busy would answer into the next
            # map, so they are replaced, after sending what they computed.
            self.interrupted(exc)
            raise
        finally:
            self.shared.close()
            pool.release(self, range(pool.size))

    def on_ready(self, busy: list[Worker], timeout: float) -> None:
        """Wait up to `timeout` for a busy worker's message or death, then take what came."""
        poller, pipes, ends = select.poll(), {}, {}
        for w in busy:
            pipes[w.conn.fileno()] = w
            ends[w.process.sentinel] = w
            poller.register(w.conn.fileno(), select.POLLIN)
            poller.register(w.process.sentinel, select.POLLIN)
        dead = []
        for fd, _ in poller.poll(int(timeout * 1000)):
            sender = pipes.get(fd)
            if sender is not None:
                if not self.receive(sender):
                    dead.append(sender)
            elif ends[fd] not in dead:
                dead.append(ends[fd])
        for w in dict.fromkeys(dead):
            self.deaths.on_death(w)

    def interrupted(self, exc: BaseException) -> None:
        """The run ends on `exc`, raised here (Ctrl-C, a PicklingError): its busy workers are
        stopped (`cancel`), and a Ctrl-C's traceback ends in the frames of the user's code the
        earliest item in flight was running, as the same script's in-process one does."""
        self.results.stop = True
        stacks = self.cancel(where=isinstance(exc, KeyboardInterrupt))
        if stacks:
            landed_in_worker(exc, stacks[min(stacks)].python_frames())

    def cancel(self, where: bool = False) -> dict[int, FaultRecord]:
        """Stop this run's busy workers now (a hung or slow item must not delay the error or the
        interruption that ends the map), keeping every result they computed: each is asked for its
        last words (the results it holds, `replies.Replies.last_words`) and its stack before it is
        killed and replaced. Their items in flight stay unrun; `where`: their stacks, by item."""
        pool, stacks = self.pool, {}  # (their records: the stack read where an interruption asks)
        busy = [(slot, w) for slot, w in enumerate(pool.workers)
                if w is not None and w.busy and pool.owners[slot] is self]
        for _, w in busy:
            w.ask_last_words()
        deadline = time.monotonic() + STACK_GRACE
        for slot, w in busy:
            w.await_last_words(deadline)
            w.process.kill()
            if where and w.unsent:
                stacks[min(w.unsent)] = read_record(w.fault_path)
            self.receive(w)
            pool.replace(slot, stop=False)
        return stacks

    def receive(self, w: Worker) -> bool:
        """Take everything the worker sent; False if its pipe is closed (it died)."""
        try:
            while w.readable():
                if not self.take(w, transport.read_frame(w.fd)):
                    break
        except (EOFError, OSError):
            return False
        return True

    def take(self, w: Worker, data: bytes) -> bool:
        """One message of the worker's; False when what it sends next is not this run's to read (its
        chunk is done: the next one's, or, released, another map's)."""
        done, each, logged, unread, logs, elapsed, need, outputs, columns, first = Header.unpack(data)
        if need:  # loading a plan, it asks for the caller's objects its modules lack
            w.send(_answer(memoryview(data)[HEADER_SIZE:]))
            return True
        w.started_any = True
        self.pool.start_failures = 0
        if unread:  # its chunk could not be unpickled there: it goes again, sealed
            chunk = list(w.unsent)
            w.plan, w.unsent = None, Unsent()
            self.deaths.send_sealed(chunk, pickle.loads(memoryview(data)[HEADER_SIZE:]))
            return False
        try:
            batch = transport.unpack(w.conn, memoryview(data)[HEADER_SIZE:])
        except (EOFError, OSError):  # it died while passing its shared memory
            raise
        except Exception as exc:  # one result cannot be read here: at chunk end, ask for each alone
            if debugger_quit(exc):
                raise  # pdb's `q` at a breakpoint in code that reads a worker's results
            w.resend = True
            batch, logged, logs = [], False, False
        if logs:
            batch = handle_logs(batch[0], batch[1], keep=self.results.kept_logs)
        unsent, free = w.unsent, done and not w.resend
        if free:  # its next chunk goes first, to run while this batch is taken
            self.chunk_done(w, elapsed)
            if not self.results.stop:
                self.assign()
        if each:
            self.take_each(unsent, batch)
        elif outputs:
            self.take_outputs(unsent, first, batch, columns)
        else:
            rows, records = batch if logged else (batch, None)
            for i, _, err, *log in self.results.take(rows, unsent, records):  # the failures
                if not self.retry_out_of_memory(i, err):
                    self.results.fail(i, with_inputs(err, self.items[i]), *log)
        if free:
            return False
        if done:  # the items with no result yet are those of unreadable batches
            w.send(pickle.dumps(Resend(list(w.unsent))))
            w.resend = False
        return True

    def take_outputs(self, unsent: Unsent, first: int, batch: list[Any], columns: bool) -> None:
        """A batch of outputs only (`Header.outputs`) of the items `first`, `first` + 1, ...: one
        per item, or, `columns`, a list per output (`Header.columns`)."""
        if columns:
            n = self.results.take_columns(first, self.plan.outputs, batch)
        else:
            n = len(batch)
            self.results.take_span(first, batch)
        unsent.answered(first, n)

    def take_each(self, unsent: Unsent, batch: list[tuple[int, bool, bytes, bytes | None]]) -> None:
        """Results sent again one by one (`replies.Replies.resend`), each with its node log (left
        out where it cannot be read here: the result counts, its events are lost)."""
        for i, ok, blob, log_blob in batch:
            unsent.pop(i, None)
            try:
                value = pickle.loads(blob)
            except Exception as exc:
                ok, value = False, self.unreadable(i, blob, exc)
            try:
                log: NodeLogBatch | None = pickle.loads(log_blob) if log_blob is not None else None
            except Exception:
                log = None
            logs = (log,) if log is not None else ()
            if ok:
                self.results.ok(i, value, logs)
            elif not self.retry_out_of_memory(i, value):
                self.results.fail(i, with_inputs(value, self.items[i]), logs)

    def retry_out_of_memory(self, i: int, err: NodeError) -> bool:
        """A GPU out-of-memory under `@node(retries=N)`: its worker retires (a fresh CUDA context has
        nothing allocated) and the item runs again on a fresh worker, after the node's backoff."""
        if not isinstance(err, GpuOutOfMemory) or self.attempts.get(i, 0) >= err.retries:
            return False
        self.attempts[i] = self.attempts.get(i, 0) + 1
        log.warning("item %d: GPU out of memory in node %r; retrying on a fresh worker (%d of %d)", i, err.node,
                    self.attempts[i], err.retries)
        self.retry.appendleft([i])
        if err.backoff:
            self.due[i] = time.monotonic() + delay(err.backoff, self.attempts[i])
        return True

    def unreadable(self, i: int, blob: bytes, exc: Exception) -> NodeError:
        """The error for a result this process cannot unpickle: node, item and the types involved."""
        steps = self.plan.steps
        producers = [s.node.name for s in steps if set(s.node.outputs) & set(self.plan.outputs)]
        types = ", ".join(globals_in(blob)) or "unknown"
        return NodeError(" / ".join(producers) or "?", None, i,
                         f"its result was computed but cannot be unpickled in this process "
                         f"({type(exc).__name__}: {exc}; types in it: {types}); make those types "
                         "importable here the same way, or return plain data")

    def chunk_done(self, w: Worker, elapsed: float) -> None:
        size = w.chunk_size
        w.plan = None
        w.unsent = Unsent()
        w.tasks += size
        if elapsed > 0:  # learn the per-item time: it sizes the next chunks toward CHUNK_TARGET
            sample = elapsed / size
            self.per_item = sample if self.per_item is None else 0.5 * (self.per_item + sample)
            self.timed += size
            self.pool.per_item_times[self.plan_id] = (self.per_item, self.timed)
        pool = self.pool
        slot = pool.workers.index(w)
        if pool.max_tasks and w.tasks >= pool.max_tasks or pool.max_memory and rss(w.process.pid) > pool.max_memory:
            pool.replace(slot, stop=True)

    def check_limits(self, busy: list[Worker]) -> None:
        now = time.monotonic()
        for w in busy:
            if not w.busy or not w.process.is_alive():
                continue
            item, step = int(w.status.item), int(w.status.step)
            if (item >= 0 or item == words.BATCH) and 0 <= step < len(self.plan.steps):
                timeout = self.plan.steps[step].node.timeout
                started = w.status.step_start
                if timeout and now - started > timeout:
                    w.kill("timeout", f"node ran past its timeout of {timeout:g} s")
                    self.deaths.on_death(w)
                    continue
                stall = self.pool.stall_report
                if stall and now - started > stall and self.stalled.get(w.number) != (item, step, started):
                    self.stalled[w.number] = (item, step, started)
                    self.report_stall(w, item, self.plan.steps[step].node.name, now - started)
                deadline = w.status.deadline  # of a node nested in the step (crash.containment.deadlined)
                if 0 < deadline < now:
                    w.kill("timeout", "node ran past its timeout")
                    self.deaths.on_death(w)
                    continue
            limit = self.pool.max_memory
            if limit is not None:
                used = rss(w.process.pid)
                if used > limit:
                    w.kill("memory", f"worker memory {used / 2**20:.0f} MiB passed max_memory_per_worker "
                                     f"({limit / 2**20:.0f} MiB)")
                    self.deaths.on_death(w)

    def report_stall(self, w: Worker, item: int, node: str, running: float) -> None:
        """Log every thread's stack of a node call running past `stall_report` (it goes on running)."""
        text, why = hang_stacks(w.process.pid)
        log.warning("item %d: node %r has been running for %.0f s (stall_report=%g s) in worker pid %d; %s", item,
                    node, running, self.pool.stall_report, w.process.pid,
                    f"its stacks:\n{text}" if text else f"no stacks: {why}")


def _weakly(receive: Callable[[Worker], bool]) -> Callable[[Worker], bool]:
    """`MapRun.receive` for its `Deaths`, without a reference back: a map's run, its items and
    its results are freed as the map returns, not at the collector's next full pass (which, with
    a million results held, takes a while and keeps their memory until then)."""
    method = weakref.WeakMethod(receive)

    def weak(w: Worker) -> bool:
        found = method()
        return found(w) if found is not None else False
    return weak


def _answer(question: memoryview) -> transport.Packed:
    """The caller's objects a worker asked for while loading a plan (`shipping.replica`), big
    buffers through shared memory; or, when one cannot travel, the sentence refusing the plan."""
    replica_id, wanted = pickle.loads(question)
    found = replica(replica_id)
    values = found.values(wanted) if found is not None else "the pipeline being loaded is no longer in use"
    try:
        return transport.pack(Values(replica_id, values), dump_values)
    except Exception:
        assert found is not None
        return transport.pack(Values(replica_id, found.refusal(wanted)), dump_values)


def has_timeouts(nodes: Sequence[Any]) -> bool:
    """Whether a node, or a node of a pipeline nested in one, has a timeout for the pool to enforce."""
    return any(n.timeout or has_timeouts(getattr(getattr(n, "pipeline", None), "nodes", ())) for n in nodes)


def _shared_values(items: Sequence[Any]) -> list[Any]:
    """The inputs every item holds as one same object (a map's constant inputs)."""
    if len(items) < 2 or not isinstance(items[0], dict):
        return []
    first, last = items[0], items[-1]
    return [v for k, v in first.items() if last.get(k, first) is v]

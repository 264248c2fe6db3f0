"""What a worker sends back: batches of results with their node log and log records, again one
by one when the parent could not read a batch, and its last words when it is dying.

One `Replies` per worker process (`REPLIES`): the fatal-signal handler that sends the last words
runs outside any call, so what it needs (the connection, the results not sent yet, the plan's
producers) lives here rather than on a call's stack.
"""

from __future__ import annotations

import faulthandler
import itertools
import logging
import operator
import os
import pickle
import signal
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

from ..crash import handler, mapped
from ..crash.lines import exit_line, interrupted_line, nesting_line, thread_line, watch_threads
from ..crash.signals import LAST_WORDS_LIMIT
from ..errors import NodeError
from ..model.executor import Row
from ..observe.nodelog import LOG, NodeLogBatch, row_logs
from ..plan.compiled import CAUGHT
from ..plan.source import columns_to_dicts
from ..shipping import dumps, out_of_band, transport
from ..shipping.context import loaded_warning
from ..shipping.failures import travelling_exception
from ..shipping.pickling import quick
from ..shipping.reductions import ATTACHED
from ..tracebacks import landed, own_frames
from .lifeline import end_descendants
from .messages import HEADER, Header
from .status import IDLE, NO_STEP, SENDING, StatusWords

Sent = tuple["list[Row] | Outputs", NodeLogBatch | None]  # a batch of results sent, with its node log


class Forward(logging.Handler):
    """The worker's log records, at the parent's level, sent to the parent with the next batch of
    results (`Replies.send`) and handled there by its loggers: `logging.basicConfig(level=INFO)`
    in the parent shows a node's `log.info` as if it had run there. Each record says where it
    came from (`hardy_worker`: the pid, `hardy_item`: the item, None between items)."""

    def __init__(self) -> None:
        super().__init__()
        self.status: StatusWords | None = None
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if not (isinstance(record.msg, str) and _plain(record.args)):  # (a handler may group by `msg`)
                record.msg, record.args = record.getMessage(), None
            if record.exc_info:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
                exc = record.exc_info[1]
                record.hardy_exc = travelling_exception(exc) if exc is not None else None
                record.exc_info = None
            for key, value in record.__dict__.items():
                if key not in _KEPT and not isinstance(value, (str, int, float, bool, type(None), tuple)):
                    record.__dict__[key] = repr(value)  # an `extra=` object: its text
            item = int(self.status.item) if self.status is not None else IDLE
            record.hardy_worker, record.hardy_item = os.getpid(), item if item >= 0 else None
            self.records.append(record)
        except Exception:
            self.handleError(record)

    def install(self, status: StatusWords) -> None:
        """Records at the parent's levels (its root's and its loggers' own, as each call sets them:
        `shipping.context.Settings.log_levels`) go to the parent, whose loggers then handle them."""
        self.status = status
        logging.getLogger().handlers[:] = [self]
        warnings.showwarning = self.warned  # a node's (or the cache's) warnings too, whatever the level

    def warned(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
               file: Any = None, line: str | None = None) -> None:
        """A warning the filters let through here (the caller's filters: `shipping.context`), sent
        as a `py.warnings` record that says what it was (`hardy_warning`), for the parent to warn
        again (`rewarn`): its own filters, `catch_warnings(record=True)` and `pytest.warns` see it
        as they see one raised in-process."""
        text = warnings.formatwarning(message, category, filename, lineno, line)
        record = logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, "%s", (text.rstrip(),), None)
        record.hardy_warning = (category.__module__, category.__qualname__, str(message), filename, lineno,
                                _warned_in(filename, lineno))
        self.emit(record)


def _warned_in(filename: str, lineno: int) -> str:
    """The module a warning was raised for, which filters name (`module="__main__"`, Python's own
    `default::DeprecationWarning:__main__`): that of the frame at its file and line (where
    `stacklevel` put it), else the file's name, as `warnings` itself derives it then."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_lineno == lineno and frame.f_code.co_filename == filename:
            return str(frame.f_globals.get("__name__", ""))
        frame = frame.f_back  # type: ignore[assignment]
    return filename[:-3] if filename.endswith(".py") else filename or "<unknown>"


_KEPT = frozenset({"msg", "args"})  # kept as logged where plain (`Forward.emit`)
_PLAIN = (str, int, float, bool, type(None), bytes)


def _plain(args: Any) -> bool:
    """Whether a record's arguments are plain values, which unpickle in the caller whatever it
    imported (an object of the worker's own classes would be formatted into the message first)."""
    if isinstance(args, dict):
        return all(isinstance(k, str) and isinstance(v, _PLAIN) for k, v in args.items())
    return isinstance(args, tuple) and all(isinstance(a, _PLAIN) for a in args)


def handle_logs(batch: Any, records: list[logging.LogRecord], keep: list[Any] | None = None) -> Any:
    """Log records a worker sent (`Forward`), handled by this process's loggers, with their
    template, arguments and exception as logged (a handler that reports `exc_info`, as Sentry's
    does, reads the worker's exception and frames); its warnings warned again here (`rewarn`);
    or kept in `keep` for a caller in another process (`ResultsSink.kept_logs`). Returns `batch`,
    the results they came with."""
    if keep is not None:
        keep.extend(records)
        return batch
    for record in records:
        if rewarn(record):
            continue
        sent = record.__dict__.pop("hardy_exc", None)
        if sent is not None:
            exc = landed(*sent)  # (`travelling_exception`'s)
            record.exc_info = (type(exc), exc, exc.__traceback__)
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)
    return batch


def rewarn(record: logging.LogRecord) -> bool:
    """A worker's warning (`Forward.warned`) warned again in this process, as raised at its file
    and line, of its category where this process has loaded its module (else `UserWarning`);
    False for any other record, or where the warning became an error here (a filter the worker
    did not have): then it is logged, as before."""
    what = getattr(record, "hardy_warning", None)
    if not (isinstance(what, tuple) and len(what) == 6):
        return False
    home, name, message, filename, lineno, module = what
    category = loaded_warning(home, name) or UserWarning
    try:
        warnings.warn_explicit(message, category, filename, lineno, module=module,
                               registry=_REGISTRIES.setdefault(module, {}))
    except Exception:
        return False
    return True


_REGISTRIES: dict[str, dict[Any, Any]] = {}  # per module, as its __warningregistry__: "default" warns once


class Outputs(NamedTuple):
    """The outputs of items `first`, `first` + 1, ..., as a plan's own loop keeps them (`Plan.each`:
    a list per output), and how to make them result dicts."""

    first: int
    columns: list[list[Any]]
    dicts: Callable[[list[list[Any]]], list[dict[str, Any]]]

    def rows(self) -> list[Row]:
        """As (item, ok, its result dict) rows."""
        values = self.dicts(self.columns)
        return list(zip(range(self.first, self.first + len(values)), itertools.repeat(True), values))


class Replies:
    """The worker's side of the results: `unsent` holds the current chunk's results not sent
    yet, and `outs` the outputs of items from `first` on that a plan's own loop ran (`Plan.each`),
    a list per output, which travel as they are when nothing else does (the parent makes them
    dicts); `sent` the chunk's batches already sent (until the next chunk: the parent may ask
    for them again), `producers` which node makes each output of the plan running, `names` its
    nodes by step while its calls are logged, `complete` where the node log's complete items end
    while a batched plan logs (`chunks.Arranged`)."""

    def __init__(self) -> None:
        self.conn: Any = None
        self.fd = -1  # the connection's descriptor
        self.status: StatusWords | None = None
        self.unsent: list[Row] = []
        self.outs: list[list[Any]] = []  # (emptied in place: the plan's loop appends to these lists)
        self.first = 0
        self.dicts: Callable[[list[list[Any]]], list[dict[str, Any]]] = columns_to_dicts(())
        self.sent: list[Sent] = []
        self.producers: dict[str, str] = {}
        self.names: tuple[str, ...] | None = None
        self.complete: int | None = None
        self.sending = False
        self.forward = Forward()
        self.fault = -1  # the crash record (`guard_exits`)

    def start(self, conn: Any, status: StatusWords) -> None:
        self.conn, self.status, self.fd = conn, status, conn.fileno()
        self.forward.install(status)
        watch_threads(lambda: (status.item, status.step, status.step_start))  # for `thread_line`

    def start_outs(self, first: int, outputs: tuple[str, ...]) -> list[list[Any]]:
        """`outs` for the outputs of the plan `outputs`, of items `first`, `first` + 1, ..."""
        self.first, self.dicts = first, columns_to_dicts(outputs)
        self.outs = [[] for _ in outputs]
        return self.outs

    def pending(self) -> int:
        """How many items' outputs `outs` holds whole (last words may come between an item's
        appends: its outputs stored so far stay where they are)."""
        return min(map(len, self.outs)) if self.outs else 0

    def _whole(self) -> Outputs:
        """The outputs of the items `outs` holds whole, copied (`_drop` takes them out)."""
        n = self.pending()
        return Outputs(self.first, [column[:n] for column in self.outs], self.dicts)

    def _drop(self, n: int) -> None:
        """The first `n` items' outputs out of `outs`, in place (the plan's loop appends to these lists)."""
        self.first += n
        for column in self.outs:
            del column[:n]

    def to_rows(self) -> None:
        """`outs` as rows at the end of `unsent`: for a batch that holds more than outputs."""
        if not self.pending():
            return
        sending, self.sending = self.sending, True  # (last words wait: `outs` is moved whole)
        try:
            whole = self._whole()
            self.unsent += whole.rows()
            self._drop(len(whole.columns[0]))
        finally:
            self.sending = sending

    def send(self, batch: list[Row], done: bool, elapsed: float = 0.0, dying: bool = False) -> None:
        """A batch of results, pickled at once (fast), with the node log of its items when it is
        kept (the items that ended only, if `dying`). A value that cannot be pickled fails its
        item; if the parent cannot unpickle the batch, it asks for those items again one by one
        (`resend`), so the chunk's batches are kept in `sent`. The batch is emptied. While this
        runs, last words stay silent: the batch is on its way already."""
        self.sending = True
        status = self.status
        assert status is not None  # (`start` set it, before any item ran)
        if not dying:  # (a dying worker's status words name the item that killed it)
            status.item = SENDING
            status.step = len(batch) + self.pending()
        try:
            names, attached = self.names, ATTACHED[0]  # (a result attached to an autograd graph: `_detached`)
            if self.pending():
                if not (batch or dying or names is not None or self.forward.records) and self._send_outs(done, elapsed):
                    return
                self.to_rows()
            plain = names is None and not dying and not self.forward.records  # (outputs alone may do)
            first = _consecutive(batch) if plain else -1
            if first >= 0 and all(map(_OK, batch)) and ATTACHED[0] == attached:
                data = quick(list(map(_OUTPUT, batch)), main=False)  # the common batch: outputs, nothing else
                if data is not None and ATTACHED[0] == attached:
                    self.sent.append((batch[:], None))
                    head = HEADER.pack(done, False, False, False, False, elapsed, False, True, False, first)
                    transport.write_frame(self.fd, head, data)
                    batch.clear()
                    return
            if dying and self.complete is not None:  # a batched plan's log: only its items written whole
                del LOG.data[self.complete:]
            records = LOG.take(names, ended=len(batch) if dying else None) if names is not None else None
            attached = ATTACHED[0]
            packed, logs, outputs = self._packed(batch, records, first)
            if ATTACHED[0] != attached and not dying and self._detached(batch):  # its warning goes with it
                packed.close()
                packed, logs, outputs = self._packed(batch, records, first)
            if logs:
                self.forward.records = []
            self.sent.append((batch[:], records))
            head = HEADER.pack(done, False, names is not None, False, logs, elapsed, False, outputs, False,
                               first if outputs else -1)
            if packed.fds:
                transport.send(self.conn, head, packed)
            else:
                transport.write_frame(self.fd, head, packed.data)
            batch.clear()
        finally:
            self.sending = False
            if not dying:
                status.item = IDLE
                status.step = NO_STEP

    def _packed(self, batch: list[Row], records: NodeLogBatch | None,
                first: int) -> tuple[transport.Packed, bool, bool]:
        """The batch's message packed, with its node log (`records`, when kept) and the records
        logged since the last batch (taken out of `forward.records` by the caller, once sent);
        whether it holds records, and whether it is outputs alone (`Header.outputs`)."""
        message: Any = batch if self.names is None else (batch, records)
        logs = bool(self.forward.records)
        if logs:  # what the nodes logged since the last batch, for the parent's handlers
            message = (message, self.forward.records)
        outputs = message is batch and first >= 0 and all(map(_OK, batch))
        if outputs:  # (`Header.outputs`)
            message = list(map(_OUTPUT, batch))
        try:
            packed = transport.pack(message, out_of_band)  # the parent has its own __main__: no need for dumps()
        except CAUGHT:  # (a __reduce__ calling sys.exit too: its item fails, the worker goes on)
            batch[:] = [_picklable(self.producers, *row) for row in batch]
            if outputs:  # (some are failures now: rows again)
                message, outputs = batch, False
            packed = transport.pack(message, dumps)
        return packed, logs, outputs

    def _detached(self, batch: list[Row]) -> bool:
        """Whether a node whose result in `batch` holds a tensor attached to an autograd graph (a
        loss computed without `torch.no_grad()`) was warned of it now: the graph cannot cross a
        process, so the tensor arrives a leaf, and `backward()` on it in the caller silently
        fills no parameter's `.grad`. Not an error (inference code that forgets `no_grad` only
        reads the values): a warning, once per node in this worker, to the caller with the batch."""
        warned = False
        for _, ok, value in batch:
            for name, part in value.items() if ok and isinstance(value, dict) else ():
                node = str(self.producers.get(name, name))
                if node in _DETACHED:
                    continue
                before = ATTACHED[0]
                try:
                    dumps(part)
                except Exception:  # (its failure is `_picklable`'s to name)
                    continue
                if ATTACHED[0] != before:
                    _DETACHED.add(node)
                    warned |= _warn_detached(node)
        return warned

    def _send_outs(self, done: bool, elapsed: float) -> bool:
        """`outs` sent as they are (`Header.columns`), when they pickle plainly (and hold no
        tensor attached to an autograd graph: `_detached`); False if not."""
        whole = self._whole()
        attached = ATTACHED[0]
        data = quick(whole.columns, main=False)
        if data is None or ATTACHED[0] != attached:
            return False
        transport.write_frame(self.fd, HEADER.pack(done, False, False, False, False, elapsed, False, True, True,
                                                   whole.first), data)
        self.sent.append((whole, None))
        self._drop(len(whole.columns[0]))
        return True

    def resend(self, items: list[int]) -> None:
        """Items of the last chunk again, each result and each node log (None when not logged)
        pickled on its own, so that the parent reads each on its own: the message itself is
        only bytes, which it can always read (else it would ask again, for ever)."""
        outcomes: dict[int, tuple[bool, Any, NodeLogBatch | None]] = {}
        for batch, records in self.sent:
            rows = batch.rows() if isinstance(batch, Outputs) else batch
            for (i, ok, value), log in zip(rows, row_logs(records, len(rows))):
                outcomes[i] = (ok, value, log)
        data = pickle.dumps([(i, ok, dumps(value, buffer_callback=_in_band), _pickled(log))
                             for i in items for ok, value, log in [outcomes[i]]], protocol=5)
        self.conn.send_bytes(Header(True, True, False, False, False, 0.0).pack() + data)

    def last_words(self, fault: int) -> None:
        """Runs in the handler of a fatal signal (or of the parent's SIGUSR1 before a kill), in
        the thread that received it: where a nested pipeline was and which thread this is, for the
        parent to name (before faulthandler's stack), then the results not sent yet, then which
        files the crash's libraries were mapped from (`crash.mapped`); then it ends the
        processes its nodes started (`lifeline.end_descendants`)."""
        try:
            os.write(fault, (nesting_line() + thread_line()).encode())
        except Exception:
            pass
        transport.WRITERS = 1  # no threads started in a dying process: segments are written by this one
        if (self.unsent or self.pending()) and not self.sending:
            self.send(self.unsent, False, dying=True)
        signal.alarm(LAST_WORDS_LIMIT)  # the results are out: the forensics get a limit of their own
        mapped.record(fault)  # which files the crash's libraries were mapped from (after: results first)
        end_descendants(os.getpid())  # what its nodes started ends with it (its fork server would, not `fork`'s parent)

    def guard_exits(self, fault: int) -> None:
        """A worker that a node ends itself leaves last words first, as a crash does, so that the
        items whose results were not sent yet never run again: `os._exit` (through which a
        SystemExit out of the message loop leaves too: `worker.run`), and exit() called by native
        code (the compiled crash handler's hook; none without a compiler). Only in this process: a
        node's fork child (multiprocessing's) leaves its own way."""
        me, leave = os.getpid(), os._exit
        self.fault = fault

        def guarded(status: int) -> NoReturn:
            if os.getpid() == me:
                loop = sys._getframe(1).f_code.co_filename.endswith(_WORKER_LOOP)
                escaped = sys.exc_info()[1] if loop else None
                if isinstance(escaped, KeyboardInterrupt):  # a node's: it interrupts the call (`deaths`)
                    try:
                        os.write(fault, interrupted_line(escaped, _travelling_interrupt(escaped)).encode())
                    except OSError:
                        pass
                self.farewell(fault, f"{escaped!r} ended the worker's loop" if escaped is not None else
                              f"os._exit({status}) was called")
            leave(status)
        os._exit = guarded
        handler.at_exit(lambda status: self.farewell(fault, f"exit({status}) was called by native code"),
                        LAST_WORDS_LIMIT)

    def retire(self, why: str) -> None:
        """The worker leaves after this chunk, for `why` (written for the parent to log)."""
        try:
            os.write(self.fault, exit_line(why).encode())
        except OSError:
            pass

    def farewell(self, fault: int, how: str) -> None:
        """The worker is leaving on a node's word (`guard_exits`): how and where (every thread's
        stack) go to its crash record, then its last words. Nothing when no item is in flight and
        every result was sent (the worker's own exit)."""
        status = self.status
        if not self.unsent and not self.pending() and (status is None or int(status.item) == IDLE):
            return
        try:
            os.write(fault, exit_line(how).encode())
            faulthandler.dump_traceback(fault, all_threads=True)
            self.last_words(fault)
        except BaseException:  # (a result whose pickling exits again): leave all the same
            pass


REPLIES = Replies()
_DETACHED: set[str] = set()  # the nodes this worker warned of a result detached from its graph (`_detached`)


def _warn_detached(node: str) -> bool:
    """The warning `Replies._detached` gives for `node`; whether it went out (the caller's filters,
    which this worker holds, may ignore it or make it an error: then nothing is raised here)."""
    before = len(REPLIES.forward.records)
    try:
        warnings.warn(
            f"node {node!r} returned a torch tensor attached to an autograd graph (it has a grad_fn): the "
            "graph cannot leave the worker process, so the tensor arrives detached from it, a leaf with "
            "requires_grad=True, and backward() on it (or on what you compute from it) reaches none of the "
            "node's parameters and fills no .grad. For inference, compute it under torch.no_grad() or "
            "torch.inference_mode(), or return .detach(); to train through a pipeline, run it with "
            "map_executor=\"sequential\".", UserWarning, stacklevel=1)
    except Exception:
        return False
    return len(REPLIES.forward.records) > before
_INDEX, _OK, _OUTPUT = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)  # of a row
_WORKER_LOOP = os.path.join("hardy", "workers", "worker.py")  # `worker.run`, whose own exit is not a node's


def _travelling_interrupt(exc: KeyboardInterrupt) -> bytes:
    """A node's KeyboardInterrupt pickled as a node's failure travels (`travelling_exception`: its
    class, or a copy that rebuilds it, and its frames from the user's first on), for the caller to
    raise it as in-process (`deaths`); empty where it will not pickle: its text travels alone."""
    try:
        return dumps(travelling_exception(exc.with_traceback(own_frames(exc.__traceback__))))
    except CAUGHT:
        return b""


def _consecutive(batch: list[Row]) -> int:
    """The first item of `batch` when its rows are items `first`, `first` + 1, ... in order (its
    outputs alone then say which items they are: `Header.first`), else -1."""
    if not batch:
        return 0
    first = batch[0][0]
    return first if all(map(operator.eq, map(_INDEX, batch), itertools.count(first))) else -1


def _pickled(log: NodeLogBatch | None) -> bytes | None:
    """A node log on its own (`resend`); None when there is none, or it cannot be pickled."""
    try:
        return None if log is None else dumps(log, buffer_callback=_in_band)
    except Exception:
        return None


def _in_band(buf: Any) -> bool:
    """A buffer_callback keeping every buffer in the pickle: with one, `dumps` pickles values as
    `transport.pack` does (a memoryview stays a memoryview; without one, cloudpickle makes it bytes)."""
    return True


def _picklable(producers: dict[str, str], i: int, ok: bool, value: Any) -> Row:
    """(item, ok, value), the value replaced by an error naming node and type if it cannot travel."""
    try:
        dumps(value)
        return i, ok, value
    except CAUGHT:
        pass
    for name, part in (value.items() if ok else ()):
        try:
            dumps(part)
        except CAUGHT as exc:
            return i, False, NodeError(
                producers.get(name, name), None, i,
                f"its output {name!r} ({type(part).__module__}.{type(part).__qualname__}) cannot be "
                f"pickled back to the parent process ({type(exc).__name__}: {exc}); return plain data "
                "(numbers, arrays, dicts, paths) or make the type picklable")
    return i, False, NodeError("?", None, i, f"the result of item {i} cannot be pickled back to the parent")

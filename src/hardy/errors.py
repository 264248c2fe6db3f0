"""Every error hardy raises, in one place.

Every class derives from `HardyError` (`except hardy.HardyError:` catches all of hardy's own
errors) and from the built-in a caller would catch it by (`InvalidArgument` is a `ValueError`,
`WorkerStartError` a `RuntimeError`). One exception stands outside `HardyError` on purpose:
`MapInterrupted` is a `KeyboardInterrupt`, which `except Exception:` must not swallow.
tests/test_errors.py checks that no exception class is defined anywhere else.

Each message answers three questions: what went wrong, where (node, input, item), and how to fix it.
Errors that users catch by their built-in meaning also inherit from the matching built-in
(`MissingInputError` is a `ValueError`), so existing `except ValueError:` code keeps working.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# (re-exported: messages are built with them here, and they are imported from here elsewhere)
from .wording import NOT_COMPUTED as NOT_COMPUTED
from .wording import did_you_mean as did_you_mean
from .wording import install_hint as install_hint
from .wording import summarize as summarize


def text_of(exc: BaseException) -> str:
    """`str(exc)`, or what Python's own traceback prints when that raises: an exception whose
    `__str__` fails must still be reported, and must not stop what reports it."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


class HardyError(Exception):
    """Base class of every error hardy raises on purpose."""


# --- building a pipeline -------------------------------------------------------------------------


class GraphError(HardyError, ValueError):
    """The nodes of a pipeline do not form a valid graph."""


class CycleError(GraphError):
    def __init__(self, cycle: Sequence[str]):
        self.cycle = list(cycle)
        path = " -> ".join([*self.cycle, self.cycle[0]])
        super().__init__(
            f"the nodes form a cycle: {path}. Each node must only consume outputs of nodes that do not "
            "(directly or indirectly) consume its own outputs; rename an output or split a node to break it."
        )


class DuplicateOutputError(GraphError):
    def __init__(self, output: str, first: str, second: str):
        self.output, self.nodes = output, (first, second)
        super().__init__(
            f"output {output!r} is produced by two nodes, {first!r} and {second!r}; "
            "give one of them a different output_name."
        )


class SelfDependencyError(GraphError):
    def __init__(self, node: str, name: str):
        self.node, self.name = node, name
        super().__init__(
            f"node {node!r} consumes its own output {name!r}; rename the parameter or the output."
        )


class DuplicateNodeError(GraphError):
    def __init__(self, name: str):
        self.name = name
        super().__init__(
            f"two nodes are named {name!r} in the same pipeline (nested pipelines need distinct names); "
            f"pass name=... to as_node() or Pipeline(name=...)."
        )


class NodeDefinitionError(HardyError, TypeError):
    """A function cannot be used as a node (not callable, *args, bad output_name...)."""


class InvalidArgument(HardyError, ValueError):
    """An argument of an engine, a pipeline call, a cache or a map has a value hardy cannot use:
    raised by the call that received it (not later, from deep inside a run), with one message
    naming the argument, the value and the fix. Node definitions raise `NodeDefinitionError`."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An `InvalidArgument` of the wrong type (`report_dir=123`): also a `TypeError`, the built-in
    Python raises for one."""


UNHASHABLE_FIXES = (
    "give the class a __cache_key__() method returning what identifies the object (e.g. its "
    "constructor arguments), teach hardy a library type with hardy.hashing.register(type, function), "
    "or opt the node out with @node(cache=False)")

# For an object a callable carries (a bound method's instance, a callable object's state): the
# object can also leave the callable and become an input, hashed with the others.
CALLABLE_FIXES = (
    "give {owner} a __cache_key__() method returning what identifies it (e.g. its constructor arguments), "
    "pass the object as an input of the node instead of binding it into the callable "
    "(node(lambda model, X: model.predict(X), output_name=...) with model=... among the inputs), "
    "teach hardy a library type with hardy.hashing.register(type, function), "
    "or opt the node out with @node(cache=False)")


class UnhashableError(HardyError, TypeError):
    """A value has no deterministic encoding (`hardy.hashing`); the message says what, where and how
    to fix it.

    `culprit` is the type that cannot be hashed and `path` the attribute / item path to it inside the
    value that was being hashed, so the message can name `model.encoder._session`, not just a type.
    """

    def __init__(self, message: str, culprit: type | None = None, path: tuple[str, ...] = ()):
        super().__init__(message)
        self.culprit, self.path, self.detail = culprit, path, message

    def at(self, segment: str) -> UnhashableError:
        """The same error one level further out (`segment` is `.attr`, `[0]` or `['key']`)."""
        self.path = (segment, *self.path)
        self.args = (self.detail,)
        return self

    def describe(self, root: str) -> str:
        """The message for a value known to the user as `root` (an input or global name)."""
        where = root + "".join(self.path)
        if self.culprit is None:
            return f"{where}: {self.detail}"
        return (f"{where} is a {self.culprit.__module__}.{self.culprit.__qualname__}, which has no "
                f"deterministic content to hash; {UNHASHABLE_FIXES}")


# --- calling a pipeline --------------------------------------------------------------------------


class MissingInputError(HardyError, ValueError):
    def __init__(self, missing: dict[str, list[str]], provided: Iterable[str], pipeline: str):
        self.missing = missing
        provided = list(provided)
        import difflib  # (here: a worker imports this module, and only this error uses it)
        parts = []
        for name, consumers in missing.items():
            given = difflib.get_close_matches(name, provided, n=1, cutoff=0.6)  # the user's typo, renamed
            hint = f"; {given[0]!r} was given: did you mean {name!r}?" if given else ""
            parts.append(f"{name!r} (needed by {', '.join(repr(c) for c in consumers)}{hint})")
        super().__init__(  # begins with HyperNodes' words, for code that matches on them
            f"Missing required input(s): {sorted(missing)} of pipeline {pipeline!r}: {'; '.join(parts)}. "
            f"Provided: {sorted(provided) or 'nothing'}. Pass them in inputs=... or with bind()."
        )


class UnknownInputError(InvalidArgument):
    def __init__(self, unknown: Sequence[str], accepted: Iterable[str], pipeline: str):
        self.unknown = list(unknown)
        accepted = sorted(accepted)
        hints = "".join(did_you_mean(u, accepted) for u in self.unknown)
        super().__init__(
            f"pipeline {pipeline!r} got input(s) no node consumes: {self.unknown}{hints}. "
            f"Accepted inputs: {accepted}."
        )


class UnknownInputWarning(UserWarning):
    """Inputs were given that no node consumes: usually a typo."""


class UnknownOutputError(HardyError, ValueError):
    def __init__(self, name: str, available: Iterable[str], pipeline: str):
        self.name = name
        available = sorted(available)
        super().__init__(
            f"pipeline {pipeline!r} has no output {name!r}{did_you_mean(name, available)}; "
            f"its outputs are {available}."
        )


class MapInputError(InvalidArgument):
    """map() was called with map_over / map_mode / lengths that do not fit."""


# --- running nodes -------------------------------------------------------------------------------



class NodeError(HardyError):
    """A node failed for one run or one map item; the original exception is `__cause__`."""

    stack: str  # the cause's traceback as text, set where it crosses a process (`shipping.portable`)
    cause_frames: list[Any] | None = None  # ... and as frames, rebuilt into a traceback here (`hardy.tracebacks`)
    cause_chain: list[Any] | None = None  # what the cause was raised from or while handling (`tracebacks.relinked`)
    cause_groups: list[Any] | None = None  # an exception group's exceptions' frames and chains (`shipping.failures`)
    rerun: Callable[[str], bool] | None = None  # how the caller runs its item again under pdb (`debug`)
    nested: tuple[str, ...] = ()  # where in nested maps it failed, outermost first: "'per_doc' item 1"

    def __init__(self, node: str, inputs: dict[str, Any] | None = None, item: int | None = None,
                 reason: str | None = None):
        self.node = node
        self.inputs_summary = summarize(inputs) if inputs else ""
        self.item = item
        self.reason = reason
        super().__init__()

    def __str__(self) -> str:
        where = f"node {self.node!r}"
        if self.item is not None:
            where += f" failed on item {self.item}"
        else:
            where += " failed"
        if self.nested:
            where += f", in nested map at {', '.join(self.nested)}"
        if self.inputs_summary:
            where += f" (inputs: {self.inputs_summary})"
        cause = self.reason
        if cause is None and self.__cause__ is not None:
            cause = f"{type(self.__cause__).__name__}: {text_of(self.__cause__)}"
        return f"{where}: {cause}" if cause else where

    def reported(self) -> dict[str, Any]:
        """How reports show it (run reports, `hardy run`'s lines, a cache key): the node, what it
        raised (type and message) or why hardy failed it, and the signal of a crash."""
        cause = self.__cause__
        return {"node": self.node, "error": type(cause or self).__name__,
                "message": text_of(cause) if cause is not None else (self.reason or str(self)),
                "signal": getattr(self, "signal", None)}

    def __repr__(self) -> str:  # a list of Failed entries should read as what went wrong
        return f"{type(self).__name__}({str(self).splitlines()[0]!r})"

    def __reduce__(self) -> tuple[Any, ...]:  # keep node/item/cause when crossing process boundaries
        state = {k: v for k, v in self.__dict__.items() if k != "rerun"}  # how to run it again: this process's
        return (_rebuild_node_error, (type(self), state, self.__cause__))

    def debug(self) -> bool:
        """Run this item again in this process, on the sequential executor (isolated nodes and
        nested pipelines too, timeouts not enforced), and open pdb where it fails: in the frame of
        your code that raised, with its live locals. True if it failed again. An item that
        crashed its worker cannot: it would end this process; `hardy replay --gdb` runs it apart."""
        if isinstance(self, NodeCrashed) and not isinstance(self, NodeTimeout):
            raise HardyError(f"{self.node!r} crashed its worker ({self.signal or 'it died'}): run here, it would end "
                             "this process too; `hardy replay REPORT --item N --gdb` runs it under gdb in a process "
                             "of its own (REPORT: Engine(report_dir=...) writes one)")
        rerun = self.rerun
        if rerun is None:
            raise HardyError("this error does not know how to run its item again (only the process that ran the map "
                             "does); `hardy replay REPORT --item N --pdb` runs a kept item under pdb")
        return bool(rerun("the run" if self.item is None else f"item {self.item}"))


def _rebuild_node_error(cls: type[NodeError], state: dict[str, Any], cause: BaseException | None) -> NodeError:
    err = cls.__new__(cls)
    Exception.__init__(err)
    err.__dict__.update(state)
    if isinstance(cause, SystemExit) and cause.code is None and cause.args:
        cause.code = cause.args[0]  # rebuilt without its constructor (tblib's pickling, in Dask's workers)
    err.__cause__ = cause
    if cause is not None:  # the worker's frames, and the exceptions it was raised from, as if raised here
        from .tracebacks import landed
        landed(cause, state.get("cause_frames"), state.get("cause_chain"), state.get("cause_groups"))
    return err


class DebuggerUnavailable(HardyError, RuntimeError):
    """`breakpoint()` in a node that runs in a worker process, which has no terminal for pdb."""


class LazyOutputError(HardyError, TypeError):
    """A node returned a generator or a coroutine as a pipeline output: its item's error's cause."""


class RemoteError(HardyError):
    """Stands in for an exception raised in another process that cannot be rebuilt here (its class
    cannot be imported here, or rebuilding it changes its message): a class of the same name and
    module (`type(e).__name__` reads the same), deriving from the built-in exception the original
    derived from (`except OSError:` still catches it), with the original's message."""

    _origin: tuple[str, str, str] = ("builtins", "Exception", "Exception")  # module, qualname, built-in base

    said: str | None = None  # the message, where `args` are the original's (`shipping.failures.rebuilt`)

    def __str__(self) -> str:  # the message as it was (KeyError's own would quote it)
        return self.said if self.said is not None else str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:  # its class is made at run time: it travels as its recipe
        made = (self.message, list(self.exceptions)) if isinstance(self, EXCEPTION_GROUP) else (str(self),)
        return stand_in, (*self._origin, *made), {**self.__dict__, "args": self.args}


_STAND_INS: dict[tuple[str, str, str], type[RemoteError]] = {}
EXCEPTION_GROUP: Any = getattr(builtins, "BaseExceptionGroup", ())  # (Python 3.11 on)


def stand_in(module: str, qualname: str, base: str, message: str,
             exceptions: list[BaseException] | None = None) -> RemoteError:
    """A `RemoteError` named `module.qualname`, deriving from the built-in exception `base`; one
    of an `ExceptionGroup` holds the group's `exceptions` (`except*` and a traceback read them)."""
    made = (message,) if exceptions is None else (message, exceptions)
    key = (module, qualname, base)
    cls = _STAND_INS.get(key)
    if cls is None:
        found = getattr(builtins, base, Exception)
        bases: tuple[type, ...] = (RemoteError,)
        if isinstance(found, type) and issubclass(found, Exception) and found is not Exception:
            bases = (RemoteError, found)
        try:
            cls = type(qualname.rpartition(".")[2], bases, {"__module__": module, "__qualname__": qualname,
                                                             "_origin": key})
            cls(*made)
        except Exception:  # a built-in base whose constructor wants more (UnicodeDecodeError): the name alone
            cls = type(qualname.rpartition(".")[2], (RemoteError,), {"__module__": module, "__qualname__": qualname,
                                                                       "_origin": key})
        _STAND_INS[key] = cls
    return cls(*made)


class OutputCountError(NodeError, TypeError):
    """A node declared n outputs but returned something else. A TypeError too, as unpacking the
    value raises in plain Python and in HyperNodes (`except TypeError` catches it there)."""


class NodeCrashed(NodeError):
    """The worker process running this item died (signal, abort, OOM kill, exit). `stack` is the
    Python stack of the thread that ran the node, `threads` that of every thread of the worker."""

    threads = ""

    def __init__(self, node: str, item: int | None, reason: str, signal: str | None = None,
                 exitcode: int | None = None, stack: str = "", native_frames: Sequence[Any] = (),
                 native_stack: str = "", diagnosis: Sequence[str] = (), inputs: dict[str, Any] | None = None):
        super().__init__(node, inputs, item, reason)
        self.signal, self.exitcode, self.stack = signal, exitcode, stack
        # the crashing thread's native frames (hardy.crash.symbols.Frame), innermost first; their
        # text as the message shows it; what they say about hazards hardy knows (hardy.crash.diagnosis)
        self.native_frames, self.native_stack, self.diagnosis = list(native_frames), native_stack, list(diagnosis)

    def __str__(self) -> str:
        text = super().__str__()
        for line in getattr(self, "diagnosis", ()):
            text += f"\ndiagnosis: {line}"
        return text + self._stacks()

    def _stacks(self) -> str:
        text = ""
        if getattr(self, "native_stack", ""):
            text += "\nworker's native stack at the crash:\n" + self.native_stack.rstrip()
        if self.stack:
            text += "\nworker's Python stack at the crash:\n" + self.stack.rstrip()
        return text


class UnencodableOutput(NodeError):
    """`hardy run`: an item's output has no JSON form (bytes, a set, a DataFrame, your own class):
    the item fails, its line naming the output, where in it, the node that made it and the type."""

    def __init__(self, kind: str, path: str):
        super().__init__("?")
        self.kind, self.path = kind, path

    def of(self, output: str, node: str) -> UnencodableOutput:
        """This error, said of `output`, made by `node`."""
        self.node = node
        where = f"output {output!r}" + (f" at {output}{self.path}" if self.path else "")
        self.reason = (f"{where} is a {self.kind}, which has no JSON form for `hardy run`'s lines; return plain data "
                       "(numbers, text, lists, dicts, arrays), leave it out with --outputs, or call the pipeline "
                       "from Python")
        return self


class ShippingError(NodeError):
    """One item's input or result could not cross between the calling process and the worker:
    it cannot be pickled here, or unpickled (its class imported, its state rebuilt) there. It
    costs that item only; `reason` names the input or output, its type and why."""


class NodeTimeout(NodeCrashed):
    """The item ran past its node's `timeout`; the worker running it was killed. `stacks`: every
    thread's stack just before the kill (Python + native with py-spy, else Python only), with a
    first line saying which tool wrote it."""

    stacks = ""

    def _stacks(self) -> str:
        if not self.stacks:
            return super()._stacks()
        return "\nworker's stacks before the kill:\n" + self.stacks.rstrip()


class CudaError(NodeError):
    """A CUDA call failed in a node; the CUDA library's exception is `__cause__`, the node's Python
    stack is `stack`. `sticky` (illegal address, device-side assert, launch failure, ECC): every
    later CUDA call of the process that ran it fails too, so a hardy worker retires before its next
    item and a fresh one takes over."""

    def __init__(self, node: str, inputs: dict[str, Any] | None, stack: str, sticky: bool = False):
        super().__init__(node, inputs)
        self.stack, self.sticky = stack, sticky
        self.retires_worker = sticky  # a fresh worker is the only cure

    def __str__(self) -> str:
        text = super().__str__()
        if self.sticky:
            text += ("\n(a sticky CUDA error: the CUDA context of the process that ran this item is unusable; "
                     "a hardy worker is replaced before its next item)")
        if self.stack:
            text += "\nnode's Python stack at the CUDA error:\n" + self.stack.rstrip()
        return text


class GpuOutOfMemory(CudaError):
    """The GPU ran out of memory in a node. With `@node(retries=N, backoff=s)` (`retries`, `backoff`
    here) the worker retires and the item is retried on a fresh one, whose CUDA context starts with
    nothing allocated."""

    def __init__(self, node: str, inputs: dict[str, Any] | None, stack: str, retries: int = 0,
                 backoff: float = 0.0):
        super().__init__(node, inputs, stack)
        self.retries, self.backoff = retries, backoff
        self.retires_worker = retries > 0


class EngineClosed(HardyError, RuntimeError):
    """An `imap` whose engine was closed before the stream ended."""


class MapError(HardyError):
    """A map item failed with on_error="raise". Nothing computed is lost: see `results`.

    `failures` is keyed by item index; `results[k]` is item `offset + k` (a streamed map, whose
    earlier results were already handed out, reports the window of items around the failure)."""

    def __init__(self, results: list[Any], failures: dict[int, NodeError], offset: int = 0):
        self.results = results
        self.failures = failures
        self.offset = offset
        first = failures[min(failures)]
        done = sum(1 for r in results if r is not None and not isinstance(r, Failed))
        super().__init__(
            f"{len(failures)} map item(s) failed; {done} of {len(results)} completed. .results has one entry per "
            f"item: the result, a Failed, or None for an item not run. First failure: {str(first).rstrip('.')}. "
            f"Use on_error='continue' to run every item.")
        self.__cause__ = first

    def debug(self) -> bool:
        """The first failure's `NodeError.debug()`: its item, again, here, under pdb."""
        return self.failures[min(self.failures)].debug()


class MapInterrupted(KeyboardInterrupt):
    """A map was interrupted (Ctrl-C, or SIGTERM once hardy's workers are running): a
    `KeyboardInterrupt` that still carries everything computed. `results` has one entry per item
    (the result, a `Failed`, or None for an item not run), `failures` the failures by index; the
    map's workers were stopped; `report_dir`: where its run report was written, if anywhere.

    Uncaught, it ends a script as Ctrl-C does, with exit code 130 (CPython gives 130 to a
    `KeyboardInterrupt` itself only), saying how many results it held (`hardy.api.interrupts`)."""

    def __init__(self, results: list[Any], failures: dict[int, NodeError], report_dir: Any = None):
        self.results = results
        self.failures = failures
        self.report_dir = report_dir
        self.done = sum(1 for r in results if r is not None and not isinstance(r, Failed))
        super().__init__(f"map interrupted: {self.done} of {len(results)} items completed, {len(failures)} failed; "
                         ".results holds them (None for an item not run)")


class Failed:
    """Stands in a map's result list in place of an item that failed (on_error="continue")."""

    __slots__ = ("error",)

    def __init__(self, error: NodeError):
        self.error = error
        if error.__traceback__ is None:  # never raised: the frames of the code that raised its cause, as
            from .tracebacks import user_traceback

            error.__traceback__ = user_traceback(error)  # `run()` raises it (`pdb.post_mortem(error.__traceback__)`)

    def __repr__(self) -> str:
        return f"Failed({self.error!r})"

    def debug(self) -> bool:
        """Its error's `NodeError.debug()`: the item, again, here, under pdb."""
        return self.error.debug()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Failed, (self.error,))

    def __cache_key__(self) -> tuple[str, str, str, str]:
        """What a cached node reading a nested map's results is keyed by where an item failed: the
        failure as reported. The same failure again finds the node's result; the item succeeding
        on a rerun changes the key, so the node runs anew."""
        reported = self.error.reported()
        return "hardy.Failed", reported["node"], reported["error"], reported["message"]


class HazardError(HardyError, RuntimeError):
    """A fork was requested while something in this process makes forking unsafe."""


class ForkRefused(HazardError):
    """A start_method="fork" pool refused to fork a worker (a replacement, a recycled one, a
    later map's first): a hazard appeared after the pool started. `results` and `failures` are
    the map's running then, as a MapError's (None for an item not run); None outside a map."""

    results: list[Any] | None = None
    failures: dict[int, Any] | None = None


class NoGpuError(HardyError, RuntimeError):
    """GPU workers were asked for where no GPU can be found."""


class WorkerStartError(HardyError, RuntimeError):
    """Worker processes die before they run anything (a failing preload, a broken environment)."""


class PicklingError(HardyError, TypeError):
    """An input or node cannot be sent to a worker process."""


class ReplicaError(HardyError, ImportError):
    """A worker cannot hold what the calling process holds under a name its pipeline reads (module
    state set at run time that neither hashes nor pickles): the pipeline is refused there rather
    than run with another value (docs/same-answer.md). The message names the module, the name and the fix."""


class PipelineRefused(NodeError):
    """A worker refused the pipeline (its `ReplicaError`'s sentence is the reason): the call raises
    that `ReplicaError` once, before any node ran (`engine.results.Results.fail`)."""


class NodeInterrupted(NodeError):
    """A node raised KeyboardInterrupt in a worker: the call raises it, as in-process (`Results.fail`)."""


class WorkerImportError(HardyError, ModuleNotFoundError):
    """A distributed engine's workers cannot import a module the pipeline's code needs; the message
    names the module and how to ship it (`ship_modules=`)."""


class Exited(HardyError, RuntimeError):
    """A node's SystemExit, carried out of an asyncio task as an ordinary exception (asyncio raises
    a task's SystemExit out of the event loop, past every `await`): it reaches the plan, which
    fails the item naming the exit code, as on every executor."""

    def __init__(self, exit: SystemExit):
        super().__init__(exit.code)
        self.exit = exit


class Escaped(Exited):
    """A node's BaseException that is neither an Exception nor a SystemExit (GeneratorExit, its own
    CancelledError, a `class Stop(BaseException)`), carried out of an asyncio task as `Exited`
    carries a SystemExit: the plan fails the item naming it as the cause (`model.policy.carried`)."""

    def __init__(self, exc: BaseException):
        RuntimeError.__init__(self, f"{type(exc).__name__}: {exc}")
        self.exit = exc  # type: ignore[assignment]


class BatchShapeError(HardyError, ValueError):
    """A batched node's function returned something other than one entry per item and output."""


# --- the cache -----------------------------------------------------------------------------------


class UntrustedCacheError(HardyError, RuntimeError):
    """A cache directory or key that someone else could have written: never used. Raised by
    `DiskCache(...)`, where it must be seen; found only later (a directory another user made after
    the constructor looked), the cache's calls run uncached and its warning says why."""


class CacheUnavailable(HardyError, OSError):
    """The object-store cache's bucket cannot be used now (unreachable, too slow, throttling,
    credentials, no bucket); an OSError, so a run goes on uncached where the local store would."""


# --- the doctor and forensics --------------------------------------------------------------------


class ReplayError(HardyError, RuntimeError):
    """A kept item cannot be replayed: missing, not this user's, tampered with, or unreadable."""


class WheelError(HardyError, ValueError):
    """A wheel or a patch that cannot be used; the message says which file and why."""

"""A Plan is what one call of a pipeline needs, compiled into the cheapest form to execute.

Given the names the caller provides and the outputs it wants, `Plan(...)` prunes the graph to the
nodes needed, orders them, resolves every node input to a provided value, another node's output or
the parameter's default, and then *generates a Python function* that executes exactly those steps.
For `clean` (text -> cleaned) then `count` (cleaned -> n words), `Pipeline.explain()` shows:

    def _run(_v, _item=None):
        _s = 0
        try:
            text = _v['text']
            cleaned = f_clean(text)  # node 'clean'
            _s = 1
            n_words = f_count(cleaned)  # node 'count'
            _s = 0
            if cleaned.__class__ in _LAZY: _lazy('cleaned', cleaned)
            _s = 1
            if n_words.__class__ in _LAZY: _lazy('n words', n_words)
        except BaseException as _e:
            if _passes(_e): raise
            raise _fail(_s, _e, locals())
        return {'cleaned': cleaned, 'n words': n_words}

Locals are named after the values they hold and node functions after their nodes (valid, unique
identifiers); `_s` is the step running, for the error `_fail` builds; `_item` is the item's index in
a map, for cache callbacks. Whatever a node raises fails its item, sys.exit() and GeneratorExit
too, but what `_passes` lets through (an interrupt, asyncio's cancel: `model.policy.passes`). The
code is registered in `linecache` under its own file name (`<hardy plan 'pipeline' #3>`), so pdb
stepping through a run shows its lines (a node's own traceback leaves them out: it starts at the
node, `hardy.tracebacks`).

Why generate code: the per-call cost of hardy is the cost of walking a plan, and a straight-line
function is the cheapest walk CPython has (no dict lookups per argument, no loop, no branches).
Every executor runs this same function (in a thread, a worker process or a Ray task), so there is one
implementation of "run the nodes of one item", whatever the engine.

Three emission modes share one generator: "sequential" (straight line), "threaded" (independent
nodes of a dependency level are submitted to a thread pool) and "async" (an `async def` whose
independent async nodes are gathered). With a cache, the same generator adds key derivation and
lookups around each call; without one, none of that code exists. `plan/source.py` writes the
function; this module resolves the steps, compiles and runs the function, and builds the error
of a node that failed in it.
"""

from __future__ import annotations

import itertools
import linecache
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cache.keys import MISS, PlanCache, call_key, output_key
from ..errors import (
    NOT_COMPUTED,
    CudaError,
    Exited,
    GpuOutOfMemory,
    LazyOutputError,
    NodeError,
    UnhashableError,
)
from ..hashing import Reach, code_fingerprint, is_user_module, recording
from ..hashing.state import token
from ..model.given import NOTHING
from ..model.graph import Graph, node_functions
from ..model.node import Node
from ..model.policy import carried, guard, passes, passes_in_coroutine
from ..tracebacks import own_frames
from .rows import batch_outputs
from .source import PlanSource
from .unpacking import check_outputs, count_error

Wrap = Callable[[int, Node], Callable[..., Any]]  # (step index, node) -> the callable to use


@dataclass(frozen=True)
class Step:
    """One node call: where each argument comes from and where each output goes."""

    node: Node
    args: tuple[tuple[str, str], ...]  # (parameter, value name) for values known at run time
    level: int


KEYS = "__hardy_keys__"  # in a keyed plan's values and results: {value name: its cache key}


CAUGHT = (Exception, SystemExit)  # what fails an item when a worker pickles its result (`workers/replies.py`)
LAZY = frozenset({types.GeneratorType, types.AsyncGeneratorType, types.CoroutineType})


def _lazy(name: str, value: Any) -> None:
    raise LazyOutputError(
        f"its output {name!r} is a {type(value).__name__}, whose work would run only when read, after the node "
        "returned: outside hardy's error handling, timeouts and crash containment, and a worker process cannot "
        "send it back. Return a list (list(...)) or another value instead")


def user_code(code: Any) -> bool:
    """Whether `code` (a function or class a call's values carry) is the user's: not a library's,
    nor hardy's own (an engine given as an input carries no user state)."""
    module = getattr(code, "__module__", None)
    return isinstance(module, str) and module.partition(".")[0] != __name__.partition(".")[0] \
        and is_user_module(module)


class Plan:
    """The pruned, ordered, compiled steps for (provided names, requested outputs, mode)."""

    def __init__(self, graph: Graph, provided: Sequence[str], outputs: Sequence[str],
                 mode: str = "sequential", wrap: Wrap | None = None, submit: Callable[..., Any] | None = None,
                 cache: PlanCache | None = None, keyed: bool = False,
                 on_cached: Callable[[str, bytes, int | None], None] | None = None, name: str | None = None,
                 calls: dict[str, Node] | None = None):
        """`on_cached(node name, key, item)` is called for each node answered from the cache (callbacks'
        `on_node_cached`); without it no code is generated for that. `keyed` makes the plan one
        stage of a larger one (an engine that runs a pipeline's nodes in several places): it takes
        the cache keys of provided values from `values[KEYS]`, where an earlier stage computed them,
        and returns the keys of its outputs under `KEYS`, so every node is keyed exactly as in the
        whole plan run at once. `name` (the pipeline's) names the generated code's file in
        tracebacks: `<hardy plan 'name' #3>`. `calls` stands nodes in for the named ones when they
        are called (keys and names stay the originals': a batched node's results handed out
        per item, `hardy.parts.batching`)."""
        self.graph = graph
        self.provided = tuple(provided)
        self.outputs = tuple(outputs)
        self.mode = mode
        self.steps = resolve(graph, set(self.provided), self.outputs)
        given = set(self.provided)
        self.inputs = tuple(dict.fromkeys(v for s in self.steps for _, v in s.args if v in given))
        self.wrap = wrap
        self._submit = submit
        self.cache = cache
        self.keyed = keyed and cache is not None
        self.on_cached = on_cached
        self._calls = calls or {}
        # A wrap that only names each step in a worker's status words (`wrap.inline`: the words
        # as doubles, where the item and the step are, what they say between items and steps:
        # workers/status.py `Marks`) is written into a plain plan's code instead, a store before each
        # call: a wrapper would cost a call of its own per node (see workers/status.py `marked`).
        # Such a plan also runs a chunk's items in a loop of its own (`each`).
        inline = getattr(wrap, "inline", None)
        self.marks: Any | None = inline if (
            inline is not None and mode == "sequential" and cache is None and not calls
            and not any(s.node.batch is not None for s in self.steps)) else None
        self.name = name or ",".join(self.outputs)[:80]  # in the generated code's file name
        self.watched: Reach | None = None  # what its nodes read, when it must be checked for changes (`reads`)
        self.given_code: frozenset[Any] = NOTHING  # the code its calls' values carry (`model.given`)
        self.run: Callable[..., dict[str, Any]]
        self.arun: Callable[..., Any] | None = None
        self.hashed_inputs: tuple[str, ...] = ()  # provided values whose content is hashed for a key
        self._fingerprints: dict[int, bytes] = {}  # of the cached steps, by step
        self._each: dict[str | None, Callable[..., Any]] = {}  # `each`'s loops, by the input mapped over
        self._compile()

    def __getstate__(self) -> dict[str, Any]:
        # The generated functions are rebuilt on the other side: cheap, and keeps pickles small.
        # A thread pool cannot travel; a plan rebuilt in a worker runs its nodes sequentially there.
        return {"graph": self.graph, "provided": self.provided, "outputs": self.outputs,
                "mode": "async" if self.mode == "async" else "sequential", "cache": self.cache, "keyed": self.keyed,
                "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["graph"], state["provided"], state["outputs"], state["mode"],  # type: ignore[misc]
                      cache=state["cache"], keyed=state["keyed"], name=state["name"])  # rebuilt, not restored

    def unresolved(self) -> dict[str, list[str]]:
        """The node inputs that nothing resolves (not provided, not computed, no default), each with
        the nodes that take it: {input: [node name, ...]}."""
        missing: dict[str, list[str]] = {}
        for step in self.steps:
            given = {p for p, _ in step.args}
            for p in step.node.inputs:
                if p not in given and p not in step.node.defaults:
                    missing.setdefault(p, []).append(step.node.name)
        return missing

    def reads(self, keyed: Reach | None = None) -> Reach:
        """What the plan's nodes read (globals, module attributes, class members, the content of
        those that can change in place), for `Reach.changed` to tell when the plan no longer
        computes what its nodes would now: a plan that runs in other processes, or whose cache
        keys hold code and state, is then made again (docs/same-answer.md). `keyed`: what keying
        its cached steps read, to which the others' reads are added (a nested pipeline's inner
        nodes, a node with `cache=False`); the nodes' own functions are watched for code and
        defaults replaced in place either way (IPython's autoreload)."""
        return self.reached(keyed).watch(token, node_functions(self.graph.nodes))

    def reached(self, keyed: Reach | None = None) -> Reach:
        """What the nodes reach, noted while they are fingerprinted as a cache would key them (an
        uncached plan checked for code edits, `Pipeline._plan`; a replica's stamps), into `keyed`
        for the steps its keys did not read; a node that cannot be fingerprinted is noted as far
        as it could."""
        reach = keyed if keyed is not None else Reach()
        previous = recording(reach)
        try:
            for k, step in enumerate(self.steps):
                if keyed is not None and k in self._fingerprints:
                    continue
                try:
                    step.node.fingerprint()
                except UnhashableError:
                    pass
            for code in self.given_code:  # what the values given run reads, as a node's own code's
                try:
                    code_fingerprint(code)
                except Exception:  # (noted as far as it could; the call says why, if it fails)
                    pass
        finally:
            recording(previous)
        return reach

    # --- the generated function (written by plan/source.py) ---------------------------------------

    def _compile(self) -> None:
        ns = self._ns = self._namespace()
        source = PlanSource(self, ns, self._function_for, reports_cached=self.on_cached is not None, keys=KEYS)
        self._writer = source if self.marks is not None else None  # (for `each`)
        self.source, self._vars = source.text, source.vars
        self.hashed_inputs, self._fingerprints = source.hashed_inputs, source.fingerprints
        self.filename = f"<hardy plan {self.name!r} #{next(_PLAN_NUMBERS)}>"
        self._exec(self.source, self.filename)
        if self.mode == "async":
            arun = self.arun = ns["_run"]
            self.run = lambda v, i=None: run_sync(arun(v, i))
        else:
            self.run = ns["_run"]

    def _exec(self, source: str, filename: str) -> None:
        """Run `source` in the plan's namespace, its lines shown under `filename` in tracebacks and pdb."""
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        weakref.finalize(self, linecache.cache.pop, filename, None)
        exec(compile(source, filename, "exec"), self._ns)

    def each(self, over: str | None) -> Callable[..., Any] | None:
        """The loop that runs a chunk's items through this plan in a worker (`PlanSource.each_text`),
        for items that are the values of the input `over` (or, None, each item's inputs); None
        when the plan has no `marks` (or no outputs). Per item it costs less than half what a call of `run` in a
        loop of its own does (no call, no dict of inputs, one row appended): in a map of fast
        items, the workers' time is mostly that."""
        found = self._each.get(over)
        if found is None and self._writer is not None and self.outputs:
            filename = f"{self.filename[:-1]} each {over!r}>"
            self._exec(self._writer.each_text(over), filename)
            found = self._each[over] = self._ns["_each"]
        return found

    def _namespace(self) -> dict[str, Any]:
        """The generated function's globals: hardy's helpers, under names no local can take."""
        ns: dict[str, Any] = {"_fail": self._fail, "_LAZY": LAZY,
                              "_passes": passes_in_coroutine if self.mode == "async" else passes, "_lazy": _lazy,
                              "_outs": check_outputs, "_await": run_sync, "_mark": _mark_step,
                              "_submit": self._submit, "_t": _thread_call, "_MISS": MISS,
                              "_oncached": self.on_cached, "_st": self.marks.words if self.marks else None,
                              "_clock": time.monotonic}
        if self.mode == "async":
            import asyncio  # only async plans pay for importing asyncio
            ns["_gather"] = asyncio.gather
        return ns

    def _function_for(self, k: int, node: Node) -> Callable[..., Any]:
        """What step k calls per item: the node's function (or the one `calls` stands in for it),
        instrumented (`wrap`) and under its failure policy; a batched node's function on lists of
        one item."""
        node = self._calls.get(self.steps[k].node.name, node)
        func = guard(node, self.wrap(k, node) if self.wrap and not self.marks else node.func)
        if node.batch is not None and node.batch is node.func:
            return one_item(func, node.name, len(node.outputs))
        return func

    def ahead_keys(self, values: dict[str, Any]) -> list[bytes]:
        """The keys of the cached steps whose arguments are all provided (the ones `PlanSource._early_fetch`
        derives), for a map to fetch items' entries ahead of running them (`DiskCache.prefetch`).
        The input keys hashed here are kept in `values[KEYS]`, so the run does not hash them again.
        The same formulas as the generated code: a key derived differently would only miss."""
        cache = self.cache
        if cache is None or not self._fingerprints:
            return []
        known = dict(values.get(KEYS) or {})
        for name in self.hashed_inputs:
            if name not in known:
                known[name] = cache.input_key(values[name], name)
        values[KEYS] = known
        keys = []
        for k, step in enumerate(self.steps):
            if k in self._fingerprints and all(v in known for _, v in step.args):
                key = call_key(self._fingerprints[k], *(known[v] for _, v in step.args))
                keys.append(key)
                outs = step.node.outputs
                known.update((o, output_key(key, o, len(outs))) for o in outs)
        return keys

    # --- errors ----------------------------------------------------------------------------------

    def _fail(self, k: int, exc: BaseException, scope: dict[str, Any]) -> NodeError:
        k = getattr(exc, "_hardy_step", k)
        step = self.steps[k]
        node = step.node
        if isinstance(exc, NodeError):  # from a nested pipeline or a worker: keep it, add the path
            if exc.node != node.name:
                exc.node = f"{node.name}/{exc.node}"
            return exc
        inputs = {p: scope.get(self._vars[v], NOT_COMPUTED) for p, v in step.args}
        if isinstance(exc, Exited):
            exc = exc.exit
        counted = count_error(node, inputs, exc)
        if counted is not None:
            return counted
        err = _error_for(node, inputs, exc)
        err.__cause__ = exc.with_traceback(own_frames(exc.__traceback__))  # from the node's own frame on
        err.__suppress_context__ = True
        return err


def _error_for(node: Node, inputs: dict[str, Any], exc: BaseException) -> NodeError:
    """A NodeError (saying why for sys.exit and generator outputs), or for CUDA's errors a
    CudaError / GpuOutOfMemory holding the node's stack (the exception's traceback does not
    survive the trip back from a worker; the text does)."""
    if isinstance(exc, SystemExit):  # the same Failed on every executor (docs/failures.md)
        return NodeError(node.name, inputs, reason=f"called sys.exit({exc.code!r}); a node cannot end the process "
                                                   "that runs it: raise an exception instead")
    if isinstance(exc, LazyOutputError):
        reason = str(exc)
        exc.args = (f"node {node.name!r}: {reason}",)  # raised as itself too (hardy.compat.hypernodes)
        return NodeError(node.name, inputs, reason=reason)
    from ..safety.gpus import cuda_failure  # failures only: `import hardy` stays light

    kind = cuda_failure(exc)
    if kind is None:
        return NodeError(node.name, inputs)
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    stack = "".join(traceback.format_list([f for f in frames if not f.filename.startswith("<hardy plan")]))
    if kind == "oom":
        return GpuOutOfMemory(node.name, inputs, stack, retries=node.retries, backoff=node.backoff)
    return CudaError(node.name, inputs, stack, sticky=kind == "sticky")


_PLAN_NUMBERS = itertools.count(1)  # each plan's code has its own file name, for linecache



def one_item(func: Callable[..., Any], name: str, outputs: int) -> Callable[..., Any]:
    """A batched node's function called for one item: each argument as a list of one, the entry
    of each output taken back, by rows (`plan/rows.py`; `Pipeline.run`, and maps whose executor does not batch)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        out = func(*[[a] for a in args], **{p: [a] for p, a in kwargs.items()})
        columns = batch_outputs(out, name, outputs, 1)
        return columns[0][0] if outputs == 1 else tuple(c[0] for c in columns)
    return call


def _tag(exc: BaseException, k: int) -> None:
    """Remember which step raised, for errors that surface away from their step (gather, futures)."""
    try:
        exc._hardy_step = k  # type: ignore[attr-defined]
    except AttributeError:
        pass


async def _mark_step(k: int, coro: Any) -> Any:
    """A gathered node's call (an asyncio task: its SystemExit or CancelledError leaves as an
    ordinary exception, `model.policy.carried`)."""
    try:
        return await coro
    except Exception as exc:
        _tag(exc, k)
        raise
    except BaseException as exc:
        if passes_in_coroutine(exc):
            raise
        exited = carried(exc)
        _tag(exited, k)
        raise exited from None


def _thread_call(k: int, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return func(*args, **kwargs)
    except BaseException as exc:
        _tag(exc, k)
        raise


def resolve(graph: Graph, provided: set[str], outputs: Sequence[str]) -> tuple[Step, ...]:
    """The steps needed for `outputs`, in dependency order; raises nothing (see Pipeline). Each
    step's node is narrowed to the outputs the run needs, so a nested pipeline computes only those."""
    wanted, chosen = set(outputs), {}
    for n in reversed(graph.order):
        if any(o in wanted and o not in provided for o in n.outputs):
            narrowed = n.narrowed(tuple(o for o in n.outputs if o in wanted))
            chosen[id(n)] = narrowed
            wanted.update(narrowed.inputs)
    steps: list[Step] = []
    level_of: dict[str, int] = {}
    for n in graph.order:
        if id(n) not in chosen:
            continue
        n = chosen[id(n)]
        args = tuple((p, p) for p in n.inputs if p in provided or p in graph.producer)
        level = 1 + max((level_of.get(v, -1) for _, v in args), default=-1)
        for o in n.outputs:
            level_of[o] = level
        steps.append(Step(n, args, level))
    return tuple(steps)


_loops = threading.local()


def _close(loop: Any) -> None:
    """A thread's loop that a KeyboardInterrupt or SystemExit left (Ctrl-C, or a node raised it):
    asyncio lets those out of the task they hit at once, the coroutine's other tasks still
    pending, which the loop's next run would resume (a map's items ran on into the next map).
    They are cancelled and the loop closed, as `asyncio.run` leaves one; the next call makes its
    own."""
    import asyncio
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    try:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    except BaseException:  # (the interrupt again, from the task that awaited the one it hit)
        pass
    finally:
        for task in pending:  # their exceptions taken: none is reported as never retrieved
            if task.done() and not task.cancelled():
                task.exception()
        loop.close()


def run_sync(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code.

    A loop per thread is reused (creating one per call costs ~50 µs). When this thread already runs
    a loop (a notebook), the coroutine runs on a helper thread's loop instead of failing.
    """
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:  # run outside the `except`: a node's exception must not have this one as its context
        loop = getattr(_loops, "loop", None)
        if loop is None or loop.is_closed():
            loop = _loops.loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(coro)
        except (KeyboardInterrupt, SystemExit):
            _close(loop)
            raise
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, asyncio.run(coro)))
        except BaseException as exc:  # re-raised in the caller's thread
            box.append((False, exc))

    t = threading.Thread(target=target, name="hardy-await")
    t.start()
    t.join()
    ok, value = box[0]
    if ok:
        return value
    raise value

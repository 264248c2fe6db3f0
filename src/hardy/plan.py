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
        except _Exception as _e:
            raise _fail(_s, _e, locals())
        return {'cleaned': cleaned, 'n words': n_words}

Locals are named after the values they hold and node functions after their nodes (valid, unique
identifiers); `_s` is the step running, for the error `_fail` builds; `_item` is the item's index in
a map, for cache callbacks. The code is registered in `linecache` under its own file name
(`<hardy plan 'pipeline' #3>`), so tracebacks and pdb show its lines.

Why generate code: the per-call cost of hardy is the cost of walking a plan, and a straight-line
function is the cheapest walk CPython has (no dict lookups per argument, no loop, no branches).
Every executor runs this same function (in a thread, a worker process or a Ray task), so there is one
implementation of "run the nodes of one item", whatever the engine.

Three emission modes share one generator: "sequential" (straight line), "threaded" (independent
nodes of a dependency level are submitted to a thread pool) and "async" (an `async def` whose
independent async nodes are gathered). With a cache, the same generator adds key derivation and
lookups around each call (see `_cache_prelude`); without one, none of that code exists.
"""

from __future__ import annotations

import builtins
import itertools
import keyword
import linecache
import re
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .cache.keys import MISS, PlanCache, call_fingerprint, call_key, output_key
from .errors import (
    NOT_COMPUTED,
    BatchShapeError,
    CudaError,
    Exited,
    GpuOutOfMemory,
    LazyOutputError,
    NodeError,
    OutputCountError,
)
from .graph import Graph
from .node import Node
from .policy import guard

Wrap = Callable[[int, Node], Callable[..., Any]]  # (step index, node) -> the callable to use


@dataclass(frozen=True)
class Step:
    """One node call: where each argument comes from and where each output goes."""

    node: Node
    args: tuple[tuple[str, str], ...]  # (parameter, value name) for values known at run time
    level: int


KEYS = "__hardy_keys__"  # in a keyed plan's values and results: {value name: its cache key}


CAUGHT = (Exception, SystemExit)  # what fails a node's item: sys.exit() too, the same on every executor
LAZY = frozenset({types.GeneratorType, types.AsyncGeneratorType, types.CoroutineType})


def _lazy(name: str, value: Any) -> None:
    raise LazyOutputError(
        f"its output {name!r} is a {type(value).__name__}, whose work would run only when read, after the node "
        "returned: outside hardy's error handling, timeouts and crash containment, and a worker process cannot "
        "send it back. Return a list (list(...)) or another value instead")


class _WrongOutputCount(Exception):
    def __init__(self, value: Any):
        self.value = value


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
        per item, `hardy.batching`)."""
        self.graph = graph
        self.provided = tuple(provided)
        self.outputs = tuple(outputs)
        self.mode = mode
        self.steps = resolve(graph, set(self.provided), self.outputs)
        given = set(self.provided)
        self.inputs = tuple(dict.fromkeys(v for s in self.steps for _, v in s.args if v in given))
        self._wrap = wrap
        self._submit = submit
        self.cache = cache
        self.keyed = keyed and cache is not None
        self._on_cached = on_cached
        self._calls = calls or {}
        self.name = name or ",".join(self.outputs)[:80]  # in the generated code's file name
        self.run: Callable[..., dict[str, Any]]
        self.arun: Callable[..., Any] | None = None
        self.hashed_inputs: tuple[str, ...] = ()  # provided values whose content is hashed for a key
        self._fingerprints: dict[int, bytes] = {}  # of the cached steps, by step
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

    # --- code generation -------------------------------------------------------------------------

    def _compile(self) -> None:
        ns = self._namespace()
        lines = self._name_locals(ns)
        if self.cache is not None:
            lines += self._cache_prelude(ns)
        by_level: dict[int, list[int]] = {}
        for k, s in enumerate(self.steps):
            by_level.setdefault(s.level, []).append(k)
        for level in sorted(by_level):
            lines += self._level(by_level[level])
        self.source = self._function(lines)
        self.filename = f"<hardy plan {self.name!r} #{next(_PLAN_NUMBERS)}>"
        linecache.cache[self.filename] = (len(self.source), None, self.source.splitlines(True), self.filename)
        weakref.finalize(self, linecache.cache.pop, self.filename, None)
        exec(compile(self.source, self.filename, "exec"), ns)
        if self.mode == "async":
            arun = self.arun = ns["_run"]
            self.run = lambda v, i=None: run_sync(arun(v, i))
        else:
            self.run = ns["_run"]

    def _namespace(self) -> dict[str, Any]:
        """The generated function's globals: hardy's helpers, under names no local can take."""
        ns: dict[str, Any] = {"_fail": self._fail, "_Exception": CAUGHT, "_LAZY": LAZY, "_lazy": _lazy,
                              "_outs": _check_outputs, "_await": run_sync, "_mark": _mark_step,
                              "_submit": self._submit, "_t": _thread_call, "_MISS": MISS,
                              "_oncached": self._on_cached}
        if self.mode == "async":
            import asyncio  # only async plans pay for importing asyncio
            ns["_gather"] = asyncio.gather
        return ns

    def _name_locals(self, ns: dict[str, Any]) -> list[str]:
        """Name each value's local after the value and each node's function after the node (unique,
        valid identifiers), put the functions to call in `ns`; the lines reading the provided values."""
        taken = set(ns) | _INTERNAL
        self._vars: dict[str, str] = {}   # value name -> local holding its value
        self._kvars: dict[str, str] = {}  # value name -> local holding its cache key
        for name in self.provided:
            if name in self.inputs or name in self.outputs:
                self._vars[name] = _identifier(name, taken)
        lines = [f"{self._vars[n]} = _v[{n!r}]" for n in self.provided if n in self._vars]
        self._cached = [False] * len(self.steps)
        self._fn: list[str] = []
        for k, step in enumerate(self.steps):
            node = step.node
            if self.cache is not None:
                node = node.cached_in(self.cache)  # a nested pipeline caches its own nodes
            self._fn.append(_identifier(f"f_{step.node.name}", taken))
            ns[self._fn[k]] = self._function_for(k, self._calls.get(step.node.name, node))
            for o in step.node.outputs:
                self._vars[o] = _identifier(o, taken)
            self._cached[k] = self.cache is not None and node.cache
        self._res = [_identifier(f"{s.node.name}_result", taken) for s in self.steps]
        self._key = [_identifier(f"{s.node.name}_key", taken) for s in self.steps]
        self._taken = taken
        return lines

    def _function_for(self, k: int, node: Node) -> Callable[..., Any]:
        """What step k calls per item: the node's function, instrumented (`wrap`) and under its
        failure policy; a batched node's function on lists of one item."""
        func = guard(node, self._wrap(k, node) if self._wrap else node.func)
        if node.batch is not None and node.batch is node.func:
            return one_item(func, node.name, len(node.outputs))
        return func

    def _level(self, ks: list[int]) -> list[str]:
        """The lines for one dependency level: the plain straight line, or lookups, calls (concurrent
        where the mode allows) and stores."""
        is_async = self.mode == "async"
        concurrent = len(ks) > 1 and (self.mode == "threaded" or
                                      (is_async and sum(self.steps[k].node.is_async for k in ks) > 1))
        lines: list[str] = []
        if self.cache is None and not concurrent:  # the plain straight line: nothing in between
            for k in ks:
                lines.append(f"_s = {k}")
                lines += self._store(k, self._call(k, is_async))
            return lines
        for k in ks:  # look up what the cache has; the result is _MISS where the node must run
            lines.append(f"_s = {k}")
            lines += self._lookup(k) if self._cached[k] else [f"{self._res[k]} = _MISS"]
        if not concurrent:
            for k in ks:
                lines += [f"_s = {k}", f"if {self._res[k]} is _MISS: {self._res[k]} = "
                          f"{self._call(k, is_async, self._cached[k])}{self._comment(k)}"]
        elif self.mode == "threaded":
            lines += self._threaded(ks)
        else:
            lines += self._gathered(ks)
        for k in ks:
            lines.append(f"_s = {k}")
            lines += self._store(k, self._res[k])
            if self.cache is not None:
                lines += self._output_keys(k)
        return lines

    def _threaded(self, ks: list[int]) -> list[str]:
        """Submit the level's nodes to the thread pool, then collect them in order."""
        lines, futures = [], [_identifier(f"{self.steps[k].node.name}_future", self._taken) for k in ks]
        for k, fut in zip(ks, futures, strict=True):
            fill = f"_fill, {self._key[k]}, {self._fn[k]}" if self._cached[k] else self._fn[k]
            lines.append(f"if {self._res[k]} is _MISS: {fut} = _submit(_t, {k}, {fill}{self._call_args(k, lead=True)})"
                         + self._comment(k))
        for k, fut in zip(ks, futures, strict=True):
            lines += [f"_s = {k}", f"if {self._res[k]} is _MISS: {self._res[k]} = {fut}.result()"]
        return lines

    def _gathered(self, ks: list[int]) -> list[str]:
        """Gather the level's async nodes, then run its sync ones."""
        lines = ["_todo = []"]
        for k in ks:
            if self.steps[k].node.is_async:
                lines.append(f"if {self._res[k]} is _MISS: _todo.append(({k}, _mark({k}, "
                             f"{self._call(k, True, self._cached[k], raw=True)}))){self._comment(k)}")
        lines += ["_s = _todo[0][0] if _todo else _s",
                  "_res = dict(zip([j for j, _ in _todo], await _gather(*[c for _, c in _todo])))"]
        for k in ks:
            if self.steps[k].node.is_async:
                lines.append(f"if {self._res[k]} is _MISS: {self._res[k]} = _res[{k}]")
            else:
                lines += [f"_s = {k}", f"if {self._res[k]} is _MISS: {self._res[k]} = "
                          f"{self._call(k, True, self._cached[k])}{self._comment(k)}"]
        return lines

    def _function(self, lines: list[str]) -> str:
        lines = lines + self._lazy_checks()
        result = ", ".join(f"{o!r}: {self._vars[o]}" for o in self.outputs)
        if self.keyed:
            result += f", {KEYS!r}: {{{', '.join(f'{o!r}: {self._kvars[o]}' for o in self.outputs)}}}"
        body = "\n".join("        " + ln for ln in _without_repeated_steps(lines)) or "        pass"
        head = "async def" if self.mode == "async" else "def"
        return (f"{head} _run(_v, _item=None):\n    _s = 0\n    try:\n{body}\n"
                f"    except _Exception as _e:\n        raise _fail(_s, _e, locals())\n"
                f"    return {{{result}}}\n")

    def _lazy_checks(self) -> list[str]:
        """A generator (or coroutine) a node returns as one of the plan's outputs fails that node:
        in this process its work would run later, outside hardy's errors, timeouts and crash
        containment, and from a worker it cannot come back at all. One class test per output."""
        lines = []
        for k, step in enumerate(self.steps):
            for o in step.node.outputs:
                if o in self.outputs:
                    lines += [f"_s = {k}", f"if {self._vars[o]}.__class__ in _LAZY: _lazy({o!r}, {self._vars[o]})"]
        return lines

    # Caching, compiled in. A node's key is BLAKE3(its fingerprint + the keys of its arguments),
    # where an input's key is the hash of its value and an intermediate's key is its producer's key
    # (a Merkle chain, as in Bazel or Nix): intermediates are never re-hashed, so a warm run costs
    # one key derivation and one lookup per node, whatever the size of the values in between. Only
    # outputs of uncached nodes are keyed by value. Keys that need nothing computed are fetched in
    # one query per item.

    def _cache_prelude(self, ns: dict[str, Any]) -> list[str]:
        cache = self.cache
        assert cache is not None
        ns.update(_ckey=call_key, _okey=output_key, _hv=cache.input_key, _fill=cache.fill, _afill=cache.afill,
                  _hit=cache.lookup, _fetch=cache.fetch, _NOKEYS={})
        # Keys of provided values may come with them (an earlier stage, or map() hashing an input
        # shared by every item once): see `hashed_inputs`.
        lines = [f"_pk = _v.get({KEYS!r}) or _NOKEYS"]
        lines += self._input_keys()
        self._fp = [""] * len(self.steps)
        for k, step in enumerate(self.steps):
            if self._cached[k]:
                self._fp[k] = _identifier(f"{step.node.name}_fingerprint", self._taken)
                ns[self._fp[k]] = self._fingerprints[k] = call_fingerprint(step.node, [p for p, _ in step.args])
        return lines + self._early_fetch()

    def ahead_keys(self, values: dict[str, Any]) -> list[bytes]:
        """The keys of the cached steps whose arguments are all provided (the ones `_early_fetch`
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

    def _input_keys(self) -> list[str]:
        """Hash the provided values a cached node reads (or a keyed plan returns), once each."""
        first_use: dict[str, int] = {}
        for k, step in enumerate(self.steps):
            for _, v in step.args:
                first_use.setdefault(v, k)
        read_by_cached = {v for k, s in enumerate(self.steps) if self._cached[k] for _, v in s.args}
        lines, hashed = [], []
        for name in self.provided:
            if self.keyed and name in self.outputs or name in first_use and name in read_by_cached:
                self._kvars[name] = _identifier(f"{name}_key", self._taken)
                hashed.append(name)
                lines += [f"_s = {first_use.get(name, 0)}",
                          f"{self._kvars[name]} = _pk.get({name!r}) or _hv({self._vars[name]}, {name!r})"]
        self.hashed_inputs = tuple(hashed)
        return lines

    def _early_fetch(self) -> list[str]:
        """Steps whose keys need no node to run first are fetched together, in one query."""
        known = set(self._kvars)
        early = []
        for k, step in enumerate(self.steps):
            if self._cached[k] and all(v in known for _, v in step.args):
                early.append(k)
                known.update(step.node.outputs)
        self._early = set(early) if len(early) > 1 else set()
        if not self._early:
            return []
        lines = []
        for k in early:
            lines += [f"_s = {k}", self._key_line(k)]
            for o in self.steps[k].node.outputs:
                self._kvars.setdefault(o, self._output_key(k, o))
        return [*lines, f"_found = _fetch(({', '.join(self._key[k] for k in early)},))"]

    def _output_key(self, k: int, o: str) -> str:
        outs = self.steps[k].node.outputs
        return self._key[k] if len(outs) == 1 else f"_okey({self._key[k]}, {o!r}, {len(outs)})"

    def _key_line(self, k: int) -> str:
        parts = ", ".join([self._fp[k], *(self._kvars[v] for _, v in self.steps[k].args)])
        return f"{self._key[k]} = _ckey({parts})"

    def _lookup(self, k: int) -> list[str]:
        res, key = self._res[k], self._key[k]
        if k in self._early:
            lines = [f"{res} = _found.get({key}, _MISS)"]
        else:
            lines = [self._key_line(k), f"{res} = _hit({key})"]
        if self._on_cached is not None:
            lines.append(f"if {res} is not _MISS: _oncached({self.steps[k].node.name!r}, {key}, _item)")
        return lines

    def _output_keys(self, k: int) -> list[str]:
        """Keys of this step's outputs, for cached consumers further down."""
        lines = []
        for o in self.steps[k].node.outputs:
            wanted = self.keyed and o in self.outputs
            if o in self._kvars or not wanted and not any(o in dict(s.args).values() for s in self.steps[k + 1:]):
                continue
            self._kvars[o] = _identifier(f"{o}_key", self._taken)
            if self._cached[k]:
                lines.append(f"{self._kvars[o]} = {self._output_key(k, o)}")
                continue
            # hashed for the cached node that reads it: a value that cannot be hashed is its input's fault
            reader = next((j for j in range(k + 1, len(self.steps))
                           if self._cached[j] and o in dict(self.steps[j].args).values()), k)
            lines += [f"_s = {reader}", f"{self._kvars[o]} = _hv({self._vars[o]}, {o!r})"]
        return lines

    def _call(self, k: int, is_async: bool, cached: bool = False, raw: bool = False) -> str:
        """The expression that runs step k (and stores its result in the cache when `cached`);
        `raw` leaves an async node's coroutine un-awaited (for gathering)."""
        node = self.steps[k].node
        if cached:
            fill = "_afill" if node.is_async else "_fill"
            call = f"{fill}({self._key[k]}, {self._fn[k]}{self._call_args(k, lead=True)})"
        else:
            call = f"{self._fn[k]}({self._call_args(k)})"
        if node.is_async and not raw:
            call = f"await {call}" if is_async else f"_await({call})"
        return call

    def _call_args(self, k: int, lead: bool = False) -> str:
        node = self.steps[k].node
        args = dict(self.steps[k].args)
        positional: list[str] = []
        keyword: list[str] = []
        for p in node.inputs:
            if p not in args:
                continue  # absent: the function's own default applies
            v = self._vars[args[p]]
            if keyword or p in node.kwonly or len(positional) < node.inputs.index(p):
                keyword.append(f"{p}={v}")
            else:
                positional.append(v)
        parts = positional + keyword
        if lead:
            return "".join(", " + a for a in parts)
        return ", ".join(parts)

    def _comment(self, k: int) -> str:
        return f"  # node {self.steps[k].node.name!r}"

    def _store(self, k: int, expr: str) -> list[str]:
        """Unpack step k's result (`expr`: its call, or the local already holding it) into its outputs."""
        outs = self.steps[k].node.outputs
        res = self._res[k]
        comment = self._comment(k) if expr != res else ""
        if len(outs) == 1:
            return [f"{self._vars[outs[0]]} = {expr}{comment}"]
        return [*([f"{res} = {expr}{comment}"] if expr != res else []),
                f"if {res}.__class__ is not tuple or len({res}) != {len(outs)}: {res} = _outs({res}, {len(outs)})",
                f"{', '.join(self._vars[o] for o in outs)} = {res}"]

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
        if isinstance(exc, _WrongOutputCount):
            got = exc.value
            shape = f"a {type(got).__name__} of length {len(got)}" if hasattr(got, "__len__") else repr(got)
            err: NodeError = OutputCountError(node.name, inputs, reason=(
                f"declared {len(node.outputs)} outputs {node.outputs} but returned {shape}; "
                f"return a tuple of {len(node.outputs)} values"))
            return err
        err = _error_for(node, inputs, exc)
        err.__cause__ = exc
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
        return NodeError(node.name, inputs, reason=str(exc))
    from .gpus import cuda_failure  # failures only: `import hardy` stays light

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
# Names the generated code uses itself (and builtins it calls): no local takes them.
_INTERNAL = frozenset({"_v", "_item", "_s", "_e", "_pk", "_found", "_todo", "_res", *keyword.kwlist,
                       *dir(builtins)})


def _identifier(name: str, taken: set[str]) -> str:
    """`name` as a valid Python identifier not in `taken` (then taken): `clean text` -> `clean_text`,
    a second `x` -> `x_2`, a keyword or builtin -> `dict_`."""
    ident = re.sub(r"\W", "_", name)
    if not ident or ident[0].isdigit():
        ident = "v_" + ident
    if ident in _INTERNAL:
        ident += "_"
    unique, n = ident, 2
    while unique in taken:
        unique, n = f"{ident}_{n}", n + 1
    taken.add(unique)
    return unique


def _without_repeated_steps(lines: list[str]) -> list[str]:
    """Drop `_s = k` lines that repeat the step already recorded (the code is straight-line and
    starts at step 0)."""
    out, current = [], "_s = 0"
    for ln in lines:
        if ln.startswith("_s = "):
            if ln == current:
                continue
            current = ln
        out.append(ln)
    return out


def one_item(func: Callable[..., Any], name: str, outputs: int) -> Callable[..., Any]:
    """A batched node's function called for one item: each argument as a list of one, the entry
    of each output list taken back (`Pipeline.run`, and maps whose executor does not batch)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        out = func(*[[a] for a in args], **{p: [a] for p, a in kwargs.items()})
        columns = batch_outputs(out, name, outputs, 1)
        return columns[0][0] if outputs == 1 else tuple(c[0] for c in columns)
    return call


def batch_outputs(out: Any, name: str, outputs: int, n: int) -> Sequence[Any]:
    """The output columns of a batched call over `n` items: one sequence per output (a list, an
    array, a tensor: anything with a length and items), each of length `n`."""
    columns = (out,) if outputs == 1 else out
    if outputs > 1 and (not isinstance(columns, (tuple, list)) or len(columns) != outputs):
        raise BatchShapeError(f"batched node {name!r} declares {outputs} outputs and must return a tuple of "
                              f"{outputs} lists, got {type(out).__name__}")
    for column in columns:
        try:
            length = len(column)
        except TypeError:
            length = -1
        if length != n or isinstance(column, (str, bytes, dict)):
            got = f"a {type(column).__name__}" + (f" of length {length}" if length >= 0 else "")
            raise BatchShapeError(
                f"batched node {name!r} was called with {n} item(s) and returned {got}; return one list "
                f"(or array) with an entry per item{', per output' if outputs > 1 else ''}, in the items' order")
    return columns


def _check_outputs(value: Any, n: int) -> tuple[Any, ...]:
    if isinstance(value, list) and len(value) == n:
        return tuple(value)
    raise _WrongOutputCount(value)


def _tag(exc: BaseException, k: int) -> None:
    """Remember which step raised, for errors that surface away from their step (gather, futures)."""
    try:
        exc._hardy_step = k  # type: ignore[attr-defined]
    except AttributeError:
        pass


async def _mark_step(k: int, coro: Any) -> Any:
    """A gathered node's call (an asyncio task: its SystemExit leaves as `Exited`, see policy.py)."""
    try:
        return await coro
    except SystemExit as exc:
        exited = Exited(exc)
        _tag(exited, k)
        raise exited from None
    except Exception as exc:
        _tag(exc, k)
        raise


def _thread_call(k: int, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return func(*args, **kwargs)
    except CAUGHT as exc:
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


def run_sync(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code.

    A loop per thread is reused (creating one per call costs ~50 µs). When this thread already runs
    a loop (a notebook), the coroutine runs on a helper thread's loop instead of failing.
    """
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = getattr(_loops, "loop", None)
        if loop is None or loop.is_closed():
            loop = _loops.loop = asyncio.new_event_loop()
        return loop.run_until_complete(coro)
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

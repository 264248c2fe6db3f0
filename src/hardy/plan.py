"""A Plan is what one call of a pipeline needs, compiled into the cheapest form to execute.

Given the names the caller provides and the outputs it wants, `Plan(...)` prunes the graph to the
nodes needed, orders them, resolves every node input to a provided value, another node's output or
the parameter's default, and then *generates a Python function* that executes exactly those steps:

    def run(_v, _i=None):
        _s = 0
        try:
            v0 = _v['x']
            v1 = f0(v0)          # a = x + 1
            _s = 1
            v2 = f1(v1)          # b = 2 * a
            ...
        except Exception as _e:
            raise _fail(_s, _e, locals())
        return {'a': v1, 'b': v2, ...}

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

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .cache.keys import MISS, PlanCache, call_fingerprint, call_key, output_key
from .errors import NOT_COMPUTED, CudaError, GpuOutOfMemory, NodeError, OutputCountError
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


class _WrongOutputCount(Exception):
    def __init__(self, value: Any):
        self.value = value


class Plan:
    """The pruned, ordered, compiled steps for (provided names, requested outputs, mode)."""

    def __init__(self, graph: Graph, provided: Sequence[str], outputs: Sequence[str],
                 mode: str = "sequential", wrap: Wrap | None = None, submit: Callable | None = None,
                 cache: PlanCache | None = None, keyed: bool = False,
                 on_cached: Callable[[str, bytes, int | None], None] | None = None):
        """`on_cached(node name, key, item)` is called for each node answered from the cache (callbacks'
        `on_node_cached`); without it no code is generated for that. `keyed` makes the plan one stage of a larger one (an engine that runs a pipeline's nodes
        in several places): it takes the cache keys of provided values from `values[KEYS]`, where
        an earlier stage computed them, and returns the keys of its outputs under `KEYS`, so every
        node is keyed exactly as in the whole plan run at once."""
        self.graph = graph
        self.provided = tuple(provided)
        self.outputs = tuple(outputs)
        self.mode = mode
        self.steps = _resolve(graph, set(self.provided), self.outputs)
        given = set(self.provided)
        self.inputs = tuple(dict.fromkeys(v for s in self.steps for _, v in s.args if v in given))
        self._wrap = wrap
        self._submit = submit
        self.cache = cache
        self.keyed = keyed and cache is not None
        self._on_cached = on_cached
        self.run: Callable[..., dict[str, Any]]
        self.arun: Callable[..., Any] | None = None
        self.hashed_inputs: tuple[str, ...] = ()  # provided values whose content is hashed for a key
        self._compile()

    def __getstate__(self) -> dict[str, Any]:
        # The generated functions are rebuilt on the other side: cheap, and keeps pickles small.
        # A thread pool cannot travel; a plan rebuilt in a worker runs its nodes sequentially there.
        return {"graph": self.graph, "provided": self.provided, "outputs": self.outputs,
                "mode": "async" if self.mode == "async" else "sequential", "cache": self.cache, "keyed": self.keyed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["graph"], state["provided"], state["outputs"], state["mode"], cache=state["cache"],
                      keyed=state["keyed"])

    # --- code generation -------------------------------------------------------------------------

    def _compile(self) -> None:
        ns: dict[str, Any] = {"_fail": self._fail, "_Exception": Exception,
                              "_outs": _check_outputs, "_await": run_sync, "_mark": _mark_step,
                              "_submit": self._submit, "_t": _thread_call, "_MISS": MISS,
                              "_oncached": self._on_cached}
        cache = self.cache
        is_async = self.mode == "async"
        if is_async:
            import asyncio  # only async plans pay for importing asyncio
            ns["_gather"] = asyncio.gather
        var: dict[str, str] = {}   # value name -> local holding its value
        kvar: dict[str, str] = {}  # value name -> local holding its cache key
        lines: list[str] = []
        for name in self.provided:
            if name in self.inputs or name in self.outputs:
                var[name] = f"v{len(var)}"
                lines.append(f"{var[name]} = _v[{name!r}]")
        cached = [False] * len(self.steps)
        for k, step in enumerate(self.steps):
            node = step.node
            if cache is not None and hasattr(node, "with_cache"):
                node = node.with_cache(cache)  # a nested pipeline caches its own nodes
            ns[f"f{k}"] = guard(step.node, self._wrap(k, node) if self._wrap else node.func)
            for o in step.node.outputs:
                var[o] = f"v{len(var)}"
            cached[k] = cache is not None and node.cache
        if cache is not None:
            lines += self._cache_prelude(ns, cached, var, kvar)
        by_level: dict[int, list[int]] = {}
        for k, s in enumerate(self.steps):
            by_level.setdefault(s.level, []).append(k)
        for level in sorted(by_level):
            ks = by_level[level]
            concurrent = len(ks) > 1 and (self.mode == "threaded" or
                                          (is_async and sum(self.steps[k].node.is_async for k in ks) > 1))
            if cache is None and not concurrent:  # the plain straight line: nothing in between
                for k in ks:
                    lines.append(f"_s = {k}")
                    lines += self._store(k, self._call(k, var, is_async), var)
                continue
            for k in ks:  # look up what the cache has; _r{k} is _MISS where the node must run
                lines.append(f"_s = {k}")
                lines += self._lookup(k, kvar) if cached[k] else [f"_r{k} = _MISS"]
            if not concurrent:
                for k in ks:
                    lines += [f"_s = {k}", f"if _r{k} is _MISS: _r{k} = {self._call(k, var, is_async, cached[k])}"]
            elif self.mode == "threaded":
                for k in ks:
                    fill = f"_fill, c{k}, f{k}" if cached[k] else f"f{k}"
                    lines.append(f"if _r{k} is _MISS: _p{k} = _submit(_t, {k}, {fill}"
                                 f"{self._call_args(k, var, lead=True)})")
                for k in ks:
                    lines += [f"_s = {k}", f"if _r{k} is _MISS: _r{k} = _p{k}.result()"]
            else:  # async: gather this level's async nodes, then run its sync ones
                lines.append("_todo = []")
                for k in ks:
                    if self.steps[k].node.is_async:
                        lines.append(f"if _r{k} is _MISS: _todo.append(({k}, _mark({k}, "
                                     f"{self._call(k, var, True, cached[k], raw=True)})))")
                lines += ["_s = _todo[0][0] if _todo else _s",
                          "_res = dict(zip([j for j, _ in _todo], await _gather(*[c for _, c in _todo])))"]
                for k in ks:
                    if self.steps[k].node.is_async:
                        lines.append(f"if _r{k} is _MISS: _r{k} = _res[{k}]")
                    else:
                        lines += [f"_s = {k}", f"if _r{k} is _MISS: _r{k} = {self._call(k, var, True, cached[k])}"]
            for k in ks:
                lines.append(f"_s = {k}")
                lines += self._store(k, f"_r{k}", var)
                if cache is not None:
                    lines += self._output_keys(k, cached[k], var, kvar)
        result = ", ".join(f"{o!r}: {var[o]}" for o in self.outputs)
        if self.keyed:
            result += f", {KEYS!r}: {{{', '.join(f'{o!r}: {kvar[o]}' for o in self.outputs)}}}"
        body = "\n".join("        " + ln for ln in _without_repeated_steps(lines)) or "        pass"
        head = "async def" if is_async else "def"
        src = (f"{head} _run(_v, _i=None):\n    _s = 0\n    try:\n{body}\n"
               f"    except _Exception as _e:\n        raise _fail(_s, _e, locals())\n"
               f"    return {{{result}}}\n")
        exec(compile(src, f"<hardy plan {self.graph_name}>", "exec"), ns)
        self.source = src
        self._vars = var
        if is_async:
            self.arun = ns["_run"]
            self.run = lambda v, i=None: run_sync(self.arun(v, i))
        else:
            self.run = ns["_run"]

    # Caching, compiled in. A node's key is BLAKE3(its fingerprint + the keys of its arguments),
    # where an input's key is the hash of its value and an intermediate's key is its producer's key
    # (a Merkle chain, as in Bazel or Nix): intermediates are never re-hashed, so a warm run costs
    # one key derivation and one lookup per node, whatever the size of the values in between. Only
    # outputs of uncached nodes are keyed by value. Keys that need nothing computed are fetched in
    # one query per item.

    def _cache_prelude(self, ns: dict[str, Any], cached: list[bool], var: dict[str, str],
                       kvar: dict[str, str]) -> list[str]:
        cache = self.cache
        ns.update(_ckey=call_key, _okey=output_key, _hv=cache.input_key, _fill=cache.fill, _afill=cache.afill,
                  _hit=cache.lookup, _fetch=cache.fetch)
        lines: list[str] = []
        first_use: dict[str, int] = {}
        for k, step in enumerate(self.steps):
            for _, v in step.args:
                first_use.setdefault(v, k)
        # Keys of provided values may come with them (an earlier stage, or map() hashing an input
        # shared by every item once): see `hashed_inputs`.
        lines.append(f"_pk = _v.get({KEYS!r}) or _NOKEYS")
        ns["_NOKEYS"] = {}
        hashed = []
        for name in self.provided:
            wanted = self.keyed and name in self.outputs
            if wanted or name in first_use and any(cached[k] for k, s in enumerate(self.steps) if any(
                    v == name for _, v in s.args)):
                kvar[name] = f"k{len(kvar)}"
                hashed.append(name)
                lines += [f"_s = {first_use.get(name, 0)}", f"{kvar[name]} = _pk.get({name!r}) or _hv({var[name]}, {name!r})"]
        self.hashed_inputs = tuple(hashed)
        for k, step in enumerate(self.steps):
            if cached[k]:
                ns[f"_fp{k}"] = call_fingerprint(step.node, [p for p, _ in step.args])
        # steps whose keys need no node to run first can be fetched together
        known = set(kvar)
        early = []
        for k, step in enumerate(self.steps):
            if cached[k] and all(v in known for _, v in step.args):
                early.append(k)
                known.update(step.node.outputs)
        self._early = set(early) if len(early) > 1 else set()
        if self._early:
            for k in early:
                lines += [f"_s = {k}", self._key_line(k, kvar)]
                for o in self.steps[k].node.outputs:
                    kvar.setdefault(o, self._output_key(k, o))
            lines.append(f"_found = _fetch(({', '.join(f'c{k}' for k in early)},))")
        return lines

    def _output_key(self, k: int, o: str) -> str:
        outs = self.steps[k].node.outputs
        return f"c{k}" if len(outs) == 1 else f"_okey(c{k}, {o!r}, {len(outs)})"

    def _key_line(self, k: int, kvar: Mapping[str, str]) -> str:
        parts = ", ".join([f"_fp{k}", *(kvar[v] for _, v in self.steps[k].args)])
        return f"c{k} = _ckey({parts})"

    def _lookup(self, k: int, kvar: Mapping[str, str]) -> list[str]:
        if k in self._early:
            lines = [f"_r{k} = _found.get(c{k}, _MISS)"]
        else:
            lines = [self._key_line(k, kvar), f"_r{k} = _hit(c{k})"]
        if self._on_cached is not None:
            lines.append(f"if _r{k} is not _MISS: _oncached({self.steps[k].node.name!r}, c{k}, _i)")
        return lines

    def _output_keys(self, k: int, cached: bool, var: Mapping[str, str], kvar: dict[str, str]) -> list[str]:
        """Keys of this step's outputs, for cached consumers further down."""
        lines = []
        for o in self.steps[k].node.outputs:
            wanted = self.keyed and o in self.outputs
            if o in kvar or not wanted and not any(o in dict(s.args).values() for s in self.steps[k + 1:]):
                continue
            kvar[o] = f"k{len(kvar)}"
            lines.append(f"{kvar[o]} = {self._output_key(k, o) if cached else f'_hv({var[o]}, {o!r})'}")
        return lines

    def _call(self, k: int, var: Mapping[str, str], is_async: bool, cached: bool = False,
              raw: bool = False) -> str:
        """The expression that runs step k (and stores its result in the cache when `cached`);
        `raw` leaves an async node's coroutine un-awaited (for gathering)."""
        node = self.steps[k].node
        if cached:
            fill = "_afill" if node.is_async else "_fill"
            call = f"{fill}(c{k}, f{k}{self._call_args(k, var, lead=True)})"
        else:
            call = self._call_expr(k, var)
        if node.is_async and not raw:
            call = f"await {call}" if is_async else f"_await({call})"
        return call

    @property
    def graph_name(self) -> str:
        return ",".join(self.outputs)[:80]

    def _call_args(self, k: int, var: Mapping[str, str], lead: bool = False) -> str:
        node = self.steps[k].node
        args = self.steps[k].args
        given = {p for p, _ in args}
        positional, keyword = [], []
        for p in node.inputs:
            if p not in given:
                continue  # absent: the function's own default applies
            v = var[dict(args)[p]]
            if keyword or p in node.kwonly or len(positional) < node.inputs.index(p):
                keyword.append(f"{p}={v}")
            else:
                positional.append(v)
        parts = positional + keyword
        if lead:
            return "".join(", " + a for a in parts)
        return ", ".join(parts)

    def _call_expr(self, k: int, var: Mapping[str, str]) -> str:
        return f"f{k}({self._call_args(k, var)})"

    def _store(self, k: int, expr: str, var: Mapping[str, str]) -> list[str]:
        outs = self.steps[k].node.outputs
        if len(outs) == 1:
            return [f"{var[outs[0]]} = {expr}"]
        targets = ", ".join(var[o] for o in outs)
        return [*([f"_r{k} = {expr}"] if expr != f"_r{k}" else []),
                      f"if _r{k}.__class__ is not tuple or len(_r{k}) != {len(outs)}: "
                      f"_r{k} = _outs(_r{k}, {len(outs)})",
                      f"{targets} = _r{k}"]

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
        if isinstance(exc, _WrongOutputCount):
            got = exc.value
            shape = f"a {type(got).__name__} of length {len(got)}" if hasattr(got, "__len__") else repr(got)
            err = OutputCountError(node.name, inputs, reason=(
                f"declared {len(node.outputs)} outputs {node.outputs} but returned {shape}; "
                f"return a tuple of {len(node.outputs)} values"))
            return err
        err = _error_for(node, inputs, exc)
        err.__cause__ = exc
        err.__suppress_context__ = True
        return err


def _error_for(node: Node, inputs: dict[str, Any], exc: BaseException) -> NodeError:
    """A NodeError, or for CUDA's errors a CudaError / GpuOutOfMemory holding the node's stack
    (the exception's traceback does not survive the trip back from a worker; the text does)."""
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


def _without_repeated_steps(lines: list[str]) -> list[str]:
    """Drop `_s = k` lines that repeat the step already recorded (the code is straight-line)."""
    out, current = [], None
    for ln in lines:
        if ln.startswith("_s = "):
            if ln == current:
                continue
            current = ln
        out.append(ln)
    return out


def _check_outputs(value: Any, n: int) -> tuple:
    if isinstance(value, list) and len(value) == n:
        return tuple(value)
    raise _WrongOutputCount(value)


def _tag(exc: Exception, k: int) -> None:
    """Remember which step raised, for errors that surface away from their step (gather, futures)."""
    try:
        exc._hardy_step = k  # type: ignore[attr-defined]
    except AttributeError:
        pass


async def _mark_step(k: int, coro: Any) -> Any:
    try:
        return await coro
    except Exception as exc:
        _tag(exc, k)
        raise


def _thread_call(k: int, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return func(*args, **kwargs)
    except Exception as exc:
        _tag(exc, k)
        raise


def _resolve(graph: Graph, provided: set[str], outputs: Sequence[str]) -> tuple[Step, ...]:
    """The steps needed for `outputs`, in dependency order; raises nothing (see Pipeline)."""
    needed: set[int] = set()
    stack = [graph.producer[o] for o in outputs if o not in provided]
    while stack:
        n = stack.pop()
        if id(n) in needed:
            continue
        needed.add(id(n))
        stack.extend(graph.producer[i] for i in n.inputs if i in graph.producer and i not in provided)
    steps: list[Step] = []
    level_of: dict[str, int] = {}
    for n in graph.order:
        if id(n) not in needed:
            continue
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

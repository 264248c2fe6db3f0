"""A Plan is what one call of a pipeline needs, compiled into the cheapest form to execute.

Given the names the caller provides and the outputs it wants, `Plan.build` prunes the graph to the
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
independent async nodes are gathered).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .errors import NodeError, OutputCountError, summarize
from .graph import Graph
from .node import Node

Wrap = Callable[[int, Node], Callable[..., Any]]  # (step index, node) -> the callable to use


@dataclass(frozen=True)
class Step:
    """One node call: where each argument comes from and where each output goes."""

    node: Node
    args: tuple[tuple[str, str], ...]  # (parameter, value name) for values known at run time
    level: int


class _WrongOutputCount(Exception):
    def __init__(self, value: Any):
        self.value = value


class Plan:
    """The pruned, ordered, compiled steps for (provided names, requested outputs, mode)."""

    def __init__(self, graph: Graph, provided: Sequence[str], outputs: Sequence[str],
                 mode: str = "sequential", wrap: Wrap | None = None, submit: Callable | None = None):
        self.graph = graph
        self.provided = tuple(provided)
        self.outputs = tuple(outputs)
        self.mode = mode
        self.steps = _resolve(graph, set(self.provided), self.outputs)
        given = set(self.provided)
        self.inputs = tuple(dict.fromkeys(v for s in self.steps for _, v in s.args if v in given))
        self.has_async = any(s.node.is_async for s in self.steps)
        self._wrap = wrap
        self._submit = submit
        self.run: Callable[..., dict[str, Any]]
        self.arun: Callable[..., Any] | None = None
        self._compile()

    def __getstate__(self) -> dict[str, Any]:
        # The generated functions are rebuilt on the other side: cheap, and keeps pickles small.
        # A thread pool cannot travel; a plan rebuilt in a worker runs its nodes sequentially there.
        return {"graph": self.graph, "provided": self.provided, "outputs": self.outputs,
                "mode": "async" if self.mode == "async" else "sequential", "wrap": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["graph"], state["provided"], state["outputs"], state["mode"])

    # --- code generation -------------------------------------------------------------------------

    def _compile(self) -> None:
        ns: dict[str, Any] = {"_fail": self._fail, "_Exception": Exception,
                              "_outs": _check_outputs, "_await": run_sync, "_mark": _mark_step,
                              "_submit": self._submit, "_t": _thread_call}
        var: dict[str, str] = {}
        lines: list[str] = []
        for name in self.provided:
            if name in self.inputs or name in self.outputs:
                var[name] = f"v{len(var)}"
                lines.append(f"{var[name]} = _v[{name!r}]")
        for k, step in enumerate(self.steps):
            func = self._wrap(k, step.node) if self._wrap else step.node.func
            ns[f"f{k}"] = func
            for o in step.node.outputs:
                var[o] = f"v{len(var)}"
        is_async = self.mode == "async"
        if is_async:
            import asyncio  # only async plans pay for importing asyncio
            ns["_gather"] = asyncio.gather
        by_level: dict[int, list[int]] = {}
        for k, s in enumerate(self.steps):
            by_level.setdefault(s.level, []).append(k)
        for level in sorted(by_level):
            ks = by_level[level]
            concurrent = len(ks) > 1 and (self.mode == "threaded" or
                                          (is_async and sum(self.steps[k].node.is_async for k in ks) > 1))
            if not concurrent:
                for k in ks:
                    lines.append(f"_s = {k}")
                    call = self._call_expr(k, var)
                    if self.steps[k].node.is_async:
                        call = f"await {call}" if is_async else f"_await({call})"
                    lines += self._store(k, call, var)
            elif self.mode == "threaded":
                for k in ks:
                    lines.append(f"_p{k} = _submit(_t, {k}, f{k}{self._call_args(k, var, lead=True)})")
                for k in ks:
                    lines.append(f"_s = {k}")
                    lines += self._store(k, f"_p{k}.result()", var)
            else:  # async: gather the async nodes of this level, then run its sync nodes
                aks = [k for k in ks if self.steps[k].node.is_async]
                calls = ", ".join(f"_mark({k}, {self._call_expr(k, var)})" for k in aks)
                lines.append(f"_s = {aks[0]}")
                lines.append(f"_r = await _gather({calls})")
                for j, k in enumerate(aks):
                    lines += self._store(k, f"_r[{j}]", var, check_step=True)
                for k in ks:
                    if k not in aks:
                        lines.append(f"_s = {k}")
                        lines += self._store(k, self._call_expr(k, var), var)
        result = ", ".join(f"{o!r}: {var[o]}" for o in self.outputs)
        body = "\n".join("        " + ln for ln in lines) or "        pass"
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

    def _store(self, k: int, expr: str, var: Mapping[str, str], check_step: bool = False) -> list[str]:
        outs = self.steps[k].node.outputs
        if len(outs) == 1:
            return [f"{var[outs[0]]} = {expr}"]
        targets = ", ".join(var[o] for o in outs)
        pre = [f"_s = {k}"] if check_step else []
        return pre + [f"_r{k} = {expr}",
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
        inputs = {p: scope.get(self._vars[v]) for p, v in step.args}
        if isinstance(exc, _WrongOutputCount):
            got = exc.value
            shape = f"a {type(got).__name__} of length {len(got)}" if hasattr(got, "__len__") else repr(got)
            err = OutputCountError(node.name, inputs, reason=(
                f"declared {len(node.outputs)} outputs {node.outputs} but returned {shape}; "
                f"return a tuple of {len(node.outputs)} values"))
            return err
        err = NodeError(node.name, inputs)
        err.__cause__ = exc
        err.__suppress_context__ = True
        return err

    def describe_inputs(self, item: Mapping[str, Any]) -> str:
        return summarize({k: item[k] for k in self.inputs if k in item})


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

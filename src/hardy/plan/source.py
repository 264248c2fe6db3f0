"""The source of a plan's generated function: the straight-line Python that runs its steps.

`PlanSource` writes `_run(_v, _item=None)` for a `Plan` (see `plan/compiled.py` for an example): one line
per node call, locals named after the values they hold and node functions after their nodes
(valid, unique identifiers), `_s` set to the step running, for the error the plan builds when a
node fails. It puts the node functions (and, with a cache, the cache's calls and the nodes'
fingerprints) in the namespace the function runs in; the plan supplies hardy's own helpers there.

Three emission modes share one generator: "sequential" (straight line), "threaded" (independent
nodes of a dependency level are submitted to a thread pool) and "async" (an `async def` whose
independent async nodes are gathered). With a cache, the same generator adds key derivation and
lookups around each call (see `_cache_prelude`); without one, none of that code exists.
"""

from __future__ import annotations

import builtins
import functools
import keyword
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..cache.keys import call_fingerprint, call_key, output_key

if TYPE_CHECKING:
    from ..model.node import Node
    from .compiled import Plan

class PlanSource:
    """The generated function of one plan: `text`, its source, and what the plan needs to know
    of it (`vars`: the local holding each value; the inputs it hashes; the cached steps'
    fingerprints)."""

    def __init__(self, plan: Plan, ns: dict[str, Any], function_for: Callable[[int, Node], Callable[..., Any]],
                 reports_cached: bool, keys: str):
        """`ns`: the function's globals, where the names it calls are put; `function_for(k, node)`:
        what step k calls; `reports_cached`: whether to call `_oncached` for a cache hit; `keys`:
        the entry of a keyed plan's values and results that holds cache keys (`compiled.KEYS`)."""
        self._keys = keys
        self.steps, self.provided, self.inputs, self.outputs = plan.steps, plan.provided, plan.inputs, plan.outputs
        self.mode, self.cache, self.keyed = plan.mode, plan.cache, plan.keyed
        self._marks = plan.marks
        self._function_for = function_for
        self._reports_cached = reports_cached
        self.hashed_inputs: tuple[str, ...] = ()  # provided values whose content is hashed for a key
        self.fingerprints: dict[int, bytes] = {}  # of the cached steps, by step
        lines = self._name_locals(ns)
        if self.cache is not None:
            lines += self._cache_prelude(ns)
        self._step_lines: list[str] = []  # the steps' lines, in order
        for ks in self._groups():
            self._step_lines += self._level(ks)
        self.text = self._function(lines + self._step_lines)

    def _groups(self) -> list[list[int]]:
        """The steps that run together: a dependency level where the mode may run its nodes
        concurrently ("threaded", "async"); else one by one in the graph's order, HyperNodes' (for
        `[a, b(a), z]`: a, b, z), so that shared state (a random generator) gives each node what it
        gives it there."""
        if self.mode not in ("threaded", "async"):
            return [[k] for k in range(len(self.steps))]
        by_level: dict[int, list[int]] = {}
        for k, s in enumerate(self.steps):
            by_level.setdefault(s.level, []).append(k)
        return [by_level[level] for level in sorted(by_level)]

    def _name_locals(self, ns: dict[str, Any]) -> list[str]:
        """Name each value's local after the value and each node's function after the node (unique,
        valid identifiers), put the functions to call in `ns`; the lines reading the provided values."""
        taken = set(ns) | _INTERNAL
        self.vars: dict[str, str] = {}  # value name -> local holding its value
        self._kvars: dict[str, str] = {}  # value name -> local holding its cache key
        for name in self.provided:
            if name in self.inputs or name in self.outputs:
                self.vars[name] = _identifier(name, taken)
        lines = [f"{self.vars[n]} = _v[{n!r}]" for n in self.provided if n in self.vars]
        self._cached = [False] * len(self.steps)
        self._fn: list[str] = []
        for k, step in enumerate(self.steps):
            node = step.node
            if self.cache is not None:
                node = node.cached_in(self.cache)  # a nested pipeline caches its own nodes
            self._fn.append(_identifier(f"f_{step.node.name}", taken))
            ns[self._fn[k]] = self._function_for(k, node)
            for o in step.node.outputs:
                self.vars[o] = _identifier(o, taken)
            self._cached[k] = self.cache is not None and node.cache
        self._res = [_identifier(f"{s.node.name}_result", taken) for s in self.steps]
        self._key = [_identifier(f"{s.node.name}_key", taken) for s in self.steps]
        self._taken = taken
        return lines

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
                if self._marks is not None:  # (`Plan.marks`: a worker's status words name the step)
                    lines.append(f"_st[{self._marks.step}] = {float(k)}")  # (a double's word: no conversion)
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
        result = ", ".join(f"{o!r}: {self.vars[o]}" for o in self.outputs)
        if self.keyed:
            result += f", {self._keys!r}: {{{', '.join(f'{o!r}: {self._kvars[o]}' for o in self.outputs)}}}"
        body = "\n".join("        " + ln for ln in _without_repeated_steps(lines)) or "        pass"
        head = "async def" if self.mode == "async" else "def"
        return (f"{head} _run(_v, _item=None):\n    _s = 0\n    try:\n{body}\n"
                f"    except BaseException as _e:\n        if _passes(_e): raise\n"
                f"        raise _fail(_s, _e, locals())\n"
                f"    return {{{result}}}\n")

    def each_text(self, over: str | None) -> str:
        """`_each(_xs, _c, _item, _columns, _due)`: the items of a chunk through the plan's steps in
        one loop, for a worker whose plan only names its steps in the status words (`Plan.marks`).
        `_xs` iterates the values of the input `over` (the other inputs are `_c`), or, `over`
        None, each item's inputs; `_item` is the first item's index (and, as in `_run`, the
        item's, for `crash.containment.nesting`). Each item's outputs are appended to `_columns`,
        a list per output (no tuple per item, nothing for the collector to track), and the status
        words name the item from its start until the next one starts or the loop returns. It
        returns None once `_xs` is done, (the next item's index, None) once the clock passed
        `_due` (a batch of results is due: `_CLOCK_READ`), or (the item's index, its NodeError)
        when one fails: the caller goes on from there, with the same iterator."""
        m = self._marks
        assert m is not None
        loop_var = "_v" if over is None else self.vars.get(over, "_x")
        before = [] if over is None else [f"{self.vars[n]} = _c[{n!r}]" for n in self.provided
                                          if n in self.vars and n != over]
        reads = [f"{self.vars[n]} = _v[{n!r}]" for n in self.provided if n in self.vars] if over is None else []
        body = _without_repeated_steps([*reads, *self._step_lines])  # (from step 0)
        begin = f"_st[{m.step}] = {float(m.no_step)}"
        if body and body[0] == f"_st[{m.step}] = 0.0":  # an item begins with step 0: named before the item is
            begin = body.pop(0)
        seen = [_identifier(f"_k{k}", self._taken) for k in range(len(self.outputs))]
        body += self._lazy_checks(dict(zip(self.outputs, seen, strict=True)))
        before += [f"{', '.join(seen)} = {', '.join('None' for _ in seen)}"] if seen else []
        appends = [_identifier(f"_o{k}", self._taken) for k in range(len(self.outputs))]
        stores = "; ".join(f"{a}({self.vars[o]})" for a, o in zip(appends, self.outputs, strict=True))
        # The intermediates (the outputs are held anyway) are freed before the next item, as `_run`'s
        # return frees them, while the status words still name the item: a destructor's crash is its.
        # They go on naming it until the next item's stores: between two items only this loop's own
        # appends run, and a return leaves the words to the caller, who sends (SENDING) or fails the
        # item. A store of IDLE there cost 12 ns an item, 5% of a trivial item's loop.
        made = [name for k, s in enumerate(self.steps)
                for name in [*(self._res[k:k + 1] if len(s.node.outputs) > 1 or s.node.unpacks else []),
                             *(self.vars[o] for o in s.node.outputs if o not in self.outputs)]]
        freed = [f"        del {', '.join(made)}"] if made else []
        return "\n".join([
            "def _each(_xs, _c, _item, _columns, _due):",
            f"    {', '.join(appends)}, = [c.append for c in _columns]", *(f"    {ln}" for ln in before),
            "    _next, _every = _item + 1, 1",
            f"    for {loop_var} in _xs:",
            f"        {begin}", f"        _st[{m.item}] = _item", "        _s = 0",
            "        try:", *(f"            {ln}" for ln in body or ["pass"]),
            "        except BaseException as _e:", "            if _passes(_e): raise",
            "            return _item, _fail(_s, _e, locals())", *freed,
            f"        {stores}", "        _item += 1", *_CLOCK_READ,
            "    return None", ""])

    def _lazy_checks(self, seen: dict[str, str] | None = None) -> list[str]:
        """A generator (or coroutine) a node returns as one of the plan's outputs fails that node:
        in this process its work would run later, outside hardy's errors, timeouts and crash
        containment, and from a worker it cannot come back at all. One class test per output; in
        a loop over items (`each_text`), only for an output whose class is not the last item's
        (held in its `seen` variable, which passed the test): a class compared costs a third of a
        set's lookup, and a chunk's outputs mostly keep their class."""
        lines = []
        for k, step in enumerate(self.steps):
            for o in step.node.outputs:
                if o in self.outputs:
                    v = self.vars[o]
                    test = f"if {v}.__class__ in _LAZY: _lazy({o!r}, {v})"
                    lines.append(f"_s = {k}")  # (before the class is read: a class that raises is its node's)
                    lines += [test] if seen is None else [f"if {v}.__class__ is not {seen[o]}:", f"    {test}",
                                                          f"    {seen[o]} = {v}.__class__"]
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
        lines = [f"_pk = _v.get({self._keys!r}) or _NOKEYS"]
        lines += self._input_keys()
        self._fp = [""] * len(self.steps)
        for k, step in enumerate(self.steps):
            if self._cached[k]:
                self._fp[k] = _identifier(f"{step.node.name}_fingerprint", self._taken)
                ns[self._fp[k]] = self.fingerprints[k] = call_fingerprint(step.node, [p for p, _ in step.args])
        return lines + self._early_fetch()


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
                          f"{self._kvars[name]} = _pk.get({name!r}) or _hv({self.vars[name]}, {name!r})"]
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
        if self._reports_cached:
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
            lines += [f"_s = {reader}", f"{self._kvars[o]} = _hv({self.vars[o]}, {o!r})"]
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
            v = self.vars[args[p]]
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
        """Unpack step k's result (`expr`: its call, or the local already holding it) into its outputs:
        a node declared with a tuple of names (one name included) returns that many values."""
        node = self.steps[k].node
        outs = node.outputs
        res = self._res[k]
        comment = self._comment(k) if expr != res else ""
        if len(outs) == 1 and not node.unpacks:
            return [f"{self.vars[outs[0]]} = {expr}{comment}"]
        return [*([f"{res} = {expr}{comment}"] if expr != res else []),
                f"if {res}.__class__ is not tuple or len({res}) != {len(outs)}: {res} = _outs({res}, {len(outs)})",
                f"{', '.join(self.vars[o] for o in outs)}{',' if len(outs) == 1 else ''} = {res}"]


# Names the generated code uses itself (and builtins it calls): no local takes them.
# When `_each` reads the clock: after its first item, its 2nd, 4th, 8th, then every 16th. A read
# per item cost 34 ns, 14% of a trivial item's loop; so a result is sent when due, at worst 15
# items late, and only at a run of slow items after fast ones in one call of the loop: a batch
# sent, or an item failed, the loop is called again and reads the clock after its first item.
_CLOCK_READ = ("        if _item >= _next:", "            if _clock() >= _due:", "                return _item, None",
               "            _next = _item + _every", "            if _every < 16:", "                _every += _every")

_INTERNAL = frozenset({"_v", "_item", "_s", "_e", "_pk", "_found", "_todo", "_res", "_st", "_xs", "_c",
                       "_columns", "_due", "_clock", "_next", "_every", "_x", *keyword.kwlist,
                       *dir(builtins)})


@functools.lru_cache(maxsize=256)
def columns_to_dicts(outputs: tuple[str, ...]) -> Callable[[list[list[Any]]], list[dict[str, Any]]]:
    """The function making the columns `_each` fills (`PlanSource.each_text`) the plan's result
    dicts, {output: value}, in the outputs' order: one generated comprehension (three times as
    fast as `dict(zip(...))` per item, and a map's parent makes one per item)."""
    names = [f"_{k}" for k in range(len(outputs))] or ["_"]
    entries = ", ".join(f"{o!r}: {n}" for o, n in zip(outputs, names, strict=False))
    ns: dict[str, Any] = {}
    exec(f"def _dicts(_columns):\n    return [{{{entries}}} for {', '.join(names)}, in zip(*_columns)]\n", ns)
    made: Callable[[list[list[Any]]], list[dict[str, Any]]] = ns["_dicts"]
    return made


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

"""Pipeline: the user's entry point — run one item, map over many, nest as a node.

The constructor builds and validates the Graph once. Each call looks up a memoised Plan keyed by
(the names provided, the outputs requested, the execution mode); the first call with a new key
checks inputs and outputs and compiles the plan, every later call only executes it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..engine.core import Engine
from ..errors import Failed, HardyError, MapError, MissingInputError, NodeError, UnknownInputWarning, UnknownOutputError
from ..model import arguments
from ..model.given import NOTHING, code_of, plan_key
from ..model.graph import Graph
from ..model.node import Node, as_nodes
from ..model.policy import check_timeouts
from ..observe.callbacks import CallbackList, PipelineCallback, listening
from ..observe.progress import MapProgress, count_cached, progress_wanted
from ..observe.report import Recorder, RunReport
from ..plan.map_items import map_items, mapped_over, share_input_keys
from ..plan.memo import Memo
from ..tracebacks import at_user_frames, where_interrupted
from .debugging import run_again, with_reruns
from .interrupts import interrupted
from .nesting import DEFAULT_NAME, PipelineNode, numbered

# What runs a call loads in the method that needs it: a first map starts its fork server first, to boot meanwhile.
if TYPE_CHECKING:
    from typing_extensions import Self

    from ..cache.keys import PlanCache
    from ..engine.results import Results
    from ..observe.watch import Watch
    from ..plan.compiled import Plan


_R = TypeVar("_R", bound="Results")  # the class of a streamed window's sink
_DEFAULT_ENGINE = Engine()

PLANS_KEPT = 256  # compiled plans a pipeline keeps (hardy.plan.memo)


class Pipeline:
    """A set of nodes wired by name, run with an Engine.

    `strict=True` turns inputs that no node consumes (usually typos) from a warning into an error."""

    _checks_bound_names: ClassVar[bool] = True  # `bind` refuses a name no node takes (not HyperNodes')
    _by_name: ClassVar[bool] = False  # nodes ready together run in declared order (HyperNodes': by name)

    def __init__(self, nodes: Sequence[Node | Pipeline | Callable[..., Any]], engine: Engine | None = None,
                 name: str | None = None, callbacks: Sequence[PipelineCallback] | None = None,
                 cache: PlanCache | None = None, strict: bool = False):
        self.name = name or DEFAULT_NAME
        self.graph = Graph(numbered(as_nodes(nodes)), by_name=self._by_name)
        self._plans: Memo[Any, Plan] = Memo(PLANS_KEPT)
        self._with_cache: dict[int, Pipeline] = {}
        self._engine = engine or _DEFAULT_ENGINE
        self._engine_given = engine is not None  # a nested pipeline without one runs on its parent's
        self._engine_cache: PlanCache | None = None  # the engine's cache when the memoised plans were compiled
        self.callbacks = list(callbacks or [])
        self.cache, self.strict = cache, strict
        self._bound: dict[str, Any] = {}
        self._with_engine: dict[int, Pipeline] = {}
        self._recorder = Recorder()  # shared with this pipeline's per-engine and per-cache copies
        self._reports = True  # sums up cache faults after each call; not the copies nested in a map

    # --- structure -------------------------------------------------------------------------------

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.graph.nodes

    @property
    def inputs(self) -> tuple[str, ...]:
        """Names the pipeline needs from outside (bound ones included)."""
        return self.graph.root_inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every output a call may name (`run()` without `output_name` returns `graph.exposed`)."""
        return self.graph.outputs

    @property
    def engine(self) -> Engine:
        return self._engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self._engine, self._engine_given = engine, True
        self._forget_plans()

    # Settings compiled into plans: changing one after a run makes the next call compile anew.

    @property
    def cache(self) -> PlanCache | None:
        return self._own_cache

    @cache.setter
    def cache(self, cache: PlanCache | None) -> None:
        self._own_cache = cache
        self._forget_plans()

    @property
    def callbacks(self) -> list[PipelineCallback]:
        """A list: appending to it (or assigning a new one) takes effect from the next call."""
        return self._callbacks

    @callbacks.setter
    def callbacks(self, callbacks: Sequence[PipelineCallback]) -> None:
        self._callbacks = CallbackList(callbacks, self._forget_plans)
        self._forget_plans()

    def _forget_plans(self) -> None:
        self._plans.clear()
        self._with_cache.clear()

    @property
    def bound_inputs(self) -> dict[str, Any]:
        return dict(self._bound)

    @property
    def unfulfilled_args(self) -> tuple[str, ...]:
        """The inputs a call must still provide: the pipeline's inputs that are not bound."""
        return tuple(i for i in self.graph.root_inputs if i not in self._bound)

    def with_engine(self, engine: Engine) -> Pipeline:
        """Use `engine` from now on; returns this pipeline, changed, for chaining (HyperNodes' builder
        rule, which every `with_*` method follows: it changes the pipeline in place, as `bind` does,
        while the methods that return a copy say so by their names: `cached_in`, `observed_by`)."""
        self.engine = engine
        return self

    def with_name(self, name: str) -> Pipeline:
        """Name the pipeline (in errors, reports, drawings and nested paths); returns it, changed."""
        self.name = name
        return self

    def visualize(self, filename: str | None = None, depth: int | None = 1, **options: Any) -> Any:
        """A drawing of the pipeline (see `hardy.api.visualize.visualize`): displays in notebooks, and
        `filename` saves it as .svg, .png, .html or .dot."""
        from .visualize import visualize
        return visualize(self, filename=filename, depth=depth, **options)

    def bind(self, **values: Any) -> Pipeline:
        """Fix inputs for every later call; inputs given to run()/map() override them. A name no
        node takes is refused here (a typo would otherwise be a value silently never used)."""
        err = self.graph.unknown_inputs(values, self.name) if self._checks_bound_names else None
        if err is not None:
            raise err
        self._bound.update(values)
        return self

    def unbind(self, *names: str) -> Pipeline:
        """Forget bound inputs (all of them when no name is given)."""
        for n in names or list(self._bound):
            self._bound.pop(n, None)
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_plans=Memo(PLANS_KEPT), _with_cache={}, _with_engine={}, _recorder=Recorder())
        return state

    def cached_in(self, cache: PlanCache | None) -> Pipeline:
        """A copy of this pipeline using `cache` (itself, if it has a cache of its own already); the
        pipeline itself is unchanged. How a nested pipeline inherits its parent's cache."""
        if self.cache is not None:
            return self
        copy = self._with_cache.get(id(cache))
        if copy is None:
            copy = self._with_cache[id(cache)] = self._copy(_own_cache=cache, _reports=False)
        return copy

    def observed_by(self, callbacks: Sequence[PipelineCallback]) -> Self:
        """A copy of this pipeline reporting to `callbacks` (a nested pipeline reports to its
        parent's); the pipeline itself is unchanged."""
        if list(callbacks) == self.callbacks:
            return self
        copy = self._copy()
        copy.callbacks = list(callbacks)
        return copy

    def nested_under(self, engine: Engine) -> Pipeline:
        """This pipeline as a node of one run by `engine`: it follows its parent's choice of where
        calls run, unless it was given an engine of its own and the parent's runs calls elsewhere."""
        if (self._engine_given and not engine.in_process) or self.engine is engine:
            return self
        return self._using(engine)

    def _using(self, engine: Engine | None) -> Pipeline:
        """This pipeline run by `engine` for one call (`run(engine=...)`), its plans kept per engine."""
        if engine is None or engine is self._engine:
            return self
        copy = self._with_engine.get(id(engine))
        if copy is None or copy._engine is not engine:
            copy = self._with_engine[id(engine)] = self._copy(_engine=engine)  # shares the bound inputs
        return copy

    def _copy(self, **changes: Any) -> Self:
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__, _plans=Memo(PLANS_KEPT), _with_cache={}, _with_engine={},
                             **changes)
        return copy

    def __repr__(self) -> str:
        bound = f", bound=[{', '.join(self._bound)}]" if self._bound else ""
        needs = f", needs=[{', '.join(self.unfulfilled_args)}]" if self.unfulfilled_args else ""
        return f"Pipeline({self.name!r}: {len(self.graph.nodes)} nodes{bound}{needs})"

    # --- run -------------------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, Any] | None = None,
            output_name: str | Sequence[str] | None = None, engine: Engine | None = None) -> dict[str, Any]:
        """Run once. Returns {output: value} for every output (or just those in `output_name`); a
        nested pipeline's outputs that no other node reads stay inside it when others are read.
        `engine` runs this call on another engine without changing the pipeline's."""
        if engine is not None and engine is not self._engine:
            return Pipeline.run(self._using(engine), inputs, output_name)
        values = {**self._bound, **(inputs or {})} if self._bound else (inputs if inputs is not None else {})
        engine = self._engine
        try:
            if engine.cache is not self._engine_cache:
                raise KeyError  # `p.engine.cache = ...` since: see _plan
            plan = self._plans[(tuple(values), output_name, False, self._key_extra(values, False))]
            if plan.watched is not None and plan.watched.changed():  # (as `_plan` asks: compiled again below)
                raise KeyError
        except (KeyError, TypeError):
            if engine.runs_in_workers:
                engine.executor  # noqa: B018  # made first, as in `map`: a first run's fork server boots meanwhile
            plan = self._plan(values, output_name, for_map=False)
        here = not engine.runs_in_workers  # else the item runs where a crash costs only it, as a map's would
        try:
            if not here:
                return self._run_in_worker(values, plan)
            if (self.callbacks or engine.reporting) and self._observers:
                return self._observed_run(values, lambda: plan.run(values))
            return plan.run(values)
        except NodeError as err:  # raised ending in the frames of the user's code that raised (pdb.pm())
            err.rerun = lambda what: run_again(self, values, output_name, what)
            raise at_user_frames(err) from err.__cause__
        except KeyboardInterrupt as exc:  # Ctrl-C: shown where it landed in the user's code (a worker's too)
            raise exc.with_traceback(where_interrupted(exc.__traceback__))  # noqa: B904
        finally:
            if here:  # (in a worker, nothing ran here to `_settle`)
                self._settle(plan, False)
            if plan.cache is not None and self._reports:
                plan.cache.report()  # what the cache could not do, in one warning

    def explain(self, inputs: Mapping[str, Any] | Sequence[str] | None = None,
                output_name: str | Sequence[str] | None = None) -> str:
        """The Python code `run(inputs, output_name)` executes: the plan hardy generates for that
        call, one line per node call, with locals named after the values they hold. The same lines
        appear in pdb stepping through a run (a node's traceback starts at the node: `hardy.tracebacks`)."""
        names = dict.fromkeys(inputs or ())
        values = {**self._bound, **names} if self._bound else names
        return self._plan(values, output_name, for_map=False).source

    def _run_in_worker(self, values: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
        """`run()` on the process executor: the one item goes to a worker (crash containment and
        timeouts as in a map), the node events listened to come back with it."""
        observers = self._observers if self.callbacks or self._engine.reporting else None
        if not observers:
            return self._engine.run_one(plan, dict(values), self.name)
        from ..observe.events import Events
        events = Events(observers, self.name, [dict(values)])
        return self._observed_run(values, lambda: self._engine.run_one(plan, dict(values), self.name, events))

    def _observed_run(self, values: Mapping[str, Any], call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        watch = self._watch("run", 1, MapProgress(1, self.name, False), None)
        return watch.run(self, dict(values), call, self._node_ids)

    def _watch(self, kind: str, n: int, bar: MapProgress, items: Sequence[dict[str, Any]] | None) -> Watch:
        """What observes this call (`Watch.begin`): `bar`, the callbacks' events, the run report."""
        from ..observe.watch import Watch
        return Watch.begin(self, kind, n, bar, items, self._observers, self._recorder)

    @property
    def _observers(self) -> list[PipelineCallback]:
        """The callbacks that listen to something, and the report recorder when the engine records reports."""
        return listening([*self.callbacks, self._recorder] if self._engine.reporting else self.callbacks)

    def report(self) -> RunReport:
        """The report of the last `run`, `map` or `imap` (see `hardy.observe.report`): per node,
        per item, per worker; an `imap`'s once it ends or is closed. `print()` it,
        `.save("run.html")` or `.to_dict()`. Every map keeps a light one (items, failures with
        their stacks, workers started and died, wall time); node timings and the timeline need
        `Engine(report=True)`."""
        if self._recorder.last is None:
            raise HardyError(
                f"pipeline {self.name!r} has no run report yet: every map() keeps one; run() and imap() "
                "when the engine asks for them, Engine(report=True) or Engine(report_dir=...) (or "
                "HARDY_REPORT_DIR).")
        return self._recorder.last

    @property
    def _node_ids(self) -> list[str]:
        return [n.name for n in self.graph.order]

    def _plan(self, values: Mapping[str, Any], output_name: str | Sequence[str] | None,
              for_map: bool) -> Plan:
        names = tuple(values)
        outputs = self.graph.requested(output_name, values)
        if self._engine.cache is not self._engine_cache:  # set on the engine after a run
            self._forget_plans()
            self._engine_cache = self._engine.cache
        key = (names, output_name if isinstance(output_name, (str, type(None))) else outputs, for_map,
               self._key_extra(values, for_map))
        plan = self._plans.get(key)  # (one look: another thread may forget the plans meanwhile)
        if plan is not None:  # unless what its nodes read was rebound or changed in place since (a notebook
            if plan.watched is None or not plan.watched.changed():  # cell run again, a reload, a dict filled)
                return plan
            self._forget_plans()  # (compiled, keyed and shipped again: docs/same-answer.md)
        for o in outputs:
            if o not in self.graph.producer and o not in values:
                raise UnknownOutputError(o, self.graph.outputs, self.name)
        err = self.graph.unknown_inputs(names, self.name)
        if err is not None:
            if self.strict:
                raise err
            warnings.warn(str(err), UnknownInputWarning, stacklevel=3)
        plan = self._compile(names, outputs, for_map, code_of(values.values()) if key[3][1] else NOTHING)
        check_timeouts([s.node for s in plan.steps], self._engine.timeout_runner(for_map))
        missing = plan.unresolved()
        if missing:
            raise MissingInputError(missing, names, self.name)
        return self._plans.put(key, plan)  # (another thread's, if it got there first: one plan, shipped once)

    def _compile(self, names: tuple[str, ...], outputs: tuple[str, ...], for_map: bool, given: frozenset[Any]) -> Plan:
        """A new plan, with what its nodes read if it must be checked for changes (`_plan`): a plan whose
        keys hold code and state, or one that runs in other processes (its replica covering `given`)."""
        mode = self._engine.plan_mode(for_map)  # (first: a map's executor, whose fork server boots meanwhile)
        from ..hashing import Reach, recording
        from ..plan.compiled import Plan, user_code
        cache = self.cache if self.cache is not None else self._engine.cache
        reach = Reach() if cache is not None else None
        previous = recording(reach)
        try:
            plan = Plan(self.graph, names, outputs, mode=mode, wrap=self._node_function,
                        submit=self._engine.submit if mode == "threaded" else None,
                        cache=cache, on_cached=self._on_cached, name=self.name)
        finally:
            recording(previous)
        plan.given_code = frozenset(filter(user_code, given))  # (a library's class carries no user state)
        plan.watched = plan.reads(reach) if reach is not None or self._engine.ships(for_map) else None
        return plan

    def _key_extra(self, values: Mapping[str, Any], for_map: bool) -> tuple[bytes, frozenset[Any]]:
        """What keys a memoised plan besides names: with a cache, the settings its keys hold (a thread
        in `localcontext(prec=3)` has a plan of its own); for workers, the code the values carry
        (`model.given`: `aug.normalize` given reads `aug.MEAN`, which the plan's replica sends)."""
        given = plan_key(code_of(values.values())) if self._engine.ships(for_map) else NOTHING
        if self._own_cache is None and self._engine.cache is None:
            return b"", given
        from ..shipping.context import result_settings  # (its import makes `cache.keys` read them too)
        return result_settings(), given

    def _settle(self, plan: Plan, for_map: bool) -> None:
        """After a call: what nodes that ran here changed in what they read is theirs (`Reach.settle`)."""
        if plan.watched is not None and not self._engine.ships(for_map):
            plan.watched.settle()

    def _node_function(self, k: int, node: Node) -> Callable[..., Any]:
        observers = self._observers
        if isinstance(node, PipelineNode):
            node = node.under(self._engine)
            if observers:
                node = node.observed_by(observers)
        func = self._engine.node_function(node)
        if observers:
            from ..observe.events import Events
            func = Events(observers).instrument(node, func)
        return func

    def _on_cached(self, node_name: str, key: bytes, item: int | None) -> None:
        count_cached()
        observers = self._observers
        if observers:
            from ..observe.events import Events
            Events(observers).cached(node_name, key, item)

    # --- map -------------------------------------------------------------------------------------

    def map(self, inputs: Mapping[str, Any] | None = None, map_over: str | Sequence[str] | None = None,
            map_mode: str = "zip", output_name: str | Sequence[str] | None = None, on_error: str = "raise",
            progress: bool | None = None, engine: Engine | None = None) -> list[dict[str, Any] | Failed]:
        """Run once per item. `map_over` names the inputs that hold one value per item.

        map_mode "zip" pairs the i-th values; "product" runs every combination. Results come back in
        input order. on_error="raise" raises MapError (with every finished result) at the first
        failure; "continue" runs everything and puts a `Failed` where an item failed. The lists may
        also be bound (`bind(texts=[...]).map(map_over="texts")`). `imap` streams instead.
        """
        if engine is not None and engine is not self._engine:
            return Pipeline.map(self._using(engine), inputs, map_over, map_mode, output_name, on_error, progress)
        self._engine.executor  # noqa: B018  # made first: a first map's fork server boots while the plan is made
        from ..engine.results import Results
        values, plan, over = self._map_plan(inputs, map_over, map_mode, output_name, on_error)
        items, n = map_items(values, over, map_mode, lazy=False)
        if plan.cache is not None and items:
            items = list(items)  # (each item holds the keys of the inputs they share)
            share_input_keys(plan, items, over, self.name)
        with MapProgress(n, self.name, progress_wanted(progress)) as bar:
            watch = self._watch("map", n, bar, items)
            results = self._sink(Results, n, on_error, watch, plan, items)
            try:
                watch.around(self.name, dict(values), lambda: self._engine.run_items(plan, items, results),
                             self._node_ids, n)
            except KeyboardInterrupt as exc:  # Ctrl-C: the workers were stopped; what finished is kept
                raise interrupted(results.values, dict(results.failures), self._engine.report_dir, exc)  # noqa: B904
            finally:
                self._settle(plan, True)
                if plan.cache is not None and self._reports:
                    plan.cache.report()  # what the cache could not do, in one warning per map
                watch.finish(self, results.failures, results.progress.done)  # also of a map that raised
        if results.failures and on_error == "raise":
            raise at_user_frames(MapError(results.values, results.failures))
        return results.values

    def imap(self, inputs: Mapping[str, Any] | None = None, map_over: str | Sequence[str] | None = None,
             map_mode: str = "zip", output_name: str | Sequence[str] | None = None, on_error: str = "raise",
             progress: bool | None = None, engine: Engine | None = None, ordered: bool = True,
             window: int | None = None, indexed: bool = False) -> Iterator[Any]:
        """`map`, streamed: an iterator of results that pulls the inputs (any iterables, generators
        included) as it goes, with at most about 3 × `window` items alive at once.

        `ordered=False` yields results as they finish. A consumer that stops asking stops the
        producers; closing the iterator (or leaving a `for` loop) stops the map. With
        on_error="raise", the first failure reached raises MapError (`.offset` and `.results` give
        the failure's window). `window` defaults to 1,024 items (64 on the sequential executor).
        `indexed=True` yields (item index, result) pairs: which item each is, when they come as
        they finish."""
        if engine is not None and engine is not self._engine:
            return Pipeline.imap(self._using(engine), inputs, map_over, map_mode, output_name, on_error, progress,
                                 ordered=ordered, window=window, indexed=indexed)
        arguments.whole_number("imap", "window", window, 1, optional=True)
        arguments.flag("imap", "ordered", ordered)
        arguments.flag("imap", "indexed", indexed)
        self._engine.executor  # noqa: B018  # made first, as in `map`
        values, plan, over = self._map_plan(inputs, map_over, map_mode, output_name, on_error)
        items, n = map_items(values, over, map_mode, lazy=True)
        return self._stream(plan, values, items, n, over, window, ordered, on_error, progress, indexed)

    def _stream(self, plan: Plan, values: dict[str, Any], items: Iterator[dict[str, Any]], n: int | None,
                over: list[str], window: int | None, ordered: bool, on_error: str,
                progress: bool | None, indexed: bool) -> Iterator[Any]:
        from ..engine.streaming import Shifted, stream
        from ..observe.events import Events
        observers, name = self._observers, self.name

        def make_results(start: int, chunk: list[dict[str, Any]], cls: type[_R]) -> _R:
            if plan.cache is not None:
                share_input_keys(plan, chunk, over, name)
            events = Events(observers, name, Shifted(chunk, start)) if observers else None
            return self._sink(cls, len(chunk), on_error, watch.window(events), plan, chunk, start)

        with MapProgress(n, name, progress_wanted(progress)) as bar:
            watch = self._watch("imap", n or 0, bar, ())
            outcomes = stream(self._engine, plan, items, window, ordered, on_error == "raise", make_results, indexed)
            if watch.report is not None:
                outcomes = watch.recorded(self, outcomes)
            try:
                yield from watch.streamed(name, dict(values), outcomes, self._node_ids, n)
            except KeyboardInterrupt as exc:  # (as in `run`)
                raise exc.with_traceback(where_interrupted(exc.__traceback__))  # noqa: B904
            finally:
                self._settle(plan, True)

    def _sink(self, cls: type[_R], n: int, on_error: str, watch: Watch, plan: Plan, items: Sequence[dict[str, Any]],
              offset: int = 0) -> _R:
        """A map's results sink (a streamed window's, from `offset`), knowing how each item runs again under pdb."""
        from ..parts.batching import batched
        return with_reruns(cls(n, on_error, watch, offset=offset, cached=plan.cache is not None,
                               batched=batched(plan) is not None), self, items, plan.outputs)

    def _map_plan(self, inputs: Mapping[str, Any] | None, map_over: str | Sequence[str] | None, map_mode: str,
                  output_name: str | Sequence[str] | None, on_error: str) -> tuple[dict[str, Any], Plan, list[str]]:
        """The checked arguments of a map: the inputs it uses, its plan, the names mapped over."""
        values = {**self._bound, **(inputs or {})}
        over = mapped_over(values, map_over, map_mode, on_error, self.name)
        plan = self._plan(values, output_name, for_map=True)
        used = set(plan.inputs) | set(plan.outputs)  # inputs nothing reads are not copied into items
        return {k: v for k, v in values.items() if k in used or k in over}, plan, over

    # --- nesting ---------------------------------------------------------------------------------

    def as_node(self, name: str | None = None, input_mapping: Mapping[str, str] | None = None,
                output_mapping: Mapping[str, str] | None = None, map_over: str | Sequence[str] | None = None,
                map_mode: str = "zip", on_error: str = "raise") -> PipelineNode:
        """This pipeline as one node of another. Mappings are {outer name: inner name} for inputs and
        {inner name: outer name} for outputs; with an output_mapping only the mapped outputs are the
        node's outputs (HyperNodes' rule). `map_over` (outer names) maps the inner pipeline over
        lists and makes each output a list; `on_error="continue"` puts a `Failed` in those lists
        where an inner item failed instead of failing the node. Of the node's outputs, a run
        computes only those it needs (read by other nodes, or asked for)."""
        return PipelineNode(self, name, input_mapping, output_mapping, map_over, map_mode, on_error)

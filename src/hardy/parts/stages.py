"""A plan cut into stages where the resources its nodes need change, and a map run stage by stage.

Two engines place nodes by their resources: the local worker pool (`@node(gpus=1)` runs on GPU
workers, the other nodes on CPU workers) and `daft_engine(node_resources=)` (each stage a UDF with
its own Daft resources). Both cut the plan here, the same way: consecutive steps (in the plan's
order) that need the same resources form one stage. A stage is a *keyed* `Plan` (see `Plan`): it
takes its inputs' cache keys from the item and returns its outputs' keys, so every node is keyed
exactly as in the whole plan run at once, and the cache is shared with every other engine.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import NodeError
from ..model.executor import Executor, ResultsSink, Row
from ..model.node import Node
from ..observe.nodelog import one_by_one
from ..plan.compiled import KEYS, Plan, Step
from ..plan.source import columns_to_dicts

if TYPE_CHECKING:
    from ..observe.nodelog import NodeLogBatch
    from ..shipping.context import Snapshot


def cut(plan: Plan, needs: Callable[[Node], Any], **options: Any) -> list[tuple[Any, Plan]]:
    """(what the stage needs, its plan) in step order; one stage is the plan itself. `needs(node)`
    may return any value that compares with ==: consecutive steps with equal needs share a stage.
    A plan with no step (every output provided) is one stage that needs None. `options` go to
    each stage's `Plan` (a batched plan's parts: `hardy.parts.batching`)."""
    groups: list[tuple[Any, list[Step]]] = []
    for step in plan.steps:
        wanted = needs(step.node)
        if groups and groups[-1][0] == wanted:
            groups[-1][1].append(step)
        else:
            groups.append((wanted, [step]))
    if len(groups) <= 1:
        return [(groups[0][0] if groups else None, plan)]
    stages: list[tuple[Any, Plan]] = []
    available = list(plan.provided)
    for n, (wanted, steps) in enumerate(groups):
        later = {v for _, rest in groups[n + 1:] for step in rest for _, v in step.args} | set(plan.outputs)
        last = n == len(groups) - 1
        outputs = list(plan.outputs) if last else [o for step in steps for o in step.node.outputs if o in later]
        stages.append((wanted, Plan(plan.graph, available, outputs, cache=plan.cache, keyed=True, **options)))
        available += outputs
    return stages


def merge(values: dict[str, Any], result: dict[str, Any], last: bool) -> dict[str, Any]:
    """What an item carries out of a stage: the last stage leaves only its outputs; the others
    leave the values so far plus theirs, and every cache key so far."""
    keys = result.pop(KEYS, {})
    if last:
        return result
    return {**values, **result, KEYS: {**values.get(KEYS, {}), **keys}}


class _StageResults(ResultsSink):
    """The sink an executor writes one stage's items to: failures and the last stage's outputs go
    to the map's results (by the item's index in the map); an earlier stage's outputs join the
    item's values for the next stage."""

    def __init__(self, results: ResultsSink, values: list[dict[str, Any]], indices: Sequence[int], first: bool,
                 last: bool, records: dict[int, list[NodeLogBatch]]):
        self.results, self.values, self.indices, self.first, self.last = results, values, indices, first, last
        self.records = records  # node records of earlier stages, per item, until its last stage
        self.alive: list[int] = []
        self.log_nodes = results.log_nodes
        self.kept_logs = results.kept_logs

    @property  # the map's: a stage view keeps none of its own
    def stop(self) -> bool:
        return self.results.stop

    @stop.setter
    def stop(self, stop: bool) -> None:
        self.results.stop = stop

    @property
    def context(self) -> Snapshot | None:
        return self.results.context

    def raise_ending(self) -> None:
        self.results.raise_ending()  # (the map's results hold a worker's refusal of a stage)

    def started(self, i: int, worker: int | None = None) -> None:
        if self.first:
            self.results.started(self.indices[i], worker)

    def handed(self, chunk: Sequence[int], worker: int, again: bool = False) -> None:
        if self.first:
            self.results.handed([self.indices[i] for i in chunk], worker, again)

    def take(self, rows: Sequence[Row], unsent: MutableMapping[int, Any],
             records: NodeLogBatch | None = None) -> list[Row]:
        """`Results.take` for one stage: each success goes on to `ok`, the failures are returned."""
        return one_by_one(rows, unsent, records, self.ok)

    def take_span(self, first: int, outputs: list[dict[str, Any]]) -> None:
        """`Results.take_span` for one stage: each output goes on to `ok`."""
        self.take([(i, True, out) for i, out in enumerate(outputs, first)], {})

    def take_columns(self, first: int, names: tuple[str, ...], columns: list[list[Any]]) -> int:
        outputs = columns_to_dicts(names)(columns)
        columns.clear()
        self.take_span(first, outputs)
        return len(outputs)

    def ok(self, i: int, out: dict[str, Any], records: Sequence[NodeLogBatch] = ()) -> None:
        n = self.indices[i]
        if self.last:
            self.results.ok(n, merge(self.values[n], out, last=True), [*self.records.pop(n, ()), *records])
        else:
            self.values[n] = merge(self.values[n], out, last=False)
            self.records.setdefault(n, []).extend(records)
            self.alive.append(n)

    def retried(self, i: int, err: NodeError, worker: int | None = None) -> None:
        self.results.retried(self.indices[i], err, worker)

    def fail(self, i: int, err: NodeError, records: Sequence[NodeLogBatch] = (), worker: int | None = None) -> None:
        n = self.indices[i]
        self.results.fail(n, err, [*self.records.pop(n, ()), *records], worker)


def run_stages(stages: Sequence[tuple[Executor, Plan]], items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
    """A map through `stages` ((executor, stage plan) pairs), one stage after another: each stage
    runs every item still alive, an item that fails leaves at its stage as that item's failure."""
    values = list(items)
    alive = list(range(len(items)))
    records: dict[int, list[NodeLogBatch]] = {}
    for n, (executor, stage) in enumerate(stages):
        sink = _StageResults(results, values, alive, first=n == 0, last=n == len(stages) - 1, records=records)
        executor.run_items(stage, [values[i] for i in alive], sink)
        if results.stop:
            return
        alive = sorted(sink.alive)


K = TypeVar("K", bound=Hashable)


class StagedExecutor(Executor, Generic[K]):
    """A map executor that sends each stage of a plan to the executor for what its nodes need
    (`executor_for(needs(node))`); a plan of one stage goes to its executor whole."""

    def __init__(self, needs: Callable[[Node], K], executor_for: Callable[[K], Executor],
                 enforces_timeouts: bool):
        """`enforces_timeouts`: whether every executor stops a node at its timeout (`hardy.model.policy`)."""
        self.needs, self.executor_for, self.enforces_timeouts = needs, executor_for, enforces_timeouts

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        stages = cut(plan, self.needs)
        if len(stages) == 1:
            self.executor_for(stages[0][0]).run_items(plan, items, results)
        else:
            run_stages([(self.executor_for(wanted), stage) for wanted, stage in stages], items, results)

    def close(self) -> None:
        """The executors belong to whoever made them (the Engine closes its pools)."""

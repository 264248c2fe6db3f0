"""`@node(isolate=True)`: every call of the node is a one-item map on the engine's worker pool, so
crash reports, retries and timeouts are the pool's, written once (`hardy.model.executor.IsolatedCall`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import NodeError
from ..hashing import Reach
from ..model.executor import Executor, IsolatedCall, Where
from ..model.graph import Graph
from ..model.node import Node
from ..observe.nodelog import NodeLogBatch
from ..observe.watch import Watch
from ..plan.compiled import Plan
from ..plan.memo import Memo
from .results import Results


class CallResults(Results):
    """The sink of one isolated call: its outcome, and where the node ran and for how long, as
    its worker measured it (the call is logged there: nodelog.py)."""

    ok_per_item = True

    def __init__(self, name: str, located: bool):
        super().__init__(1, "raise", Watch.quiet(1, name))
        self.log_nodes = located  # someone listens to the node's events
        self.where: tuple[int, float | None] | None = None

    def ok(self, i: int, out: dict[str, Any], records: Sequence[NodeLogBatch] = ()) -> None:
        super().ok(i, out)
        self._ran(records)

    def fail(self, i: int, err: NodeError, records: Sequence[NodeLogBatch] = (), worker: int | None = None) -> None:
        super().fail(i, err)
        self._ran(records, worker)

    def _ran(self, records: Sequence[NodeLogBatch], died_in: int | None = None) -> None:
        if records:  # its last event is the last attempt's
            events = records[-1].events()
            self.where = records[-1].pid, events.ends[-1] - events.starts[-1] if len(events.starts) else None
        elif died_in:
            self.where = died_in, None


class WorkerCall(IsolatedCall):
    """A sync node's calls, each run by the pool `pool()` gives (the engine's, made on first use)."""

    def __init__(self, node: Node, pool: Callable[[], Executor]):
        self.node, self.pool = node, pool
        self.plans: Memo[tuple[str, ...], tuple[Plan, Reach]] = Memo(64)  # per set of argument names: shipped once

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any], located: bool = False) -> CallResults:
        item = dict(zip(self.node.inputs, args))
        item.update(kwargs)
        names = tuple(item)
        kept = self.plans.get(names)
        if kept is None or kept[1].changed():  # its code or state changed since: made (and shipped) again
            if kept is not None:
                self.plans.clear()
            plan = Plan(Graph([self.node]), names, self.node.outputs)
            kept = self.plans.put(names, (plan, plan.reads()))
        plan = kept[0]
        results = CallResults(self.node.name, located)
        self.pool().run_items(plan, [item], results)
        return results

    def settle(self, results: CallResults) -> Any:
        if results.failures:
            err = results.failures[0]
            err.item = None
            raise err
        out, outputs = results.values[0], self.node.outputs
        if len(outputs) == 1 and not self.node.unpacks:
            return out[outputs[0]]
        return tuple(out[o] for o in outputs)  # (one name too where declared as a tuple: the caller unpacks it)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.settle(self.run(args, kwargs))

    def located(self, *args: Any, **kwargs: Any) -> tuple[Where, Callable[[], Any]]:
        results = self.run(args, kwargs, located=True)
        return results.where, functools.partial(self.settle, results)


class AsyncWorkerCall(IsolatedCall):
    """An async node's calls: the pool's blocking wait runs in a thread, off the event loop."""

    def __init__(self, node: Node, pool: Callable[[], Executor]):
        self.calls = WorkerCall(node, pool)

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.calls, *args, **kwargs)

    async def located(self, *args: Any, **kwargs: Any) -> tuple[Where, Callable[[], Any]]:
        return await asyncio.to_thread(self.calls.located, *args, **kwargs)

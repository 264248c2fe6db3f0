"""`DaftEngine`: a pipeline as a Daft query, each node a process-isolated Daft batch UDF
(`pip install "hardy[daft]"`).

    from hardy.integrations.daft import DaftEngine
    Pipeline(nodes=[...], engine=DaftEngine())          # Daft's native runner on this machine
    Pipeline(nodes=[...], engine=DaftEngine(address="ray://head:10001"))  # Daft on a Ray cluster
    Pipeline(nodes=[...], engine=DaftEngine(address="auto"))  # Daft on the Ray this process runs

How a map becomes a query: the items are cut into rows of ROW_ITEMS items (Daft's process UDFs
cost ~25 µs per row and per UDF here, so one row per item would cap a 3-node pipeline near 13,000
items/s); every value travels in a binary column as a pickled list of per-item cells
`(ok, value, key)`, so Daft's process workers are really used for Python objects (Daft isolates
only UDFs whose columns are Arrow types); each node is a `daft.func.batch` UDF with
`use_process=True` over its argument columns, in dependency order. A failed node puts its
NodeError in the cell and every node below passes it on, so errors stay per item. Cache keys are
the same as every other engine's (inputs by value, intermediates by their producer's key), so a
cache filled here is hit elsewhere and the other way round. `@stateful` resources are built once
per UDF process, on first use.

A UDF process that crashes fails the whole query. hardy then bisects the items (the halves that
succeed deliver their results) down to the item that crashes, and runs that item's nodes one
prefix at a time to name the node: that item becomes a NodeCrashed, every other item completes.
"""

from __future__ import annotations

import pickle
from typing import Any, Sequence

from ..engine.core import Engine
from ..errors import NodeCrashed, NodeError, OutputCountError
from ..plan import Plan
from ..shipping import portable, ship_items, ship_plan


ROW_ITEMS = 256  # items per Daft row (see the module docstring)


def DaftEngine(address: str | None = None, use_process: bool = True, **engine_options: Any) -> Engine:
    """An Engine whose maps run as Daft queries (see the module docstring)."""
    return Engine(map_executor=DaftExecutor(address=address, use_process=use_process), **engine_options)


def _dumps(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj, protocol=5)
    except Exception:
        import cloudpickle
        return cloudpickle.dumps(obj, protocol=5)


def _node_udf(plan: Plan, k: int, use_process: bool) -> Any:
    """Step k as a Daft batch UDF: (index row, argument rows...) -> result row, a row being a
    pickled list of per-item cells (ok, value, key)."""
    import daft

    step = plan.steps[k]
    node, cache = step.node, plan.cache
    params = [p for p, _ in step.args]
    picks = []  # for each argument: (its producer's output index or None, its producer's output count)
    for _, v in step.args:
        producer = next((s.node for s in plan.steps if v in s.node.outputs), None)
        several = producer is not None and len(producer.outputs) > 1
        picks.append((producer.outputs.index(v), len(producer.outputs)) if several else (None, 1))
    names = [v for _, v in step.args]
    fingerprint = None
    if cache is not None and node.cache:
        from ..cache.disk import call_fingerprint
        fingerprint = call_fingerprint(node, params)

    def one(i: int, cells: list[tuple]) -> tuple:
        from ..cache.disk import call_key, output_key
        from ..plan import MISS
        args, keys = {}, []
        for p, name, cell, (pick, n) in zip(params, names, cells, picks):
            ok, value, key = cell
            if not ok:
                return cell  # a failure upstream: passed on unchanged
            if pick is not None:  # one output of a several-output producer
                value = value[pick]
                key = output_key(key, name, n) if key is not None else None
            args[p] = value
            keys.append(key if key is not None or cache is None else cache.input_key(value, name))
        try:
            key = call_key(fingerprint, *keys) if fingerprint is not None else None
            value = cache.lookup(key) if key is not None else MISS
            if value is MISS:
                value = node.func(**args)
                if len(node.outputs) > 1 and (not isinstance(value, (tuple, list))
                                              or len(value) != len(node.outputs)):
                    raise OutputCountError(node.name, args, i, f"declared {len(node.outputs)} outputs "
                                           f"{node.outputs} but returned {type(value).__name__}")
                if key is not None:
                    cache.put(key, value)
            if key is None and cache is not None:
                key = cache.input_key(value, node.outputs[0])  # an uncached node: keyed by value
            return (True, value, key)
        except NodeError as err:
            err.item = i
            return (False, portable(err), None)
        except Exception as exc:
            err = NodeError(node.name, args, i)
            err.__cause__ = exc
            return (False, portable(err), None)

    def run_batch(index: Any, *columns: Any) -> list[bytes]:
        rows = [c.to_pylist() for c in columns]
        out = []
        for r, raw_index in enumerate(index.to_pylist()):
            arg_rows = [pickle.loads(col[r]) for col in rows]
            out.append(_dumps([one(i, [a[j] for a in arg_rows]) for j, i in enumerate(pickle.loads(raw_index))]))
        return out

    run_batch.__name__ = f"hardy_{node.name}"
    return daft.func.batch(return_dtype=daft.DataType.binary(), use_process=use_process)(run_batch)


class DaftExecutor:
    """The map executor behind DaftEngine."""

    mode = "sequential"

    def __init__(self, address: str | None = None, use_process: bool = True):
        self.address = address
        self.use_process = use_process
        self._ready = False

    def _start(self) -> None:
        if self._ready:
            return
        if self.address:
            import daft
            daft.set_runner_ray(address=None if self.address == "auto" else self.address, noop_if_initialized=True)
        self._ready = True

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: Any) -> None:
        ship_plan(plan)  # hardy's clear error for an unpicklable node, before Daft's
        if items:
            ship_items(items, [0])
        self._start()
        for i in range(len(items)):
            results.started(i)
        self._run(plan, items, list(range(len(items))), results, len(plan.steps))

    def _query(self, plan: Plan, items: Sequence[dict[str, Any]], indices: list[int], upto: int) -> Any:
        import daft
        cache = plan.cache
        provided = [n for n in plan.provided if n in plan.inputs or n in plan.outputs]
        rows = [indices[s:s + ROW_ITEMS] for s in range(0, len(indices), ROW_ITEMS)]
        binary = daft.DataType.binary()
        columns: dict[str, Any] = {"__index": daft.Series.from_pylist([_dumps(r) for r in rows], name="__index",
                                                                      dtype=binary)}
        for name in provided:
            cells = [_dumps([(True, items[i][name], cache.input_key(items[i][name], name) if cache else None)
                             for i in r]) for r in rows]
            columns[name] = daft.Series.from_pylist(cells, name=name, dtype=binary)
        df = daft.from_pydict(columns)
        producer_col: dict[str, str] = {n: n for n in provided}
        for k, step in enumerate(plan.steps[:upto]):
            udf = _node_udf(plan, k, self.use_process)
            col = f"__step{k}"
            df = df.with_column(col, udf(daft.col("__index"), *(daft.col(producer_col[v]) for _, v in step.args)))
            for o in step.node.outputs:
                producer_col[o] = col
        wanted = sorted({producer_col[o] for o in plan.outputs if o in producer_col} | {"__index"})
        return df.select(*wanted).to_pydict(), producer_col

    def _run(self, plan: Plan, items: Sequence[dict[str, Any]], indices: list[int], results: Any, upto: int) -> None:
        if not indices or results.stop:
            return
        try:
            table, producer_col = self._query(plan, items, indices, upto)
        except Exception as exc:
            if "UDF process" not in str(exc) and "closed the connection" not in str(exc):
                raise
            if len(indices) > 1:  # bisect: the half without the crash delivers its results
                mid = len(indices) // 2
                self._run(plan, items, indices[:mid], results, upto)
                self._run(plan, items, indices[mid:], results, upto)
            else:
                results.fail(indices[0], self._diagnose(plan, items, indices[0], str(exc)))
            return
        for r, raw_index in enumerate(table["__index"]):
            per_col = {col: pickle.loads(table[col][r]) for col in table if col != "__index"}
            for j, i in enumerate(pickle.loads(raw_index)):
                outputs, failure = {}, None
                for o in plan.outputs:
                    ok, value, _ = per_col[producer_col[o]][j]
                    if not ok:
                        failure = value
                        break
                    node = next(s.node for s in plan.steps if o in s.node.outputs)
                    outputs[o] = value if len(node.outputs) == 1 else value[node.outputs.index(o)]
                if failure is not None:
                    results.fail(i, failure)
                else:
                    results.ok(i, outputs)

    def _diagnose(self, plan: Plan, items: Sequence[dict[str, Any]], i: int, reported: str) -> NodeCrashed:
        """The item crashes its UDF process: the shortest prefix of nodes that crashes names the node."""
        for k in range(1, len(plan.steps) + 1):
            if not all(self._crashes(plan, items, i, k) for _ in range(2)):  # twice: not a leftover
                continue
            return NodeCrashed(plan.steps[k - 1].node.name, i, f"the Daft UDF process running it died: {reported}")
        return NodeCrashed("?", i, f"a Daft UDF process died on this item ({reported}), but no prefix of its "
                                   "nodes crashes when run alone")

    def _crashes(self, plan: Plan, items: Sequence[dict[str, Any]], i: int, upto: int) -> bool:
        try:
            self._query(plan, items, [i], upto)
            return False
        except Exception:
            return True

    def close(self) -> None:
        pass

"""The dependency graph of a pipeline, built and validated once when the Pipeline is constructed.

Nodes are wired purely by names: a node consumes the parameter names it declares and produces its
output names. Validation here (duplicates, self-consumption, cycles) means no later stage needs to
re-check: a Plan can trust the graph.
"""

from __future__ import annotations

import graphlib
import heapq
import itertools
from collections.abc import Container, Iterable, Sequence
from typing import Any

from ..errors import (
    CycleError,
    DuplicateNodeError,
    DuplicateOutputError,
    SelfDependencyError,
    UnknownInputError,
    UnknownOutputError,
)
from .node import Node


class Graph:
    def __init__(self, nodes: Iterable[Node], by_name: bool = False):
        """`by_name`: HyperNodes' order for nodes ready together (`_topological_order`)."""
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.by_name = by_name
        self.producer: dict[str, Node] = {}
        names: set[str] = set()
        for n in self.nodes:
            if n.name in names and getattr(n, "pipeline", None) is not None:
                raise DuplicateNodeError(n.name)
            names.add(n.name)
            for out in n.outputs:
                if out in self.producer:
                    raise DuplicateOutputError(out, self.producer[out].name, n.name)
                self.producer[out] = n
            for inp in n.inputs:
                if inp in n.outputs:
                    raise SelfDependencyError(n.name, inp)
        self.consumers: dict[str, list[Node]] = {}
        for n in self.nodes:
            for inp in n.inputs:
                self.consumers.setdefault(inp, []).append(n)
        self.order: tuple[Node, ...] = self._topological_order()
        # Inputs the pipeline accepts from outside: everything some node consumes and no node produces.
        self.root_inputs: tuple[str, ...] = tuple(dict.fromkeys(
            i for n in self.order for i in n.inputs if i not in self.producer))
        self.outputs: tuple[str, ...] = tuple(o for n in self.order for o in n.outputs)
        hidden = self._kept_inside()
        # What a run returns when it names no output: every output but those kept inside nested pipelines.
        self.exposed: tuple[str, ...] = tuple(o for o in self.outputs if o not in hidden)

    def unknown_inputs(self, names: Iterable[str], pipeline: str) -> UnknownInputError | None:
        """The error for inputs no node takes (usually a typo), or None."""
        unknown = [n for n in names if n not in self.consumers and n not in self.producer]
        return UnknownInputError(unknown, self.root_inputs, pipeline) if unknown else None

    def requested(self, output_name: str | Sequence[str] | None, provided: Container[str]) -> tuple[str, ...]:
        """The outputs a call asks for by `output_name`; with none named, every exposed output that
        is not `provided`."""
        if output_name is None:
            return tuple(o for o in self.exposed if o not in provided)
        return (output_name,) if isinstance(output_name, str) else tuple(output_name)

    # HyperNodes' names for the graph's introspection, with its sorting and list types.

    @property
    def root_args(self) -> list[str]:
        """The inputs from outside, sorted."""
        return sorted(self.root_inputs)

    @property
    def available_output_names(self) -> list[str]:
        """Every output, sorted."""
        return sorted(self.outputs)

    @property
    def execution_order(self) -> list[Node]:
        """The nodes, dependencies first."""
        return list(self.order)

    @property
    def output_to_node(self) -> dict[str, Node]:
        """The node producing each output."""
        return dict(self.producer)

    @property
    def required_outputs(self) -> dict[Node, list[str] | None]:
        """For each nested pipeline, the outputs other nodes read when they read only some of
        them (the rest stay inside: `_kept_inside`), else None (all leave)."""
        nested = [n for n in self.nodes if getattr(n, "pipeline", None) is not None]
        read = {n: sorted(o for o in n.outputs if o in self.consumers) for n in nested}
        return {n: r if r and len(r) < len(n.outputs) else None for n, r in read.items()}

    def get_required_nodes(self, output_names: str | Sequence[str] | None) -> list[Node] | None:
        """The nodes computing `output_names` and what they need, in execution order; None for
        None (every node runs). An output no node produces is an UnknownOutputError (a ValueError)."""
        if output_names is None:
            return None
        wanted = [output_names] if isinstance(output_names, str) else list(output_names)
        for name in wanted:
            if name not in self.producer:
                raise UnknownOutputError(name, self.outputs, "pipeline")
        needed: set[int] = set()
        todo = [self.producer[name] for name in wanted]
        while todo:
            n = todo.pop()
            if id(n) not in needed:
                needed.add(id(n))
                todo += self.dependencies(n)
        return [n for n in self.order if id(n) in needed]

    def _kept_inside(self) -> set[str]:
        """HyperNodes' rule for nested pipelines: when other nodes read some of a nested pipeline's
        outputs, only those leave it; the rest are intermediate results of the inner pipeline (not
        returned, and not computed unless a run names them). When none or all are read, all leave."""
        hidden: set[str] = set()
        for n in self.nodes:
            if getattr(n, "pipeline", None) is None:
                continue
            read = [o for o in n.outputs if o in self.consumers]
            if read and len(read) < len(n.outputs):
                hidden.update(o for o in n.outputs if o not in read)
        return hidden

    def dependencies(self, n: Node) -> list[Node]:
        return [self.producer[i] for i in n.inputs if i in self.producer]

    def _topological_order(self) -> tuple[Node, ...]:
        """Dependencies first, and otherwise the order the nodes were declared in, level by level
        (`[a, b(a), z]`: a, z, b). `by_name` (a HyperNodes pipeline, `compat.hypernodes`): among the
        nodes ready to run, the first by name, one at a time (HyperNodes' Kahn sort: a, b, z), and of
        two of one name the one ready first; a switch from HyperNodes then keeps the order nodes run
        in, and with it what shared state (a random generator) gives each. The standard library's
        `graphlib` tracks readiness; a cycle is reported by its node names."""
        sorter: graphlib.TopologicalSorter[int] = graphlib.TopologicalSorter()
        position = {id(n): k for k, n in enumerate(self.nodes)}
        for k, n in enumerate(self.nodes):
            sorter.add(k, *(position[id(d)] for d in self.dependencies(n)))
        try:
            sorter.prepare()
        except graphlib.CycleError as exc:
            cycle = exc.args[1][:-1]  # graphlib repeats the first node at the end
            raise CycleError([self.nodes[k].name for k in reversed(cycle)]) from None
        if not self.by_name:  # (graphlib's `static_order`, after the `prepare` above)
            levels: list[Node] = []
            while sorter.is_active():
                batch = sorter.get_ready()
                levels += (self.nodes[k] for k in batch)
                sorter.done(*batch)
            return tuple(levels)
        ready: list[tuple[str, int, int]] = []  # (name, when it became ready, position)
        became = itertools.count()
        order: list[Node] = []
        while sorter.is_active():
            for k in sorted(sorter.get_ready()):  # (HyperNodes queues the newly ready in declared order)
                heapq.heappush(ready, (self.nodes[k].name, next(became), k))
            _, _, k = heapq.heappop(ready)
            order.append(self.nodes[k])
            sorter.done(k)
        return tuple(order)

def walk_nodes(nodes: Iterable[Node]) -> Iterable[Node]:
    """Nodes, and those of the pipelines nested in them, at any depth."""
    for node in nodes:
        yield node
        inner = getattr(node, "pipeline", None)  # a PipelineNode (hardy.api.nesting)
        if inner is not None:
            yield from walk_nodes(inner.graph.nodes)


def node_functions(nodes: Iterable[Node]) -> list[Any]:
    """The functions the nodes wrap, nested pipelines' included: what runs when they are called."""
    return [n.func for n in walk_nodes(nodes) if getattr(n, "pipeline", None) is None]

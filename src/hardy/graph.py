"""The dependency graph of a pipeline, built and validated once when the Pipeline is constructed.

Nodes are wired purely by names: a node consumes the parameter names it declares and produces its
output names. Validation here (duplicates, self-consumption, cycles) means no later stage needs to
re-check: a Plan can trust the graph.
"""

from __future__ import annotations

from typing import Iterable

from .errors import CycleError, DuplicateNodeError, DuplicateOutputError, SelfDependencyError
from .node import Node


class Graph:
    def __init__(self, nodes: Iterable[Node]):
        self.nodes: tuple[Node, ...] = tuple(nodes)
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

    def dependencies(self, n: Node) -> list[Node]:
        return [self.producer[i] for i in n.inputs if i in self.producer]

    def _topological_order(self) -> tuple[Node, ...]:
        """Depth-first order; on a back edge, report the cycle by its node names."""
        state: dict[int, int] = {}  # id(node) -> 1 visiting, 2 done
        order: list[Node] = []
        for root in self.nodes:
            if state.get(id(root)):
                continue
            stack: list[tuple[Node, int]] = [(root, 0)]
            path: list[Node] = [root]
            state[id(root)] = 1
            while stack:
                n, i = stack[-1]
                deps = self.dependencies(n)
                if i < len(deps):
                    stack[-1] = (n, i + 1)
                    d = deps[i]
                    s = state.get(id(d))
                    if s == 1:
                        cycle = path[path.index(d):]
                        raise CycleError([c.name for c in reversed(cycle)])
                    if s is None:
                        state[id(d)] = 1
                        stack.append((d, 0))
                        path.append(d)
                else:
                    stack.pop()
                    path.pop()
                    state[id(n)] = 2
                    order.append(n)
        return tuple(order)

"""A pipeline as one node of another (`Pipeline.as_node`): names mapped between the outer and the
inner pipeline, the inner pipeline run (or mapped over items) for each call, and its fingerprint
for the cache. A nested pipeline with no engine of its own follows its parent's (`under`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import Failed, InvalidArgument, InvalidArgumentType, MapError
from ..model.node import Node
from ..observe.callbacks import PipelineCallback
from ..observe.progress import nested_progress

if TYPE_CHECKING:
    from ..engine.core import Engine
    from .pipeline import Pipeline


DEFAULT_NAME = "pipeline"  # nested pipelines that keep it are numbered (pipeline, pipeline_2, ...)


class PipelineNode(Node):
    """A pipeline used as a node: its free inputs are the node's inputs, its exposed outputs the
    node's. Called directly, it returns {output: value}, as HyperNodes' does."""

    def __init__(self, pipeline: Pipeline, name: str | None = None, input_mapping: Mapping[str, str] | None = None,
                 output_mapping: Mapping[str, str] | None = None, map_over: str | Sequence[str] | None = None,
                 map_mode: str = "zip", on_error: str = "raise"):
        input_mapping, output_mapping = input_mapping or {}, output_mapping or {}
        self.pipeline = pipeline
        self.name = name or pipeline.name
        inner_to_outer = {inner: outer for outer, inner in input_mapping.items()}
        for outer, inner in input_mapping.items():
            if inner not in pipeline.graph.consumers:
                raise InvalidArgument(
                    f"as_node({self.name!r}): input_mapping maps {outer!r} to {inner!r}, which no node of "
                    f"pipeline {pipeline.name!r} consumes; its inputs are {list(pipeline.inputs)}.")
        for inner in output_mapping:
            if inner not in pipeline.graph.producer:
                raise InvalidArgument(
                    f"as_node({self.name!r}): output_mapping names {inner!r}, which pipeline "
                    f"{pipeline.name!r} does not produce; its outputs are {list(pipeline.outputs)}.")
        if on_error not in ("raise", "continue"):
            raise InvalidArgument(
                f"as_node({self.name!r}): on_error must be 'raise' or 'continue', got {on_error!r}.")
        bound = pipeline.bound_inputs
        free = [i for i in pipeline.graph.root_inputs if i not in bound]
        self.inner_inputs = {inner_to_outer.get(i, i): i for i in free}
        self.inner_outputs = (tuple(o for o in pipeline.graph.outputs if o in output_mapping) if output_mapping
                               else pipeline.graph.exposed)
        self.inputs = tuple(self.inner_inputs)
        optional = {i for i in free if all(i in c.defaults for c in pipeline.graph.consumers.get(i, []))}
        self.defaults = {inner_to_outer.get(i, i): None for i in optional}
        self.kwonly = frozenset(self.inputs)
        self.outputs = tuple(output_mapping.get(o, o) for o in self.inner_outputs)
        over = [map_over] if isinstance(map_over, str) else list(map_over or [])
        for o in over:
            if o not in self.inner_inputs:
                raise InvalidArgument(
                    f"as_node({self.name!r}): map_over names {o!r}, which is not an input of this node "
                    f"(its inputs are {list(self.inputs)}).")
        self.map_over = [self.inner_inputs[o] for o in over]
        self.map_mode = map_mode
        self.on_error = on_error
        self.is_async = False
        self.cache = True
        self.isolate = False
        self.retries = 0
        self.retry_on = ()
        self.backoff = 0.0
        self.timeout = None
        self.func = self._call

    def cached_in(self, cache: Any) -> PipelineNode:
        """A copy of this node with its inner pipeline caching into `cache`: each inner node and map
        item is cached on its own, so a nested map over 1,010 items recomputes only the 10 new ones."""
        return self._copy(self.pipeline.cached_in(cache), cache=False)

    def observed_by(self, callbacks: Sequence[PipelineCallback]) -> PipelineNode:
        """A copy of this node with its inner pipeline reporting to `callbacks`."""
        return self._copy(self.pipeline.observed_by(callbacks))

    def under(self, engine: Engine) -> PipelineNode:
        """This node run by the engine of the pipeline it is part of, unless its own pipeline was
        given one: a nested pipeline follows its parent's choice of where calls run."""
        inner = self.pipeline.nested_under(engine)
        return self if inner is self.pipeline else self._copy(inner)

    def _copy(self, pipeline: Pipeline, **changes: Any) -> PipelineNode:
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__, pipeline=pipeline, **changes)
        copy.func = copy._call
        return copy

    def narrowed(self, outputs: tuple[str, ...]) -> PipelineNode:
        """This node computing only `outputs`: the inner pipeline runs just the nodes they need,
        and the node takes just the inputs those nodes read."""
        if outputs == self.outputs:
            return self
        from ..plan.compiled import resolve  # (loaded by then, with the plan that narrows it: `api.pipeline`)
        outer_of = dict(zip(self.inner_outputs, self.outputs))
        inner_outputs = tuple(i for i, o in outer_of.items() if o in outputs)
        graph = self.pipeline.graph
        provided = {*self.inner_inputs.values(), *self.pipeline.bound_inputs}
        read = {v for s in resolve(graph, provided, inner_outputs) for _, v in s.args}
        inner_inputs = {o: i for o, i in self.inner_inputs.items() if i in read or i in self.map_over}
        return self._copy(self.pipeline, inner_outputs=inner_outputs, outputs=outputs, inner_inputs=inner_inputs,
                          inputs=tuple(inner_inputs), kwonly=frozenset(inner_inputs),
                          defaults={k: v for k, v in self.defaults.items() if k in inner_inputs})

    @property
    def bound_inputs(self) -> dict[str, Any]:
        """The inner pipeline's bound inputs (HyperNodes' name)."""
        return self.pipeline.bound_inputs

    @property
    def unfulfilled_args(self) -> tuple[str, ...]:
        """The inputs the outer pipeline must provide, by their outer names (HyperNodes' name)."""
        return self.inputs

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if args:
            raise InvalidArgumentType(f"pipeline node {self.name!r} takes its inputs by name: {list(self.inputs)}")
        out = self._call(**kwargs)
        return dict(zip(self.outputs, (out,) if len(self.outputs) == 1 else out))

    def _call(self, **kwargs: Any) -> Any:
        inner = {self.inner_inputs[k]: v for k, v in kwargs.items()}
        if self.pipeline.callbacks:
            from ..observe.events import Events  # (loaded by the plan running this node: `api.pipeline`)
            out = Events(self.pipeline.callbacks).nested(self.pipeline.name, lambda: self._run(inner))
        else:
            out = self._run(inner)
        return out[0] if len(out) == 1 else out

    def _run(self, inner: dict[str, Any]) -> tuple[Any, ...]:
        wanted = list(self.inner_outputs)
        if self.map_over:
            try:
                rows = self.pipeline.map(inner, self.map_over, self.map_mode, output_name=wanted,
                                         on_error=self.on_error, progress=nested_progress())
            except MapError as exc:  # the inner item's own error: the plan running this node adds its name
                err = exc.failures[min(exc.failures)]
                err.nested = (f"{self.name!r} item {err.item}", *err.nested)
                err.item = None  # (the outer call's item, which its map sets: a run() has none)
                raise err from err.__cause__
            for row in rows:
                if isinstance(row, Failed):  # named by its path, as a crash in it would be
                    row.error.node = f"{self.name}/{row.error.node}"
            return tuple([row if isinstance(row, Failed) else row[o] for row in rows] for o in wanted)
        result = self.pipeline.run(inner, output_name=wanted)
        return tuple(result[o] for o in wanted)

    def fingerprint(self) -> bytes:
        from ..hashing import FORMAT, digest, hash_value
        inner = sorted(n.fingerprint() for n in self.pipeline.graph.nodes)
        return digest(FORMAT, b"pipeline", *inner, repr((self.inputs, self.outputs, self.map_over,
                                                          self.map_mode)).encode(),
                      hash_value(self.pipeline.bound_inputs))

    def __repr__(self) -> str:
        return f"PipelineNode({self.name}: {', '.join(self.inputs)} -> {', '.join(self.outputs)})"


def numbered(nodes: list[Node]) -> list[Node]:
    """Nested pipelines that kept the default name, numbered so that their names (in errors,
    events and reports) tell them apart: pipeline, pipeline_2, ... (HyperNodes runs them as they are)."""
    taken, seen, out = {n.name for n in nodes}, False, []
    for n in nodes:
        if isinstance(n, PipelineNode) and n.name == DEFAULT_NAME:
            if seen:
                number = 2
                while f"{DEFAULT_NAME}_{number}" in taken:
                    number += 1
                n = n._copy(n.pipeline, name=f"{DEFAULT_NAME}_{number}")
                taken.add(n.name)
            seen = True
        out.append(n)
    return out

"""`hypernodes.pipeline_node`: HyperNodes' PipelineNode signature on hardy's PipelineNode."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...api.nesting import PipelineNode as HardyPipelineNode

if TYPE_CHECKING:
    from ...api.pipeline import Pipeline


class PipelineNode(HardyPipelineNode):
    """`PipelineNode(pipeline, input_mapping=None, output_mapping=None, map_over=None, map_mode="zip",
    cache=True, name=None)`, HyperNodes' order. `cache` is accepted for the reason `as_node(cache=)`
    is (docs/hypernodes.md); `on_error` is hardy's. Its inner pipeline gets its inputs in HyperNodes'
    order, that of their inner names sorted, which a product map over them follows (`Pipeline.map`)."""

    def __init__(self, pipeline: Pipeline, input_mapping: Mapping[str, str] | None = None,
                 output_mapping: Mapping[str, str] | None = None, map_over: str | Sequence[str] | None = None,
                 map_mode: str = "zip", cache: bool = True, name: str | None = None, on_error: str = "raise"):
        super().__init__(pipeline, name, input_mapping, output_mapping, map_over, map_mode, on_error)


    def _call(self, **kwargs: Any) -> Any:
        return super()._call(**dict(sorted(kwargs.items(), key=lambda item: self.inner_inputs[item[0]])))


__all__ = ["PipelineNode"]

"""`hypernodes.pipeline_node`: `PipelineNode(pipeline=..., input_mapping=, output_mapping=, map_over=,
map_mode=, name=)` is hardy's PipelineNode, which takes these keywords with HyperNodes' defaults."""

from ...pipeline import PipelineNode

__all__ = ["PipelineNode"]

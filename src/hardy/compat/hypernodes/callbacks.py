"""`hypernodes.callbacks`: hardy's callbacks already have HyperNodes' hooks and signatures."""

from ...observe import CallbackContext, PipelineCallback

__all__ = ["PipelineCallback", "CallbackContext"]

"""Watching a pipeline run: callbacks (events) and the map progress bar.

Both stay off the hot path when unused: with no callback registered, plans are compiled without
instrumentation, and progress costs one counter increment per item.
"""

from .callbacks import CallbackContext, PipelineCallback
from .progress import MapProgress

__all__ = ["CallbackContext", "PipelineCallback", "MapProgress"]

"""What a worker was doing, in the words the parent reads after its death.

A worker's status words (`workers/status.py`) say which item it runs and which step; between
items, `item` holds one of these words instead, and each Python thread it starts notes them in its
fault record (`lines.thread_line`). They are defined here, in the package that reads them after a
death to decide what the death means (`verdict`, `blame`); the status words re-export them. Floats:
the words are doubles, and a float is stored as it is (an int is converted, a float made, at every
store: they are stored per item, on the hot path).
"""

from __future__ import annotations

IDLE, READING, SENDING, LOADING = -1.0, -3.0, -4.0, -5.0  # LOADING: the pipeline, its nodes' modules
BATCH = -2.0  # `item` while a batched node's call runs: the parent splits the batch if the worker dies
OPENING = -2  # `step` while a sealed item's input k is unpickled: OPENING - k (`item` is the item)

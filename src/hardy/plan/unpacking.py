"""A node's result split into its declared outputs: `output_name=("a", "b")` (or `("a",)`: a
tuple of names always means the result is unpacked, as HyperNodes does), and the error that says
what the node returned instead. Kept apart from `compiled.py`, whose generated code calls
`check_outputs` for every result that is not already a tuple of the right length."""

from __future__ import annotations

import itertools
from typing import Any

from ..errors import NodeError, OutputCountError
from ..model.node import Node


class _WrongOutputCount(Exception):
    def __init__(self, shape: str):
        self.shape = shape  # what the node returned, in words


def check_outputs(value: Any, n: int) -> tuple[Any, ...]:
    """The `n` values of a result that is not already an n-tuple: a list, or any other ordered
    iterable (a generator too, as Python's own unpacking takes it) with exactly `n` items. A str or
    bytes (its characters), a dict or a DataFrame (its keys, its column labels) and a set (no order)
    are refused: unpacked, they give values no one meant."""
    if isinstance(value, list) and len(value) == n:
        return tuple(value)
    if isinstance(value, dict):
        raise _WrongOutputCount(f"a dict of length {len(value)}, which is not unpacked (that would give its keys)")
    if hasattr(value, "columns") and hasattr(value, "iloc"):  # (pandas' iterate their columns, count their rows)
        raise _WrongOutputCount(f"a {type(value).__name__} of {len(value)} rows, which is not unpacked (that would "
                                "give its column labels)")
    if isinstance(value, (set, frozenset)):
        raise _WrongOutputCount(f"a {type(value).__name__} of length {len(value)}, which is not unpacked "
                                "(it has no order)")
    if isinstance(value, (str, bytes, bytearray)) or not hasattr(value, "__iter__") or (
            hasattr(value, "__len__") and len(value) != n):
        raise _WrongOutputCount(_shape(value))
    items = tuple(itertools.islice(value, n + 1))  # (n + 1: an endless generator is not read to its end)
    if len(items) == n:
        return items
    more = "more than " if len(items) > n else ""
    raise _WrongOutputCount(f"a {type(value).__name__} of {more}{min(len(items), n)} values")


def count_error(node: Node, inputs: dict[str, Any], exc: BaseException) -> NodeError | None:
    """The OutputCountError (a TypeError) for a result `check_outputs` refused; None for any other
    exception."""
    if not isinstance(exc, _WrongOutputCount):
        return None
    n = len(node.outputs)
    declared = f"{n} outputs {node.outputs}" if n > 1 else f"output_name={node.outputs}, a tuple of one name,"
    fix = (f"return a tuple of {n} values" if n > 1 else
           f"return a 1-tuple (value,), or declare output_name={node.outputs[0]!r} for the value itself")
    return OutputCountError(node.name, inputs, reason=f"declared {declared} but returned {exc.shape}; {fix}")


def _shape(value: Any) -> str:
    """A returned value in words, for the output count error."""
    if hasattr(value, "__len__"):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"{value!r:.80} (a {type(value).__name__})"

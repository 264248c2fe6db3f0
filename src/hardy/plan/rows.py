"""A batched node's outputs as one entry per item: row i goes to item i.

A batched function returns, per output, a column with an entry per item. What "an entry" is
depends on the column's type, and iterating is not always it: iterating a pandas DataFrame gives
its column labels, an Arrow array its Arrow scalars, a dict its keys. So each kind is read by its
rows, the same way in this process and in a worker (the same answer everywhere):

| returned | item i gets |
| --- | --- |
| a list, a tuple, a numpy array | its entry i (an array's row i) |
| a torch tensor | its row i, copied (a row is a view of the whole batch, which torch pickles whole) |
| a pandas Series | its value i, by position |
| a pandas DataFrame, an Arrow Table or RecordBatch | its row i as a dict {column: value} |
| an Arrow Array or ChunkedArray | its value i, as Python |
| a dict of columns {name: column} | {name: the column's entry i} |

Anything else with a length and items is read as a list. A column with another number of entries
than items, a string, or a value with no length fails every item of the call with one
`BatchShapeError` naming the node, how many items it got and what came back: the mistake is the
function's, not an item's.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import BatchShapeError

_FIX = ("return one entry per item, in the items' order: a list, an array or tensor with a row per item, a "
        "DataFrame or Arrow table with a row per item, or a dict of such columns")


def batch_outputs(out: Any, name: str, outputs: int, n: int) -> list[list[Any]]:
    """The entries of a batched call over `n` items: one list per output, each of `n` entries."""
    columns = (out,) if outputs == 1 else out
    if outputs > 1 and (not isinstance(columns, (tuple, list)) or len(columns) != outputs):
        raise BatchShapeError(f"batched node {name!r} declares {outputs} outputs and must return a tuple of "
                              f"{outputs} columns, got {_described(out)}")
    found = []
    for k, column in enumerate(columns):
        entries, what = _rows(column, n)
        if entries is None or len(entries) != n:
            which = f" as its output {k + 1} of {outputs}" if outputs > 1 else ""
            raise BatchShapeError(f"batched node {name!r} was called with {n} item(s) and returned {what}{which}; "
                                  f"{_FIX}")
        found.append(entries)
    return found


def _rows(column: Any, n: int) -> tuple[list[Any] | None, str]:
    """(one entry per row, or None when `column` has no rows; how it is described in an error)."""
    if isinstance(column, (str, bytes)) or not hasattr(column, "__len__"):
        return None, _described(column)
    if isinstance(column, dict):
        return _dict_rows(column, n)
    kind, module = type(column).__name__, type(column).__module__.partition(".")[0]
    if module == "pandas" and kind == "DataFrame":
        return column.to_dict("records"), f"a DataFrame of {len(column)} row(s)"
    if module == "pyarrow" and hasattr(column, "to_pylist"):  # Table, RecordBatch, Array, ChunkedArray
        return column.to_pylist(), f"an Arrow {kind} of {len(column)} row(s)"
    if module == "torch" and "torch" in sys.modules:
        if not column.dim():
            return None, "a torch tensor with no dimension (a scalar)"
        return [row.clone() for row in column], f"a torch tensor of {len(column)} row(s)"
    if module == "numpy" and getattr(column, "ndim", 1) == 0:
        return None, "a numpy array with no dimension (a scalar)"
    return list(column), _described(column)


def _dict_rows(columns: dict[Any, Any], n: int) -> tuple[list[Any] | None, str]:
    """A dict of columns as one dict per row; None when a value is not a column of `n` entries."""
    if not columns:
        return None, "an empty dict"
    read = {}
    for key, column in columns.items():
        entries, what = _rows(column, n) if not isinstance(column, dict) else (None, "a dict")
        if entries is None or len(entries) != n:
            return None, f"a dict of columns whose {key!r} is {what}"
        read[key] = entries
    return [dict(zip(read, row)) for row in zip(*read.values())], f"a dict of {len(read)} column(s)"


def _described(value: Any) -> str:
    """`a list of length 2`, `a int`: the type, and the length where there is one."""
    try:
        length = f" of length {len(value)}"
    except TypeError:
        length = ""
    return f"a {type(value).__name__}{length}"


__all__ = ["batch_outputs"]

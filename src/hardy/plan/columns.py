"""A map's items as a column: the items of a map over one input, made only where they are read.

A map over one list (`p.map(inputs={"x": xs, "model": m}, map_over="x")`) has item k =
`{**constants, "x": xs[k]}`. `Items` is that sequence without the dicts: this process builds an
item only when something reads it (an in-process executor, a failure's report), and a chunk for a
worker process travels as its slice of the column and the constants (`WorkerPool.chunk_message`),
from which the worker builds its own (`built`). So a worker starts on its chunk at once, instead
of after this process has built a dict per item of the map, and the pickle holds plain values.
A leaf: the map's API (`plan/map_items.py`) makes it, the worker pool ships it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload


class Items(Sequence[dict[str, Any]]):
    """The items of a map over one input, made when read: item k is `{**constants, name: column[k]}`."""

    __slots__ = ("constants", "name", "column")

    def __init__(self, constants: dict[str, Any], name: str, column: Sequence[Any]):
        self.constants, self.name, self.column = constants, name, column

    def __len__(self) -> int:
        return len(self.column)

    @overload
    def __getitem__(self, k: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, k: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, k: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(k, slice):
            return [{**self.constants, self.name: x} for x in self.column[k]]
        return {**self.constants, self.name: self.column[k]}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        constants, name = self.constants, self.name
        return ({**constants, name: x} for x in self.column)


def built(constants: dict[str, Any], name: str, column: Sequence[Any]) -> list[dict[str, Any]]:
    """The items of `column` as `Items` reads them (what a worker makes of a chunk of them)."""
    if not constants:
        return [{name: x} for x in column]
    return [{**constants, name: x} for x in column]

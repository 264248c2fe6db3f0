"""Where compiled plans are kept: one bounded memo, used by every place that compiles or ships one.

A pipeline keeps its plans by (input names, outputs, map or run); an isolated node by argument
names; the pool the message that ships each plan to workers; an engine's worker (Dask, Ray) the
plan built from each spec. All are small in the common case (a handful of keys, all hits) and
unbounded only for a caller that varies its keys endlessly (input names built per call): past
`limit` the memo starts over, the simplest policy that keeps the common case free.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, MutableMapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Memo(Generic[K, V]):
    """`weak`: keys are held weakly (a plan no pipeline keeps any more takes its entry with it)."""

    def __init__(self, limit: int, weak: bool = False):
        self.limit = limit
        self._items: MutableMapping[K, V] = weakref.WeakKeyDictionary() if weak else {}

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> list[V]:
        return list(self._items.values())

    def put(self, key: K, value: V) -> V:
        """Keep `value`; the one kept already when another thread got there first."""
        if len(self._items) >= self.limit and key not in self._items:
            self._items.clear()
        return self._items.setdefault(key, value)

    def clear(self) -> None:
        self._items.clear()

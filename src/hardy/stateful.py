"""Stateful resources: an expensive object (a model, a tokenizer, a client) built once per process.

`@stateful` makes constructing the class cheap: `Model("bert")` returns a handle that records the
constructor arguments. The real object is built on first use, once in each process that uses it,
and reused for every item that process runs. Handles pickle as (class, arguments), never as the
loaded object, so a worker process builds its own model instead of receiving a copy (seed 003:
one model per worker, and nothing CUDA-bound ever crosses a process boundary).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_instances: dict[str, Any] = {}
_lock = threading.Lock()


class Resource:
    """A handle on a lazily built instance; attribute access and calls go to the instance."""

    __slots__ = ("_cls", "_args", "_kwargs", "_key")

    def __init__(self, cls: type, args: tuple, kwargs: dict, key: str | None = None):
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_kwargs", kwargs)
        if key is None:
            import uuid
            key = uuid.uuid4().hex
        object.__setattr__(self, "_key", key)

    @property
    def instance(self) -> Any:
        """The object itself, built here on first access."""
        obj = _instances.get(self._key)
        if obj is None:
            with _lock:  # two threads of one process must not build the model twice
                obj = _instances.get(self._key)
                if obj is None:
                    obj = _instances[self._key] = self._cls(*self._args, **self._kwargs)
        return obj

    def __getattr__(self, name: str) -> Any:
        return getattr(self.instance, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.instance, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.instance(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return (Resource, (self._cls, self._args, self._kwargs, self._key))

    def __cache_key__(self) -> tuple:
        """What identifies the resource for caching: its class and constructor arguments."""
        return (f"{self._cls.__module__}.{self._cls.__qualname__}", self._args,
                tuple(sorted(self._kwargs.items())))

    def __repr__(self) -> str:
        built = "built" if self._key in _instances else "not built yet"
        return f"<{self._cls.__qualname__} resource ({built}) args={self._args!r}>"


def stateful(cls: type[T]) -> Callable[..., T]:
    """Class decorator: instances are built lazily, once per process (see module docstring)."""

    @functools.wraps(cls, updated=())
    def make(*args: Any, **kwargs: Any) -> Any:
        return Resource(cls, args, kwargs)

    return make

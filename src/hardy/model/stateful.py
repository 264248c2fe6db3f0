"""Stateful resources: an expensive object (a model, a tokenizer, a client) built once per process.

`@stateful` makes constructing the class cheap: `Model("bert")` returns a handle that records the
constructor arguments. The real object is built on first use, once in each process that uses it,
and reused for every item that process runs. Handles pickle as (class, arguments), never as the
loaded object, so a worker process builds its own model instead of receiving a copy (one model
per worker, and nothing CUDA-bound ever crosses a process boundary). Attributes set on a handle
(`clf.threshold = 0.9`) travel with it, where they pickle and hold nothing on a GPU, and are set
on each other process's object, so a worker computes with them as the caller does; what the
object's own methods change (`clf.fit(...)`) stays in the process that called them
(docs/same-answer.md).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, TypeVar

T = TypeVar("T")

_instances: dict[str, Any] = {}
_lock = threading.Lock()


class _HandleClass(type):
    """Class attributes the handle class lacks (constants, static and class methods) are the
    decorated class's, so `Model.DEFAULT_PATH` works as before decorating."""

    def __getattr__(cls, name: str) -> Any:
        wrapped = type.__getattribute__(cls, "_cls")
        if wrapped is object:
            raise AttributeError(name)
        return getattr(wrapped, name)


class Resource(metaclass=_HandleClass):
    """A handle on a lazily built instance; attribute access and calls go to the instance.

    `@stateful` returns a subclass of this named like the decorated class, so `Model("bert")` is a
    handle and `isinstance(handle, Model)` holds, as in HyperNodes.
    """

    __slots__ = ("_args", "_kwargs", "_key", "_set", "_origin")
    _cls: type = object  # the decorated class, set on each subclass by `stateful`
    __hypernode_stateful__ = True  # HyperNodes' marker, for code that checks it

    def __init__(self, *args: Any, **kwargs: Any):
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_kwargs", kwargs)
        object.__setattr__(self, "_key", os.urandom(16).hex())
        object.__setattr__(self, "_set", {})  # attributes set on the handle that travel with it, by name
        object.__setattr__(self, "_origin", os.getpid())  # the process whose object they were set on

    @property
    def instance(self) -> Any:
        """The object itself, built here on first access."""
        obj = _instances.get(self._key)
        if obj is None:
            with _lock:  # two threads of one process must not build the model twice
                obj = _instances.get(self._key)
                if obj is None:
                    obj = self._cls(*self._args, **self._kwargs)
                    for name, value in self._set.items():
                        setattr(obj, name, value)
                    _instances[self._key] = obj
        return obj

    @property
    def _instance(self) -> Any:
        """HyperNodes' view of the handle: the object once this process has built it, else None."""
        return _instances.get(self._key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.instance, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.instance, name, value)
        if _travels(value):
            self._set[name] = value
        else:  # (a lock, a client, a GPU tensor: the other processes' objects keep their own)
            self._set.pop(name, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.instance(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_handle, (type(self), self._args, self._kwargs, self._key, self._set, self._origin))

    def __cache_key__(self) -> Any:
        """What identifies the resource for caching: the class's own `__cache_key__()` when it
        defines one (this builds the object), else its class and constructor arguments."""
        if hasattr(self._cls, "__cache_key__"):
            return self.instance.__cache_key__()
        key = (f"{self._cls.__module__}.{self._cls.__qualname__}", self._args, tuple(sorted(self._kwargs.items())))
        return (*key, tuple(sorted(self._set.items()))) if self._set else key

    def __repr__(self) -> str:
        built = "built" if self._key in _instances else "not built yet"
        return f"<{self._cls.__qualname__} resource ({built}) args={self._args!r}>"


def _handle(cls: type[Resource], args: tuple[Any, ...], kwargs: dict[str, Any], key: str,
            attributes: dict[str, Any] | None = None, origin: int | None = None) -> Resource:
    """A handle arrived from another process (or a copy of one): in another process than its
    own, the attributes set on it there are set on this process's object too, if it was built
    before (a worker's, at an earlier call). In its own, its object already has them, and what its
    methods changed since stays (a `deepcopy` of the handle changes nothing)."""
    handle = Resource.__new__(cls)
    for name, value in (("_args", args), ("_kwargs", kwargs), ("_key", key), ("_set", dict(attributes or {})),
                        ("_origin", origin if origin is not None else os.getpid())):
        object.__setattr__(handle, name, value)
    built = _instances.get(key)
    if built is not None and handle._origin != os.getpid():
        for name, value in handle._set.items():
            setattr(built, name, value)
    return handle


def _travels(value: Any) -> bool:
    """Whether an attribute set on a handle goes with it: it pickles, and holds nothing on a GPU
    (a worker would start CUDA to unpickle it): a tensor's device, a torch module's parameters'."""
    parameters = getattr(value, "parameters", None) if "torch" in sys.modules else None
    tensors = list(parameters()) if callable(parameters) and hasattr(value, "state_dict") else [value]
    if any(getattr(getattr(t, "device", None), "type", "cpu") != "cpu" for t in tensors):
        return False
    import pickle  # (here: `import hardy` loads this module, and no pickling)
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def stateful(cls: type[T]) -> type[T]:
    """Class decorator: instances are built lazily, once per process (see module docstring)."""
    return _HandleClass(cls.__name__, (Resource,), {  # type: ignore[return-value]
        "__slots__": (), "_cls": cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__})

"""How values are pickled to cross a process: pickle where it can, cloudpickle for functions and
anything from `__main__` (workers never import the user's main script, so its classes and
functions travel by value), code keeping its file name and line numbers (`_reduce_code`), so crash
stacks name the user's lines; and, to and from hardy's own workers, big torch tensors and
bytes-likes offered as out-of-band buffers like numpy's (`out_of_band`, `shipping.transport`);
and what the libraries' own pickling drops or cannot rebuild kept (`shipping.reductions`); an open
text file refused, as a binary one is, where cloudpickle would send a `StringIO` copy of it
(`ByValuePickler`).
"""

from __future__ import annotations

import copyreg
import enum
import functools
import io
import linecache
import marshal
import operator
import os
import pickle
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import cloudpickle

from ..buffers import THRESHOLD, big_buffer
from .reductions import (
    is_singledispatch,
    made_with_its_class,
    reduce_posing,
    reduce_singledispatch,
    reduce_tensor_as_torch,
    reductions,
    subclass_reduction,
    with_member_attributes,
)


def dumps(obj: Any, buffer_callback: Callable[[Any], bool] | None = None) -> bytes:
    """pickle where it can; cloudpickle for functions, and for anything that names `__main__`:
    workers never import the user's main script, so its classes and functions travel by value.
    `buffer_callback` is pickle's; given one (the worker transport does), torch tensors and
    bytes-likes offer their bytes as buffers too (`out_of_band`). It is called with None when a
    second attempt starts over."""
    try:
        data = _pickled(obj, buffer_callback, by_value=False)
        if b"__main__" not in data:
            return data
    except Exception:
        pass
    if buffer_callback is not None:
        buffer_callback(None)
    return _pickled(obj, buffer_callback, by_value=True)


def quick(obj: Any, main: bool = True) -> bytes | None:
    """`obj` pickled as `transport.pack` would pickle it (`dumps`, or with `main` False
    `out_of_band`) when that needs no shared memory: None when it holds a big buffer (or cannot
    be pickled plainly, or, `main`, refers to `__main__`), for the caller to pack it the full way.
    The one pickling most messages between the parent and its workers need: small ones."""
    try:
        if "torch" in sys.modules or "numpy" in sys.modules:  # (their tensors, and ndarray subclasses,
            data = _kept().dump(obj, _in_band)  # pickle another way here: `reductions`)
        else:  # the same pickle, from C alone (a memoryview, which `reductions` handles, fails it)
            data = pickle.dumps(obj, protocol=5, buffer_callback=_in_band)
            if len(data) >= THRESHOLD:  # a big bytes in it: out of band, the full way
                return None
    except Exception:  # (a big buffer stops it at once)
        return None
    return None if main and b"__main__" in data else data


def _in_band(buf: Any) -> bool:
    if big_buffer(buf) is not None:
        raise _BigBytes
    return True


def _pickled(obj: Any, buffer_callback: Callable[[Any], bool] | None, by_value: bool) -> bytes:
    if buffer_callback is not None:
        return out_of_band(obj, buffer_callback, by_value)
    if by_value:  # (not cloudpickle.dumps: `ByValuePickler` refuses an open text file, keeps a tensor's grad)
        with io.BytesIO() as file:
            ByValuePickler(file, protocol=5).dump(obj)
            return file.getvalue()
    if "torch" not in sys.modules and "numpy" not in sys.modules:
        data: bytes = pickle.dumps(obj, protocol=5)
        return data
    with io.BytesIO() as file:  # every buffer in band: tensors as torch pickles them (`_in_band_table`)
        pickler = pickle.Pickler(file, protocol=5)
        pickler.dispatch_table = _in_band_table()
        pickler.dump(obj)
        return file.getvalue()


def pickled_by_value(obj: Any) -> bytes:
    """`obj` pickled by value, as workers receive plans (functions keep their file and lines),
    every buffer in band: for a file (the inputs `hardy replay` runs again)."""
    return out_of_band(obj, lambda buffer: True, by_value=True)


def out_of_band(obj: Any, buffer_callback: Callable[[Any], bool], by_value: bool = False) -> bytes:
    """`obj` pickled (protocol 5, cloudpickle if `by_value`) for `transport.pack`, which takes every
    big `PickleBuffer` out of band. numpy and Arrow pickle their memory as PickleBuffers; here the
    others do too: a plain CPU torch tensor of `THRESHOLD` bytes or more (`reductions`), bytes,
    bytearray and memoryview. The C pickler writes bytes and bytearrays before any hook could see
    them, so the first attempt stops where it would write a big one (`_Sink`), and the pickle is
    made again with the big ones in its dicts, lists and tuples wrapped (`_lift`): a message with
    none costs no walk."""
    try:
        if not by_value:
            return _kept().dump(obj, buffer_callback)
        return _dump(obj, buffer_callback, by_value, _Sink())
    except _BigBytes:
        buffer_callback(None)
        return _dump(_lift(obj, {}), buffer_callback, by_value, io.BytesIO())


def _dump(obj: Any, buffer_callback: Callable[[Any], bool], by_value: bool, file: io.BytesIO) -> bytes:
    """One pickling into `file`, with the reductions of `reductions` ahead of everyone else's."""
    with file:
        if by_value:
            ByValuePickler(file, protocol=5, buffer_callback=buffer_callback).dump(obj)
        else:
            pickler = pickle.Pickler(file, protocol=5, buffer_callback=buffer_callback)
            pickler.dispatch_table = _dispatch_table()
            pickler.dump(obj)
        return file.getvalue()


class _Kept:
    """`out_of_band`'s first attempt, with one pickler per thread kept from call to call: every
    message between the parent and a worker is pickled so, and making a pickler (its dispatch
    table, its file) cost twice the pickling of a small message. It is made again when copyreg's
    table changed or torch was imported since; a pickling inside a pickling (a `__reduce__` that
    pickles) gets a pickler of its own, and a failure drops the kept one."""

    def __init__(self) -> None:
        self.sink = _Sink()
        self.pickler: pickle.Pickler | None = None
        self.torch: Any = None  # sys.modules["torch"] when the pickler was made
        self.registered: dict[Any, Any] = {}  # copyreg's table then
        self.callback: Callable[[Any], bool] | None = None
        self.busy = False

    def dump(self, obj: Any, buffer_callback: Callable[[Any], bool]) -> bytes:
        if self.busy:
            return _dump(obj, buffer_callback, False, _Sink())
        if (self.pickler is None or sys.modules.get("torch") is not self.torch
                or copyreg.dispatch_table != self.registered):
            self.pickler = pickle.Pickler(self.sink, protocol=5, buffer_callback=self._callback)
            self.pickler.dispatch_table = _dispatch_table()
            self.torch, self.registered = sys.modules.get("torch"), dict(copyreg.dispatch_table)
        self.busy, self.callback, sink = True, buffer_callback, self.sink
        try:
            sink.seek(0)
            sink.truncate()
            self.pickler.dump(obj)
            self.pickler.clear_memo()
            return sink.getvalue()
        except BaseException:
            self.pickler = None  # (its state after a failure is not relied on)
            raise
        finally:
            self.busy, self.callback = False, None

    def _callback(self, buf: Any) -> bool:
        assert self.callback is not None
        return self.callback(buf)


def _kept() -> _Kept:
    """This thread's `_Kept` (a dict by thread: a `threading.local` costs more per attribute read)."""
    ident = threading.get_ident()
    kept = _KEPT.get(ident)
    if kept is None:
        if len(_KEPT) > 64:  # threads come and go: start over rather than keep the gone ones' picklers
            _KEPT.clear()
        kept = _KEPT[ident] = _Kept()
    return kept


_KEPT: dict[int, _Kept] = {}


def _dispatch_table() -> dict[Any, Any]:
    """copyreg's reductions, with `reductions` ahead of them."""
    return _Table({**copyreg.dispatch_table, **reductions()})


def _in_band_table() -> dict[Any, Any]:
    """`_dispatch_table` for a pickle that keeps every buffer in band: a tensor pickled as torch
    pickles it (its `.grad` kept), not as a buffer for the transport."""
    table = _dispatch_table()
    torch = sys.modules.get("torch")
    if torch is not None:
        table[torch.Tensor] = reduce_tensor_as_torch
    return table


class _Table(dict):  # type: ignore[type-arg]
    """A C pickler's dispatch table that also finds hardy's reduction for a subclass (of
    `numpy.ndarray`, of `torch.Tensor`: `reductions.subclass_reduction`), which a lookup by exact type cannot
    name in advance. The pickler looks every type up once per object; a type the table lacks is
    decided here once and kept: another type gets the pickler's own default (`__reduce_ex__(5)`,
    called from C), a class of another metaclass its name (as the pickler's `save_global`). So no
    object costs a Python call past its type's first."""

    def __missing__(self, kind: type) -> Any:
        found = subclass_reduction(kind)
        if found is None:
            found = _BY_NAME if issubclass(kind, type) else _DEFAULT
        if len(self) < 4096:  # (types made at run time, without end: decided anew past that)
            self[kind] = found
        return found


_DEFAULT = operator.methodcaller("__reduce_ex__", 5)  # what the C pickler does without a table entry
_BY_NAME = operator.attrgetter("__qualname__")  # a string: the pickler saves the object as a global


class _BigBytes(Exception):
    pass


class _Sink(io.BytesIO):
    """A pickle's file that refuses a big bytes or bytearray: the pickler hands it over whole
    (anything over 64 KiB skips its frames), before the copy. A big str's UTF-8 comes the same
    way; it is then pickled again for nothing, as no bytes were found to wrap."""

    def write(self, data: Any) -> int:
        if type(data) in (bytes, bytearray) and len(data) >= THRESHOLD:
            raise _BigBytes
        return super().write(data)


class ByValuePickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle's pickler with `reductions` first: its class-level dispatch table hides the
    C pickler's, so they go in its `reducer_override` (the by-value path is the slow one anyway).
    A proxy posing as a function goes whole (`reductions.reduce_posing`: cloudpickle asks
    `isinstance` and sent only the function it wraps), an Enum class by value with its members'
    attributes (`Unit.KG.scale = 2`, which cloudpickle's leaves out)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ours: dict[type, Callable[[Any], Any] | None] = {**reductions(),
                                                              types.BuiltinFunctionType: reduce_builtin}

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        reduce = self.ours.get(kind, _UNSEEN)
        if reduce is _UNSEEN:
            reduce = self.ours[kind] = subclass_reduction(kind)
        if reduce is not None:
            return reduce(obj)
        if kind is types.CodeType:
            return _reduce_code(obj)
        if kind is io.TextIOWrapper and obj is not sys.stdout and obj is not sys.stderr:
            # cloudpickle would send a StringIO of what is left to read: another object than the
            # file the node has in this process. Refused as pickle refuses a binary file.
            raise TypeError(f"cannot pickle {kind.__module__ + '.' + kind.__qualname__!r} object")
        if kind is not types.FunctionType and isinstance(obj, types.FunctionType):
            return reduce_posing(obj)  # (a proxy whose type forwards every attribute, `__class__` too)
        if is_singledispatch(obj):
            return reduce_singledispatch(obj)
        reduced = super().reducer_override(obj)
        if kind is types.FunctionType and isinstance(reduced, tuple) and len(reduced) > 2:
            _with_class_body_globals(obj, reduced[2])
        elif issubclass(kind, enum.EnumMeta) and isinstance(reduced, tuple):  # an Enum by value: its members' own
            reduced = with_member_attributes(obj, reduced)
        elif issubclass(kind, type):  # a class by value that defines `__class__` (a proxy's)
            reduced = made_with_its_class(obj, reduced)
        return reduced


def reduce_builtin(func: Any) -> Any:
    """A library's C function pickles by its name (`math.sqrt`). Kept by a script that replaced
    that name with a wrapper calling it (`_sqrt = math.sqrt; math.sqrt = logged_sqrt`), its name
    finds the wrapper: pickle refused it, and a worker would have called the wrapper in its place.
    Such a one travels as the library's own object of that name (`own_object`)."""
    module_name, name = getattr(func, "__module__", None), func.__qualname__
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    found = vars(module).get(name, _NOTHING) if isinstance(module, types.ModuleType) else _NOTHING
    if not isinstance(module_name, str) or found is _NOTHING or found is func:
        return NotImplemented  # (by its name, pickle's own way)
    _OWN[(module_name, name)] = func
    return own_object, (module_name, name)


def own_object(module_name: str, name: str) -> Any:
    """The library's own object named `name` in `module_name`, not a patch installed there: the one
    a worker's sync replaced with the caller's patch (`PATCHED`, which `replica` keeps), or the one this process
    pickled (the caller's own, where an engine runs in it), else the module's."""
    import importlib

    for kept in (PATCHED, _OWN):
        found = kept.get((module_name, name), _NOTHING)
        if found is not _NOTHING and type(found) is types.BuiltinFunctionType:
            return found
    return getattr(importlib.import_module(module_name), name)


_OWN: dict[tuple[str, str], Any] = {}  # (module, name) -> a library's C function pickled as its own (`own_object`)
# A worker's: (library module, name) a sync installed a patch over -> the library's own object (`replica`)
PATCHED: dict[tuple[str, str], Any] = {}
_NOTHING: Any = object()


def _with_class_body_globals(func: types.FunctionType, state: Any) -> None:
    """Adds to a function sent by value the globals that a class defined in its body reads.
    cloudpickle sends the globals its code reads with LOAD_GLOBAL; a class body reads them with
    LOAD_NAME (`class Local: k = SCALE` inside a node), so a worker raised NameError where the
    caller's process computed."""
    if not (isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict)
            and isinstance(state[1].get("__globals__"), dict)):
        return
    sent, module = state[1]["__globals__"], func.__globals__
    for name in _class_body_names(func.__code__):
        if name not in sent and name in module:
            sent[name] = module[name]


@functools.lru_cache(maxsize=256)
def _class_body_names(code: types.CodeType) -> frozenset[str]:
    """The names the code objects nested in `code` (class bodies) load by name: the ones they also
    set too (`THRESHOLD = THRESHOLD` reads the global before the class binds its own)."""
    import dis

    found: set[str] = set()
    for inner in code.co_consts:
        if isinstance(inner, types.CodeType):
            found |= {step.argval for step in dis.get_instructions(inner) if step.opname == "LOAD_NAME"}
            found |= _class_body_names(inner)
    return frozenset(found)


_UNSEEN: Any = object()


def main_by_value_in_pools() -> None:
    """In a worker: the caller's `__main__` is not this process's, so a node that hands a script's
    or notebook's function to a process pool of its own (multiprocessing, concurrent.futures)
    would send it by a name its pool's processes cannot find (`__main__.helper`). multiprocessing
    pickles what it sends with `ForkingPickler`; from here on, functions and classes of
    `__main__` go by value there (cloudpickle), whatever the pool's start method. Imported up
    front, in the fork server, rather than patched as a node first imports multiprocessing (about
    1 ms of a first map): a finder that a node or a library puts first on `sys.meta_path` would
    skip that patch, and the node's pool would not find the script's functions."""
    from multiprocessing.reduction import ForkingPickler

    def by_value(self: Any, obj: Any) -> Any:
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__":
            return cloudpickle.loads, (cloudpickle.dumps(obj, protocol=5),)
        return NotImplemented

    ForkingPickler.reducer_override = by_value  # type: ignore[method-assign]


def _reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    """The code of a function sent by value keeps its file name, where cloudpickle writes
    "<dynamic-code>", so a worker's crash stack names the user's file and line; the source of a file
    that is not on disk (a notebook cell) travels too, for linecache. marshal keeps the whole code
    object (nested functions included); parent and workers run the same interpreter."""
    name = code.co_filename
    entry: Any = None if os.path.exists(name) else linecache.cache.get(name)
    lines = entry[2] if entry is not None and len(entry) == 4 else None
    return _code, (marshal.dumps(code), name, lines)


def _code(data: bytes, filename: str, lines: list[str] | None) -> types.CodeType:
    if lines and filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    code: types.CodeType = marshal.loads(data)
    return code


class _Lifted:
    """A big bytes or bytearray, pickled as a PickleBuffer so that it can travel out of band. It
    comes back as its own type, copied out of the segment: neither type can be a view of one."""

    __slots__ = ("value",)

    def __init__(self, value: bytes | bytearray):
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self.value), (pickle.PickleBuffer(self.value),)


def _lift(obj: Any, seen: dict[int, Any]) -> Any:
    """`obj` with its bytes and bytearrays of `THRESHOLD` bytes or more (itself, or in its dicts,
    lists and tuples: a node's inputs and outputs) wrapped; `obj` itself where there are none."""
    kind = type(obj)
    if kind not in (bytes, bytearray, dict, list, tuple):
        return obj
    if id(obj) in seen:  # shared (or cyclic) references stay shared
        return seen[id(obj)]
    seen[id(obj)] = obj
    if kind is bytes or kind is bytearray:
        new: Any = _Lifted(obj) if len(obj) >= THRESHOLD else obj
    elif kind is dict:
        new = {key: _lift(value, seen) for key, value in obj.items()}
        new = obj if all(new[key] is value for key, value in obj.items()) else new
    else:
        new = kind(_lift(value, seen) for value in obj)
        new = obj if all(a is b for a, b in zip(new, obj)) else new
    seen[id(obj)] = new
    return new

"""How values are pickled to cross a process: pickle where it can, cloudpickle for functions and
anything from `__main__` (workers never import the user's main script, so its classes and
functions travel by value), code keeping its file name and line numbers (`_reduce_code`), so crash
stacks name the user's lines; and, to and from hardy's own workers, big torch tensors and
bytes-likes offered as out-of-band buffers like numpy's (`out_of_band`, `shipping.transport`);
and what the libraries' own pickling drops kept: a tensor's `.grad` (`_reduce_tensor`), an ndarray
subclass's instance attributes (`_reduce_array`); an open text file refused, as a binary one is,
where cloudpickle would send a `StringIO` copy of it (`ByValuePickler`).
"""

from __future__ import annotations

import copyreg
import io
import linecache
import marshal
import operator
import os
import pickle
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from ..buffers import THRESHOLD, big_buffer


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
            data = _kept().dump(obj, _in_band)  # pickle another way here: `_reductions`)
        else:  # the same pickle, from C alone (a memoryview, which `_reductions` handles, fails it)
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
    others do too: a plain CPU torch tensor of `THRESHOLD` bytes or more (`_reduce_tensor`), bytes,
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
    """One pickling into `file`, with the reductions of `_reductions` ahead of everyone else's."""
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
    """copyreg's reductions, with `_reductions` ahead of them."""
    return _Table({**copyreg.dispatch_table, **_reductions()})


def _in_band_table() -> dict[Any, Any]:
    """`_dispatch_table` for a pickle that keeps every buffer in band: a tensor pickled as torch
    pickles it (its `.grad` kept), not as a buffer for the transport."""
    table = _dispatch_table()
    torch = sys.modules.get("torch")
    if torch is not None:
        table[torch.Tensor] = _reduce_tensor_as_torch
    return table


class _Table(dict):  # type: ignore[type-arg]
    """A C pickler's dispatch table that also finds hardy's reduction for a subclass (of
    `numpy.ndarray`, of `torch.Tensor`: `_subclass_reduction`), which a lookup by exact type cannot
    name in advance. The pickler looks every type up once per object; a type the table lacks is
    decided here once and kept: another type gets the pickler's own default (`__reduce_ex__(5)`,
    called from C), a class of another metaclass its name (as the pickler's `save_global`). So no
    object costs a Python call past its type's first."""

    def __missing__(self, kind: type) -> Any:
        found = _subclass_reduction(kind)
        if found is None:
            found = _BY_NAME if issubclass(kind, type) else _DEFAULT
        if len(self) < 4096:  # (types made at run time, without end: decided anew past that)
            self[kind] = found
        return found


_DEFAULT = operator.methodcaller("__reduce_ex__", 5)  # what the C pickler does without a table entry
_BY_NAME = operator.attrgetter("__qualname__")  # a string: the pickler saves the object as a global


def _subclass_reduction(kind: type) -> Callable[[Any], Any] | None:
    """hardy's reduction for objects of `kind` that `_reductions` cannot list by exact type: a
    tensor subclass (a `nn.Parameter`: its grad), an ndarray subclass that pickles as numpy does
    (its instance attributes), a module of its own class (`_reduce_module`); None for any other type."""
    if issubclass(kind, types.ModuleType) and kind is not types.ModuleType:
        return _reduce_module
    if _looks_itself_up(kind):
        return _reduce_past_getattr
    try:
        torch = sys.modules.get("torch")
        if torch is not None and issubclass(kind, torch.Tensor) and kind is not torch.Tensor:
            return _reduce_tensor_as_torch
        numpy = sys.modules.get("numpy")
        if (numpy is not None and issubclass(kind, numpy.ndarray) and kind is not numpy.ndarray
                and not issubclass(kind, numpy.memmap)  # (its attributes are its file's mapping: the data travels)
                and kind.__reduce_ex__ is numpy.ndarray.__reduce_ex__
                and kind.__reduce__ is numpy.ndarray.__reduce__):
            return _reduce_array
    except Exception:  # (a metaclass whose subclass check raises: the pickler's own way)
        pass
    return None


def _looks_itself_up(kind: type) -> bool:
    """Whether `kind` pickles the default way and has a `__getattr__` of its own, which pickle's
    look-up of `__setstate__` on a new instance reaches before its state is set."""
    try:
        return (kind.__reduce_ex__ is object.__reduce_ex__ and kind.__reduce__ is object.__reduce__  # type: ignore[comparison-overlap]
                and getattr(kind, "__setstate__", None) is None
                and any("__getattr__" in vars(c) for c in kind.__mro__[:-1]))
    except Exception:  # (a metaclass that raises: the pickler's own way)
        return False


def _reduce_past_getattr(obj: Any) -> Any:
    """An instance of such a class (`_looks_itself_up`: pydantic's `ConfigWrapper`, which a
    `@validate_call` function holds, answers `self.config_dict[name]`) reduced as pickle would,
    with a state setter of its own: pickle would look `__setstate__` up on the new, empty
    instance, its `__getattr__` would read `config_dict`, and so on until the recursion limit."""
    reduced = obj.__reduce_ex__(5)
    if isinstance(reduced, str) or len(reduced) < 3 or reduced[2] is None:
        return reduced
    func, args, state, items, entries = (*reduced, None, None)[:5]
    return func, args, state, items, entries, _set_default_state


def _set_default_state(obj: Any, state: Any) -> None:
    """What pickle's BUILD does with a state when the object has no `__setstate__`."""
    attributes, slots = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
    if attributes:
        obj.__dict__.update(attributes)
    for name, value in (slots or {}).items():
        object.__setattr__(obj, name, value)


def _reduce_module(module: types.ModuleType) -> Any:
    """A module that replaced itself in `sys.modules` with an instance of its own subclass, for
    properties (`torch.backends.cudnn`), by reference, as cloudpickle sends a plain module: it finds
    submodules that a function's attribute chains reach in `sys.modules`, and would pickle such an
    object's attributes instead (which fails). Any other: pickle's own way."""
    name = module.__name__
    if name != "__main__" and sys.modules.get(name) is module:
        return cloudpickle.cloudpickle.subimport, (name,)
    return NotImplemented


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
    """cloudpickle's pickler with `_reductions` first: its class-level dispatch table hides the
    C pickler's, so they go in its `reducer_override` (the by-value path is the slow one anyway)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ours: dict[type, Callable[[Any], Any] | None] = dict(_reductions())

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        reduce = self.ours.get(kind, _UNSEEN)
        if reduce is _UNSEEN:
            reduce = self.ours[kind] = _subclass_reduction(kind)
        if reduce is not None:
            return reduce(obj)
        if kind is types.CodeType:
            return _reduce_code(obj)
        if kind is io.TextIOWrapper and obj is not sys.stdout and obj is not sys.stderr:
            # cloudpickle would send a StringIO of what is left to read: another object than the
            # file the node has in this process. Refused as pickle refuses a binary file.
            raise TypeError(f"cannot pickle {kind.__module__ + '.' + kind.__qualname__!r} object")
        return super().reducer_override(obj)


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


def _reductions() -> dict[type, Callable[[Any], Any]]:
    """By exact type, so that the C pickler calls no Python for any other object; torch's only
    once something imported it (checking never imports it)."""
    torch = sys.modules.get("torch")
    found: dict[type, Callable[[Any], Any]] = {memoryview: _reduce_memoryview}
    if torch is not None:
        found[torch.Tensor] = _reduce_tensor
    return found


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


def _reduce_memoryview(view: memoryview) -> tuple[Any, ...]:
    """A memoryview (which pickle refuses) travels as its bytes: out of band when big, so that it
    arrives as a writable view of the shared pages, with its format and shape (`_memoryview`)."""
    data = pickle.PickleBuffer(view) if view.c_contiguous else view.tobytes()
    return _memoryview, (data, view.format, view.shape)


def _memoryview(data: Any, format: Any, shape: tuple[int, ...]) -> memoryview:
    flat = memoryview(data).cast("B")
    try:
        view: memoryview = flat.cast(format, shape)
        return view
    except (TypeError, ValueError):  # a format `cast` cannot make (a struct's, say): flat bytes
        return flat


_exporters: weakref.WeakValueDictionary[tuple[int, int], Any] = weakref.WeakValueDictionary()


def _reduce_tensor(tensor: Any) -> Any:
    """A plain CPU tensor of `THRESHOLD` bytes or more travels as a PickleBuffer of its bytes,
    plus dtype, shape and requires_grad: out of band, so that it arrives as a view of the shared
    pages (`_tensor`), where torch would have written a copy of its storage into the pickle. Any
    other tensor (not contiguous, not on the CPU, sparse, quantized, named, conjugated, part of an
    autograd graph, with attributes of its own) is pickled the way torch does it. Either way its
    `.grad`, which torch's pickling drops, travels with it (`_with_grad`)."""
    data = _tensor_bytes(tensor)
    if data is None:
        return _reduce_tensor_as_torch(tensor)
    reduced = _tensor, (pickle.PickleBuffer(data), tensor.dtype, tuple(tensor.shape), tensor.requires_grad)
    return _with_grad(tensor, reduced)


def _reduce_tensor_as_torch(tensor: Any) -> Any:
    """A tensor (or a subclass's: a `nn.Parameter`) pickled as torch pickles it, its grad kept."""
    return _with_grad(tensor, tensor.__reduce_ex__(5))


def _with_grad(tensor: Any, reduced: Any) -> Any:
    """`reduced` (the tensor's reduction) with its grad, set once the tensor is rebuilt (a grad
    is not part of torch's pickle: a saliency map, a gradient a node computed, would arrive None).
    A tensor outside autograd's leaves holds none unless it retains it; its `.grad` is not read
    (it warns)."""
    if not (tensor.is_leaf or tensor.retains_grad):
        return reduced
    grad = tensor.grad
    if grad is None:
        return reduced
    return _with_state(reduced, grad, _set_grad)


def _set_grad(tensor: Any, grad: Any) -> None:
    tensor.grad = grad


def _with_state(reduced: Any, extra: Any, setter: Callable[[Any, Any], None]) -> Any:
    """The reduction `reduced`, extended with `setter(obj, extra)` once its own state is set
    (pickle's state setter, run after the object is memoized: `extra` may refer to it)."""
    if isinstance(reduced, str):  # (a global: nothing to add to)
        return reduced
    func, args, state, items, entries, setter_of_its_own = (*reduced, None, None, None, None)[:6]
    return func, args, (state, setter_of_its_own, extra, setter), items, entries, _set_both


def _set_both(obj: Any, states: tuple[Any, Any, Any, Callable[[Any, Any], None]]) -> None:
    """The object's own state set as pickle's BUILD sets it, then hardy's (`_with_state`). Only
    arrays and tensors come here: a state of theirs has a `__setstate__` (numpy's) or none."""
    state, setter, extra, ours = states
    if setter is not None:
        setter(obj, state)
    elif state is not None:
        obj.__setstate__(state)
    ours(obj, extra)


def _reduce_array(array: Any) -> Any:
    """An ndarray subclass's instance as numpy pickles it (the subclass, its data), plus the
    attributes it holds (numpy's pickle drops them: `meta` set in `__array_finalize__`, as numpy's
    subclassing guide does, would arrive None), set after numpy's state, once the instance is made."""
    reduced = array.__reduce_ex__(5)
    attributes = getattr(array, "__dict__", None)
    if not attributes:
        return reduced
    return _with_state(reduced, dict(attributes), _set_attributes)


def _set_attributes(obj: Any, attributes: dict[str, Any]) -> None:
    obj.__dict__.update(attributes)


def _tensor_bytes(tensor: Any) -> Any:
    """The tensor's bytes as a uint8 numpy array (which exports buffers: no torch type does), the
    same one while it lives, so that a tensor every item shares is recognised (`transport.Shared`)."""
    torch = sys.modules["torch"]
    try:  # the layout first: a sparse tensor has no `nbytes`, and a kind torch adds later may lack more
        if (tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_nested or not tensor.is_cpu
                or tensor.nbytes < THRESHOLD or not tensor.is_contiguous() or not tensor.is_leaf
                or tensor.is_conj() or tensor.is_neg() or any(getattr(tensor, "names", ())) or tensor.__dict__):
            return None
    except (RuntimeError, AttributeError, NotImplementedError):  # pickled the way torch does it
        return None
    key = (tensor.data_ptr(), tensor.nbytes)  # an exporter keeps its tensor, so its address, alive
    data = _exporters.get(key)
    if data is None:
        try:
            data = _exporters[key] = tensor.detach().reshape(-1).view(torch.uint8).numpy()
        except RuntimeError:  # torch without numpy
            return None
    return data


def _tensor(data: Any, dtype: Any, shape: tuple[int, ...], requires_grad: bool) -> Any:
    """The tensor `_reduce_tensor` described, over `data` (the mapped segment: no copy, writable)."""
    import torch
    tensor = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
    return tensor.requires_grad_(requires_grad)

"""What hardy's picklers do for the objects whose own pickling loses part of them or cannot be
read back (`shipping.pickling` puts these first): big CPU tensors and memoryviews offered as
out-of-band buffers (`_reduce_tensor`: a view of the shared pages where they land), a tensor's
`.grad` and an ndarray subclass's instance attributes kept, an object whose `__getattr__` reads its
own attributes rebuilt without the look-up that recursed (pydantic's `ConfigWrapper`), and a module
that made itself an instance of its own class sent by reference (`torch.backends.cudnn`), as is
`os.environ` held as a global (`from os import environ`); a `functools.cached_property` rebuilt
without the lock Python 3.11 gives it. A proxy that poses as what it wraps (its `__class__` is not
its type: a `wrapt` decorator's wrapper) travels whole, never as what it wraps (`reduce_posing`), and
an `lru_cache` function of a script by its function, with an empty cache (`_reduce_lru_cached`), and
a `functools.singledispatch` function of a script by its function and its registrations
(`reduce_singledispatch`).
"""

from __future__ import annotations

import copyreg
import functools
import importlib
import os
import pickle
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from ..buffers import THRESHOLD
from ..errors import PicklingError
from ..hashing.callables import wrapper_parts
from ..hashing.values import member_attributes


def subclass_reduction(kind: type) -> Callable[[Any], Any] | None:
    """hardy's reduction for objects of `kind` that `reductions` cannot list by exact type: a
    tensor subclass (a `nn.Parameter`: its grad), an ndarray subclass that pickles as numpy does
    (its instance attributes), a module of its own class (`_reduce_module`), an object whose
    `__getattr__` reads its own attributes (`_reduce_past_getattr`); None for any other type, and
    for one registered with copyreg (its own way)."""
    if kind in copyreg.dispatch_table:  # (registered with copyreg: its own way)
        return None
    if poses(kind):
        return reduce_posing
    module = types.ModuleType
    if (issubclass(kind, module) and kind is not module
            and kind.__reduce_ex__ is module.__reduce_ex__ and kind.__reduce__ is module.__reduce__):
        return _reduce_module
    if _looks_itself_up(kind):
        return _reduce_past_getattr
    try:
        torch = sys.modules.get("torch")
        if torch is not None and issubclass(kind, torch.Tensor) and kind is not torch.Tensor:
            return reduce_tensor_as_torch
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
    look-up of `__setstate__` on a new instance reaches before its state is set. Not a metaclass
    (an `Enum`'s, with a `__getattr__`): a class travels by reference or as cloudpickle sends it."""
    try:
        return (not issubclass(kind, type) and kind.__reduce_ex__ is object.__reduce_ex__
                and kind.__reduce__ is object.__reduce__ and getattr(kind, "__setstate__", None) is None
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
    return module.__reduce_ex__(5)  # (pickle's own way, and its refusal)


def reductions() -> dict[type, Callable[[Any], Any]]:
    """By exact type, so that the C pickler calls no Python for any other object; torch's only
    once something imported it (checking never imports it)."""
    torch = sys.modules.get("torch")
    found: dict[type, Callable[[Any], Any]] = {memoryview: _reduce_memoryview, type(os.environ): _reduce_environ,
                                              functools.cached_property: _reduce_cached_property,
                                              _LRU_CACHED: _reduce_lru_cached}
    if torch is not None:
        found[torch.Tensor] = _reduce_tensor
    return found


def _reduce_environ(environ: Any) -> Any:
    """`os.environ` (or `environb`) that a script's function holds as a global (`from os import
    environ`) by reference: the worker's own, which carries the caller's variables (`Context`) and
    which `os.getenv` and the processes a node starts read. Pickled by value it was a copy: a
    variable the node set in it was invisible to `os.getenv` in the worker."""
    for name in ("environ", "environb"):
        if environ is getattr(os, name, None):
            return _environment, (name,)
    return environ.__reduce_ex__(5)  # (another mapping of that class: pickle's own way)


def _environment(name: str) -> Any:
    return getattr(os, name)


def _reduce_cached_property(prop: functools.cached_property[Any]) -> Any:
    """A `functools.cached_property` of a class sent by value (a script's class whose method is a
    node): on Python 3.11 it holds a lock, which no pickle takes. Rebuilt from its function and the
    name its class set it under (`__set_name__`, which rebuilding the class does not call again)."""
    return _cached_property, (prop.func, prop.attrname, prop.__doc__)


def _cached_property(func: Callable[[Any], Any], name: str | None, doc: str | None) -> Any:
    prop = functools.cached_property(func)
    prop.attrname, prop.__doc__ = name, doc
    return prop


def poses(kind: type) -> bool:
    """Whether objects of `kind` answer another class than their own to `__class__` (a proxy:
    wrapt's, a mock's), so that `isinstance(proxy, types.FunctionType)` holds. cloudpickle and
    `shipping.payload` ask `isinstance` and would pickle such an object as the function it wraps:
    the proxy's own code (a decorator's wrapper) would not run in a worker. A class is no proxy."""
    try:
        return not issubclass(kind, type) and any("__class__" in vars(c) for c in kind.__mro__[:-1])
    except Exception:  # (a metaclass that raises: the pickler's own way)
        return False


def reduce_posing(obj: Any, by_name: bool = True) -> Any:
    """A proxy that poses as what it wraps, whole: a wrapt function wrapper (`@wrapt.decorator`) by
    its parts (`_function_wrapper`), or, `by_name`, as the name its module binds it to, where a
    worker imports it (`named`); any other by its own type's pickling, made without pickle's check
    of `__class__` (which refuses every proxy) and without looking `__setstate__` up through the
    proxy (it would ask the object it wraps). One whose pickling fails is refused, named, with the fix."""
    where = _function_wrapper(type(obj))
    if where is not None:
        name = named(obj) if by_name else None
        if name is not None:
            return name
        parts = wrapper_parts(obj)
        return _wrapper_shell, (where,), (obj.__wrapped__, parts), None, None, _wrapper_filled
    try:
        reduced = obj.__reduce_ex__(5)
    except Exception as exc:
        raise PicklingError(_posing_refusal(obj, exc)) from exc
    if isinstance(reduced, str) or len(reduced) < 2:
        return reduced
    func, args, state, items, entries, setter = (*reduced, None, None, None, None)[:6]
    if func is copyreg.__newobj__:  # type: ignore[attr-defined]
        func, args = _made, (args[0], args[1:], {})
    elif func is copyreg.__newobj_ex__:  # type: ignore[attr-defined]
        func, args = _made, tuple(args)
    if state is not None and setter is None and getattr(type(obj), "__setstate__", None) is None:
        setter = _set_default_state
    return func, args, state, items, entries, setter


def _posing_refusal(obj: Any, exc: Exception) -> str:
    kind, claimed = type(obj), obj.__class__
    module, name = getattr(claimed, "__module__", None), getattr(claimed, "__qualname__", repr(claimed))
    posing = name if module in ("builtins", None) else f"{module}.{name}"
    wrapt = kind.__module__.partition(".")[0] == "wrapt"
    fix = ("define the decorator (or the class holding it) in a module your script imports, which a worker imports "
           "by name" if wrapt else "give its class a __reduce__ that rebuilds it")
    return (f"a {kind.__module__}.{kind.__qualname__} object posing as a {posing} (a proxy) cannot be pickled "
            f"as itself ({type(exc).__name__}: {exc}), and sent as what it wraps it "
            f"would run without its own code in the worker. To fix: {fix}, apply it inside the node, or run this "
            "pipeline in-process (Engine(map_executor=\"sequential\") or \"threaded\")")


def made_with_its_class(cls: type, reduced: Any) -> Any:
    """cloudpickle's reduction of a class by value, with what only a `class` statement can give in
    the namespace it is made with (`_AT_CREATION`): the `__class__` a proxy defines (set after, with
    the rest of its members, it would change the class's own class: TypeError in the worker), and
    `__slots__` (set after, the class made anew had no slots: its instances held a `__dict__`, and
    one sent back to the caller, whose own class is slotted, could not be unpickled there)."""
    own = vars(cls)
    moved = {k: own[k] for k in _AT_CREATION if k in own}
    if (not moved or not isinstance(reduced, tuple) or len(reduced) < 3
            or reduced[0] is not cloudpickle.cloudpickle._make_skeleton_class):
        return reduced
    make, (kind, name, bases, kwargs, *rest), (members, slots), *after = reduced
    members = {k: v for k, v in members.items() if k not in moved}
    return (make, (kind, name, bases, {**kwargs, **moved}, *rest), (members, slots), *after)


_AT_CREATION = ("__class__", "__slots__")


def _made(kind: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What `copyreg.__newobj__` makes, unpickled as a plain call (pickle checks that the class
    given is the object's `__class__` before it writes NEWOBJ, and a proxy answers another)."""
    return kind.__new__(kind, *args, **kwargs)


# wrapt's function wrappers, by where a worker finds their type (its C types' `__module__` is "builtins")
_WRAPPERS = (("wrapt", "FunctionWrapper"), ("wrapt", "BoundFunctionWrapper"),
             ("wrapt.wrappers", "FunctionWrapper"), ("wrapt.wrappers", "BoundFunctionWrapper"))


def _function_wrapper(kind: type) -> tuple[str, str] | None:
    """Where a worker finds `kind` when it is one of wrapt's function wrappers (C or pure Python),
    which hold nothing besides `_WRAPPER_PARTS`; None for any other type (a subclass may hold more)."""
    if "wrapt" not in sys.modules:
        return None
    for module_name, name in _WRAPPERS:
        if getattr(sys.modules.get(module_name), name, None) is kind:
            return module_name, name
    return None


def _wrapper_shell(where: tuple[str, str]) -> Any:
    kind = getattr(importlib.import_module(where[0]), where[1])
    return kind.__new__(kind)


def _wrapper_filled(made: Any, state: tuple[Any, dict[str, Any]]) -> None:
    """A wrapper `_wrapper_shell` made, given what the caller's wraps and holds (after it is
    memoized: the instance of a bound wrapper may hold it)."""
    wrapped, parts = state
    base: Any = next(c for c in type(made).__mro__ if c.__name__ == "_FunctionWrapperBase")
    base.__init__(made, wrapped, **parts)


def named(obj: Any) -> str | None:
    """`obj`'s qualified name where pickling it by name finds `obj` itself in a worker, as
    cloudpickle decides for a function: its module imported by name, not `__main__` (never the
    worker's), not registered to travel by value, not made at run time (no import spec)."""
    module_name, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or module_name == "__main__":
        return None
    module = sys.modules.get(module_name)
    by_value = cloudpickle.list_registry_pickle_by_value()
    if (module is None or getattr(module, "__spec__", None) is None or "<locals>" in qualname
            or any(module_name == m or module_name.startswith(m + ".") for m in by_value)):
        return None
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return qualname if found is obj else None


_LRU_CACHED = type(functools.lru_cache(maxsize=None)(len))


def _reduce_lru_cached(func: Any, by_name: bool = True) -> Any:
    """An `lru_cache` (or `functools.cache`) function: by name where a worker imports it (`named`),
    else by the function it caches, its size and typing and the attributes set on it, made again
    with an empty cache: a script's was pickled by a name (`__main__.load_vocab`) that no worker
    has. Each process's cache is its own, as in any process pool."""
    name = named(func) if by_name else None
    if name is not None:
        return name
    parameters = func.cache_parameters()
    attributes = {k: v for k, v in vars(func).items() if k not in ("__wrapped__", "cache_parameters")}
    return _lru_cached, (func.__wrapped__, parameters["maxsize"], parameters["typed"], attributes)


def _lru_cached(func: Callable[..., Any], maxsize: int | None, typed: bool, attributes: dict[str, Any]) -> Any:
    made = functools.lru_cache(maxsize=maxsize, typed=typed)(func)
    vars(made).update(attributes)
    return made


_SINGLEDISPATCH = functools.singledispatch(len).__code__  # type: ignore[attr-defined]  # (of every one)


def is_singledispatch(obj: Any) -> bool:
    return type(obj) is types.FunctionType and obj.__code__ is _SINGLEDISPATCH


def reduce_singledispatch(func: Any) -> Any:
    """A `functools.singledispatch` function: by name where a worker imports it (`named`), else by the
    function it dispatches from, its registrations and the attributes set on it, made again with an
    empty dispatch cache: by value, its closure held that cache (a `WeakKeyDictionary`, which does
    not pickle), and a script's such function stopped the default executor."""
    name = named(func)
    if name is not None:
        return name
    registered = [(kind, impl) for kind, impl in func.registry.items() if kind is not object]
    own = {k: v for k, v in vars(func).items() if k not in _SINGLEDISPATCH_OWN}
    return _singledispatched, (func.__wrapped__, registered, own)


_SINGLEDISPATCH_OWN = frozenset({"register", "dispatch", "registry", "_clear_cache", "__wrapped__"})


def _singledispatched(func: Callable[..., Any], registered: list[tuple[Any, Any]], own: dict[str, Any]) -> Any:
    made = functools.singledispatch(func)
    for kind, impl in registered:
        made.register(kind, impl)
    vars(made).update(own)
    return made


def whole(obj: Any) -> Any:
    """The reduction of a module's own binding (`shipping.payload`'s root) that is a proxy posing as
    what it wraps, or an `lru_cache` function: by its parts, never by its name (that name finds the
    worker's own, which the caller's replaces); None for any other object."""
    kind = type(obj)
    if kind is _LRU_CACHED:
        return _reduce_lru_cached(obj, by_name=False)
    if poses(kind) or (kind is not types.FunctionType and isinstance(obj, types.FunctionType)):
        return reduce_posing(obj, by_name=False)
    return None


def with_member_attributes(cls: Any, reduced: Any) -> Any:
    """The reduction of an Enum class sent by value (a script's) with what its members hold
    besides name and value (`Unit.KG.scale = 2`), which cloudpickle's leaves out; `reduced` as it
    is when no member holds anything."""
    attributes = {m.name: member_attributes(m) for m in cls}
    if not any(attributes.values()) or not isinstance(reduced, tuple) or len(reduced) < 3:
        return reduced
    return _with_state(reduced, attributes, _set_member_attributes)


def _set_member_attributes(cls: Any, attributes: dict[str, dict[str, Any]]) -> None:
    """The caller's members' attributes set on this process's members (a class cloudpickle made
    before in this process is that one again: what it holds since the caller dropped goes)."""
    for name, held in attributes.items():
        member = cls[name]
        for gone in set(member_attributes(member)) - set(held):
            delattr(member, gone)
        vars(member).update(held)


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


# How many tensors attached to an autograd graph (`grad_fn`) were pickled in this process: a worker
# compares it before and after pickling a batch of results (`workers.replies.Replies.send`).
ATTACHED = [0]
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
        return reduce_tensor_as_torch(tensor)
    reduced = _tensor, (pickle.PickleBuffer(data), tensor.dtype, tuple(tensor.shape), tensor.requires_grad)
    return _with_grad(tensor, reduced)


def reduce_tensor_as_torch(tensor: Any) -> Any:
    """A tensor (or a subclass's: a `nn.Parameter`) pickled as torch pickles it, its grad kept."""
    return _with_grad(tensor, tensor.__reduce_ex__(5))


def _with_grad(tensor: Any, reduced: Any) -> Any:
    """`reduced` (the tensor's reduction) with its grad, set once the tensor is rebuilt (a grad
    is not part of torch's pickle: a saliency map, a gradient a node computed, would arrive None).
    A tensor outside autograd's leaves holds none unless it retains it; its `.grad` is not read
    (it warns). Such a tensor is a node's result attached to its autograd graph (a loss), which
    cannot cross a process: it arrives a leaf, and `backward()` on it reaches no parameter. It is
    counted (`ATTACHED`), for a worker's replies to say so (`workers.replies`); a leaf costs the
    one check it cost before."""
    if not tensor.is_leaf:
        ATTACHED[0] += 1
        if not tensor.retains_grad:
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
    arrays, tensors and Enum classes come here: a state of theirs has a `__setstate__` (numpy's),
    a setter of its own (cloudpickle's, for a class) or none."""
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
    return _with_state(reduced, dict(attributes), _set_default_state)


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

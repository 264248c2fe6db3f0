"""What hardy's picklers do for the objects whose own pickling loses part of them or cannot be
read back (`shipping.pickling` puts these first): big CPU tensors and memoryviews offered as
out-of-band buffers (`_reduce_tensor`: a view of the shared pages where they land), a tensor's
`.grad` and an ndarray subclass's instance attributes kept, an object whose `__getattr__` reads its
own attributes rebuilt without the look-up that recursed (pydantic's `ConfigWrapper`), and a module
that made itself an instance of its own class sent by reference (`torch.backends.cudnn`), as is
`os.environ` held as a global (`from os import environ`); a `functools.cached_property` rebuilt
without the lock Python 3.11 gives it.
"""

from __future__ import annotations

import copyreg
import functools
import os
import pickle
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from ..buffers import THRESHOLD


def subclass_reduction(kind: type) -> Callable[[Any], Any] | None:
    """hardy's reduction for objects of `kind` that `reductions` cannot list by exact type: a
    tensor subclass (a `nn.Parameter`: its grad), an ndarray subclass that pickles as numpy does
    (its instance attributes), a module of its own class (`_reduce_module`), an object whose
    `__getattr__` reads its own attributes (`_reduce_past_getattr`); None for any other type, and
    for one registered with copyreg (its own way)."""
    if kind in copyreg.dispatch_table:  # (registered with copyreg: its own way)
        return None
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
                                              functools.cached_property: _reduce_cached_property}
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

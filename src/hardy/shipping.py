"""What crosses a process (or machine) boundary: a plan's spec, chunks of items, results.

A plan travels as its spec — graph, provided names, outputs, cache — pickled once with cloudpickle
and compiled again on the other side (`build_plan`), never as generated code. Nodes defined at
module level travel by reference, like plain functions (the worker imports the user's module);
the others (a script's, a notebook's, `python -`'s) by value, their code keeping its file name
and line numbers (`_reduce_code`), so crash stacks name the user's lines either way;
`ship_modules=` sends a module by value. Items travel with
pickle (cloudpickle when they hold functions); to and from hardy's own workers, big torch tensors
and bytes-likes become out-of-band buffers like numpy's (`out_of_band`, `hardy.transport`).
Anything that cannot travel gets an error naming the node or the input and the remedy, before
anything is sent.
"""

from __future__ import annotations

import copyreg
import io
import linecache
import marshal
import os
import pickle
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from importlib.machinery import SourceFileLoader
from typing import Any

import cloudpickle

from .errors import NodeError, PicklingError, ShippingError, UnhashableError, rebuilt_exception
from .hashing import Reach, is_user_module, module_stamp, recording
from .plan import Plan, Wrap
from .transport import THRESHOLD


def ship_plan(plan: Plan) -> bytes:
    try:
        file = io.BytesIO()
        _ByValue(file, protocol=5).dump((_Modules(_stamps(plan)), plan.graph, plan.provided, plan.outputs, plan.cache,
                                         plan.keyed))
        return file.getvalue()
    except Exception as exc:
        raise PicklingError(_unpicklable_node(plan, exc)) from exc


def build_plan(spec: bytes, wrap: Wrap | None = None,
               on_cached: Callable[[str, bytes, int | None], None] | None = None) -> Plan:
    _, graph, provided, outputs, cache, keyed = cloudpickle.loads(spec)
    return Plan(graph, provided, outputs, "sequential", wrap=wrap, cache=cache, keyed=keyed, on_cached=on_cached)


def _stamps(plan: Plan) -> dict[str, dict[str, bytes]]:
    """The stamps (`module_stamp`) of what the plan's nodes reach in user modules, as the parent
    has them now. Modules loaded by another loader than Python's own (pytest's assertion
    rewriting changes their bytecode) cannot be compared with the worker's import and are left out."""
    reach = Reach()
    previous = recording(reach)
    try:
        for step in plan.steps:
            try:
                step.node.fingerprint()
            except UnhashableError:
                pass
    finally:
        recording(previous)
    by_value = cloudpickle.list_registry_pickle_by_value()  # `ship_modules`: their code travels with the plan
    modules = {id(vars(m)): m for m in map(sys.modules.get, sorted(reach.modules))
               if m is not None and is_user_module(m.__name__) and m.__name__.split(".")[0] not in by_value
               and m.__name__ not in by_value and isinstance(getattr(m, "__loader__", None), SourceFileLoader)}
    names: dict[str, set[str]] = {}
    for namespace, name, _ in reach.reads:
        if id(namespace) in modules:
            names.setdefault(modules[id(namespace)].__name__, set()).add(name)
    return {m: module_stamp(sys.modules[m], sorted(n)) for m, n in names.items()}


class _Modules:
    """First in a plan's spec: unpickled before the nodes, in the worker, it makes the user
    modules there the parent's (`_same_modules`), so that nodes travelling by reference find
    the code the parent runs."""

    def __init__(self, stamps: dict[str, dict[str, bytes]]):
        self.stamps = stamps

    def __reduce__(self) -> tuple[Any, ...]:
        return (_same_modules, (self.stamps,))


def _same_modules(stamps: dict[str, dict[str, bytes]]) -> None:
    """A module the parent reloaded (or a notebook changed) since this worker imported it is
    reloaded here; one that still differs (its file edited since the parent loaded it) is an
    error naming it, never other code run in its place."""
    import importlib
    for name, stamp in stamps.items():
        module = sys.modules.get(name) or importlib.import_module(name)
        if module_stamp(module, stamp) == stamp:
            continue
        module = importlib.reload(module)
        mine = module_stamp(module, stamp)
        if mine != stamp:
            what = sorted(n for n in {*stamp, *mine} if stamp.get(n) != mine.get(n))
            raise ImportError(f"module {name!r} differs between the parent and this worker ({', '.join(what[:5])}): "
                              "its file was edited since the parent loaded it, or the parent changed it in memory; "
                              f"importlib.reload({name}) in the parent (or restore the file) and map again")


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


def _pickled(obj: Any, buffer_callback: Callable[[Any], bool] | None, by_value: bool) -> bytes:
    if buffer_callback is not None:
        return out_of_band(obj, buffer_callback, by_value)
    data: bytes = cloudpickle.dumps(obj, protocol=5) if by_value else pickle.dumps(obj, protocol=5)
    return data


def out_of_band(obj: Any, buffer_callback: Callable[[Any], bool], by_value: bool = False) -> bytes:
    """`obj` pickled (protocol 5, cloudpickle if `by_value`) for `transport.pack`, which takes every
    big `PickleBuffer` out of band. numpy and Arrow pickle their memory as PickleBuffers; here the
    others do too: a plain CPU torch tensor of `THRESHOLD` bytes or more (`_reduce_tensor`), bytes,
    bytearray and memoryview. The C pickler writes bytes and bytearrays before any hook could see
    them, so the first attempt stops where it would write a big one (`_Sink`), and the pickle is
    made again with the big ones in its dicts, lists and tuples wrapped (`_lift`): a message with
    none costs no walk."""
    try:
        return _dump(obj, buffer_callback, by_value, _Sink())
    except _BigBytes:
        buffer_callback(None)
        return _dump(_lift(obj, {}), buffer_callback, by_value, io.BytesIO())


def _dump(obj: Any, buffer_callback: Callable[[Any], bool], by_value: bool, file: io.BytesIO) -> bytes:
    """One pickling into `file`, with the reductions of `_reductions` ahead of everyone else's."""
    with file:
        if by_value:
            _ByValue(file, protocol=5, buffer_callback=buffer_callback).dump(obj)
        else:
            pickler = pickle.Pickler(file, protocol=5, buffer_callback=buffer_callback)
            pickler.dispatch_table = {**copyreg.dispatch_table, **_reductions()}
            pickler.dump(obj)
        return file.getvalue()


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


class _ByValue(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle's pickler with `_reductions` first: its class-level dispatch table hides the
    C pickler's, so they go in its `reducer_override` (the by-value path is the slow one anyway)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ours = _reductions()

    def reducer_override(self, obj: Any) -> Any:
        reduce = self.ours.get(type(obj))
        if reduce is not None:
            return reduce(obj)
        if type(obj) is types.CodeType:
            return _reduce_code(obj)
        return super().reducer_override(obj)


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
    autograd graph, with attributes of its own) is pickled the way torch does it."""
    data = _tensor_bytes(tensor)
    if data is None:
        return tensor.__reduce_ex__(5)
    return _tensor, (pickle.PickleBuffer(data), tensor.dtype, tuple(tensor.shape), tensor.requires_grad)


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


def globals_in(blob: bytes) -> list[str]:
    """The classes and functions a pickle refers to (module.name), to name what failed to load."""
    import pickletools
    found: list[str] = []
    pushed: list[str | None] = []
    memo: list[str | None] = []
    top: str | None = None  # the object on top of the stack, when it is a string
    try:
        for op, arg, _ in pickletools.genops(blob):
            if op.name == "MEMOIZE":
                memo.append(top)
                continue
            top = None
            if op.name == "GLOBAL":
                found.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(pushed) >= 2:
                found.append(f"{pushed[-2]}.{pushed[-1]}")
            elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                top = arg
                pushed.append(top)
            elif op.name in ("BINGET", "LONG_BINGET") and isinstance(arg, int) and arg < len(memo):
                top = memo[arg]
                pushed.append(top)
    except Exception:  # a truncated or foreign pickle: report what was read
        pass
    return [g for g in dict.fromkeys(found) if not g.startswith(("builtins.", "copyreg.", "None"))]


def ship_items(items: Sequence[Any], indices: Sequence[int],
               wrap: Callable[[list[tuple[int, Any]]], Any] = lambda chunk: chunk,
               dump: Callable[[Any], Any] = dumps) -> tuple[Any, dict[int, Unshippable]]:
    """A chunk of (index, item) pairs pickled by `dump` (None if no item can travel), and apart,
    each item that cannot (a lock, a nesting too deep for pickle) with why: it costs that item
    only. A chunk that travels costs one pickling; only a chunk that does not is taken apart."""
    try:
        return dump(wrap([(i, items[i]) for i in indices])), {}
    except Exception as exc:
        failed = exc
    bad = {i: why for i in indices if (why := unshippable(items[i])) is not None}
    if not bad:  # each item travels alone but not together: nothing to blame one item for
        raise PicklingError(f"items {list(indices)[:5]} cannot be sent to a worker process together: "
                            f"{type(failed).__name__}: {failed}") from failed
    good = [i for i in indices if i not in bad]
    return (dump(wrap([(i, items[i]) for i in good])) if good else None), bad


Unshippable = tuple[str | None, str]  # the input that cannot be pickled (None: the item), and why


def unshippable(item: Any) -> Unshippable | None:
    """Why one item cannot be pickled for a worker (None if it can): the input, its type, the error."""
    for name, value in (item.items() if isinstance(item, dict) else [(None, item)]):
        try:
            pickle.dumps(value, protocol=5, buffer_callback=_left_out)  # (fast: most values of a chunk are fine)
            continue
        except Exception:
            pass
        try:
            dumps(value, buffer_callback=_left_out)
        except Exception as exc:
            return name, f"({described(value)}) cannot be pickled to be sent: {_first_line(exc)}"
    return None


def check_constants(items: Sequence[dict[str, Any]]) -> None:
    """Raise before anything starts if an input every item holds (a map's constant inputs) cannot
    travel: it would fail every item the same way, so it is the call that is wrong."""
    if not items:
        return
    first, last = items[0], items[-1]
    for name, value in first.items():
        if len(items) > 1 and last.get(name, first) is not value:
            continue
        try:
            dumps(value, buffer_callback=_left_out)
        except Exception as exc:
            raise PicklingError(
                f"input {name!r} ({described(value)}, given to every item) cannot be sent to a worker process: "
                f"{_first_line(exc)}. {FIX_INPUT}") from exc


FIX_INPUT = ("Pass plain data (or a path) instead, construct the object inside a node, or wrap its class with "
             "@hardy.stateful so each worker builds its own.")


def item_error(plan: Plan, i: int, why: Unshippable) -> ShippingError:
    """The failure of item i, whose input cannot be pickled (`why`, from `ship_items`/`ship_each`)."""
    name, text = why
    return ShippingError(readers(plan, name), None, i, f"input {name!r} {text}. {FIX_INPUT}" if name is not None
                         else f"the item {text}. {FIX_INPUT}")


def readers(plan: Plan, name: str | None) -> str:
    """The nodes reading input `name`; for None, those reading any input of the map (the first
    step's node, if none does)."""
    found = [s.node.name for s in plan.steps
             if any(v == name or name is None and v in plan.provided for _, v in s.args)]
    return " / ".join(dict.fromkeys(found)) or (plan.steps[0].node.name if plan.steps else "?")


def described(value: Any) -> str:
    """A value's type as module.qualname (builtins bare), for messages."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0].rstrip(".") if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _left_out(buf: Any) -> bool:
    """A buffer_callback that leaves big buffers out rather than copying them: only whether a
    value can travel is wanted."""
    return False


class Pickled:
    """An item pickled where the map was called, unpickled only in the hardy worker that runs it:
    an engine's worker (Dask, Ray, Daft) passes it on as bytes, so an item whose class cannot be
    imported there, or whose unpickling raises or crashes, costs that item in a contained worker
    (`workers.pool`), never the engine's process or the chunk."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes):
        self.blob = blob

    def __reduce__(self) -> tuple[Any, ...]:
        return pickle.loads, (self.blob,)


class Sealed:
    """One input of a chunk's item pickled on its own, inside the chunk: the worker opens the
    item's inputs one by one (`open_item`), so that one it cannot unpickle (its class missing
    there, a __setstate__ that raises or crashes) is known by item and input. Chunks are sealed
    only when sent again after their unpickling failed: sealing costs a pickling per input."""

    __slots__ = ("blob", "kind")

    def __init__(self, blob: bytes, kind: str):
        self.blob, self.kind = blob, kind  # kind: the value's type, as `described` names it

    def __reduce__(self) -> tuple[Any, ...]:
        return Sealed, (self.blob, self.kind)


def seal(item: Any) -> Any:
    """`item` (a dict of inputs, or a `Pickled` item) with each input sealed."""
    if isinstance(item, Pickled):
        return Sealed(item.blob, f"types in it: {', '.join(globals_in(item.blob)) or 'builtins only'}")
    return {name: Sealed(dumps(value), described(value)) for name, value in item.items()}


def open_input(value: Any) -> Any:
    """A sealed input's value (any other value as it is)."""
    return pickle.loads(value.blob) if isinstance(value, Sealed) else value


def unopened(plan: Plan, i: int, name: str | None, value: Any, exc: Exception) -> ShippingError:
    """The failure of item i whose input `name` (None: the whole item) could not be opened."""
    kind = value.kind if isinstance(value, Sealed) else described(value)
    what = f"input {name!r} ({kind})" if name is not None else f"input ({kind})"
    missing = exc.name if isinstance(exc, ImportError) else None
    hint = (f"; make module {missing!r} importable in the worker as it is here (it runs with this process's "
            "sys.path and working directory)" if missing else "")
    return ShippingError(readers(plan, name), None, i,
                         f"its {what} cannot be unpickled in the worker process ({_first_line(exc)}){hint}. "
                         f"{FIX_INPUT}")


def ship_each(items: Sequence[dict[str, Any]],
              indices: Sequence[int]) -> tuple[list[tuple[int, bytes]], dict[int, Unshippable]]:
    """For an engine's task: (index, the item pickled on its own) for each item of the chunk that
    can be, to be wrapped in `Pickled` where it is handed to hardy's worker; and the others, with why."""
    blobs, bad = [], {}
    for i in indices:
        try:
            blobs.append((i, dumps(items[i])))
        except Exception:
            bad[i] = unshippable(items[i]) or (None, "cannot be pickled to be sent")
    return blobs, bad


def portable(err: NodeError) -> NodeError:
    """The error, ready to cross a process: its cause's traceback kept as text in `stack` (a
    traceback does not pickle), and a cause that would not come back whole (an exception whose
    constructor takes other arguments than it passes to Exception, or holding an unpicklable
    attribute: pickle rebuilds an exception by calling its class with its `args`) replaced by a
    copy that rebuilds it on the other side (`errors.rebuilt_exception`)."""
    cause = err.__cause__
    if cause is not None and not getattr(err, "stack", ""):
        import traceback
        err.stack = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    try:
        pickle.loads(dumps(err))  # the round trip: unpickling is where such exceptions fail
        return err
    except Exception:
        err.__cause__ = _CauseCopy(cause) if cause is not None else None
        return err


class _CauseCopy(Exception):
    """What travels for an exception pickle cannot carry: where its class lives, its built-in base,
    message, `args` and attributes (those that pickle, the others as their repr)."""

    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        kind = type(exc)
        base = next((c.__name__ for c in kind.__mro__ if c.__module__ == "builtins"), "Exception")
        self.recipe = (kind.__module__, kind.__qualname__, base, _message(exc), tuple(_travelling(a) for a in exc.args),
                       {k: _travelling(v) for k, v in getattr(exc, "__dict__", {}).items()})

    def __reduce__(self) -> tuple[Any, ...]:
        return rebuilt_exception, self.recipe


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a __str__ that raises must not hide the error
        return f"<{type(exc).__name__} whose str() failed>"


def _travelling(value: Any) -> Any:
    """`value` if it survives pickling there and back, else its repr."""
    try:
        pickle.loads(dumps(value))
        return value
    except Exception:
        try:
            return repr(value)
        except Exception:
            return f"<{type(value).__name__}>"


def _unpicklable_node(plan: Plan, exc: Exception) -> str:
    for step in plan.steps:
        try:
            cloudpickle.dumps(step.node)
        except Exception as node_exc:
            return (f"node {step.node.name!r} cannot be sent to a worker process: {node_exc}. Define it "
                    "at module level or in an importable module, and keep unpicklable objects (locks, open "
                    "files, clients) out of its closure: build them inside the node or with @stateful.")
    return f"the pipeline cannot be sent to a worker process: {exc}"

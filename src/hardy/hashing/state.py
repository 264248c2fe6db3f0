"""Module state a plan reads, seen two ways: *tokens* tell this process cheaply whether a value it
read has changed in place since (a dict filled, an array written, a tensor trained), and *stamps*
let two processes compare their copies of a module, name by name, without sending the values.

Why both: a pipeline's plan is compiled once and reused while nothing it reads changes
(`Reach.changed`), and its worker processes import the user's modules themselves. Identity catches
a name bound again (a notebook cell, `importlib.reload`, `steps.WEIGHTS = ...`); a token catches the
same object changed (`STATE["add"] = 5`). A stamp is what a worker compares with its own copy of
the module before it runs the plan: code by its bytecode, values by content (docs/same-answer.md).
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import enum
import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from blake3 import blake3

from ..errors import UnhashableError
from .bytecode import code_bytes
from .classes import code_fingerprint_of
from .origin import is_user_module
from .values import ABSENT, CONTENT_TOKEN, DIGEST, encode_into, register, type_name

# Objects whose identity says everything: they cannot change in place (or, code, are compared by
# identity and recompiled when rebound), so a read of one costs one identity test per call.
_FIXED = (type(None), bool, int, float, complex, str, bytes, range, types.FunctionType, types.BuiltinFunctionType,
          types.MethodType, types.ModuleType, type, types.CodeType, frozenset)
_SCALARS = (int, float, complex, str, bytes)
RESOURCE = b"?"  # a value hardy cannot hash (a lock, a client): compared by its type alone
# Set while a token is made: a module inside a value counts by identity (`module_value`), as
# the names a plan read in it are watched by its `Reach` already, and hashing its code at every
# call would cost what compiling the plan did.
IN_PROCESS: contextvars.ContextVar[bool] = contextvars.ContextVar("hardy_in_process", default=False)


@contextlib.contextmanager
def _versions_only() -> Iterator[None]:
    """Tokens, not keys: tensors by their version counters, modules by identity."""
    from . import libraries
    token = libraries.TENSOR_VERSIONS.set([CONTENT_TOKEN])
    modules = IN_PROCESS.set(True)
    try:
        yield
    finally:
        IN_PROCESS.reset(modules)
        libraries.TENSOR_VERSIONS.reset(token)


def token(value: Any) -> bytes | None:
    """What tells, at the next call, whether `value` changed in place: None when its identity
    does (immutable values, code, a resource hardy cannot hash), else a digest of its content now
    (tensors by their version counters, which every in-place operation bumps; read-only numpy
    arrays that own their memory by identity)."""
    if isinstance(value, types.FunctionType) and (_attributes(value) or value.__kwdefaults__):
        with _versions_only():  # its attributes can change in place, and so can its keyword defaults
            return stamp_of(value) if _attributes(value) else _defaults_token(value)
    if isinstance(value, types.BuiltinMethodType) and not isinstance(value.__self__, (types.ModuleType, type)):
        return token(value.__self__)  # `lookup = TABLE.get`: the data it is bound to
    if hasattr(value, "__wrapped__") and not isinstance(value, types.FunctionType) and hasattr(value, "__dict__"):
        with _versions_only():  # a decorator object: the configuration it holds (`scaled.factor = 10`)
            return stamp_of(value)
    if (isinstance(value, _FIXED) and not isinstance(value, enum.Enum)  # (an IntEnum's member holds attributes,
            and not (isinstance(value, _SCALARS) and hasattr(value, "__dict__"))  # so can a `str` subclass's)
            or hasattr(value, "__wrapped__") or _frozen_array(value)):
        return None
    if type(value) is tuple and all(isinstance(v, _FIXED) for v in value):
        return None
    h = blake3()
    try:
        with _versions_only():
            encode_into(value, h.update, set())
    except Exception:  # UnhashableError, or a library refusing (a tensor on the meta device): by its pickle
        try:  # (a ConfigParser, a ChainMap, a UserDict: plain data, no encoder), else a resource
            return _by_pickle(value)
        except Exception:
            return None
    return h.digest(DIGEST)


def _defaults_token(func: types.FunctionType) -> bytes:
    """A function's defaults by content (`normalize.__kwdefaults__["scale"] = 5.0` changes them in
    place); its code is seen by identity, as any function's."""
    h = blake3()
    tolerant((func.__defaults__, func.__kwdefaults__), h.update)
    return h.digest(DIGEST)


def _frozen_array(value: Any) -> bool:
    """A read-only numpy array owning its memory, too big to hash at every call: identity says
    whether it changed (a small one is hashed: it can be made writable again and written)."""
    flags = getattr(value, "flags", None)
    return (type(value).__module__ == "numpy" and flags is not None and not flags.writeable
            and getattr(value, "base", None) is None and value.nbytes > CONTENT_TOKEN)


def module_stamp(module: types.ModuleType, names: Iterable[str]) -> dict[str, bytes]:
    """What the module binds to each name, as this process has it (see `stamp_of`); a name the
    module lacks is `ABSENT_STAMP`. Two processes with equal stamps compute the same from those names."""
    namespace = vars(module)
    return {name: stamp_of(namespace.get(name, ABSENT), module.__name__) for name in names}


ABSENT_STAMP = b"-"


def stamp_of(value: Any, home: str = "") -> bytes:
    """One name's stamp in module `home`: a module by its name; code defined in a user module by
    its bytecode, defaults, attributes and configuration (a node's outputs); library code by where
    it comes from; a value by its content, else by its pickle, else by its type alone (`RESOURCE`)."""
    if value is ABSENT:
        return ABSENT_STAMP
    if isinstance(value, types.ModuleType):
        return b"module:" + value.__name__.encode()
    if _is_code(value) and not is_user_module(_defined_in(value)):
        return b"library:" + f"{_defined_in(value)}.{getattr(value, '__qualname__', '?')}".encode()
    h = blake3()
    try:
        if _is_code(value):
            _code_of(value, h.update, set())
        else:
            encode_into(value, h.update, set())
    except Exception:  # UnhashableError, or a library's own refusal: its pickle, or its type
        try:
            return _by_pickle(value)
        except Exception:
            return RESOURCE + type_name(type(value))
    return h.digest(DIGEST)


def _defined_in(value: Any) -> str | None:
    """The module code comes from: a wrapper's (a node, `lru_cache`) is its wrapped function's."""
    while not isinstance(value, (types.FunctionType, type)) and getattr(value, "__wrapped__", None) is not None:
        value = value.__wrapped__
    module = getattr(value, "__module__", None)
    return module if isinstance(module, str) else None


def _is_code(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, type)) or (callable(value) and hasattr(value, "__wrapped__"))


def _code_of(value: Any, out: Callable[[bytes], Any], seen: set[int]) -> None:
    """Code as a worker would run it: a function's bytecode, defaults and the code or values in
    its closure (a decorator's wrapper holds the function it wraps there); a class's members; a
    wrapper (a node, `lru_cache`) by its type, its configuration and what it wraps."""
    if id(value) in seen:
        out(b"@")
        return
    seen.add(id(value))
    if isinstance(value, types.FunctionType):
        out(b"f")
        code_bytes(value.__code__, out)
        tolerant((value.__defaults__, value.__kwdefaults__, _attributes(value)), out)
        for cell in value.__closure__ or ():
            try:
                inner = cell.cell_contents
            except ValueError:
                out(b"empty")
                continue
            _code_of(inner, out, seen) if _is_code(inner) else tolerant(inner, out)
    elif isinstance(value, type):
        out(b"c" + type_name(value))
        for name, member in sorted(vars(value).items()):
            if name == "__slotnames__":  # (copyreg's cache, set on the class once an instance is pickled)
                continue
            out(name.encode())
            for target in _accessors(member):
                _code_of(target, out, seen) if _is_code(target) else tolerant(target, out)
        if isinstance(value, abc.ABCMeta):  # the classes `register` made its virtual subclasses
            out(b"registered" + b",".join(sorted(type_name(c) for c in registered(value))))
    else:
        out(b"w" + type_name(type(value)))
        config = getattr(value, "__dict__", {})
        tolerant({k: v for k, v in config.items() if not _is_code(v) and k != "func"}, out)
        _code_of(value.__wrapped__, out, seen)


def registered(cls: abc.ABCMeta) -> set[type]:
    """The classes `cls.register` made an ABC's virtual subclasses (no public way lists them)."""
    return {c for ref in abc._get_dump(cls)[0] if (c := ref()) is not None}  # type: ignore[attr-defined]


def _accessors(member: Any) -> list[Any]:
    """What a class member runs: a static or class method's function, a property's three accessors,
    a `cached_property`'s function; else the member itself."""
    if isinstance(member, property):
        return [member.fget, member.fset, member.fdel]
    if isinstance(member, functools.cached_property):
        return [member.func]
    return [getattr(member, "__func__", member)]


def _attributes(func: types.FunctionType) -> dict[str, Any]:
    """What was set on a function (`lookup.table = {...}`), besides the function a decorator wraps."""
    return {k: v for k, v in vars(func).items() if k != "__wrapped__"}


def tolerant(value: Any, out: Callable[[bytes], Any], active: set[int] | None = None) -> None:
    """A value inside code (a default, a function's or a class's attribute) by content; a dict,
    list or tuple whose content cannot all be hashed, part by part; any other value without
    content (a lock, a sentinel `object()`) by its type alone. Part by part, so that one part
    without content does not hide a change of the others: `get.calls = 5` beside a sentinel
    default, `get.opts["k"] = 6` beside `get.opts["fallback"] = MISSING` (a worker computed with
    its import-time values, and a cache served the old entry). A module is code, never state: one
    whose code cannot be keyed is refused (`class R: c = cfg` counted as present served `cfg.g`'s
    old results)."""
    try:
        h = blake3()
        encode_into(value, h.update, set())
        out(h.digest(DIGEST))
        return
    except Exception as exc:  # UnhashableError, or a library's own refusal
        if isinstance(value, types.ModuleType) and isinstance(exc, UnhashableError):
            raise
    active = set() if active is None else active
    if type(value) not in (dict, list, tuple) or id(value) in active:
        out(RESOURCE + type_name(type(value)))
        return
    active.add(id(value))
    out(b"%s%d" % (type(value).__name__.encode(), len(value)))
    for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
        tolerant(key, out, active)
        tolerant(item, out, active)
    active.discard(id(value))


def _by_pickle(value: Any) -> bytes:
    """A value no encoder takes, by its pickle (raises if it has none)."""
    import pickle  # (here: `import hardy` stays light, and most values have an encoder)
    return b"pickle:" + blake3(pickle.dumps(value, protocol=5)).digest(DIGEST)


def module_value(module: types.ModuleType) -> Any:
    """A module inside a value (a class attribute, a default, a list's item, a partial's argument)
    as one read whole from a closure cell (`code._reference`): a user module by what it defines and
    its values, a library's by its distribution; by identity in a token (`IN_PROCESS`). Once
    counted as present only (`class R: c = cfg`), or refused (`def h(x, _m=math)`)."""
    if IN_PROCESS.get():
        return f"{module.__name__}@{id(module)}"
    try:
        return code_fingerprint_of(module)
    except UnhashableError as exc:
        raise UnhashableError(f"the module {module.__name__} cannot be keyed: {exc}") from None


register(types.ModuleType, module_value)

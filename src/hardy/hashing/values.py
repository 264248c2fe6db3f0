"""Deterministic fingerprints of values, for cache keys.

A type-tagged canonical encoding fed to BLAKE3 (128-bit output; why: docs/caching.md), so
that `1`, `1.0`, `True` and `"1"` all differ, a list differs from a tuple, dicts are hashed in
insertion order (code can read the order) and sets independently of it, numpy arrays by dtype, shape
and bytes (about 1 ms for 8 MB here), pandas objects by content (index and dtypes included),
dataclasses / attrs / pydantic models and plain objects by their class's code and their fields
(private state included), torch modules and scikit-learn estimators by class, configuration and
weights (`hash_public` leaves plain objects' private attributes out: HyperNodes' documented rule,
for hardy.compat.hypernodes). `__cache_key__()` overrides all of this, and `register()` teaches
hashing a library type. What cannot be encoded deterministically raises `UnhashableError` naming the
path to the part that cannot (`model.encoder._session`); there is no fallback to `id()` or `repr()`
that could collide or vary. Built-in, library and user types sit in one table keyed by type; the
encoders of library types are in `hardy.hashing.libraries`.
"""


from __future__ import annotations

import array
import collections
import contextvars
import dataclasses
import enum
import functools
import math
import operator
import os
import re
import struct
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from blake3 import blake3

from ..errors import UNHASHABLE_FIXES, UnhashableError
from . import classes
from .classes import BY_REPR, a_value_type, by_repr, class_code, code_fingerprint_of, instance_fields, native_bases
from .distributions import module_identity
from .origin import is_user_module

FORMAT = b"hardy-key-3"  # 3: BLAKE3 instead of blake2b
DIGEST = 16
CONTENT_TOKEN = 64 * 1024  # bytes: a tensor or read-only array up to this is watched by content (`state.token`)

Encoder = Callable[[Any, Callable[[bytes], Any], set[int]], None]  # (value, out, values being encoded)

ABSENT = object()  # a name that is not there (a sentinel no value can be)

# Value hashing is a table keyed by type, looked up along the value's MRO (the most specific class
# wins), as dask's `normalize_token`: built-in types are registered below with `_register`, library
# types when their module is loaded (`_LAZY`, filled by `libraries.py`), user types with `register`.
# Not functools.singledispatch: subclasses of the scalar types must keep their own rule ahead of the
# MRO (`numpy.float64` is a float first) for keys to stay what they were, and types of libraries not
# imported must cost nothing.
_ENCODERS: dict[type, Encoder] = {}
_RESOLVED: dict[type, Encoder] = {}  # type -> its encoder, once resolved


def _register(cls: type, encoder: Encoder) -> None:
    _ENCODERS[cls] = encoder
    _RESOLVED.clear()


def register(cls: type, identify: Callable[[Any], Any]) -> None:
    """Hash instances of `cls` (and subclasses) by what `identify(value)` returns, itself hashed by
    these rules: for library types that cannot have a `__cache_key__()` method of their own."""
    _register(cls, identified_by(identify))


def registered(t: type) -> bool:
    """Whether values of `t` have an encoder of their own in the table (a library's callable
    objects, such as `np.vectorize` or numba's dispatchers, are keyed by it); callables keyed by
    their code fingerprint (functions, ufuncs) are not."""
    _load_lazy()
    return next((_ENCODERS[cls] for cls in t.__mro__[:-1] if cls in _ENCODERS), encode_callable) is not encode_callable


def digest(*parts: bytes) -> bytes:
    h = blake3()
    for p in parts:
        h.update(p)
    return h.digest(DIGEST)


# --- values ---------------------------------------------------------------------------------------


def hash_value(value: Any) -> bytes:
    """A 16-byte digest of `value`'s content."""
    h = blake3()
    encode(value, h.update)
    return h.digest(DIGEST)


_PUBLIC_ONLY = contextvars.ContextVar("hardy_public_only", default=False)


def hash_public(value: Any) -> bytes:
    """`hash_value`, but a plain object (an instance of a user class without `__cache_key__`) is
    keyed by its class and its public attributes only: `_cache`, `_session`, `_client` neither change
    the key nor stop one from being made. HyperNodes keys objects this way; hardy's own keys keep
    private state, because results can depend on it."""
    token = _PUBLIC_ONLY.set(True)
    try:
        return hash_value(value)
    finally:
        _PUBLIC_ONLY.reset(token)


def encode(value: Any, out: Callable[[bytes], Any]) -> None:
    """Feed `value`'s canonical, self-delimiting encoding to `out` (a hasher's update)."""
    t = type(value)
    if t is int and value.bit_length() <= BIG_INT:  # the common cases first, without the general dispatch
        s = str(value).encode()
        out(b"I" + length(len(s)) + s)
    elif t is str:
        b = value.encode("utf-8", "surrogatepass")
        out(b"S" + length(len(b)) + b)
    else:
        encode_into(value, out, set())


def type_name(t: type) -> bytes:
    return f"{t.__module__}.{t.__qualname__}".encode()


def length(n: int) -> bytes:
    return struct.pack("<q", n)


def encode_into(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """Encode `v` into `out`; `active` holds the ids of the containers being encoded (cycles)."""
    t = type(v)
    exact = _EXACT.get(t)
    if exact is not None:
        exact(v, out, active)
    elif not isinstance(v, type) and classes.keyed_by_method(t):
        out(b"K" + type_name(t) + class_code(t, active))
        encode_into(v.__cache_key__(), out, active)
    else:
        encoder = _RESOLVED.get(t)
        if encoder is None:
            encoder = _RESOLVED[t] = _resolve(t)
        encoder(v, out, active)


def _resolve(t: type) -> Encoder:
    """The encoder for values of type `t`: a subclass of a scalar type by its rule, else the most
    specific registered class of its MRO, else the first structural rule that applies."""
    if issubclass(t, _SCALARS):
        return _encode_scalar_subclass
    _load_lazy()
    for cls in t.__mro__:
        if cls in _ENCODERS:
            if cls in _VALUE_ONLY and cls is not t and is_user_module(t.__module__):
                return functools.partial(_encode_subclass, _ENCODERS[cls])
            return _ENCODERS[cls]
    return next((encoder for applies, encoder in _STRUCTURAL if applies(t)), _encode_plain_object)


def _encode_subclass(encoder: Encoder, v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A user's subclass of a type keyed by its value alone (`class Window(deque)`): the value,
    then what the subclass adds (`encode_subclass_state`)."""
    encoder(v, out, active)
    encode_subclass_state(v, out, active)


def encode_subclass_state(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """What a user's subclass of a value type adds to the value: its code, and what the instance
    holds besides the value (`window.label`, an ndarray's `meta`), which its code can read."""
    out(b"sub" + class_code(type(v), active))
    _container_state(v, out, active)


def _encode_none(v: None, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"N")


def _encode_bool(v: bool, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"T" if v else b"F")


def _encode_int(v: int, out: Callable[[bytes], Any], active: set[int]) -> None:
    """By its digits; past `BIG_INT` bits (below Python's default limit on int-to-str conversion,
    4,300 digits, where `str` raises) by its bytes (two's complement) under a tag of its own: by
    its size, not by whether `str` raises, so that a process that changed the limit keys alike."""
    if v.bit_length() > BIG_INT:
        b = v.to_bytes(v.bit_length() // 8 + 1, "little", signed=True)
        out(b"X" + length(len(b)) + b)
        return
    s = str(v).encode()
    out(b"I" + length(len(s)) + s)


BIG_INT = 14_000  # bits: about 4,214 digits

def _encode_float(v: float, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"D" + _float_text(v) + b";")


def _float_text(v: float) -> bytes:  # float("nan") as ever; another NaN (-nan: `copysign` reads its sign) by its bits
    bits = struct.pack("<d", v) if math.isnan(v) else b""
    return float.hex(v).encode() if not bits else b"nan" if bits == _QUIET_NAN else bits.hex().encode()


def _encode_str(v: str, out: Callable[[bytes], Any], active: set[int]) -> None:
    b = v.encode("utf-8", "surrogatepass")
    out(b"S" + length(len(b)) + b)


def _encode_bytes(v: bytes, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"Y" + length(len(v)) + v)


def _encode_complex(v: complex, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"C" + _float_text(v.real) + b"," + _float_text(v.imag) + b";")


def _encode_buffer(v: bytearray | memoryview, out: Callable[[bytes], Any], active: set[int]) -> None:
    """The bytes; a memoryview's format and shape too (a cast reads the same bytes as other items),
    and whether it is writable (code reads `.readonly`, and writing into a read-only one raises;
    said for a writable one only, so that the keys of read-only views, the common kind, stay)."""
    data = bytes(v)
    view = b"" if isinstance(v, bytearray) else f"m{v.format}{v.shape}".encode() + (b"" if v.readonly else b"w")
    out(b"A" + view + length(len(data)) + data)


_SCALARS = (bool, int, float, str, bytes, complex, bytearray)
# A scalar subclass's value as its base type, read past any override of `__int__`, `__str__`...
_AS_BASE: dict[type, Callable[[Any], Any]] = {
    bool: bool, int: int.__index__, float: float.__float__, str: str.__str__,
    bytes: lambda v: bytes(memoryview(v)), bytearray: lambda v: bytearray(memoryview(v)),
    complex: lambda v: complex(complex.real.__get__(v), complex.imag.__get__(v))}
_QUIET_NAN = struct.pack("<d", float("nan"))  # a NaN's bits: its sign, which `math.copysign` reads


def _encode_scalar_subclass(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A subclass of a scalar type (an IntEnum, numpy.float64, a `str` that carries a `.lang`): the
    class, the base value, then what the instance holds besides it, which its code can read."""
    base = next(b for b in _SCALARS if isinstance(v, b))
    out(b"B" + type_name(type(v)) + class_code(type(v), active))
    encode_into(_AS_BASE[base](v), out, active)
    if isinstance(v, enum.Enum):  # an IntEnum's or StrEnum's member
        _encode_member_attributes(v, out, active)
    elif is_user_module(type(v).__module__):  # (a library's may hold a whole tree: bs4's NavigableString)
        _container_state(v, out, active)


def _encode_sequence(v: list[Any] | tuple[Any, ...], out: Callable[[bytes], Any], active: set[int]) -> None:
    t = type(v)
    out((b"L" if isinstance(v, list) else b"U") + (b"" if t in (list, tuple) else type_name(t) + class_code(t, active))
        + length(len(v)))
    for i, x in enumerate(_guard(v, active)):
        try:
            encode_into(x, out, active)
        except UnhashableError as exc:
            raise exc.at(f"[{i}]") from None
    if t not in (list, tuple):
        _container_state(v, out, active)
    active.discard(id(v))


def _encode_dict(v: dict[Any, Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    """In insertion order: code can read it (next(iter(d)), json.dumps)."""
    out(b"M" + (b"" if type(v) is dict else type_name(type(v)) + class_code(type(v), active)) + length(len(v)))
    for k, x in _guard(v, active).items():
        encode_into(k, out, active)
        try:
            encode_into(x, out, active)
        except UnhashableError as exc:
            raise exc.at(f"[{k!r}]") from None
    if type(v) is not dict:
        _container_state(v, out, active)
    active.discard(id(v))


def _encode_set(v: set[Any] | frozenset[Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    """The members' digests in iteration order where that order is the same in every process
    (`classes.ordered_alike`: `list({1, 9})` is not `list({9, 1})`), marked by a byte no module name
    starts with; else sorted (a set of strings iterates in the order of its process's hash salt)."""
    digests = [hash_value_in(m, active) for m in _guard(v, active)]
    ordered = classes.ordered_alike(v)
    out((b"Z" if isinstance(v, frozenset) else b"E") + (b"\x01" if ordered else b"") + type_name(type(v))
        + class_code(type(v), active) + length(len(digests)) + b"".join(digests if ordered else sorted(digests)))
    if type(v) not in (set, frozenset):
        _container_state(v, out, active)
    active.discard(id(v))


def _container_state(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """What a subclass of a built-in or library type holds besides its value, which code can read:
    its attributes (slots included), and a defaultdict's `default_factory` (`d["new"]` is 0 or [] by it)."""
    fields = instance_fields(v)
    factory = getattr(v, "default_factory", ABSENT) if isinstance(v, collections.defaultdict) else ABSENT
    if factory is not ABSENT:
        fields["default_factory"] = factory
    if fields:  # nothing for a plain subclass (a named tuple): its keys stay what they were
        out(b"@")
        encode_attributes(fields, out, active)


def _encode_enum(v: enum.Enum, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"En" + type_name(type(v)) + class_code(type(v), active))
    encode_into(v.value, out, active)
    _encode_member_attributes(v, out, active)


def _encode_member_attributes(v: enum.Enum, out: Callable[[bytes], Any], active: set[int]) -> None:
    attributes = member_attributes(v)
    if attributes:  # (said only when set: a plain member's key stays what it was)
        out(b"attributes")
        encode_into(attributes, out, active)


member_attributes = classes.member_attributes  # (where `shipping.payload` imports it from)


def encode_callable(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A callable inside a value: by its code fingerprint (`hardy.hashing.code`)."""
    out(b"Fn" + code_fingerprint_of(v))


def _encode_path(v: os.PathLike[str], out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"P" + type_name(type(v)))
    encode_into(os.fspath(v), out, active)


def _encode_by_repr(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """datetime, decimal, uuid, fractions: exact, deterministic reprs (`repr_parts`). A user's subclass
    of their value types by its base's repr (its own may leave the value out), code and attributes."""
    t = type(v)
    base = t if t.__module__ in BY_REPR else next(c for c in t.__mro__ if a_value_type(c))
    out(b"R" + type_name(t))
    for part in classes.repr_parts(v, base):  # (the base's own repr, given `v`; a user's tzinfo apart)
        encode_into(part, out, active)
    if base is not t:
        encode_subclass_state(v, out, active)


# dataclasses, attrs classes and pydantic models: by the encoders `hardy.hashing.models` installs here
MODELS: dict[str, Encoder] = {}


def _encode_plain_object(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """An instance of a user class by its state (slots included); anything else cannot be hashed,
    nor can a user class built on a type that keeps its value where attributes cannot show it (a
    subclass of `io.BytesIO`: every instance would get one key). An exception by its `args` too."""
    t = type(v)
    if not (is_user_module(t.__module__) and (hasattr(v, "__dict__") or hasattr(t, "__slots__"))):
        raise _cannot(t)
    hidden = native_bases(t)
    if hidden and not issubclass(t, BaseException):
        base = f"{hidden[0].__module__}.{hidden[0].__qualname__}"
        raise UnhashableError(f"a {t.__module__}.{t.__qualname__} is built on {base}, whose value its attributes "
                              f"do not show; {UNHASHABLE_FIXES}", t)
    state = instance_fields(v)
    if not state and not hasattr(v, "__dict__"):
        raise _cannot(t)
    if hidden:
        state = {"__args__": v.args, **state}
    if _PUBLIC_ONLY.get():
        state = {k: x for k, x in state.items() if not k.startswith("_")}
    encode_object(v, b"O", state, out, active)


_EXACT: dict[type, Encoder] = {type(None): _encode_none, bool: _encode_bool, int: _encode_int,
                               float: _encode_float, str: _encode_str, bytes: _encode_bytes,
                               complex: _encode_complex, bytearray: _encode_buffer, memoryview: _encode_buffer}


def _cannot(t: type) -> UnhashableError:
    return UnhashableError(f"a {t.__module__}.{t.__qualname__} has no deterministic content to hash; "
                           f"{UNHASHABLE_FIXES}", t)


def encode_object(v: Any, tag: bytes, fields: dict[str, Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    """An object by its class (the class's code, for a user class, its library's distribution for
    a library's: its methods change results) and its fields; a field that cannot be hashed is
    reported by its attribute path."""
    t = type(v)
    code = class_code(t, active) if is_user_module(t.__module__) else module_identity(t.__module__)
    out(tag + type_name(t) + code)
    _guard(v, active)
    encode_attributes(fields, out, active)
    active.discard(id(v))


def encode_attributes(fields: dict[str, Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    """Named fields, each reported by its attribute path if it cannot be hashed."""
    out(length(len(fields)))
    for name, x in fields.items():
        encode_into(name, out, active)
        try:
            encode_into(x, out, active)
        except UnhashableError as exc:
            raise exc.at(f".{name}") from None


# --- registered types, and types known by module without importing it ---------------------------


def identified_by(identify: Callable[[Any], Any]) -> Callable[[Any, Callable[[bytes], Any], set[int]], None]:
    """The encoder of a type hashed by what `identify(value)` returns (its class first)."""
    def encode_registered(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
        out(b"RG" + type_name(type(v)))
        encode_into(identify(v), out, active)
    return encode_registered


def _encode_reduced(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    rebuild, args, *rest = v.__reduce__()
    out(b"RD" + type_name(type(v)))
    encode_into((args, rest[0] if rest else None), out, active)


def _guard(v: Any, active: set[int]) -> Any:
    if id(v) in active:
        raise UnhashableError("a value contains itself (a reference cycle); give it a __cache_key__()")
    active.add(id(v))
    return v


def hash_value_in(v: Any, active: set[int]) -> bytes:
    h = blake3()
    encode_into(v, h.update, active)
    return h.digest(DIGEST)


# Callables that are values (a global, a field, an argument of a partial): keyed by their code.
_CALLABLES: tuple[type, ...] = (
    types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.MethodWrapperType,
    types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType,
    staticmethod, classmethod, functools.partial, functools.partialmethod, functools.singledispatchmethod)

_OPERATORS: tuple[type, ...] = (operator.itemgetter, operator.attrgetter, operator.methodcaller)

# Rules on what a type is rather than what it derives from, in order; after the registered classes.
_STRUCTURAL: tuple[tuple[Callable[[type], bool], Encoder], ...] = (
    (classes.a_path_type, _encode_path),
    (by_repr, _encode_by_repr),
    (dataclasses.is_dataclass, lambda v, out, active: MODELS["dataclass"](v, out, active)),
    (lambda t: hasattr(t, "__attrs_attrs__"), lambda v, out, active: MODELS["attrs"](v, out, active)),
    (lambda t: hasattr(t, "model_dump") and hasattr(t, "model_fields"),  # pydantic v2
     lambda v, out, active: MODELS["pydantic"](v, out, active)),
    (lambda t: t.__module__ == "argparse" and t.__name__ == "Namespace", identified_by(vars)),
    (lambda t: t.__module__.startswith("sklearn."), _encode_reduced),  # Cython parts of fitted estimators
    (lambda t: t.__name__ in ("cython_function_or_method", "fused_cython_function"), encode_callable),
    # a ctypes array, structure or number: its type and its memory (`buf[0] = 9` changes it in place)
    (lambda t: any(c.__module__ == "_ctypes" for c in t.__mro__[1:]), identified_by(lambda v: bytes(memoryview(v)))),
)

for _callable in _CALLABLES:
    _register(_callable, encode_callable)
for _operator in _OPERATORS:
    _register(_operator, _encode_reduced)
for _cls, _encoder in ((list, _encode_sequence), (tuple, _encode_sequence), (dict, _encode_dict),
                      (set, _encode_set), (frozenset, _encode_set), (enum.Enum, _encode_enum),
                      (re.Pattern, identified_by(lambda p: (p.pattern, p.flags))),
                      (array.array, identified_by(lambda a: (a.typecode, a.tobytes()))),
                      (range, identified_by(lambda r: (r.start, r.stop, r.step))),
                      # `x[W]` for `W = slice(0, 2)`, `x[...]`, a read-only view of a dict: by value
                      (slice, identified_by(lambda sl: (sl.start, sl.stop, sl.step))),
                      (type(Ellipsis), identified_by(lambda _: "Ellipsis")),
                      (types.MappingProxyType, identified_by(dict)),
                      (types.SimpleNamespace, identified_by(vars)),  # configuration objects
                      (collections.deque, identified_by(lambda d: (d.maxlen, list(d)))),
                      # what a dataclass's generated __init__ holds for a field with a default_factory
                      (type(dataclasses._HAS_DEFAULT_FACTORY), identified_by(lambda _: "default_factory"))):  # type: ignore[attr-defined]
    _register(_cls, _encoder)

# Types keyed by their value alone, whose user subclasses add their code and attributes (`_resolve`).
_VALUE_ONLY = frozenset({array.array, collections.deque, types.SimpleNamespace})

# Library types (`hardy.hashing.libraries`), registered when their module is first seen loaded.
_LAZY: dict[str, Callable[[Any], tuple[tuple[type, Encoder], ...]]] = {}
_LAZY_LOCK = threading.Lock()


def register_library(module: str, types: Callable[[Any], tuple[tuple[type, Encoder], ...]]) -> None:
    """Register the encoders `types(module)` returns once `module` is loaded: hashing imports no
    library, and a library never loaded costs nothing."""
    _LAZY[module] = types


def _load_lazy() -> None:
    """Register the types of the libraries loaded since; a module leaves `_LAZY` only once its types
    are in the table, so a thread hashing meanwhile waits instead of missing them."""
    if not any(name in sys.modules for name in tuple(_LAZY)):
        return
    with _LAZY_LOCK:
        for name in [n for n in _LAZY if n in sys.modules]:
            for cls, encoder in _LAZY[name](sys.modules[name]):
                _register(cls, encoder)
            del _LAZY[name]

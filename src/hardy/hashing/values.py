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
that could collide or vary. Built-in, library and user types sit in one table keyed by type.
"""


from __future__ import annotations

import collections
import contextvars
import dataclasses
import enum
import functools
import math
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
from .origin import is_user_module

FORMAT = b"hardy-key-3"  # 3: BLAKE3 instead of blake2b
DIGEST = 16

Encoder = Callable[[Any, Callable[[bytes], Any], set[int]], None]  # (value, out, values being encoded)

ABSENT = object()  # a name that is not there (a sentinel no value can be)

# Values and code recurse into each other: a function or a user class inside a value is hashed by its
# code, and a function's globals by their values. `hardy.hashing.code` imports this module and
# installs its fingerprint here, so that the import graph points one way (code -> values).
_code_fingerprint: list[Callable[[Any], bytes]] = []


def install_code_fingerprint(fingerprint: Callable[[Any], bytes]) -> None:
    _code_fingerprint[:] = [fingerprint]


# Value hashing is a table keyed by type, looked up along the value's MRO (the most specific class
# wins), as dask's `normalize_token`: built-in types are registered below with `_register`, library
# types when their module is loaded (`_LAZY`), user types with `register`. Not functools.singledispatch:
# subclasses of the scalar types must keep their own rule ahead of the MRO (`numpy.float64` is a float
# first) for keys to stay what they were, and types of libraries not imported must cost nothing.
_ENCODERS: dict[type, Encoder] = {}
_RESOLVED: dict[type, Encoder] = {}  # type -> its encoder, once resolved


def _register(cls: type, encoder: Encoder) -> None:
    _ENCODERS[cls] = encoder
    _RESOLVED.clear()


def register(cls: type, identify: Callable[[Any], Any]) -> None:
    """Hash instances of `cls` (and subclasses) by what `identify(value)` returns, itself hashed by
    these rules: for library types that cannot have a `__cache_key__()` method of their own."""
    _register(cls, _registered(identify))


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
    if t is int:  # the common cases first, without the general dispatch
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
    elif hasattr(v, "__cache_key__") and not isinstance(v, type):
        out(b"K" + type_name(t) + (_code_fingerprint[0](t) if is_user_module(t.__module__) else b""))
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
            return _ENCODERS[cls]
    return next((encoder for applies, encoder in _STRUCTURAL if applies(t)), _encode_plain_object)


def _encode_none(v: None, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"N")


def _encode_bool(v: bool, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"T" if v else b"F")


def _encode_int(v: int, out: Callable[[bytes], Any], active: set[int]) -> None:
    s = str(v).encode()
    out(b"I" + length(len(s)) + s)


def _encode_float(v: float, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"D" + (b"nan" if math.isnan(v) else float.hex(v).encode()) + b";")


def _encode_str(v: str, out: Callable[[bytes], Any], active: set[int]) -> None:
    b = v.encode("utf-8", "surrogatepass")
    out(b"S" + length(len(b)) + b)


def _encode_bytes(v: bytes, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"Y" + length(len(v)) + v)


def _encode_complex(v: complex, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"C" + float.hex(v.real).encode() + b"," + float.hex(v.imag).encode() + b";")


def _encode_buffer(v: bytearray | memoryview, out: Callable[[bytes], Any], active: set[int]) -> None:
    data = bytes(v)
    out(b"A" + length(len(data)) + data)


_SCALARS = (bool, int, float, str, bytes)


def _encode_scalar_subclass(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A subclass of a scalar type (an IntEnum, numpy.float64): the class, then the base value."""
    base = next(b for b in _SCALARS if isinstance(v, b))
    out(b"B" + type_name(type(v)))
    encode_into(base(v) if base is not str else str.__str__(v), out, active)


def _encode_sequence(v: list[Any] | tuple[Any, ...], out: Callable[[bytes], Any], active: set[int]) -> None:
    t = type(v)
    out((b"L" if isinstance(v, list) else b"U") + (b"" if t in (list, tuple) else type_name(t)) + length(len(v)))
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
    out(b"M" + (b"" if type(v) is dict else type_name(type(v))) + length(len(v)))
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
    """No order to read: the sorted digests of the members."""
    digests = sorted(hash_value_in(m, active) for m in _guard(v, active))
    out((b"Z" if isinstance(v, frozenset) else b"E") + type_name(type(v)) + length(len(digests)) + b"".join(digests))
    if type(v) not in (set, frozenset):
        _container_state(v, out, active)
    active.discard(id(v))


def _container_state(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """What a subclass of a built-in container holds besides its items, which code can read: its
    attributes, and a defaultdict's `default_factory` (`d["new"]` is 0 or [] by it)."""
    fields = dict(getattr(v, "__dict__", None) or {})
    factory = getattr(v, "default_factory", ABSENT) if isinstance(v, collections.defaultdict) else ABSENT
    if factory is not ABSENT:
        fields["default_factory"] = factory
    if fields:  # nothing for a plain subclass (a named tuple): its keys stay what they were
        out(b"@")
        _attributes(fields, out, active)


def _encode_enum(v: enum.Enum, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"En" + type_name(type(v)))
    encode_into(v.value, out, active)


def _encode_code(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"Fn" + _code_fingerprint[0](v))


def _encode_tensor(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    import torch
    out(b"TT" + str(v.dtype).encode() + str(tuple(v.shape)).encode())
    if type(v) is not torch.Tensor or v.device.type != "cpu" or v.requires_grad:  # cpu tensors: as before
        out(b"|" + type_name(type(v)) + str(v.device).encode() + (b"grad" if v.requires_grad else b""))
    _encode_numpy(v.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy(), out, active)


def _encode_path(v: os.PathLike[str], out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"P" + type_name(type(v)))
    encode_into(os.fspath(v), out, active)


def _encode_by_repr(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"R" + type_name(type(v)))
    encode_into(repr(v), out, active)  # datetime, decimal, uuid, fractions: exact, deterministic reprs


def _encode_dataclass(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    _object(v, b"DC", {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, out, active)


def _encode_attrs(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    _object(v, b"AT", {a.name: getattr(v, a.name) for a in type(v).__attrs_attrs__}, out, active)


def _encode_pydantic(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    _object(v, b"PY", {**v.model_dump(), "__pydantic_private__": getattr(v, "__pydantic_private__", None)},
            out, active)


def _encode_plain_object(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """An instance of a user class by its state (slots included); anything else cannot be hashed."""
    t = type(v)
    if not (is_user_module(t.__module__) and (hasattr(v, "__dict__") or hasattr(t, "__slots__"))):
        raise _cannot(t)
    state = dict(getattr(v, "__dict__", {}))
    for cls in t.__mro__:
        for s in getattr(cls, "__slots__", ()):
            if isinstance(s, str) and hasattr(v, s) and s not in ("__dict__", "__weakref__"):
                state[s] = getattr(v, s)
    if not state and not hasattr(v, "__dict__"):
        raise _cannot(t)
    if _PUBLIC_ONLY.get():
        state = {k: x for k, x in state.items() if not k.startswith("_")}
    _object(v, b"O", state, out, active)


_EXACT: dict[type, Encoder] = {type(None): _encode_none, bool: _encode_bool, int: _encode_int,
                               float: _encode_float, str: _encode_str, bytes: _encode_bytes,
                               complex: _encode_complex, bytearray: _encode_buffer, memoryview: _encode_buffer}


def _cannot(t: type) -> UnhashableError:
    return UnhashableError(f"a {t.__module__}.{t.__qualname__} has no deterministic content to hash; "
                           f"{UNHASHABLE_FIXES}", t)


def _object(v: Any, tag: bytes, fields: dict[str, Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    """An object by its class (the class's code too, for a user class: methods change results) and
    its fields; a field that cannot be hashed is reported by its attribute path."""
    t = type(v)
    out(tag + type_name(t) + (_code_fingerprint[0](t) if is_user_module(t.__module__) else b""))
    _guard(v, active)
    _attributes(fields, out, active)
    active.discard(id(v))


def _attributes(fields: dict[str, Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    out(length(len(fields)))
    for name, x in fields.items():
        encode_into(name, out, active)
        try:
            encode_into(x, out, active)
        except UnhashableError as exc:
            raise exc.at(f".{name}") from None


# --- library types: registered, or known by module without importing it ------------------------


def _registered(identify: Callable[[Any], Any]) -> Callable[[Any, Callable[[bytes], Any], set[int]], None]:
    def encode_registered(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
        out(b"RG" + type_name(type(v)))
        encode_into(identify(v), out, active)
    return encode_registered


def _encode_partial(v: functools.partial[Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"FP" + _code_fingerprint[0](v.func))
    encode_into((v.args, v.keywords), out, active)


_TORCH_INTERNALS: frozenset[str] | None = None


def _encode_torch_module(m: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A torch module: the code of each submodule's class, its configuration (the attributes it
    was built with, `training` included) and its parameters and buffers by content; hooks and
    torch's bookkeeping are left out."""
    global _TORCH_INTERNALS
    if _TORCH_INTERNALS is None:
        _TORCH_INTERNALS = frozenset(vars(type(m).__mro__[-2]())) - {"training"}  # a bare torch.nn.Module
    config = {k: x for k, x in vars(m).items() if k not in _TORCH_INTERNALS}
    _object(m, b"TM", config, out, active)
    for tag, members in ((b"p", m._parameters), (b"b", m._buffers), (b"m", m._modules)):
        out(tag)
        _attributes(members, out, active)


def _encode_estimator(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A scikit-learn estimator: its class, then its state (the parameters it was built with and
    the fitted attributes, which scikit-learn keeps in the instance's __dict__)."""
    state = v.__getstate__()
    _object(v, b"SK", state if isinstance(state, dict) else {"state": state}, out, active)


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


def _encode_numpy(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """dtype, shape, memory order and bytes. A subclass adds its class (np.matrix multiplies as
    matrices, a recarray reads fields as attributes), a masked array its mask and fill value."""
    import numpy as np
    if type(v) is not np.ndarray and not isinstance(v, np.generic):
        out(b"NS" + type_name(type(v)))
        if isinstance(v, np.ma.MaskedArray):
            _encode_numpy(np.ma.getmaskarray(v), out, active)
            encode_into(v.fill_value, out, active)
        v = v.view(np.ndarray)
    if v.dtype.hasobject:
        out(b"NO" + str(v.shape).encode())
        encode_into(v.tolist(), out, active)
        return
    arr = np.ascontiguousarray(v)
    out(b"NP" + v.dtype.str.encode() + str(v.dtype.descr).encode() + str(arr.shape).encode()
        + (b"s" if isinstance(v, np.generic) else b"a"))
    if not (isinstance(v, np.generic) or v.flags.c_contiguous):  # strides code can read (ravel("K"), .flags)
        out(b"F" if v.flags.f_contiguous else b"K")
    if v.dtype.kind in "mM":  # datetime64 / timedelta64: no buffer format of their own
        arr = arr.reshape(-1).view(np.uint8)
    out(memoryview(arr).cast("B") if arr.size else b"")  # type: ignore[arg-type]  # ndarray is a buffer; out takes any


def _encode_pandas(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A frame, series or index by everything code can read: class, names and labels (typed: a
    column `1` is not a column `"1"`), `attrs`, each column's dtype (a categorical's categories and
    order) and values (object columns typed like Python values)."""
    import pandas as pd
    out(b"PD" + type_name(type(v)))
    if isinstance(v, pd.api.extensions.ExtensionArray):  # a Categorical, a nullable or Arrow array
        _encode_pandas_values(pd.Series(v, copy=False), out, active)
        return
    if isinstance(v, pd.Index):
        _encode_pandas_values(v, out, active)
        encode_into(list(v.names), out, active)
        return
    encode_into(dict(v.attrs), out, active)
    _encode_pandas(v.index, out, active)
    if isinstance(v, pd.Series):
        encode_into(v.name, out, active)
        _encode_pandas_values(v, out, active)
        return
    _encode_pandas(v.columns, out, active)
    for i in range(v.shape[1]):
        _encode_pandas_values(v.iloc[:, i], out, active)


def _encode_pandas_values(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """One column's (or an index's) dtype and values."""
    import numpy as np
    import pandas as pd
    dtype = v.dtype
    out(b"pv" + str(dtype).encode() + length(len(v)))
    if isinstance(dtype, pd.CategoricalDtype):
        out(b"T" if dtype.ordered else b"F")
        _encode_pandas(dtype.categories, out, active)
        _encode_numpy(np.asarray(v.cat.codes if isinstance(v, pd.Series) else v.codes), out, active)
    elif isinstance(dtype, np.dtype) and not isinstance(v, pd.MultiIndex):
        _encode_numpy(v.to_numpy(), out, active)  # object columns element by element, typed
    elif isinstance(v, pd.MultiIndex):
        encode_into(list(v), out, active)
    else:  # extension dtypes (nullable ints, strings, tz-aware times, Arrow): pandas' own row hashes
        rows = pd.util.hash_pandas_object(v, index=False).to_numpy()
        out(memoryview(rows).cast("B") if rows.size else b"")  # type: ignore[arg-type]  # as for arrays


def _encode_arrow(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A pyarrow table, batch or array: its Arrow IPC stream (schema with metadata, chunks, nulls)."""
    import pyarrow as pa
    batch = v if isinstance(v, (pa.Table, pa.RecordBatch)) else pa.table({"": v})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write(batch)
    out(b"AR" + type_name(type(v)))
    out(memoryview(sink.getvalue()))  # type: ignore[arg-type]  # a pyarrow Buffer is a buffer


def _encode_sparse(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A scipy.sparse matrix or array: class and format (csr and csc differ for code that reads
    `.indices`), shape, dtype, block size, then its entries in stored order (explicit zeros too)."""
    import numpy as np
    coo = v.tocoo(copy=False)
    coords = getattr(coo, "coords", None) or (coo.row, coo.col)
    out(b"SP" + type_name(type(v)) + f"{v.format}{v.shape}{v.dtype.str}{getattr(v, 'blocksize', '')}".encode())
    for part in (*coords, coo.data):
        _encode_numpy(np.asarray(part), out, active)


# Rules on what a type is rather than what it derives from, in order; after the registered classes.
_STRUCTURAL: tuple[tuple[Callable[[type], bool], Encoder], ...] = (
    (lambda t: issubclass(t, os.PathLike), _encode_path),
    (lambda t: t.__module__ in ("datetime", "decimal", "uuid", "fractions"), _encode_by_repr),
    (dataclasses.is_dataclass, _encode_dataclass),
    (lambda t: hasattr(t, "__attrs_attrs__"), _encode_attrs),
    (lambda t: hasattr(t, "model_dump") and hasattr(t, "model_fields"), _encode_pydantic),  # pydantic v2
    (lambda t: t.__module__ == "argparse" and t.__name__ == "Namespace", _registered(vars)),
    (lambda t: t.__module__.startswith("sklearn."), _encode_reduced),  # Cython parts of fitted estimators
)

for _cls, _encoder in ((list, _encode_sequence), (tuple, _encode_sequence), (dict, _encode_dict),
                      (set, _encode_set), (frozenset, _encode_set), (enum.Enum, _encode_enum),
                      (types.FunctionType, _encode_code), (types.BuiltinFunctionType, _encode_code),
                      (types.MethodType, _encode_code), (type, _encode_code), (functools.partial, _encode_partial),
                      (re.Pattern, _registered(lambda p: (p.pattern, p.flags))),
                      (range, _registered(lambda r: (r.start, r.stop, r.step))),
                      (types.SimpleNamespace, _registered(vars)),  # configuration objects
                      # what a dataclass's generated __init__ holds for a field with a default_factory
                      (type(dataclasses._HAS_DEFAULT_FACTORY), _registered(lambda _: "default_factory"))):  # type: ignore[attr-defined]
    _register(_cls, _encoder)

# Library types, registered when their module is first seen loaded: hashing imports none of them.
_LAZY: dict[str, Callable[[Any], tuple[tuple[type, Encoder], ...]]] = {
    "numpy": lambda np: ((np.ndarray, _encode_numpy), (np.generic, _encode_numpy),
                         (np.dtype, _registered(lambda d: (d.str, str(d.descr))))),
    "pandas": lambda pd: ((pd.DataFrame, _encode_pandas), (pd.Series, _encode_pandas), (pd.Index, _encode_pandas),
                          (pd.api.extensions.ExtensionArray, _encode_pandas)),
    "torch": lambda torch: ((torch.Tensor, _encode_tensor), (torch.nn.Module, _encode_torch_module),
                            (torch.device, _registered(str)), (torch.dtype, _registered(str))),  # torch.device("cuda")
    "logging": lambda logging: ((logging.Logger, _registered(lambda lg: lg.name)),),  # what it records is no result
    "sklearn.base": lambda base: ((base.BaseEstimator, _encode_estimator),),
    "pyarrow": lambda pa: ((pa.Table, _encode_arrow), (pa.RecordBatch, _encode_arrow), (pa.Array, _encode_arrow),
                           (pa.ChunkedArray, _encode_arrow), (pa.DataType, _registered(str)),
                           (pa.Schema, _registered(lambda sc: sc.serialize().to_pybytes())),
                           (pa.Scalar, _registered(lambda x: (str(x.type), x.as_py())))),
    "scipy.sparse": lambda sp: tuple((cls, _encode_sparse) for cls in (sp.spmatrix, getattr(sp, "sparray", None))
                                     if cls is not None),
}


_LAZY_LOCK = threading.Lock()


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

"""Deterministic fingerprints of values and of code, for cache keys.

Values: a type-tagged canonical encoding fed to BLAKE3 (128-bit output; why: docs/caching.md), so
that `1`, `1.0`, `True` and `"1"` all differ, a list differs from a tuple, dicts are hashed in
insertion order (code can read the order) and sets independently of it, numpy arrays by dtype, shape
and bytes (about 1 ms for 8 MB here), pandas objects by content (index and dtypes included),
dataclasses / attrs / pydantic models and plain objects by their class's code and their fields
(private state included), torch modules and scikit-learn estimators by class, configuration and
weights (`hash_public` leaves plain objects' private attributes out: HyperNodes' documented rule,
for hardy.compat.hypernodes). `__cache_key__()` overrides all of this, and `register()` teaches hashing a library type.
What cannot be encoded deterministically raises `UnhashableError` naming the path to the part that
cannot (`model.encoder._session`); there is no fallback to `id()` or `repr()` that could collide
or vary. Built-in, library and user types sit in one table keyed by type (`register()`).

Code: a function's fingerprint covers its bytecode and constants (not its source text), its
defaults, the globals and closure values it reads — following attribute chains read from the
bytecode through user modules (`utils.clean`, `pkg.sub.fn`) and imports inside the function — and,
transitively, the code of the user functions and classes reached that way (a class by its methods,
cached properties and `lru_cache`d methods by what they wrap, nested classes, its metaclass and its
class-level values by content). Library code is identified by name and package version. While a
`Reach` is recording, fingerprints note every name they read, so that a pipeline can tell cheaply
whether the code it compiled is still the code bound to those names (docs/caching.md).
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
import sysconfig
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

from blake3 import blake3

from .errors import UNHASHABLE_FIXES, UnhashableError

FORMAT = b"hardy-key-3"  # 3: BLAKE3 instead of blake2b
DIGEST = 16

Encoder = Callable[[Any, Callable[[bytes], Any], set[int]], None]  # (value, out, values being encoded)

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
        out(b"I" + _len(len(s)) + s)
    elif t is str:
        b = value.encode("utf-8", "surrogatepass")
        out(b"S" + _len(len(b)) + b)
    else:
        _encode(value, out, set())


def _qualname(t: type) -> bytes:
    return f"{t.__module__}.{t.__qualname__}".encode()


def _len(n: int) -> bytes:
    return struct.pack("<q", n)


def _encode(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    t = type(v)
    exact = _EXACT.get(t)
    if exact is not None:
        exact(v, out, active)
    elif hasattr(v, "__cache_key__") and not isinstance(v, type):
        out(b"K" + _qualname(t) + (code_fingerprint(t) if is_user_module(t.__module__) else b""))
        _encode(v.__cache_key__(), out, active)
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
    out(b"I" + _len(len(s)) + s)


def _encode_float(v: float, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"D" + (b"nan" if math.isnan(v) else float.hex(v).encode()) + b";")


def _encode_str(v: str, out: Callable[[bytes], Any], active: set[int]) -> None:
    b = v.encode("utf-8", "surrogatepass")
    out(b"S" + _len(len(b)) + b)


def _encode_bytes(v: bytes, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"Y" + _len(len(v)) + v)


def _encode_complex(v: complex, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"C" + float.hex(v.real).encode() + b"," + float.hex(v.imag).encode() + b";")


def _encode_buffer(v: bytearray | memoryview, out: Callable[[bytes], Any], active: set[int]) -> None:
    data = bytes(v)
    out(b"A" + _len(len(data)) + data)


_SCALARS = (bool, int, float, str, bytes)


def _encode_scalar_subclass(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A subclass of a scalar type (an IntEnum, numpy.float64): the class, then the base value."""
    base = next(b for b in _SCALARS if isinstance(v, b))
    out(b"B" + _qualname(type(v)))
    _encode(base(v) if base is not str else str.__str__(v), out, active)


def _encode_sequence(v: list[Any] | tuple[Any, ...], out: Callable[[bytes], Any], active: set[int]) -> None:
    t = type(v)
    out((b"L" if isinstance(v, list) else b"U") + (b"" if t in (list, tuple) else _qualname(t)) + _len(len(v)))
    for i, x in enumerate(_guard(v, active)):
        try:
            _encode(x, out, active)
        except UnhashableError as exc:
            raise exc.at(f"[{i}]") from None
    if t not in (list, tuple):
        _container_state(v, out, active)
    active.discard(id(v))


def _encode_dict(v: dict[Any, Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    """In insertion order: code can read it (next(iter(d)), json.dumps)."""
    out(b"M" + (b"" if type(v) is dict else _qualname(type(v))) + _len(len(v)))
    for k, x in _guard(v, active).items():
        _encode(k, out, active)
        try:
            _encode(x, out, active)
        except UnhashableError as exc:
            raise exc.at(f"[{k!r}]") from None
    if type(v) is not dict:
        _container_state(v, out, active)
    active.discard(id(v))


def _encode_set(v: set[Any] | frozenset[Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    """No order to read: the sorted digests of the members."""
    digests = sorted(hash_value_in(m, active) for m in _guard(v, active))
    out((b"Z" if isinstance(v, frozenset) else b"E") + _qualname(type(v)) + _len(len(digests)) + b"".join(digests))
    if type(v) not in (set, frozenset):
        _container_state(v, out, active)
    active.discard(id(v))


def _container_state(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """What a subclass of a built-in container holds besides its items, which code can read: its
    attributes, and a defaultdict's `default_factory` (`d["new"]` is 0 or [] by it)."""
    fields = dict(getattr(v, "__dict__", None) or {})
    factory = getattr(v, "default_factory", _ABSENT) if isinstance(v, collections.defaultdict) else _ABSENT
    if factory is not _ABSENT:
        fields["default_factory"] = factory
    if fields:  # nothing for a plain subclass (a named tuple): its keys stay what they were
        out(b"@")
        _attributes(fields, out, active)


def _encode_enum(v: enum.Enum, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"En" + _qualname(type(v)))
    _encode(v.value, out, active)


def _encode_code(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"Fn" + code_fingerprint(v))


def _encode_tensor(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    import torch
    out(b"TT" + str(v.dtype).encode() + str(tuple(v.shape)).encode())
    if type(v) is not torch.Tensor or v.device.type != "cpu" or v.requires_grad:  # cpu tensors: as before
        out(b"|" + _qualname(type(v)) + str(v.device).encode() + (b"grad" if v.requires_grad else b""))
    _encode_numpy(v.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy(), out, active)


def _encode_path(v: os.PathLike[str], out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"P" + _qualname(type(v)))
    _encode(os.fspath(v), out, active)


def _encode_by_repr(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"R" + _qualname(type(v)))
    _encode(repr(v), out, active)  # datetime, decimal, uuid, fractions: exact, deterministic reprs


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
    out(tag + _qualname(t) + (code_fingerprint(t) if is_user_module(t.__module__) else b""))
    _guard(v, active)
    _attributes(fields, out, active)
    active.discard(id(v))


def _attributes(fields: dict[str, Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    out(_len(len(fields)))
    for name, x in fields.items():
        _encode(name, out, active)
        try:
            _encode(x, out, active)
        except UnhashableError as exc:
            raise exc.at(f".{name}") from None


# --- library types: registered, or known by module without importing it ------------------------


def _registered(identify: Callable[[Any], Any]) -> Callable[[Any, Callable[[bytes], Any], set[int]], None]:
    def encode_registered(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
        out(b"RG" + _qualname(type(v)))
        _encode(identify(v), out, active)
    return encode_registered


def _encode_partial(v: functools.partial[Any], out: Callable[[bytes], Any], active: set[int]) -> None:
    out(b"FP" + code_fingerprint(v.func))
    _encode((v.args, v.keywords), out, active)


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
    out(b"RD" + _qualname(type(v)))
    _encode((args, rest[0] if rest else None), out, active)


def _guard(v: Any, active: set[int]) -> Any:
    if id(v) in active:
        raise UnhashableError("a value contains itself (a reference cycle); give it a __cache_key__()")
    active.add(id(v))
    return v


def hash_value_in(v: Any, active: set[int]) -> bytes:
    h = blake3()
    _encode(v, h.update, active)
    return h.digest(DIGEST)


def _encode_numpy(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """dtype, shape, memory order and bytes. A subclass adds its class (np.matrix multiplies as
    matrices, a recarray reads fields as attributes), a masked array its mask and fill value."""
    import numpy as np
    if type(v) is not np.ndarray and not isinstance(v, np.generic):
        out(b"NS" + _qualname(type(v)))
        if isinstance(v, np.ma.MaskedArray):
            _encode_numpy(np.ma.getmaskarray(v), out, active)
            _encode(v.fill_value, out, active)
        v = v.view(np.ndarray)
    if v.dtype.hasobject:
        out(b"NO" + str(v.shape).encode())
        _encode(v.tolist(), out, active)
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
    out(b"PD" + _qualname(type(v)))
    if isinstance(v, pd.api.extensions.ExtensionArray):  # a Categorical, a nullable or Arrow array
        _encode_pandas_values(pd.Series(v, copy=False), out, active)
        return
    if isinstance(v, pd.Index):
        _encode_pandas_values(v, out, active)
        _encode(list(v.names), out, active)
        return
    _encode(dict(v.attrs), out, active)
    _encode_pandas(v.index, out, active)
    if isinstance(v, pd.Series):
        _encode(v.name, out, active)
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
    out(b"pv" + str(dtype).encode() + _len(len(v)))
    if isinstance(dtype, pd.CategoricalDtype):
        out(b"T" if dtype.ordered else b"F")
        _encode_pandas(dtype.categories, out, active)
        _encode_numpy(np.asarray(v.cat.codes if isinstance(v, pd.Series) else v.codes), out, active)
    elif isinstance(dtype, np.dtype) and not isinstance(v, pd.MultiIndex):
        _encode_numpy(v.to_numpy(), out, active)  # object columns element by element, typed
    elif isinstance(v, pd.MultiIndex):
        _encode(list(v), out, active)
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
    out(b"AR" + _qualname(type(v)))
    out(memoryview(sink.getvalue()))  # type: ignore[arg-type]  # a pyarrow Buffer is a buffer


def _encode_sparse(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A scipy.sparse matrix or array: class and format (csr and csc differ for code that reads
    `.indices`), shape, dtype, block size, then its entries in stored order (explicit zeros too)."""
    import numpy as np
    coo = v.tocoo(copy=False)
    coords = getattr(coo, "coords", None) or (coo.row, coo.col)
    out(b"SP" + _qualname(type(v)) + f"{v.format}{v.shape}{v.dtype.str}{getattr(v, 'blocksize', '')}".encode())
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


# --- code -----------------------------------------------------------------------------------------


class Reach:
    """What a set of fingerprints read, to tell cheaply whether it still holds: each global,
    module attribute, class attribute and module imported inside a function that the code
    reaches, as (namespace, name, the object found there), and the user modules reached. A
    notebook cell run again, a helper redefined, a global reassigned or `importlib.reload` all
    put another object under a name; `changed()` is one dict lookup and an identity test per
    name. A value changed in place (a global list appended to) keeps its object: not seen."""

    __slots__ = ("reads", "modules")

    def __init__(self) -> None:
        self.reads: list[tuple[Any, str, Any]] = []
        self.modules: set[str] = set()

    def changed(self) -> bool:
        for namespace, name, found in self.reads:  # noqa: SIM110 - a loop is faster than any() here
            if namespace.get(name, _ABSENT) is not found:
                return True
        return False


_RECORDING = threading.local()


def recording(reach: Reach | None) -> Any:
    """Make this thread's fingerprints note what they read into `reach` (None: stop); returns the
    previous recorder, to restore."""
    previous = getattr(_RECORDING, "reach", None)
    _RECORDING.reach = reach
    return previous


def _read(namespace: Any, name: str) -> None:
    reach = getattr(_RECORDING, "reach", None)
    if reach is not None:
        reach.reads.append((namespace, name, namespace.get(name, _ABSENT)))


def _module_reached(name: str | None) -> None:
    reach = getattr(_RECORDING, "reach", None)
    if reach is not None and name and name != "__main__" and name in sys.modules:
        reach.modules.add(name)


def module_stamp(module: types.ModuleType, names: Iterable[str]) -> dict[str, bytes]:
    """What the module binds to `names`, as loaded in this process: a function's or class's code
    (not the values it reads), a constant (numbers, strings, tuples of them). Two processes with
    equal stamps run the same code from those names; mutable state (a dict filled at run time)
    is not part of it."""
    stamp = {}
    namespace = vars(module)
    for name in names:
        value = namespace.get(name, _ABSENT)
        h = blake3()
        if isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == module.__name__:
            for member in (vars(value).values() if isinstance(value, type) else (value,)):
                code = getattr(getattr(member, "__func__", member), "__code__", None)
                if code is not None:
                    _code(code, h.update)
        elif isinstance(value, (type(None), bool, int, float, complex, str, bytes, tuple)):
            try:
                _encode(value, h.update, set())
            except UnhashableError:
                continue
        else:
            continue
        stamp[name] = h.digest(DIGEST)
    return stamp

_LIBRARY_ROOTS = tuple({p for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"),
                                    sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib"))
                        if p})


def is_user_module(module_name: str | None) -> bool:
    """User code is whatever is not the standard library, an installed package, or hardy itself.

    Code of unknown origin (exec'd, no module) counts as user code: it is hashed by its content.
    """
    if not module_name:
        return True
    known = _USER.get(module_name)
    if known is not None:
        return known
    if module_name == "builtins" or module_name.split(".")[0] == "hardy":
        return False
    if module_name == "__main__":
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return module_name not in sys.builtin_module_names and module_name not in sys.stdlib_module_names
    user = _is_user_file(path)
    _USER[module_name] = user  # a loaded module's file does not move: resolving it once is enough
    return user


def _is_user_file(path: str) -> bool:
    path = os.path.realpath(path)
    return not any(path.startswith(root + os.sep) for root in _REAL_ROOTS) \
        and "site-packages" not in path and "dist-packages" not in path


_REAL_ROOTS = tuple(os.path.realpath(root) for root in _LIBRARY_ROOTS)
_USER: dict[str, bool] = {}


def _package_version(module_name: str) -> str:
    top = sys.modules.get(module_name.split(".")[0])
    return str(getattr(top, "__version__", ""))


def code_fingerprint(obj: Any) -> bytes:
    """What a function computes, as far as Python can see: a 16-byte digest (see module docstring)."""
    busy: set[int] = _BUSY.__dict__.setdefault("ids", set())
    if id(obj) in busy:  # Config.DEFAULT = Config(): the class's value hashes the class being hashed
        return b"self:" + _qualname(obj if isinstance(obj, type) else type(obj))
    busy.add(id(obj))
    try:
        h = blake3()
        _fingerprint(obj, h.update, {})
        return h.digest(DIGEST)
    finally:
        busy.discard(id(obj))


_BUSY = threading.local()


def _fingerprint(obj: Any, out: Callable[[bytes], Any], seen: dict[int, int]) -> None:
    if id(obj) in seen:  # recursion and mutual recursion: refer back by position
        out(b"@" + _len(seen[id(obj)]))
        return
    seen[id(obj)] = len(seen)
    func = getattr(obj, "__func__", obj)  # bound methods: the function (its instance is an input)
    if not isinstance(func, (types.FunctionType, type)) and getattr(func, "__wrapped__", None) is not None:
        out(b"wraps:" + _qualname(type(func)))  # lru_cache, a Node: the code it wraps
        _fingerprint(func.__wrapped__, out, seen)
        return
    module = getattr(func, "__module__", None)
    if not is_user_module(module):
        name = getattr(func, "__qualname__", None) or getattr(type(func), "__qualname__", "?")
        out(b"lib:" + f"{module}.{name}@{_package_version(module or '')}".encode())
    elif isinstance(func, _BUILTIN_CODE):  # tuple.__new__ (a named tuple's __new__ reads it): C code, by name
        owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
        where = _qualname(owner) if isinstance(owner, type) else str(module).encode()
        out(b"builtin:" + where + b"." + func.__name__.encode())
    elif isinstance(func, type):
        _fingerprint_class(func, out, seen)
    elif getattr(func, "__code__", None) is None:
        call = getattr(type(func), "__call__", None)  # noqa: B004 - the method itself is fingerprinted
        if call is None:
            raise UnhashableError(f"cannot fingerprint {func!r}: it is not a function")
        out(b"callable:" + _qualname(type(func)))
        _fingerprint(call, out, seen)
        _encode(func, out, set())
    else:
        _fingerprint_function(func, out, seen)


def _fingerprint_class(cls: type, out: Callable[[bytes], Any], seen: dict[int, int]) -> None:
    """A user class: its user bases and metaclass, its methods and properties (cached ones and
    `lru_cache`d ones by the function they wrap), nested classes, and its class-level values by
    content (`Model.THRESHOLD`, a class-level array or configured instance), like globals."""
    out(b"class:" + _qualname(cls))
    _module_reached(cls.__module__)
    members = vars(cls)
    for name in members:
        _read(members, name)
    for base in (*cls.__mro__[1:], type(cls)):
        if is_user_module(base.__module__):
            _fingerprint(base, out, seen)
    for name, member in sorted(vars(cls).items()):
        target = getattr(member, "__func__", member)  # staticmethod, classmethod
        if isinstance(target, (property, functools.cached_property)):
            target = target.fget if isinstance(target, property) else target.func
        if isinstance(target, (types.FunctionType, type)) or hasattr(target, "__wrapped__"):
            out(name.encode())
            if target is not None:
                _fingerprint(target, out, seen)
        elif not name.startswith("__") and not isinstance(target, _DESCRIPTORS):
            out(name.encode())
            try:
                _encode(member, out, set())
            except UnhashableError:  # a class-level cache, lock or registry: state, not configuration
                out(b"?")


_BUILTIN_CODE = (types.BuiltinFunctionType, types.WrapperDescriptorType, types.MethodWrapperType,
                 types.MethodDescriptorType, types.ClassMethodDescriptorType)
_DESCRIPTORS = (types.MemberDescriptorType, types.GetSetDescriptorType)  # __slots__ fields: per instance


def _fingerprint_function(func: Any, out: Callable[[bytes], Any], seen: dict[int, int]) -> None:
    """A user function: its code and defaults, then what it reads (globals, closure cells, modules
    it imports), each with the attribute chains the code reads from it."""
    code = func.__code__
    _code(code, out)
    out(b"defaults")
    _encode((getattr(func, "__defaults__", None), getattr(func, "__kwdefaults__", None)), out, set())
    globs = getattr(func, "__globals__", {})
    chains = _chains(code)
    _module_reached(getattr(func, "__module__", None))
    for kind, name in chains:  # the names it loads, present or not: one defined later shadows a builtin
        if kind == "g":
            _read(globs, name)
    for name in sorted(_global_names(code)):
        if name in globs:
            out(b"g:" + name.encode())
            _reference(globs[name], out, seen, chains.get(("g", name), ()), name, func)
    for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
        out(b"c:" + name.encode())
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            out(b"empty")
            continue
        _reference(value, out, seen, chains.get(("c", name), ()), name, func)
    for root in sorted(r for r in chains if r[0] == "import"):  # imports inside the function
        out(b"i:" + root[1].encode())
        module = _imported(root[1])
        _read(sys.modules, root[1])
        if module is not _ABSENT:
            _reference(module, out, seen, chains[root], root[1], func)


def _reference(value: Any, out: Callable[[bytes], Any], seen: dict[int, int], chains: Any, name: str,
               reader: Any) -> None:
    """A global, closure value or imported module the code reads, with the attribute chains the
    code reads from it: through a user module, what counts is what the chains reach."""
    if isinstance(value, types.ModuleType):
        out(b"mod:" + value.__name__.encode() + _package_version(value.__name__).encode())
        if is_user_module(value.__name__):
            _module_reached(value.__name__)
            _module_attributes(value, out, seen, chains, name, reader)
    elif isinstance(value, (types.FunctionType, type)) or hasattr(value, "__wrapped__"):
        _fingerprint(value, out, seen)
    elif isinstance(value, types.MethodType):  # a bound method read as a global: its object counts too
        _fingerprint(value.__func__, out, seen)
        _reference(value.__self__, out, seen, (), f"{name}.__self__", reader)
    else:  # a value; an instance of a user class is keyed by its class's code too (see _object)
        try:
            _encode(value, out, set())
        except UnhashableError as exc:
            kind = "module attribute" if "." in name else "global"
            reader_name = f"{getattr(reader, '__module__', '?')}.{getattr(reader, '__qualname__', '?')}"
            raise UnhashableError(f"{reader_name} reads the {kind} {name!r}: {exc.describe(name)}", exc.culprit,
                                  exc.path) from None


def _module_attributes(module: types.ModuleType, out: Callable[[bytes], Any], seen: dict[int, int],
                       chains: Any, name: str, reader: Any) -> None:
    """What a function reaches through a user module: each attribute chain, followed through
    submodules to the first object that is not one. Read without a chain (`getattr(m, name)`,
    passed along as a value), the module counts by all the functions and classes it defines."""
    if not chains or () in chains:
        if id(module) in seen:
            out(b"@" + _len(seen[id(module)]))
        else:
            seen[id(module)] = len(seen)
            for attr in vars(module):
                _read(vars(module), attr)  # a module read whole: any name it binds again counts
            for attr, value in sorted(vars(module).items()):
                if isinstance(value, (types.FunctionType, type)) and value.__module__ == module.__name__:
                    out(b"a:" + attr.encode())
                    _fingerprint(value, out, seen)
    for chain in sorted(c for c in chains if c):
        target, path = module, name
        for attr in chain:
            if not (isinstance(target, types.ModuleType) and is_user_module(target.__name__)):
                break
            path += "." + attr
            _read(vars(target), attr)
            target = getattr(target, attr, _ABSENT)  # type: ignore[arg-type]  # absent: fails the same way when run
        out(b"." + path.encode())
        if target is _ABSENT:
            out(b"absent")
        else:  # a user module the chain ends at is read as a value: all of it counts
            _reference(target, out, seen, ((),) if isinstance(target, types.ModuleType) else (), path, reader)


_ABSENT = object()


def _imported(module_name: str) -> Any:
    """The module an import inside a function binds. One not imported yet is imported now only if
    it is user code: a library imported inside a node (`import torch` there, to keep the parent
    process free of its threads) must stay unimported here; it counts by name."""
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    import importlib.util
    try:
        top = importlib.util.find_spec(module_name.split(".")[0])  # a top-level name: no code runs
        if top is None or top.origin is None or not _is_user_file(top.origin):
            return _ABSENT
        return importlib.import_module(module_name)
    except Exception:  # the node itself will fail the same way when it runs
        return _ABSENT


@functools.lru_cache(maxsize=4096)  # code objects are immutable; reading bytecode is the slow part
def _chains(code: types.CodeType) -> dict[tuple[str, str], set[tuple[str, ...]]]:
    """The attribute chains the code (and its nested code) reads, from the bytecode:
    `utils.clean(x)` is LOAD_GLOBAL utils, LOAD_METHOD clean -> {("g", "utils"): {("clean",)}}.
    Roots are globals ("g"), closure cells ("c") and modules imported inside the function
    ("import", top module): `from m import f` there, then `f.g`, is the chain m.f.g."""
    found: dict[tuple[str, str], set[tuple[str, ...]]] = {}
    stack = [code]
    while stack:
        c = stack.pop()
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        _scan_chains(c, found)
    return found


def _scan_chains(c: types.CodeType, found: dict[tuple[str, str], set[tuple[str, ...]]]) -> None:
    """Add the chains one code object (not its nested code) reads to `found`."""
    import dis
    bound: dict[str, tuple[tuple[str, str], tuple[str, ...]]] = {}  # local -> (root, chain prefix)
    root: tuple[str, str] | None = None
    attrs: list[str] = []
    importing: tuple[str, str] | None = None
    prefix: tuple[str, ...] = ()
    last_const: Any = None  # IMPORT_NAME's fromlist: None for `import a.b`
    for ins in dis.get_instructions(c):
        op = ins.opname
        if op in ("LOAD_ATTR", "LOAD_METHOD") and root is not None:
            attrs.append(ins.argval)
            continue
        if root is not None:
            found.setdefault(root, set()).add(tuple(attrs))
            root = None
        if op in ("LOAD_GLOBAL", "LOAD_NAME"):
            root, attrs = ("g", ins.argval), []
        elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF") and ins.argval in c.co_freevars:
            root, attrs = ("c", ins.argval), []
        elif op in ("LOAD_FAST", "LOAD_DEREF") and ins.argval in bound:
            root, chain = bound[ins.argval]
            attrs = list(chain)
        elif op == "IMPORT_NAME":  # `import a.b` binds a; `from a.b import c` reads from a.b
            importing = ("import", ins.argval if last_const is not None else ins.argval.split(".")[0])
            prefix = ()
            found.setdefault(importing, set())
            continue
        elif op == "IMPORT_FROM" and importing is not None:
            prefix = (*prefix, ins.argval)
            found[importing].add(prefix)
            continue
        elif op.startswith("STORE_") and importing is not None:
            bound[ins.argval] = (importing, prefix)
            prefix = ()
            continue
        elif op in ("SWAP", "ROT_TWO", "POP_TOP") and importing is not None:
            continue
        importing = None
        last_const = ins.argval if op == "LOAD_CONST" else None
    if root is not None:
        found.setdefault(root, set()).add(tuple(attrs))


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


# Flags that change what code does (varargs, generator, coroutine...). Compiler flags such as
# `from __future__ import annotations`, inherited by exec() from its caller, do not count.
_SEMANTIC_FLAGS = 0x3FF


def _code(code: types.CodeType, out: Callable[[bytes], Any]) -> None:
    out(b"code" + _len(len(code.co_code)) + code.co_code)
    out(repr((code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount,
              code.co_flags & _SEMANTIC_FLAGS)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code(const, out)
        else:
            _encode(const, out, set())

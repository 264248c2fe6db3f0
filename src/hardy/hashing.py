"""Deterministic fingerprints of values and of code, for cache keys.

Values: a type-tagged canonical encoding fed to BLAKE3 (128-bit output), so that `1`, `1.0`,
`True` and `"1"` all differ, a list differs from a tuple, dicts and sets do not depend on insertion
order, numpy arrays are hashed by dtype, shape and bytes (about 1 ms for 8 MB here; why BLAKE3:
docs/caching.md), pandas objects by content (index and
dtypes included), dataclasses / attrs / pydantic models and plain objects by their fields (private
state included). `__cache_key__()` overrides all of this. What cannot be encoded deterministically
raises `UnhashableError`; there is no fallback to `id()` or `repr()` that could collide or vary.

Code: a function's fingerprint covers its bytecode and constants (not its source text), its
defaults, the globals and closure values it reads, and — transitively — the code of the functions
and classes from user modules it calls. Library code is identified by name and package version.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import struct
import sys
import sysconfig
import types
from typing import Any, Callable

from blake3 import blake3

FORMAT = b"hardy-key-2"  # 2: BLAKE3 instead of blake2b
DIGEST = 16


class UnhashableError(TypeError):
    """A value has no deterministic encoding; the message says what and how to fix it."""


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


def _encode(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:  # noqa: C901 - one dispatch
    t = type(v)
    if v is None:
        out(b"N")
    elif t is bool:
        out(b"T" if v else b"F")
    elif t is int:
        s = str(v).encode()
        out(b"I" + _len(len(s)) + s)
    elif t is float:
        out(b"D" + (b"nan" if math.isnan(v) else float.hex(v).encode()) + b";")
    elif t is str:
        b = v.encode("utf-8", "surrogatepass")
        out(b"S" + _len(len(b)) + b)
    elif t is bytes:
        out(b"Y" + _len(len(v)) + v)
    elif hasattr(v, "__cache_key__") and not isinstance(v, type):
        out(b"K" + _qualname(t))
        _encode(v.__cache_key__(), out, active)
    elif isinstance(v, (bool, int, float, str, bytes)):  # subclasses: the class, then the base value
        base = next(b for b in (bool, int, float, str, bytes) if isinstance(v, b))
        out(b"B" + _qualname(t))
        _encode(base(v) if base is not str else str.__str__(v), out, active)
    elif isinstance(v, (list, tuple)):
        out((b"L" if isinstance(v, list) else b"U") + (b"" if t in (list, tuple) else _qualname(t))
            + _len(len(v)))
        for x in _guard(v, active):
            _encode(x, out, active)
        active.discard(id(v))
    elif t in (dict, set, frozenset) or isinstance(v, (dict, set, frozenset)):
        # order-independent: the sorted digests of the members
        tag = b"M" if isinstance(v, dict) else (b"Z" if isinstance(v, frozenset) else b"E")
        members = v.items() if isinstance(v, dict) else v
        digests = sorted(hash_value_in(m, active) for m in _guard(members, active, id(v)))
        active.discard(id(v))
        out(tag + _qualname(t) + _len(len(digests)) + b"".join(digests))
    elif t is complex:
        out(b"C" + float.hex(v.real).encode() + b"," + float.hex(v.imag).encode() + b";")
    elif t is bytearray or t is memoryview:
        data = bytes(v)
        out(b"A" + _len(len(data)) + data)
    elif isinstance(v, enum.Enum):
        out(b"En" + _qualname(t))
        _encode(v.value, out, active)
    elif isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)) or t is types.MethodType:
        out(b"Fn" + code_fingerprint(v))
    elif _is_numpy(v):
        _encode_numpy(v, out, active)
    elif _is_pandas(v):
        _encode_pandas(v, out)
    elif _is_torch(v):
        out(b"TT" + str(v.dtype).encode() + str(tuple(v.shape)).encode())
        _encode_numpy(v.detach().cpu().contiguous().view(-1).view(dtype=_torch_bytes()).numpy(), out, active)
    elif isinstance(v, os.PathLike):
        out(b"P" + _qualname(t))
        _encode(os.fspath(v), out, active)
    elif type(v).__module__ in ("datetime", "decimal", "uuid", "fractions"):
        out(b"R" + _qualname(t))
        _encode(repr(v), out, active)  # these reprs are exact and deterministic
    elif dataclasses.is_dataclass(v):
        out(b"DC" + _qualname(t))
        _fields(v, [f.name for f in dataclasses.fields(v)], out, active)
    elif hasattr(t, "__attrs_attrs__"):
        out(b"AT" + _qualname(t))
        _fields(v, [a.name for a in t.__attrs_attrs__], out, active)
    elif hasattr(v, "model_dump") and hasattr(t, "model_fields"):  # pydantic v2
        out(b"PY" + _qualname(t))
        _encode((v.model_dump(), getattr(v, "__pydantic_private__", None)), out, active)
    elif is_user_module(t.__module__) and (hasattr(v, "__dict__") or hasattr(t, "__slots__")):
        state = dict(getattr(v, "__dict__", {}))
        for cls in t.__mro__:
            for s in getattr(cls, "__slots__", ()):
                if isinstance(s, str) and hasattr(v, s) and s not in ("__dict__", "__weakref__"):
                    state[s] = getattr(v, s)
        if not state and not hasattr(v, "__dict__"):
            raise UnhashableError(_cannot(t))
        out(b"O" + _qualname(t))
        _encode(state, out, active)
    else:
        raise UnhashableError(_cannot(t))


def _cannot(t: type) -> str:
    return (f"a {t.__module__}.{t.__qualname__} has no deterministic content to hash; give the class a "
            "__cache_key__() method returning what identifies the object (e.g. its constructor "
            "arguments), or opt the node out with @node(cache=False)")


def _guard(v: Any, active: set[int], ident: int | None = None) -> Any:
    ident = id(v) if ident is None else ident
    if ident in active:
        raise UnhashableError("a value contains itself (a reference cycle); give it a __cache_key__()")
    active.add(ident)
    return v


def hash_value_in(v: Any, active: set[int]) -> bytes:
    h = blake3()
    _encode(v, h.update, active)
    return h.digest(DIGEST)


def _fields(v: Any, names: list[str], out: Callable[[bytes], Any], active: set[int]) -> None:
    marker = id(v)
    _guard(v, active, marker)
    _encode({n: getattr(v, n) for n in names}, out, active)
    active.discard(marker)


def _is_numpy(v: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(v, (np.ndarray, np.generic))


def _encode_numpy(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    import numpy as np
    if v.dtype.hasobject:
        out(b"NO" + str(v.shape).encode())
        _encode(v.tolist(), out, active)
        return
    arr = np.ascontiguousarray(v)
    out(b"NP" + v.dtype.str.encode() + str(v.dtype.descr).encode() + str(arr.shape).encode()
        + (b"s" if isinstance(v, np.generic) else b"a"))
    out(memoryview(arr).cast("B") if arr.size else b"")


def _is_torch(v: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def _torch_bytes() -> Any:
    import torch
    return torch.uint8


def _is_pandas(v: Any) -> bool:
    pd = sys.modules.get("pandas")
    return pd is not None and isinstance(v, (pd.DataFrame, pd.Series, pd.Index))


def _encode_pandas(v: Any, out: Callable[[bytes], Any]) -> None:
    import pandas as pd
    meta: list[Any] = [type(v).__name__, v.shape]
    if isinstance(v, pd.DataFrame):
        meta += [list(map(str, v.columns)), [str(d) for d in v.dtypes], str(v.index.dtype), v.index.names]
    else:
        meta += [str(v.dtype), str(v.name), str(getattr(v, "index", v).dtype)]
    out(b"PD" + repr(meta).encode())
    if isinstance(v, pd.Index):
        v = v.to_series(index=None)
    rows = pd.util.hash_pandas_object(v, index=True).to_numpy()
    out(memoryview(rows).cast("B") if rows.size else b"")


# --- code -----------------------------------------------------------------------------------------

_LIBRARY_ROOTS = tuple({p for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"),
                                    sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib"))
                        if p})


def is_user_module(module_name: str | None) -> bool:
    """User code is whatever is not the standard library, an installed package, or hardy itself.

    Code of unknown origin (exec'd, no module) counts as user code: it is hashed by its content.
    """
    if not module_name:
        return True
    if module_name == "builtins" or module_name.split(".")[0] == "hardy":
        return False
    if module_name == "__main__":
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return module_name not in sys.builtin_module_names and module_name not in sys.stdlib_module_names
    path = os.path.realpath(path)
    return not any(path.startswith(os.path.realpath(root) + os.sep) for root in _LIBRARY_ROOTS) \
        and "site-packages" not in path and "dist-packages" not in path


def _package_version(module_name: str) -> str:
    top = sys.modules.get(module_name.split(".")[0])
    return str(getattr(top, "__version__", ""))


def code_fingerprint(obj: Any) -> bytes:
    """What a function computes, as far as Python can see: a 16-byte digest (see module docstring)."""
    h = blake3()
    _fingerprint(obj, h.update, {})
    return h.digest(DIGEST)


def _fingerprint(obj: Any, out: Callable[[bytes], Any], seen: dict[int, int]) -> None:
    if id(obj) in seen:  # recursion and mutual recursion: refer back by position
        out(b"@" + _len(seen[id(obj)]))
        return
    seen[id(obj)] = len(seen)
    func = getattr(obj, "__func__", obj)  # bound methods: the function (its instance is an input)
    module = getattr(func, "__module__", None)
    if not is_user_module(module):
        name = getattr(func, "__qualname__", None) or getattr(type(func), "__qualname__", "?")
        out(b"lib:" + f"{module}.{name}@{_package_version(module or '')}".encode())
        return
    if isinstance(func, type):
        out(b"class:" + _qualname(func))
        for base in func.__mro__[1:]:
            if is_user_module(base.__module__):
                _fingerprint(base, out, seen)
        for name, member in sorted(vars(func).items()):
            target = getattr(member, "__func__", member)
            if isinstance(target, (types.FunctionType, property)):
                out(name.encode())
                _fingerprint(target.fget if isinstance(target, property) else target, out, seen)
        return
    code = getattr(func, "__code__", None)
    if code is None:
        call = getattr(type(func), "__call__", None)
        if call is None:
            raise UnhashableError(f"cannot fingerprint {func!r}: it is not a function")
        out(b"callable:" + _qualname(type(func)))
        _fingerprint(call, out, seen)
        _encode(func, out, set())
        return
    _code(code, out)
    out(b"defaults")
    _encode((getattr(func, "__defaults__", None), getattr(func, "__kwdefaults__", None)), out, set())
    globs = getattr(func, "__globals__", {})
    for name in sorted(_global_names(code)):
        if name in globs:
            out(b"g:" + name.encode())
            _reference(globs[name], out, seen)
    for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
        out(b"c:" + name.encode())
        try:
            _reference(cell.cell_contents, out, seen)
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            out(b"empty")


def _reference(value: Any, out: Callable[[bytes], Any], seen: dict[int, int]) -> None:
    """A global or closure value the code reads."""
    if isinstance(value, types.ModuleType):
        out(b"mod:" + value.__name__.encode() + _package_version(value.__name__).encode())
    elif isinstance(value, (types.FunctionType, types.MethodType, type)) or hasattr(value, "__wrapped__"):
        _fingerprint(getattr(value, "func", value) if hasattr(value, "inputs") else value, out, seen)
    else:
        try:
            _encode(value, out, set())
        except UnhashableError:
            # An object we cannot encode (a client, a lock): it is identified by its type only.
            out(b"opaque:" + _qualname(type(value)))


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

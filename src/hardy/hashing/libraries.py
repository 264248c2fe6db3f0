"""How values of library types are hashed: numpy arrays, pandas objects, torch tensors and modules,
pyarrow tables, scipy.sparse matrices, loggers (TorchScript: `torchscript`; scikit-learn estimators:
`models`).

`hardy.hashing.values` holds the table of encoders by type and the rules for built-in and user
types; the types here are registered into it only once their library is loaded (`LIBRARIES`,
`register_library`), so hashing imports none of these libraries and a library not used costs
nothing. Each encoder feeds what code can read of a value: dtype, shape, memory order and bytes
for an array, labels, dtypes and values for a frame, configuration and weights for a torch module.
Like `code`, this module registers itself into `values` when imported (by `hardy.hashing`), so
imports point one way (libraries -> values).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from ..errors import UnhashableError
from .classes import class_code, tz_key
from .distributions import module_identity
from .origin import is_user_module
from .values import (
    Encoder,
    encode_attributes,
    encode_callable,
    encode_into,
    encode_object,
    encode_subclass_state,
    hash_value_in,
    identified_by,
    length,
    register_library,
    type_name,
)


def _encode_numpy(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """dtype (its `metadata` too, which code reads), shape, memory order and bytes. A subclass adds
    its class (np.matrix multiplies as matrices, a recarray reads fields as attributes), a masked
    array its mask, fill value and whether the mask is hard (an assignment to a masked element is
    then ignored). The shape is the array's own: `np.array(5)` is not `np.array([5])` (`.ndim`,
    iteration and `len` tell them apart); a numpy scalar keeps the one-element shape it was keyed by."""
    import numpy as np
    if type(v) is not np.ndarray and not isinstance(v, np.generic):
        out(b"NS" + type_name(type(v)))
        if is_user_module(type(v).__module__):  # a user's subclass: its code, and what `__array_finalize__` set
            encode_subclass_state(v, out, active)
        if isinstance(v, np.ma.MaskedArray):
            _encode_numpy(np.ma.getmaskarray(v), out, active)
            encode_into(v.fill_value, out, active)
            if v.hardmask:  # (said only when hard: a soft mask's keys stay those of earlier versions)
                out(b"H")
        v = v.view(np.ndarray)
    if v.dtype.metadata is not None:  # (said only when set: other arrays keep their keys)
        out(b"md")
        encode_into(dict(v.dtype.metadata), out, active)
    if v.dtype.hasobject:
        out(b"NO" + str(v.shape).encode())
        if v.dtype.kind != "O":  # a record with an object field: its fields' names, types and byte order
            out(b"d" + v.dtype.str.encode() + str(v.dtype.descr).encode())  # (a plain object array keeps its key)
        _memory_order(v, out)
        encode_into(v.tolist(), out, active)
        return
    arr = np.ascontiguousarray(v)
    out(b"NP" + v.dtype.str.encode() + str(v.dtype.descr).encode()
        + str(arr.shape if isinstance(v, np.generic) else v.shape).encode()
        + (b"s" if isinstance(v, np.generic) else b"a"))
    _memory_order(v, out)
    if v.dtype.kind in "mM":  # datetime64 / timedelta64: no buffer format of their own
        arr = arr.reshape(-1).view(np.uint8)
    elif v.dtype.kind in "fc" and v.dtype.itemsize > 8:
        arr = _significant(arr)
    out(memoryview(arr).cast("B") if arr.size else b"")  # type: ignore[arg-type]  # ndarray is a buffer; out takes any


def _memory_order(v: Any, out: Callable[[bytes], Any]) -> None:
    """Strides code can read (`ravel("K")`, `.flags`), said when not C-contiguous: Fortran or strided."""
    if not v.flags.c_contiguous:
        out(b"F" if v.flags.f_contiguous else b"K")


def _significant(arr: Any) -> Any:
    """A `longdouble` or `clongdouble` array's bytes without padding: x87's 80-bit format (`nmant`
    63) is stored in 12 or 16 bytes, the last ones whatever the memory held (an identical array was
    keyed otherwise in every process). IEEE quad, double-double and a double fill all their bytes."""
    import numpy as np
    part = arr.dtype.itemsize // (2 if arr.dtype.kind == "c" else 1)
    if np.finfo(arr.dtype).nmant != 63 or part <= 10:
        return arr
    cut = slice(part - 10, part) if arr.dtype.byteorder == ">" else slice(0, 10)  # (the exponent's end)
    return np.ascontiguousarray(arr.reshape(-1).view(np.uint8).reshape(-1, part)[:, cut])


def _encode_ndarray(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """An array as `_encode_numpy` keys it, then whether it is read-only (`x *= 2` raises on it),
    said only then, as a memoryview's `.readonly`: writable arrays keep their keys. Only for an
    array that is itself the value: the arrays a frame's or a tensor's key is made of are views
    whose flags say nothing of theirs (pandas 3 hands out read-only ones)."""
    _encode_numpy(v, out, active)
    if not v.flags.writeable:
        out(b"ro")


def _encode_pandas(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A frame, series or index by everything code can read: class, names and labels (typed: a
    column `1` is not a column `"1"`), `attrs` and flags (`set_flags`: duplicate labels refused),
    each column's dtype (a categorical's categories and order) and values (object columns typed
    like Python values); a MultiIndex by its levels, unused values too, and codes."""
    import pandas as pd
    out(b"PD" + type_name(type(v)))
    if is_user_module(type(v).__module__):  # a user's subclass: its code, and what its `_metadata` names
        _pandas_subclass_state(v, out, active)
    if isinstance(v, pd.api.extensions.ExtensionArray):  # a Categorical, a nullable or Arrow array
        _encode_pandas_values(pd.Series(v, copy=False), out, active)
        return
    if isinstance(v, pd.Index):
        _encode_pandas_values(v, out, active)
        encode_into(list(v.names), out, active)
        freq = getattr(v, "freq", None)  # a date range's step, which `shift`, `asfreq` and `str(freq)` read
        if freq is not None:
            encode_into(str(freq), out, active)
        return
    encode_into(dict(v.attrs), out, active)
    if not v.flags.allows_duplicate_labels:  # (said only when set: other frames' keys stay as they were)
        out(b"u")
    _encode_pandas(v.index, out, active)
    if isinstance(v, pd.Series):
        encode_into(v.name, out, active)
        _encode_pandas_values(v, out, active)
        return
    _encode_pandas(v.columns, out, active)
    for i in range(v.shape[1]):
        _encode_pandas_values(v.iloc[:, i], out, active)


def _pandas_subclass_state(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A user's subclass of a frame or series: its code (its methods and properties are code the
    node runs) and the attributes its `_metadata` names (`df.unit = "kg"`, which pandas carries
    through its operations), as numpy subclasses are keyed. Its other attributes are pandas' own
    (its block manager, caches): the values are keyed by the rules for frames."""
    out(b"sub" + class_code(type(v), active))
    # (pandas' subclassing attribute, read off the classes: hardy's callbacks have a `_metadata` of their own)
    names = next((vars(c)["_metadata"] for c in type(v).__mro__ if "_metadata" in vars(c)), ())
    own = vars(v)
    encode_attributes({name: own[name] for name in dict.fromkeys(names) if name in own}, out, active)


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
        for level, codes in zip(v.levels, v.codes, strict=True):
            _encode_pandas(level, out, active)
            _encode_numpy(np.asarray(codes), out, active)
    else:  # extension dtypes (nullable ints, strings, tz-aware times, Arrow)
        _encode_extension_values(v.array, out, active)


def _encode_extension_values(arr: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """An extension array's values by what they hold, not by pandas' row hashes (a 64-bit SipHash
    with a public key, which equates -0.0 and 0.0 and can be made to collide): a masked array
    (`Int64`, `Float64`, `boolean`) by its mask and its values with masked slots zeroed; an
    Arrow-backed one (`pd.ArrowDtype`, `str`, `string[pyarrow]`) by its Arrow IPC form; dates,
    durations and periods by their integers, and a tz-aware column also by its wall times (what
    its zone computes for each); intervals by their bounds, a sparse array by its stored values and
    where they sit; any other by `np.asarray`, element by element as object columns are."""
    import numpy as np
    import pandas as pd
    kinds = pd.arrays
    out(type_name(type(arr)))
    if isinstance(arr, (kinds.IntegerArray, kinds.FloatingArray, kinds.BooleanArray)):
        zero = arr.dtype.numpy_dtype.type(0)
        _encode_numpy(np.asarray(arr.isna()), out, active)
        _encode_numpy(arr.to_numpy(dtype=arr.dtype.numpy_dtype, na_value=zero), out, active)
    elif isinstance(arr, kinds.ArrowExtensionArray):
        _encode_arrow(arr.__arrow_array__(), out, active)
    elif isinstance(arr, (kinds.DatetimeArray, kinds.TimedeltaArray, kinds.PeriodArray)):
        _encode_numpy(arr.asi8, out, active)
        if getattr(arr, "tz", None) is not None:
            _encode_numpy(arr.tz_localize(None).asi8, out, active)
    elif isinstance(arr, kinds.IntervalArray):
        _encode_pandas(arr.left, out, active)
        _encode_pandas(arr.right, out, active)
    elif isinstance(arr, kinds.SparseArray):
        out(arr.kind.encode())
        encode_into(arr.fill_value, out, active)
        _encode_numpy(arr.sp_values, out, active)
        _encode_numpy(np.asarray(arr.sp_index.indices), out, active)
    else:  # (a library's own: what it holds, typed; refused, naming the element, if that cannot be hashed)
        _encode_numpy(np.asarray(arr, dtype=object), out, active)


def _timestamp(ts: Any) -> tuple[Any, ...]:
    """A pandas Timestamp: its instant in its own unit (`asm8`, with the nanoseconds a datetime's
    repr drops), then its zone keyed as a datetime's is (`classes.tz_key`)."""
    return (ts.asm8,) if ts.tzinfo is None else (ts.asm8, *tz_key(ts))


def _zone_key(zone: Any) -> str:
    """A ZoneInfo by its key, which names the rules it loads; one made from a file
    (`ZoneInfo.from_file`, which refuses to be pickled for that reason) holds whatever the file
    held, under any key or none: refused."""
    try:
        zone.__reduce__()
    except Exception:
        raise UnhashableError(f"{zone!r} was made from a file (ZoneInfo.from_file), whose rules its key does "
                              "not name; pass ZoneInfo(key), or give the value a __cache_key__()") from None
    return str(zone.key)


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


TENSOR_VERSIONS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("hardy_tensor_versions",
                                                                                 default=None)
"""Set while a change token is made (`hashing.state.token`), not a key: a tensor is then named by
its identity and version counter, which every in-place operation bumps, instead of its bytes;
except CPU tensors while the token's budget of `CONTENT_TOKEN` bytes lasts (the one item of the
list), named by their bytes, which also see a write the counter does not (through `.data` or a
numpy view). A budget for the whole token, not a size per tensor: a container of many small
tensors is not hashed whole at every call (a torch module's tensors are always named by their
counters: `_encode_torch_module`)."""


def _spent(budget: list[int], size: int) -> bool:
    """Whether a tensor of `size` bytes is past what is left of a token's `budget` (else taken from it)."""
    if size > budget[0]:
        return True
    budget[0] -= size
    return False


def _encode_tensor(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """dtype, shape, device, `requires_grad`, class and bytes; then what no byte shows (`_tensor_state`).
    In a change token (`TENSOR_VERSIONS`), past its budget: identity, version counter and
    `requires_grad` (switched on a submodule, `NET[0].requires_grad_(False)`, it bumps no version)."""
    import torch
    if v.is_nested or v.device.type == "meta":
        _encode_nested_or_meta(v, out, active)
        return
    if v.layout != torch.strided:
        _encode_sparse_tensor(v, out, active)
        return
    budget = TENSOR_VERSIONS.get()
    if budget is not None and (v.device.type != "cpu" or _spent(budget, v.numel() * v.element_size())):
        out(b"TV" + repr((id(v), v._version, v.data_ptr(), tuple(v.shape), str(v.dtype), str(v.device),
                          v.requires_grad)).encode())
        _tensor_state(v, out, active)
        return
    out(b"TT" + str(v.dtype).encode() + str(tuple(v.shape)).encode())
    if v.is_quantized:  # its integers mean nothing without their scale and zero point (`dequantize()`)
        _quantization(v, out, active)
    if type(v) is not torch.Tensor or v.device.type != "cpu" or v.requires_grad:  # cpu tensors: as before
        out(b"|" + type_name(type(v)) + str(v.device).encode() + _grad_tag(v))
    if not v.is_contiguous():  # strides code can read (`.stride()`, `.is_contiguous()`), as for arrays
        out(b"K" + str(v.stride()).encode())
    values = v
    if v.is_conj() or v.is_neg():  # a lazy conjugate or negation: its values made, and said
        out(b"C" if v.is_conj() else b"N")
        values = v.resolve_conj().resolve_neg()
    flat = values.detach().cpu().reshape(-1)
    if flat.stride() != (1,):  # (one element at another stride: `.contiguous()` returns it as it is)
        flat = flat.clone(memory_format=torch.contiguous_format)
    _encode_numpy(flat.view(dtype=torch.uint8).numpy(), out, active)
    _tensor_state(v, out, active)


def _grad_tag(v: Any) -> bytes:
    """`requires_grad`, and then whether the tensor is no leaf (made by an operation: `backward()`
    fills no `.grad` of its, unless it `retain_grad()`): a leaf's key stays what it was."""
    if not v.requires_grad:
        return b""
    return b"grad" if v.is_leaf else b"grad-nonleaf" + (b"r" if v.retains_grad else b"")


def _encode_nested_or_meta(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A nested tensor by its components in order (`unbind()`, each keyed as a tensor: its dtype,
    shape and bytes), under its layout (strided or jagged); a meta tensor, which holds no values,
    by all it has: dtype, shape, strides. Always so, a change token too: a component is a new view
    at each read, whose identity names nothing."""
    out(b"TN" + f"{v.layout}{v.dtype}{v.device}{v.dim()}".encode() + _grad_tag(v))
    if v.device.type == "meta":
        out(b"meta" + str((tuple(v.shape), v.stride()) if not v.is_nested else ()).encode())
        if not v.is_nested:
            _tensor_state(v, out, active)
            return
    token = TENSOR_VERSIONS.set(None)
    try:
        parts = v.unbind()
        out(length(len(parts)))
        for part in parts:
            _encode_tensor(part.detach(), out, active)
    finally:
        TENSOR_VERSIONS.reset(token)
    _tensor_state(v, out, active)


def _quantization(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A quantized tensor's scheme and parameters: a scale and a zero point, or per channel the
    scales, zero points and axis. Two tensors of equal integers dequantize differently by them."""
    import torch
    scheme = v.qscheme()
    out(b"Q" + str(scheme).encode())
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        encode_into((v.q_scale(), v.q_zero_point()), out, active)
    else:
        encode_into((v.q_per_channel_axis(), v.q_per_channel_scales().tolist(),  # (values: tensors made at
                     v.q_per_channel_zero_points().tolist()), out, active)      # each read name nothing)


def _encode_sparse_tensor(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A sparse tensor (COO, CSR, CSC, BSR, BSC): layout, dtype, shape, device, `requires_grad`, its
    sparse and dense dimensions, then its parts by content in stored order (an uncoalesced COO
    tensor, whether coalesced said too: `_values()` reads its entries as stored, duplicates apart,
    and sums them in that order). Always by bytes, a change token too: its parts are new tensors
    at each read, whose identity names nothing. Another layout (mkldnn, jagged) is refused."""
    import torch
    coo = v.layout == torch.sparse_coo
    parts: tuple[Any, ...]
    if coo:
        parts = (v._indices(), v._values())
    elif v.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (v.crow_indices(), v.col_indices(), v.values())
    elif v.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (v.ccol_indices(), v.row_indices(), v.values())
    else:
        raise UnhashableError(f"a tensor of layout {v.layout} has no content hardy can read; pass "
                              "t.to_dense(), or opt the node out with @node(cache=False)")
    out(b"TS" + f"{v.layout}{v.dtype}{tuple(v.shape)}{v.device}{v.sparse_dim()},{v.dense_dim()}".encode()
        + _grad_tag(v) + (b"c" if coo and v.is_coalesced() else b""))
    token = TENSOR_VERSIONS.set(None)
    try:
        for part in parts:
            _encode_tensor(part.detach(), out, active)
    finally:
        TENSOR_VERSIONS.reset(token)
    _tensor_state(v, out, active)


def _tensor_state(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """What a tensor holds besides its values, which code can read: a user subclass's code and
    attributes (`t.scale = 2`, as for numpy's subclasses), a Python attribute set on any tensor
    (`SCALE.unit = "kg"`), and its `.grad` once `backward()` filled it (in a change token, by
    identity and version: `Reach` then sees a `backward()` in the caller). Each said only when
    there (a tensor without keeps its key). Measured on the change token of a model of six tensors,
    at every call: 82 us without gradients as before, 86 us with them (81 us when they were left
    out); a tensor over the token's budget 7.8 us (7.2)."""
    if is_user_module(type(v).__module__):
        encode_subclass_state(v, out, active)
    elif v.__dict__:  # (a library's bookkeeping on a parameter that has no content: by its type, not refused)
        out(b"@" + length(len(v.__dict__)))
        for name, x in list(v.__dict__.items()):
            encode_into(name, out, active)
            try:
                out(hash_value_in(x, active))
            except UnhashableError:
                out(b"?" + type_name(type(x)))
    grad = v.grad if v.is_leaf or v.retains_grad else None  # (a non-leaf's `.grad` warns)
    if grad is not None and TENSOR_VERSIONS.get() is not None:  # (`backward()` bumps its version, or makes one)
        out(b"g" + repr((id(grad), grad._version)).encode())
    elif grad is not None:
        out(b"g")
        encode_into(grad, out, active)


_TORCH_INTERNALS: frozenset[str] | None = None


def _encode_torch_module(m: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A torch module: the code of each submodule's class, its configuration (the attributes it
    was built with, `training` included) and its parameters and buffers by content; hooks and
    torch's bookkeeping are left out."""
    global _TORCH_INTERNALS
    if _TORCH_INTERNALS is None:
        _TORCH_INTERNALS = frozenset(vars(type(m).__mro__[-2]())) - {"training"}  # a bare torch.nn.Module
    config = {k: x for k, x in vars(m).items() if k not in _TORCH_INTERNALS}
    encode_object(m, b"TM", config, out, active)
    budget = TENSOR_VERSIONS.get()  # a change token: a module's tensors by their version counters (its
    left = budget[0] if budget is not None else 0  # bytes at every call cost 1.6 ms for a model of many small ones)
    if budget is not None:
        budget[0] = 0
    try:
        for tag, members in ((b"p", m._parameters), (b"b", m._buffers), (b"m", m._modules)):
            out(tag)
            encode_attributes(members, out, active)
    finally:
        if budget is not None:
            budget[0] = left
    if m._non_persistent_buffers_set:  # left out of `state_dict()`: said only when there (others keep their keys)
        out(b"np")
        encode_into(sorted(m._non_persistent_buffers_set), out, active)
    hooks = {k: v for k in _HOOKS if (v := getattr(m, k, None))}
    if hooks:  # `register_forward_hook(...)`: said only when there is one (a module without keeps its key)
        out(b"hooks")
        try:
            encode_attributes(hooks, out, active)
        except UnhashableError:  # (a library's hook object hardy cannot hash: how many there are)
            out(repr(sorted((k, len(v)) for k, v in hooks.items())).encode())


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _encode_vectorize(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """`np.vectorize`: the function it vectorizes and the options that change its results."""
    out(b"NV" + module_identity("numpy"))
    encode_attributes({k: getattr(v, k, None) for k in ("pyfunc", "otypes", "excluded", "signature", "cache")},
                      out, active)


def _encode_numba(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A numba dispatcher (`@njit`, `@jit`): the Python function it compiles and the options it
    compiles it with (`fastmath`, `error_model`, `locals`...), under numba's distribution. One built
    with explicit signatures (`@njit("float64(float64)")`) compiles nothing else: an `int` argument
    is converted to them (7 / 2 computed as floats, or as ints under `"int64(int64)"`), so they
    are its code too, with their return types. A lazy one's signatures grow as it is called, and
    are left out: it compiles whatever it is called with (and its key stays what it was)."""
    out(b"NB" + type_name(type(v)) + module_identity("numba"))
    fields = {"py_func": v.py_func, "targetoptions": dict(v.targetoptions),
              "locals": dict(getattr(v, "locals", None) or {})}
    if not getattr(v, "_can_compile", True):
        fields["signatures"] = [str(compiled.signature) for compiled in v.overloads.values()]
    encode_attributes(fields, out, active)


def _encode_numba_ufunc(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A numba ufunc (`@vectorize`, `@guvectorize`): its dispatcher, its layout, and the loops it
    was built with when they were given (`["int64(int64)"]`; a dynamic one compiles what it is called with)."""
    frozen = getattr(v, "_frozen", False) or not getattr(v, "is_dynamic", True)
    out(b"NU" + type_name(type(v)))
    encode_attributes({"dispatcher": v._dispatcher, "signature": getattr(v, "signature", None),
                       "types": sorted(v.types) if frozen else None}, out, active)


# Library types, registered when their module is first seen loaded: hashing imports none of them.
LIBRARIES: dict[str, Callable[[Any], tuple[tuple[type, Encoder], ...]]] = {
    "numpy": lambda np: ((np.ndarray, _encode_ndarray), (np.generic, _encode_numpy), (np.vectorize, _encode_vectorize),
                         (np.ufunc, encode_callable),
                         (np.dtype, identified_by(lambda d: (d.str, str(d.descr)) if d.metadata is None
                                                  else (d.str, str(d.descr), dict(d.metadata)))),
                         # a random generator by its state: what it draws next
                         (np.random.Generator, identified_by(lambda g: g.bit_generator.state)),
                         (np.random.RandomState, identified_by(lambda r: r.get_state(legacy=False)))),
    "pandas": lambda pd: ((pd.DataFrame, _encode_pandas), (pd.Series, _encode_pandas), (pd.Index, _encode_pandas),
                          (pd.api.extensions.ExtensionArray, _encode_pandas),
                          (pd.Timestamp, identified_by(_timestamp)), (pd.Timedelta, identified_by(lambda td: td.asm8)),
                          (type(pd.NaT), identified_by(lambda _: None)), (type(pd.NA), identified_by(lambda _: None)),
                          (pd.Period, identified_by(lambda p: (p.ordinal, p.freqstr))),
                          (pd.Interval, identified_by(lambda i: (i.left, i.right, i.closed))),
                          (pd.CategoricalDtype, identified_by(lambda d: (d.categories, d.ordered)))),
    "zoneinfo": lambda zoneinfo: ((zoneinfo.ZoneInfo, identified_by(_zone_key)),),
    "torch": lambda torch: ((torch.Tensor, _encode_tensor), (torch.nn.Module, _encode_torch_module),
                            (torch.device, identified_by(str)),  # torch.device("cuda")
                            (torch.dtype, identified_by(str))),
    "numba.core.dispatcher": lambda nb: ((nb.Dispatcher, _encode_numba),),
    "numba.np.ufunc.ufunc_base": lambda nb: ((nb.UfuncBase, _encode_numba_ufunc),),
    "numba.np.ufunc.ufuncbuilder": lambda nb: ((nb.UFuncDispatcher, _encode_numba),),
    "numba.core.types": lambda nb: ((nb.Type, identified_by(str)),),  # numba.float64 in `locals=`
    "logging": lambda logging: ((logging.Logger, identified_by(lambda lg: lg.name)),),  # what it records is no result
    "pyarrow": lambda pa: ((pa.Table, _encode_arrow), (pa.RecordBatch, _encode_arrow), (pa.Array, _encode_arrow),
                           (pa.ChunkedArray, _encode_arrow), (pa.DataType, identified_by(str)),
                           (pa.Schema, identified_by(lambda sc: sc.serialize().to_pybytes())),
                           (pa.Scalar, identified_by(lambda x: (str(x.type), x.as_py()))),  # a dictionary one by .index
                           (pa.DictionaryScalar, identified_by(lambda x: (str(x.type), x.index, x.dictionary)))),
    "scipy.sparse": lambda sp: tuple((cls, _encode_sparse) for cls in (sp.spmatrix, getattr(sp, "sparray", None))
                                     if cls is not None),
}

for _name, _types in LIBRARIES.items():
    register_library(_name, _types)

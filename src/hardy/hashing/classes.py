"""What a value's class adds to its key: the class's code, for a user class (its methods are code
the node runs), and what an instance holds besides its value.

Values and code recurse into each other: a function or a user class inside a value is hashed by
its code, and a function's globals by their values. `hardy.hashing.code` imports the value
encoders and installs its fingerprint here (`install_code_fingerprint`), so that the import graph
points one way (code -> values -> classes).
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from .origin import is_user_module

_code_fingerprint: list[Callable[[Any], bytes]] = []


def install_code_fingerprint(fingerprint: Callable[[Any], bytes]) -> None:
    _code_fingerprint[:] = [fingerprint]


def code_fingerprint_of(obj: Any) -> bytes:
    """`hardy.hashing.code.code_fingerprint`, as installed."""
    return _code_fingerprint[0](obj)


def class_code(t: type, active: set[int]) -> bytes:
    """A user class's code (`hardy.hashing.code`), which its instances' methods run: an Enum's, a
    named tuple's, a subclass of a built-in type's, a plain object's (`values.encode_object`);
    nothing for a library's class (its name says it, with the library's version where that
    matters). Once per class in one hashing pass (the pass's `active` set names it): a list of
    10,000 named tuples fingerprints their class once, not 10,000 times; a class changed between
    two passes is fingerprinted again."""
    if not is_user_module(t.__module__):
        return b""
    memo: tuple[set[int], dict[type, bytes]] | None = getattr(_PASS, "memo", None)
    if memo is None or memo[0] is not active:
        memo = _PASS.memo = (active, {})
    code = memo[1].get(t)
    if code is None:
        code = memo[1][t] = _code_fingerprint[0](t)  # (hashes values of its own: passes of their own)
        _PASS.memo = memo
    return code


_PASS = threading.local()  # `memo`: (the hashing pass's `active` set, {class: its code}), `class_code`


def instance_fields(v: Any) -> dict[str, Any]:
    """An instance's attributes: its `__dict__` and the slots its classes declare. A slot is read
    through its own descriptor where it has one: an empty slot is then left out without asking the
    class's `__getattr__`, which would answer for it (an attrs class's `cached_property`, computed
    there: hashing would run it)."""
    fields = dict(getattr(v, "__dict__", None) or {})
    t = type(v)
    for name in slot_names(t):
        descriptor = next((vars(c)[name] for c in t.__mro__ if name in vars(c)), None)
        try:
            if isinstance(descriptor, types.MemberDescriptorType):
                fields[name] = descriptor.__get__(v, t)
            elif hasattr(v, name):
                fields[name] = getattr(v, name)
        except AttributeError:  # an empty slot
            pass
    return fields


def slot_names(t: type) -> tuple[str, ...]:
    """The attributes the `__slots__` of `t` and its bases declare (a private one as Python names
    it), which live in no `__dict__`: a `@dataclass(slots=True)`'s fields."""
    names: dict[str, None] = {}
    for cls in t.__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if isinstance(name, str) and name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"  # a private slot, as Python names it
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                names[name] = None
    return tuple(names)


def ordered_alike(members: set[Any] | frozenset[Any]) -> bool:
    """Whether a set of two or more members iterates in the same order in every process, which code
    can read (`list(s)`, `next(iter(s))`): the order of its table follows its members' hashes and
    the order they were added in, and the hashes of numbers are not salted: ints, bools, floats and
    complex numbers (NaN aside: its hash is its address), numpy's number scalars (`set(df["id"])`;
    not its datetimes and timedeltas), `Decimal`, `Fraction`, `timedelta`, `UUID`, None (from
    Python 3.12; its address before) and tuples of them. A str's or bytes' is salted (unless
    PYTHONHASHSEED is set), and so is a naive date's, time's or datetime's (a hash of its bytes),
    and may be any other class's (an Enum member hashes by its name). A set of one member has one
    order: it keeps the key it had. 0.05 us a member (measured on 1,000 ints)."""
    return len(members) > 1 and all(map(_hashed_alike, members))


def _hashed_alike(m: Any) -> bool:
    t = type(m)
    if t is int or t is bool or t is _NONE:
        return True
    if t is float or t is complex:
        return bool(m == m)  # (not NaN)
    if t is tuple:
        return all(map(_hashed_alike, m))
    return _numeric_hash(t) and bool(m == m)  # (a numpy NaN, a Decimal NaN: hashed by address)


def _numeric_hash(t: type) -> bool:
    """A library's type (not a user's subclass, whose `__hash__` may be its own) hashed by its
    numeric value: the standard library's, and numpy's numbers and bools. Not `np.str_`, nor
    `np.datetime64` and `np.timedelta64` (kinds 'M' and 'm'; the latter a subclass of
    `np.signedinteger`), whose hashes are salted in some units (`ns`: `set(df["dur"].to_numpy())`
    would iterate in another order under every PYTHONHASHSEED, and never hit)."""
    if (t.__module__, t.__name__) in _NUMERIC_HASHED:
        return True
    np = sys.modules.get("numpy") if t.__module__ == "numpy" else None
    return (np is not None and issubclass(t, (np.number, np.bool_))
            and not issubclass(t, (np.datetime64, np.timedelta64)))


_NUMERIC_HASHED = frozenset({("decimal", "Decimal"), ("fractions", "Fraction"), ("datetime", "timedelta"),
                             ("uuid", "UUID")})
_NONE = type(None) if sys.version_info >= (3, 12) else bool  # (bool: already said)


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a `class` statement, whose state attributes show


def native_bases(t: type) -> tuple[type, ...]:
    """The bases of `t` written in C that hold more than a plain object does (`datetime.date`,
    `io.BytesIO`, `BaseException`): what they hold is no attribute."""
    return tuple(c for c in t.__mro__ if c is not object and not c.__flags__ & _HEAP_TYPE
                 and c.__basicsize__ > object.__basicsize__)


BY_REPR = ("datetime", "decimal", "uuid", "fractions")  # modules whose types are keyed by their repr (`values`)
# Their value types, whose repr holds the whole value (not tzinfo's, object's own: an address), by
# name: hashing imports none of these modules.
_VALUE_TYPES = frozenset({("datetime", "date"), ("datetime", "time"), ("datetime", "datetime"),
                          ("datetime", "timedelta"), ("decimal", "Decimal"), ("uuid", "UUID"),
                          ("fractions", "Fraction")})


def a_value_type(c: type) -> bool:
    return (c.__module__, c.__name__) in _VALUE_TYPES


def by_repr(t: type) -> bool:
    """A type of those modules; a user's subclass of one of their value types (a library's, such
    as pandas' Timestamp, has more than its base's repr shows: registered, or refused)."""
    return t.__module__ in BY_REPR or is_user_module(t.__module__) and any(map(a_value_type, t.__mro__))


def repr_parts(v: Any, base: type) -> tuple[Any, ...]:
    """What keys a value of a repr-keyed type (`by_repr`): `base`'s repr of it; for a datetime or
    time whose tzinfo is not the standard library's (`datetime.timezone`, whose repr holds its
    offset and name), its repr without it, then the tzinfo as `tz_key` keys it."""
    tz = getattr(v, "tzinfo", None)
    if tz is None or type(tz).__module__ == "datetime":
        return (base.__repr__(v),)  # type: ignore[call-arg]  # (the base's own, given `v`)
    return base.__repr__(v.replace(tzinfo=None)), *tz_key(v)  # type: ignore[call-arg]


def tz_key(at: Any) -> tuple[Any, ...]:
    """What keys the tzinfo of a datetime, time or pandas Timestamp `at`. The standard library's,
    or a user's class: itself (a user's by its code and attributes: its own repr may hide its
    state, and the default one shows an address, another in every process). A library's: its
    class, its repr and what it computes at `at` (`utcoffset`, `dst`, `tzname`: what `at`'s
    arithmetic, `timestamp()` and `astimezone` read), not its repr alone: dateutil's `tzlocal()`
    reprs alike in every zone, and a ZoneInfo made from a file (or dateutil's `gettz(path)`)
    shows a key or a path whatever the file held. Rules it would apply at other instants
    (`at + timedelta(days=180)` in a zone of the same offset now) are not keyed."""
    tz = at.tzinfo
    if type(tz).__module__ == "datetime" or is_user_module(type(tz).__module__):
        return (tz,)
    return f"{type(tz).__module__}.{type(tz).__qualname__}", repr(tz), at.utcoffset(), at.dst(), at.tzname()


def keyed_by_method(t: type) -> bool:
    """Whether `t` defines `__cache_key__`, looked up on the type along its MRO as Python looks up
    special methods: not through the instance, whose class's `__getattr__` would answer for a
    wrapper it delegates to (two `Wrapper(inner, scale)` keyed as their `inner`) or raise from a
    dict subclass that reads keys as attributes (`__getattr__ = dict.__getitem__`)."""
    return any("__cache_key__" in vars(c) for c in t.__mro__)


def a_path_type(t: type) -> bool:
    """A path, keyed by its type and `os.fspath`: pathlib's and `os.DirEntry` (a user's subclass of
    them too), and a library's path-like. A user class that merely defines `__fspath__` (a
    dataclass naming a file and its version) holds more than its path, and runs its own code: it
    is keyed by the rules of user classes (its code and its attributes)."""
    if not issubclass(t, os.PathLike):
        return False
    pathlib = sys.modules.get("pathlib")  # (not imported here: a path of pathlib's means it is loaded)
    paths = (os.DirEntry, pathlib.PurePath) if pathlib is not None else (os.DirEntry,)
    return not is_user_module(t.__module__) or issubclass(t, paths)


def member_attributes(member: enum.Enum) -> dict[str, Any]:
    """What a user Enum's member holds besides its name and value (`Unit.CM.factor = 10`, or set by
    the enum's `__init__`), which its methods read; a library's are its version's (`HTTPStatus.OK.phrase`)."""
    if not is_user_module(type(member).__module__):
        return {}
    return {k: x for k, x in sorted(vars(member).items()) if k not in _ENUM_OWN}


_ENUM_OWN = frozenset({"_value_", "_name_", "__objclass__", "_sort_order_", "__init__"})


def automatic(name: str, value: Any) -> bool:
    """Whether a class-level value named `name` is one Python, `typing`, `abc`, dataclasses, attrs
    or pydantic make for every class of a kind, which `code` leaves out of the class's
    fingerprint: what it says shows in the code keyed besides (a dataclass's generated methods, a
    pydantic model's fields, `models.pydantic_class_parts`), or it holds a line number (Python
    3.13's `__firstlineno__`: a line added above would invalidate), is a cache set later (copyreg's
    `__slotnames__`) or holds reprs of defaults (a dataclass's generated `__doc__`, whose set
    members are listed in the order of the process's hash salt); a docstring is left out with them.
    Every other `__dunder__` value counts, as any class-level value does: `__array_ufunc__ = None`,
    `__array_priority__` (how numpy dispatches operators), `__match_args__` (what `case S(v, _)`
    binds), `__slots__`, a TypedDict's required keys. Names with one leading underscore always did."""
    if not (name.startswith("__") and name.endswith("__")):
        return False
    return name in _AUTOMATIC or name.startswith(("__pydantic_", "__attrs_")) or (name == "__hash__" and value is None)


_AUTOMATIC = frozenset({
    "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__", "__firstlineno__",
    "__static_attributes__", "__orig_bases__", "__parameters__", "__type_params__", "__abstractmethods__",
    "__dataclass_fields__", "__dataclass_params__", "__signature__", "__classcell__", "__private_attributes__",
    "__class_vars__", "__annotations_cache__", "__annotate_func__", "__protocol_attrs__",
    "__non_callable_proto_members__", "__callable_proto_members_only__",
    "__slotnames__"})  # (copyreg's cache, set on the class when an instance is first pickled)

"""How dataclasses, attrs classes, pydantic models and scikit-learn estimators are hashed: an instance
by its class and its whole state, a pydantic model class by what pydantic keeps out of its namespace.

An instance's key holds what its methods can read, not what a serializer shows: a pydantic model
by its `__dict__` (the nested models themselves, each by its own class, not `model_dump()`, which
writes a subclass as its declared type, leaves out `exclude=True` fields and applies custom
serializers), its extra fields, private attributes and which fields were set; a dataclass or an
attrs class by its fields, then by what the instance holds besides them (`self.mean_` set by
`fit()`, a slot a mixin declares). Like `libraries`, this module installs its encoders into
`values` (`values.MODELS`) and imports neither pydantic, attrs nor scikit-learn: a pydantic secret's
type, and scikit-learn's estimators, are registered once their library has loaded them.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

from .classes import instance_fields, slot_names
from .origin import is_user_module
from .values import MODELS, encode_object, identified_by, register_library, type_name


def _encode_dataclass(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """Its fields, then what it holds besides them (set in `__post_init__` or later, or a slot of a
    base that is no dataclass), which methods read: said only when there is some, so that the keys
    of other instances stay what they were. A `cached_property`'s value in its `__dict__` counts, as
    a plain object's does: a stale one (`p.total` read, then `p.values` reassigned) is what the node
    reads, and a dataclass's fields are as easily reassigned."""
    fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
    encode_object(v, b"DC", _with_extra(fields, instance_fields(v)), out, active)


def _encode_attrs(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """Its attrs fields, then what it holds besides them (`self.mean_ = ...` in a `fit()` of a class
    without slots), as for a dataclass; its `cached_property` values left out (`_state`)."""
    fields = {a.name: getattr(v, a.name) for a in type(v).__attrs_attrs__}
    encode_object(v, b"AT", _with_extra(fields, _state(v)), out, active)


def _with_extra(fields: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    extra = {k: x for k, x in state.items() if k not in fields}
    return {**fields, "__extra__": extra} if extra else fields


def _state(v: Any) -> dict[str, Any]:
    """What the instance holds (`instance_fields`), without the values its `cached_property`s
    computed: they follow from the rest, and a key must not change because one was read."""
    state = instance_fields(v)
    cached = _cached_properties(type(v))
    return {k: x for k, x in state.items() if k not in cached} if cached else state


def _cached_properties(cls: type) -> frozenset[str]:
    names = _CACHED_PROPERTIES.get(cls)
    if names is None:
        names = _CACHED_PROPERTIES[cls] = frozenset(name for c in cls.__mro__ for name, member in vars(c).items()
                                                    if isinstance(member, functools.cached_property))
    return names


_CACHED_PROPERTIES: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _encode_pydantic(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A pydantic (v2) model by its state as it holds it (`instance_fields`: `__dict__`, then the
    slots `__pydantic_fields_set__`, `__pydantic_extra__`, `__pydantic_private__`), not by
    `model_dump()`: two requests whose `pet` is a `Dog(breed="collie")` and a `Dog(breed="poodle")`
    dump alike where `pet` is declared an `Animal`, and a field with `exclude=True`, or one a
    `field_serializer` rounds, is read by the node as it is. Which fields were set counts too
    (`model_dump(exclude_unset=True)`, `model_fields_set`)."""
    encode_object(v, b"PY", _state(v), out, active)


MODELS.update({"dataclass": _encode_dataclass, "attrs": _encode_attrs, "pydantic": _encode_pydantic})


# A pydantic secret (`SecretStr`, `SecretBytes`, `Secret[T]`) is keyed by the value it hides: the one
# the node computes with (it reaches the key only through BLAKE3, as any other input's value).
register_library("pydantic.types", lambda types: tuple(
    (cls, identified_by(lambda s: s.get_secret_value())) for cls in
    (getattr(types, name, None) for name in ("SecretStr", "SecretBytes", "Secret")) if isinstance(cls, type)))


def _encode_estimator(v: Any, out: Callable[[bytes], Any], active: set[int]) -> None:
    """A scikit-learn estimator: its class, then its state (the parameters it was built with and
    the fitted attributes, which scikit-learn keeps in the instance's `__dict__`)."""
    encode_object(v, b"SK", _estimator_state(v), out, active)


def _estimator_state(v: Any) -> dict[str, Any]:
    """What the estimator holds; its `__getstate__` never runs on it: IsotonicRegression's pops `f_`
    from the dict it is given, the live `__dict__` of a user's subclass, and hashing must not
    change an input. A user's own `__getstate__` may leave out what the node reads (an `index_`
    rebuilt on unpickling, or reassigned since): the instance's fields are keyed instead, as a
    plain object's. scikit-learn's own runs on a shallow copy: what it leaves out it rebuilds from
    the rest (IsotonicRegression's `f_`, an interpolator that cannot be hashed), and the version
    it adds keeps the keys estimators had."""
    t = type(v)
    owner = next((c for c in t.__mro__ if "__getstate__" in vars(c)), object)
    if is_user_module(owner.__module__):
        return instance_fields(v)
    shadow: Any = object.__new__(_without_del(t))
    shadow.__dict__.update(vars(v))
    state = shadow.__getstate__()
    return state if isinstance(state, dict) else {"state": state}


def _without_del(t: type) -> type:
    """The class of the copy `__getstate__` runs on: `t`, or where `t` has a `__del__` (which ran
    when the copy was dropped, on what it shares with the instance: a subclass's `__del__` that
    closes `self.handle_` closed the user's) a subclass of it whose `__del__` does nothing, named
    and placed as `t` (scikit-learn's `__getstate__` reads `type(self).__module__`); made once."""
    if not any("__del__" in vars(c) for c in t.__mro__):
        return t
    inert = _INERT.get(t)
    if inert is None:
        namespace = {"__del__": _ignore, "__slots__": (), "__module__": t.__module__, "__qualname__": t.__qualname__}
        inert = _INERT[t] = type(t)(t.__name__, (t,), namespace)
    return inert


def _ignore(self: Any) -> None:
    """The copy's `__del__`: it releases nothing, the instance it copies owns it all."""


_INERT: dict[type, type] = {}  # (classes with a `__del__`, few: each stays loaded, held by its entry)


register_library("sklearn.base", lambda base: ((base.BaseEstimator, _encode_estimator),))


def pydantic_class_parts(cls: type) -> list[tuple[str, Any]]:
    """What a pydantic model class validates and builds instances with, which pydantic moves out
    of the class's namespace: each field's definition from `__pydantic_fields__` (its default,
    `default_factory`, alias, constraints such as `gt=` and `le=`, the validators of its `Annotated`
    metadata), each private attribute's default, and each validator's and serializer's settings
    (the fields it applies to, its mode) from `__pydantic_decorators__`; the validators' functions
    are methods in the namespace, keyed as such. Not the core schema, nor the validator or the
    serializer: their reprs hold addresses. As (label, value) pairs, for `code` to key each value by
    content, a pydantic object by its type and its public attributes in turn."""
    members = vars(cls)
    found: list[tuple[str, Any]] = []
    for name, info in (members.get("__pydantic_fields__") or {}).items():
        _parts(info, f"field.{name}", found, 0)
    for name, attribute in (members.get("__private_attributes__") or {}).items():
        _parts(attribute, f"private.{name}", found, 0)
    decorators = members.get("__pydantic_decorators__")
    if dataclasses.is_dataclass(decorators):
        for kind in dataclasses.fields(decorators):
            for name, decorator in (getattr(decorators, kind.name, None) or {}).items():
                _parts(getattr(decorator, "info", None), f"{kind.name}.{name}", found, 0)
    return found


def _parts(obj: Any, label: str, found: list[tuple[str, Any]], depth: int) -> None:
    """`obj` as (label, value) pairs: one of pydantic's records (`_pydantic_object`), and a list
    holding one, by its type and each public attribute in turn; anything else as it is."""
    if depth < 4 and _pydantic_object(obj):
        found.append((label, type_name(type(obj)).decode()))
        for name in _public_attributes(obj):
            _parts(getattr(obj, name, None), f"{label}.{name}", found, depth + 1)
    elif depth < 4 and type(obj) in (list, tuple) and any(map(_pydantic_object, obj)):
        found.append((label, len(obj)))
        for i, x in enumerate(obj):
            _parts(x, f"{label}[{i}]", found, depth + 1)
    else:
        found.append((label, obj))


def _pydantic_object(obj: Any) -> bool:
    """One of pydantic's records of a definition (`FieldInfo`, `ModelPrivateAttr`, a decorator's
    info, `_PydanticGeneralMetadata`, `PydanticUndefined`); not a value pydantic defines (a
    `SecretStr` or URL default), which is keyed as a value."""
    module = type(obj).__module__
    return not isinstance(obj, type) and (module == "pydantic.fields" or module.startswith("pydantic._internal")
                                          or type(obj).__name__ == "PydanticUndefinedType")


def _public_attributes(obj: Any) -> list[str]:
    """The attributes an object of pydantic's declares (its slots, dataclass fields or `__dict__`),
    private ones left out (bookkeeping such as `_attributes_set`, which the public ones already show)."""
    names = set(slot_names(type(obj))) | set(getattr(obj, "__dict__", None) or ())
    if dataclasses.is_dataclass(obj):
        names |= {f.name for f in dataclasses.fields(obj)}
    return sorted(n for n in names if not n.startswith("_"))

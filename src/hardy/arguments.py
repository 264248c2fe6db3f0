"""Checks of the arguments people pass to `@node` and `Engine`: one sentence per mistake, naming
the owner, the argument, what was given and what is expected, raised where the mistake is made
rather than as a raw TypeError from a comparison deep inside a run."""

from __future__ import annotations

import numbers
from typing import Any

from .errors import NodeDefinitionError


def _bad(owner: str, name: str, value: Any, expected: str) -> NodeDefinitionError:
    return NodeDefinitionError(f"{owner}: {name}={value!r} is not valid; {name} must be {expected}.")


def whole_number(owner: str, name: str, value: Any, least: int, optional: bool = False) -> Any:
    if value is None and optional:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise _bad(owner, name, value, f"a whole number >= {least}" + (" or None" if optional else ""))
    return int(value)


def seconds(owner: str, name: str, value: Any, optional: bool = False, zero: bool = False) -> Any:
    if value is None and optional:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0 or (value == 0 and not zero):
        expected = "a number of seconds " + (">= 0" if zero else "> 0") + (" or None" if optional else "")
        raise _bad(owner, name, value, expected)
    return float(value)


def share(owner: str, name: str, value: Any, expected: str) -> float:
    """A non-negative amount of a resource."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
        raise _bad(owner, name, value, expected)
    return float(value)


def flag(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(owner, name, value, "True or False")
    return value


def names(owner: str, name: str, value: Any) -> tuple[str, ...]:
    """A list of names; a lone string would silently become its characters, so it is refused."""
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in _iterable(owner, name, value)):
        raise _bad(owner, name, value, f"a list of strings, e.g. {name}=[{value!r}]" if isinstance(value, str)
                   else "a list of non-empty strings")
    return tuple(value)


def exception_types(owner: str, value: Any) -> tuple[type[Exception], ...]:
    types = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(t, type) and issubclass(t, Exception) for t in types):
        raise _bad(owner, "retry_on", value, "an exception class or a tuple of them, e.g. retry_on=(OSError,)")
    return tuple(types)


def _iterable(owner: str, name: str, value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        raise _bad(owner, name, value, "a list of strings") from None

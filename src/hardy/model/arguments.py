"""Checks of the arguments people pass to `@node`, `Engine`, `Pipeline` calls and caches: one
sentence per mistake, naming the owner, the argument, what was given and what is expected, raised
where the mistake is made rather than as a raw TypeError from a comparison deep inside a run.

The owner says what the argument belongs to, and so the error's class: a node's (`node 'f'`)
raise `NodeDefinitionError`; anything else's `InvalidArgument`, or `InvalidArgumentType` for a
value of the wrong type."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

from ..errors import InvalidArgument, InvalidArgumentType, NodeDefinitionError
from .sizes import parse_size

NODE = "node "  # how a node's owner begins: model/node.py passes f"node {name!r}"
HardyArgumentError = NodeDefinitionError | InvalidArgument


def bad(owner: str, name: str, value: Any, expected: str, wrong_type: bool = False) -> HardyArgumentError:
    """The error for `owner`'s argument `name`: its class by owner (see the module docstring)."""
    kind: type[HardyArgumentError] = NodeDefinitionError if owner.startswith(NODE) else (
        InvalidArgumentType if wrong_type else InvalidArgument)
    return kind(f"{owner}: {name}={value!r:.80} is not valid; {name} must be {expected}.")


def whole_number(owner: str, name: str, value: Any, least: int, optional: bool = False) -> Any:
    if value is None and optional:
        return value
    wrong_type = isinstance(value, bool) or not isinstance(value, numbers.Integral)
    if wrong_type or value < least:
        raise bad(owner, name, value, f"a whole number >= {least}" + (" or None" if optional else ""), wrong_type)
    return int(value)


def seconds(owner: str, name: str, value: Any, optional: bool = False, zero: bool = False) -> Any:
    """A finite number of seconds: a NaN compares false with everything, so it would pass a
    range check and then never be enforced; infinity is spelt None."""
    if value is None and optional:
        return value
    wrong_type = isinstance(value, bool) or not isinstance(value, numbers.Real)
    if wrong_type or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        expected = "a finite number of seconds " + (">= 0" if zero else "> 0") + (
            " or None (no limit)" if optional else "")
        raise bad(owner, name, value, expected, wrong_type)
    return float(value)


def share(owner: str, name: str, value: Any, expected: str) -> float:
    """A non-negative amount of a resource."""
    wrong_type = isinstance(value, bool) or not isinstance(value, numbers.Real)
    if wrong_type or not math.isfinite(value) or value < 0:
        raise bad(owner, name, value, expected, wrong_type)
    return float(value)


def flag(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad(owner, name, value, "True or False", wrong_type=True)
    return value


def size(owner: str, name: str, value: Any) -> int | None:
    """Bytes, from a number or a string such as "10GB" (`hardy.model.sizes`); None stays None."""
    if value is None:
        return None
    expected = "a number of bytes > 0 or a size such as '10GB' or '512M', or None for no limit"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise bad(owner, name, value, expected, wrong_type=True)
    try:
        parsed = parse_size(value)
    except (ValueError, OverflowError):
        parsed = None
    if parsed is None or parsed <= 0:
        raise bad(owner, name, value, expected)
    return parsed


def path(owner: str, name: str, value: Any, optional: bool = False) -> Any:
    """A file system path (str or os.PathLike), checked for its type only: where it points is
    the run's business (it may not exist yet)."""
    if value is None and optional:
        return value
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise bad(owner, name, value, "a path (a string or a pathlib.Path)" + (" or None" if optional else ""),
                  wrong_type=not isinstance(value, (str, os.PathLike)))
    return value


def names(owner: str, name: str, value: Any) -> tuple[str, ...]:
    """A list of names; a lone string would silently become its characters, so it is refused."""
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in _iterable(owner, name, value)):
        raise bad(owner, name, value, f"a list of strings, e.g. {name}=[{value!r}]" if isinstance(value, str)
                  else "a list of non-empty strings", wrong_type=True)
    return tuple(value)


def exception_types(owner: str, value: Any) -> tuple[type[Exception], ...]:
    types = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(t, type) and issubclass(t, Exception) for t in types):
        raise bad(owner, "retry_on", value, "an exception class or a tuple of them, e.g. retry_on=(OSError,)",
                  wrong_type=True)
    return tuple(types)


def _iterable(owner: str, name: str, value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        raise bad(owner, name, value, "a list of strings", wrong_type=True) from None

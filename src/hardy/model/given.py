"""What the values given to a call bring with them: the modules of their code.

A function, a class, a bound method or an instance of a user's class given as an input (or bound,
or in the list a map runs over) runs its module's code in the worker, which reads that module's
state: `aug.MEAN = 10.0`, set by the script after import, must reach the worker's `aug` as it
reaches the plan's own modules (`shipping.replica`). So a plan is made per set of such modules
(`Pipeline._plan` keys it), and its replica covers them too. Only names: which of them are the
user's is decided when a plan is compiled, once (`hashing.is_user_module`).

Looked at: each value, and the items of each list, tuple, set or dict among them (a map's inputs,
a dict of transforms), one level deep; a value's own attributes are not walked.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

_PLAIN = frozenset({int, float, str, bytes, bool, type(None), complex, bytearray, range, slice})
_CONTAINERS = frozenset({list, tuple, set, frozenset, dict})
NOTHING: frozenset[str] = frozenset()  # (no values that carry code)
_CODE = frozenset({types.FunctionType, types.MethodType, functools.partial, type})  # (their own module counts)


def modules_of(values: Iterable[Any]) -> frozenset[str]:
    """The modules of the code the values carry: a function's, a class's, an object's class's (a
    library's too: the caller keeps only the user's). About 17 ns an item of a list, by type."""
    found: set[str] = set()
    for value in values:
        kind = type(value)
        if kind in _PLAIN:
            continue
        if kind in _CONTAINERS:
            items = value.values() if kind is dict else value
            for inner in set(map(type, items)) - _PLAIN - _CONTAINERS:
                if inner in _CODE or issubclass(inner, type):
                    for item in items:
                        if type(item) is inner:
                            _add(item, found)
                else:
                    _add_name(inner.__module__, found)
        else:
            _add(value, found)
    return frozenset(found)


def _add(value: Any, found: set[str]) -> None:
    if isinstance(value, type):
        _add_name(value.__module__, found)
    elif isinstance(value, types.MethodType):
        _add(value.__func__, found)
        _add(value.__self__, found)
    elif isinstance(value, functools.partial):
        _add(value.func, found)
    elif isinstance(value, types.FunctionType):
        _add_name(value.__module__, found)
    else:
        _add_name(type(value).__module__, found)


def _add_name(module: Any, found: set[str]) -> None:
    if isinstance(module, str) and module not in _SKIP and module.partition(".")[0] != _OWN:
        found.add(module)


_OWN = __name__.partition(".")[0]  # hardy's own objects (an engine, a cache) carry no user state
# (the script's code travels by value, with the globals it reads: cloudpickle's way, `shipping.plans`)
_SKIP = frozenset({"builtins", "__main__"})

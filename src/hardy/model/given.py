"""What the values given to a call bring with them: the code they run.

A function, a class, a bound method, a `partial` or an instance of a user's class given as an
input (or bound, or in the list a map runs over) runs its code in the worker, and that code reads
its module's state: `aug.MEAN = 10.0`, set by the script after import, must reach the worker's
`aug` as it reaches the modules of the plan's own nodes (`shipping.replica`). So a plan for
workers is made per set of such code (`Pipeline._plan` keys it), and compiling it fingerprints
that code as a node's is fingerprinted (`Plan.reached`): what it reads, through any module, travels.

Looked at: each value, and the items of each list, tuple, set or dict among them (a map's inputs,
a dict of transforms), one level deep, by type (about 17 ns an item of a list), and the code a
`partial` binds; an object's own attributes (a wrapper holding a function) and containers inside
containers are not walked (docs/same-answer.md).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

NOTHING: frozenset[Any] = frozenset()  # (no values that carry code)
_PLAIN = frozenset({int, float, str, bytes, bool, type(None), complex, bytearray, range, slice})
_CONTAINERS = frozenset({list, tuple, set, frozenset, dict})
_CODE = frozenset({types.FunctionType, types.MethodType, functools.partial})  # (each item's own code counts)


def code_of(values: Iterable[Any]) -> frozenset[Any]:
    """The code the values carry: each function, class, bound method's function and instance's class,
    `partial`'s function, and each other object's class (a library's too: the plan fingerprints
    only the user's). Hashable by identity, so a plan's key holds them."""
    found: set[Any] = set()
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
                    found.add(inner)
        else:
            _add(value, found)
    return frozenset(found) if found else NOTHING


def plan_key(code: frozenset[Any]) -> frozenset[Any]:
    """`code` as a plan's key holds it: a function by its code and its module's globals, so that a
    lambda or closure made anew at each call (`lambda v: aug.normalize(v) * k`) shares one plan
    with the others made from the same code, and no key holds what one of them closes over."""
    if not code:
        return code
    return frozenset((c.__code__, id(c.__globals__)) if type(c) is types.FunctionType else c for c in code)


def _add(value: Any, found: set[Any]) -> None:
    if isinstance(value, types.MethodType):
        found.add(value.__func__)
        found.add(type(value.__self__))
    elif isinstance(value, functools.partial):  # its function, and the code among its arguments
        _add(value.func, found)
        for argument in (*value.args, *value.keywords.values()):
            if type(argument) in _CODE or isinstance(argument, type):
                _add(argument, found)
    elif isinstance(value, (types.FunctionType, type)):
        found.add(value)
    else:
        found.add(type(value))

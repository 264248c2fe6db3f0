"""decimal's two contexts a node's result depends on: the calling thread's (`getcontext()`) and
`DefaultContext`, which a new thread's context and `decimal.Context()` copy (the Python docs' way to
give every thread a precision: `DefaultContext.prec = 6`). Read only where the caller loaded decimal
(pandas does); carried to threads and workers, and keyed, by `shipping.context`."""

from __future__ import annotations

import sys
from typing import Any

# decimal's context as Python makes it (not `decimal.Context()`: a copy of `DefaultContext`, which a script may change)
DECIMAL = (28, "ROUND_HALF_EVEN", -999999, 999999, 1, 0, ["InvalidOperation", "DivisionByZero", "Overflow"])


def decimal_contexts() -> tuple[tuple[Any, ...] | None, tuple[Any, ...] | None]:
    """This thread's context and `DefaultContext`, each as `Settings` holds it (`_fields`) where it
    is not what Python makes (`DECIMAL`), else None; both None where decimal is not loaded."""
    decimal = sys.modules.get("decimal")
    if decimal is None:
        return None, None
    return _changed(decimal.getcontext()), _changed(decimal.DefaultContext)


def decimal_key(decimal: Any) -> tuple[Any, ...]:
    """What tells cheaply that either context changed (`settings_key`): this thread's context and
    its fields but the flags, in one call, and `DefaultContext`'s fields (0.3 us: it is set in place,
    `DefaultContext.prec = 6`, between two calls too)."""
    context = decimal.getcontext()
    fields = context.__reduce__()[1]
    default = decimal.DefaultContext.__reduce__()[1]
    return context, fields[:6], fields[7], default[:6], default[7]


def take_decimal(context: tuple[Any, ...] | None, default: tuple[Any, ...] | None) -> None:
    """Make both contexts the caller's (None: Python's own), where the caller changed one or this
    process loaded decimal: `DefaultContext` in place, since decimal copies that very object (not
    the module's attribute), and this thread's context made anew."""
    if context is None and default is None and "decimal" not in sys.modules:
        return
    import decimal
    wanted = default or DECIMAL
    made = decimal.DefaultContext
    if _fields(made) != wanted:
        made.prec, made.rounding, made.Emin, made.Emax, made.capitals, made.clamp = wanted[:6]
        made.clear_traps()
        for name in wanted[6]:
            made.traps[getattr(decimal, name)] = True
    prec, rounding, emin, emax, capitals, clamp, traps = context or DECIMAL
    decimal.setcontext(decimal.Context(prec, rounding, emin, emax, capitals, clamp,
                                       traps=[getattr(decimal, name) for name in traps]))


def _changed(context: Any) -> tuple[Any, ...] | None:
    made = _fields(context)
    return None if made[:6] == DECIMAL[:6] and sorted(made[6]) == sorted(DECIMAL[6]) else made


def _fields(c: Any) -> tuple[Any, ...]:
    """A decimal context as `Settings` holds it: (prec, rounding, Emin, Emax, capitals, clamp, traps' names)."""
    return c.prec, c.rounding, c.Emin, c.Emax, c.capitals, c.clamp, [t.__name__ for t, on in c.traps.items() if on]

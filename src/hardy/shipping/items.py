"""Map items across a process: a chunk of items pickled once (`ship_items`), or each item on its
own for an engine's task (`ship_each`, `Pickled`), each input sealed apart when a chunk must be
opened input by input (`seal`, `open_input`). An item that cannot travel, or cannot be unpickled
where it runs, costs that item only, with an error naming the node, the input and the remedy;
an input every item holds that cannot travel fails the call before anything starts.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import PicklingError, ShippingError
from ..plan.compiled import Plan
from .pickling import dumps


def globals_in(blob: bytes) -> list[str]:
    """The classes and functions a pickle refers to (module.name), to name what failed to load."""
    import pickletools
    found: list[str] = []
    pushed: list[str | None] = []
    memo: list[str | None] = []
    top: str | None = None  # the object on top of the stack, when it is a string
    try:
        for op, arg, _ in pickletools.genops(blob):
            if op.name == "MEMOIZE":
                memo.append(top)
                continue
            top = None
            if op.name == "GLOBAL":
                found.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(pushed) >= 2:
                found.append(f"{pushed[-2]}.{pushed[-1]}")
            elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                top = arg
                pushed.append(top)
            elif op.name in ("BINGET", "LONG_BINGET") and isinstance(arg, int) and arg < len(memo):
                top = memo[arg]
                pushed.append(top)
    except Exception:  # a truncated or foreign pickle: report what was read
        pass
    return [g for g in dict.fromkeys(found) if not g.startswith(("builtins.", "copyreg.", "None"))]


def ship_items(items: Sequence[Any], indices: Sequence[int],
               wrap: Callable[[list[tuple[int, Any]]], Any] = lambda chunk: chunk,
               dump: Callable[[Any], Any] = dumps) -> tuple[Any, dict[int, Unshippable]]:
    """A chunk of (index, item) pairs pickled by `dump` (None if no item can travel), and apart,
    each item that cannot (a lock, a nesting too deep for pickle) with why: it costs that item
    only. A chunk that travels costs one pickling; only a chunk that does not is taken apart."""
    try:
        return dump(wrap([(i, items[i]) for i in indices])), {}
    except Exception as exc:
        failed = exc
    bad = {i: why for i in indices if (why := unshippable(items[i])) is not None}
    if not bad:  # each item travels alone but not together: nothing to blame one item for
        raise PicklingError(f"items {list(indices)[:5]} cannot be sent to a worker process together: "
                            f"{type(failed).__name__}: {failed}") from failed
    good = [i for i in indices if i not in bad]
    return (dump(wrap([(i, items[i]) for i in good])) if good else None), bad


Unshippable = tuple[str | None, str]  # the input that cannot be pickled (None: the item), and why


def unshippable(item: Any) -> Unshippable | None:
    """Why one item cannot be pickled for a worker (None if it can): the input, its type, the error."""
    for name, value in (item.items() if isinstance(item, dict) else [(None, item)]):
        try:
            pickle.dumps(value, protocol=5, buffer_callback=_left_out)  # (fast: most values of a chunk are fine)
            continue
        except Exception:
            pass
        try:
            dumps(value, buffer_callback=_left_out)
        except Exception as exc:
            return name, f"({described(value)}) cannot be pickled to be sent: {_first_line(exc)}"
    return None


def check_constants(items: Sequence[dict[str, Any]]) -> None:
    """Raise before anything starts if an input every item holds (a map's constant inputs) cannot
    travel: it would fail every item the same way, so it is the call that is wrong."""
    if not items:
        return
    first, last = items[0], items[-1]
    for name, value in first.items():
        if len(items) > 1 and last.get(name, first) is not value:
            continue
        try:
            dumps(value, buffer_callback=_left_out)
        except Exception as exc:
            raise PicklingError(
                f"input {name!r} ({described(value)}, given to every item) cannot be sent to a worker process: "
                f"{_first_line(exc)}. {FIX_INPUT}") from exc


FIX_INPUT = ("Pass plain data (or a path) instead, construct the object inside a node, or wrap its class with "
             "@hardy.model.stateful so each worker builds its own.")


def item_error(plan: Plan, i: int, why: Unshippable) -> ShippingError:
    """The failure of item i, whose input cannot be pickled (`why`, from `ship_items`/`ship_each`)."""
    name, text = why
    return ShippingError(readers(plan, name), None, i, f"input {name!r} {text}. {FIX_INPUT}" if name is not None
                         else f"the item {text}. {FIX_INPUT}")


def readers(plan: Plan, name: str | None) -> str:
    """The nodes reading input `name`; for None, those reading any input of the map (the first
    step's node, if none does)."""
    found = [s.node.name for s in plan.steps
             if any(v == name or name is None and v in plan.provided for _, v in s.args)]
    return " / ".join(dict.fromkeys(found)) or (plan.steps[0].node.name if plan.steps else "?")


def described(value: Any) -> str:
    """A value's type as module.qualname (builtins bare), for messages."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0].rstrip(".") if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _left_out(buf: Any) -> bool:
    """A buffer_callback that leaves big buffers out rather than copying them: only whether a
    value can travel is wanted."""
    return False


class Pickled:
    """An item pickled where the map was called, unpickled only in the hardy worker that runs it:
    an engine's worker (Dask, Ray, Daft) passes it on as bytes, so an item whose class cannot be
    imported there, or whose unpickling raises or crashes, costs that item in a contained worker
    (`workers.pool`), never the engine's process or the chunk."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes):
        self.blob = blob

    def __reduce__(self) -> tuple[Any, ...]:
        return pickle.loads, (self.blob,)


class Sealed:
    """One input of a chunk's item pickled on its own, inside the chunk: the worker opens the
    item's inputs one by one (`open_item`), so that one it cannot unpickle (its class missing
    there, a __setstate__ that raises or crashes) is known by item and input. Chunks are sealed
    only when sent again after their unpickling failed: sealing costs a pickling per input."""

    __slots__ = ("blob", "kind")

    def __init__(self, blob: bytes, kind: str):
        self.blob, self.kind = blob, kind  # kind: the value's type, as `described` names it

    def __reduce__(self) -> tuple[Any, ...]:
        return Sealed, (self.blob, self.kind)


def seal(item: Any) -> Any:
    """`item` (a dict of inputs, or a `Pickled` item) with each input sealed."""
    if isinstance(item, Pickled):
        return Sealed(item.blob, f"types in it: {', '.join(globals_in(item.blob)) or 'builtins only'}")
    return {name: Sealed(dumps(value), described(value)) for name, value in item.items()}


def open_input(value: Any) -> Any:
    """A sealed input's value (any other value as it is)."""
    return pickle.loads(value.blob) if isinstance(value, Sealed) else value


def unopened(plan: Plan, i: int, name: str | None, value: Any, exc: Exception) -> ShippingError:
    """The failure of item i whose input `name` (None: the whole item) could not be opened."""
    kind = value.kind if isinstance(value, Sealed) else described(value)
    what = f"input {name!r} ({kind})" if name is not None else f"input ({kind})"
    missing = exc.name if isinstance(exc, ImportError) else None
    hint = (f"; make module {missing!r} importable in the worker as it is here (it runs with this process's "
            "sys.path and working directory)" if missing else "")
    return ShippingError(readers(plan, name), None, i,
                         f"its {what} cannot be unpickled in the worker process ({_first_line(exc)}){hint}. "
                         f"{FIX_INPUT}")


def ship_each(items: Sequence[dict[str, Any]],
              indices: Sequence[int]) -> tuple[list[tuple[int, bytes]], dict[int, Unshippable]]:
    """For an engine's task: (index, the item pickled on its own) for each item of the chunk that
    can be, to be wrapped in `Pickled` where it is handed to hardy's worker; and the others, with why."""
    blobs, bad = [], {}
    for i in indices:
        try:
            blobs.append((i, dumps(items[i])))
        except Exception:
            bad[i] = unshippable(items[i]) or (None, "cannot be pickled to be sent")
    return blobs, bad

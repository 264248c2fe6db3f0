"""The items of a map: one dict of inputs per item, built from the inputs mapped over (`zip` or
`product`, the map's arguments checked), as a list or, for `imap`, lazily; and the input keys every
item of a cached map shares.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from ..errors import MapInputError, UnhashableError
from .columns import Items

if TYPE_CHECKING:
    from .compiled import Plan


def share_input_keys(plan: Plan, items: list[dict[str, Any]], over: list[str], pipeline: str) -> None:
    """Hash once the inputs every item shares (a model: hashing it per item would cost as much as
    the items) and the first item's own ones: a value that cannot be hashed fails the map here,
    once, before any item runs, instead of failing every item the same way."""
    first, shared = items[0], {}
    cache = plan.cache
    assert cache is not None  # only a cached plan hashes inputs
    for name in plan.hashed_inputs:
        try:
            key = cache.input_key(first[name], name)
        except UnhashableError as exc:
            users = sorted({s.node.name for s in plan.steps if name in dict(s.args).values()})
            raise UnhashableError(f"pipeline {pipeline!r}, node {', '.join(map(repr, users))}: cannot cache "
                                  f"this map: {exc}", exc.culprit, exc.path) from None
        if name not in over:
            shared[name] = key
    if shared:
        from .compiled import KEYS  # (loaded by then, with the plan: a map's `from hardy import` need not wait for it)
        for item in items:
            item[KEYS] = shared


def mapped_over(values: Mapping[str, Any], map_over: str | Sequence[str] | None, map_mode: str, on_error: str,
                pipeline: str) -> list[str]:
    """The names a map maps over, its arguments checked first: a wrong one fails the map before any
    item runs, with the fix."""
    over = [map_over] if isinstance(map_over, str) else list(map_over or [])
    if map_mode not in ("zip", "product"):
        raise MapInputError(f"map_mode must be 'zip' or 'product', got {map_mode!r}.")
    if on_error not in ("raise", "continue"):
        raise MapInputError(f"on_error must be 'raise' or 'continue', got {on_error!r}.")
    if not over:
        raise MapInputError("map_over is empty: name at least one input that holds a list of values.")
    for name in over:
        if name not in values:
            raise MapInputError(
                f"map_over names {name!r}, which is not among the inputs {sorted(values)} of pipeline "
                f"{pipeline!r}; pass inputs={{{name!r}: [...]}} or fix the name.")
    return over


@overload
def map_items(values: Mapping[str, Any], over: list[str], mode: str,
           lazy: Literal[False]) -> tuple[Sequence[dict[str, Any]], int]: ...
@overload
def map_items(values: Mapping[str, Any], over: list[str], mode: str,
           lazy: Literal[True]) -> tuple[Iterator[dict[str, Any]], int | None]: ...
def map_items(values: Mapping[str, Any], over: list[str], mode: str,
           lazy: bool) -> tuple[Sequence[dict[str, Any]] | Iterator[dict[str, Any]], int | None]:
    """The items of a map and their number (None for inputs of unknown length): a sequence (a
    list, or `Items` for a map over one list), or with `lazy` an iterator that reads the inputs
    only as it is advanced."""
    seqs = []
    for name in over:
        v = values[name]
        if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
            raise MapInputError(
                f"map_over input {name!r} must be a list (or any iterable) of per-item values, got "
                f"{type(v).__name__} {v!r:.60}; wrap a single value in a list.")
        frame = next((c for c in type(v).__mro__ if c.__name__ == "DataFrame"), None)
        if frame is not None:  # pandas', polars', a GeoDataFrame: len() counts rows, iterating gives columns
            raise MapInputError(
                f"map_over input {name!r} is a {frame.__module__.split('.')[0]} DataFrame, which iterates over "
                f"its column names, not its rows: pass one value per item, such as a column ({name}=df['col']), "
                "its rows as dicts (df.to_dict('records') in pandas, df.to_dicts() in polars), or "
                "list(df.itertuples()); or give the whole frame as an input that is not mapped over.")
        if isinstance(v, Sized):
            try:
                len(v)
            except TypeError:  # a 0-d array: iterable and sized by its type, neither in fact
                raise MapInputError(f"map_over input {name!r} ({type(v).__name__}) holds a single value, not one "
                                    "per item; wrap it in a list.") from None
        seqs.append(v if lazy or isinstance(v, Sized) else list(v))
    const = {k: v for k, v in values.items() if k not in over}
    sized = all(isinstance(s, Sized) for s in seqs)  # always, unless `lazy`
    n = None
    if mode == "zip":
        if sized:
            lengths = {name: len(s) for name, s in zip(over, cast("list[Sized]", seqs))}
            _check_lengths(lengths)
            n = len(cast(Sized, seqs[0]))
        if len(over) == 1:
            name = over[0]
            if not lazy:
                column = seqs[0]
                if type(column) in (list, tuple, range):
                    return Items(const, name, cast("Sequence[Any]", column)), n
                return _counted([{**const, name: x} for x in column], n, over, seqs), n
            return ({**const, name: x} for x in seqs[0]), n
        combos: Iterable[tuple[Any, ...]] = zip(*seqs) if sized else _zip_checked(over, seqs)
    else:
        if sized:
            n = math.prod(len(s) for s in cast("list[Sized]", seqs))
        combos = itertools.product(*seqs)
    if not lazy:
        return _counted([{**const, **dict(zip(over, combo))} for combo in combos], n, over, seqs), n
    return ({**const, **dict(zip(over, combo))} for combo in combos), n


def _counted(items: list[dict[str, Any]], n: int | None, over: list[str], seqs: list[Any]) -> list[dict[str, Any]]:
    """`items`, when as many as the inputs' len() said (else an input's len() counts something
    other than what iterating it gives, and items would be missing: refused)."""
    if n is None or len(items) == n:
        return items
    kinds = ", ".join(f"{name!r} (a {type(seq).__name__})" for name, seq in zip(over, seqs, strict=True))
    raise MapInputError(f"map_over input(s) {kinds}: their len() says {n} item(s), but iterating them gives "
                        f"{len(items)}; pass a list of the per-item values.")


def _check_lengths(lengths: dict[str, int]) -> None:
    if len(set(lengths.values())) > 1:
        raise MapInputError(
            f"map_mode='zip' needs equally long inputs, got lengths {lengths}; "
            "fix the lists or use map_mode='product' for every combination.")


def _zip_checked(over: list[str], seqs: list[Iterable[Any]]) -> Iterator[tuple[Any, ...]]:
    """zip() that raises, naming the inputs, when iterables of unknown length turn out unequal."""
    for counted, combo in enumerate(itertools.zip_longest(*seqs, fillvalue=_ENDED)):
        if _ENDED in combo:
            ended = [n for n, x in zip(over, combo) if x is _ENDED]
            longer = [n for n, x in zip(over, combo) if x is not _ENDED]
            raise MapInputError(
                f"map_mode='zip' needs equally long inputs: {ended} ended after {counted} items while "
                f"{longer} went on; fix the inputs or use map_mode='product' for every combination.")
        yield combo


_ENDED = object()

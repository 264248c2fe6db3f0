"""Inside a crash-containing worker: what runs there, and which nested plans it is in.

A crash in a worker costs only the item in flight, so everything a worker runs (nested pipelines,
their maps, `run()`) runs in it, in-process. The chain of nested plans (`nesting`) is what the
worker writes into its fault record as it dies (`lines.nesting_line`), and what the parent sends
back as poison: inner items that crashed before and now fail without running (`poisoned_here`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType

_CONTAINED: list[Any] = [False, None]  # in a crash-containing worker; its status words' deadline slot
POISON: dict[tuple[tuple[str, int | None], ...], dict[int | None, Any]] = {}  # see `poisoned_here`


def contained() -> bool:
    """Whether this process is one of hardy's crash-containing workers. A crash here costs only
    the item in flight, so everything a worker runs (nested pipelines, their maps, `run()`) runs
    in it, in-process, instead of starting workers of its own."""
    return bool(_CONTAINED[0])


def mark_contained(deadline: Callable[[float], float]) -> None:
    """This process is a worker; `deadline(t)` posts the monotonic time `t` by which the node
    running now must end (0: none) for the parent to enforce, and returns the one posted before."""
    _CONTAINED[:] = [True, deadline]


def deadlined(func: Callable[..., Any], timeout: float) -> Callable[..., Any]:
    """`func` of a node nested in a worker, posting its deadline while it runs: the parent kills
    the worker when it passes, as for the worker's own steps (a nested deadline inside an outer one
    keeps the earlier of the two)."""
    import time

    def call(*args: Any, **kwargs: Any) -> Any:
        post = _CONTAINED[1]
        end = time.monotonic() + timeout
        before = post(end)
        if 0 < before < end:
            post(before)
        try:
            return func(*args, **kwargs)
        finally:
            post(before)
    return call


BATCH = "batch"  # a level of `nesting` that is a batched node's call (its item: the call's only one, or None)


def nesting(frame: FrameType | None = None) -> list[tuple[str, int | None, str | None, float | None]]:
    """The plans running in this thread, outermost first: (node, item, the node's on_error when it
    maps a nested pipeline, or BATCH for a batched node's call, its timeout). Read from the
    generated functions' frames (`_s` the step, `_item` the item) and from a batch call's
    (`hardy.parts.batching`: `_hardy_batch`, the innermost of its halves), so nothing is paid while
    nothing asks."""
    chain = []
    batch_seen = False
    f: FrameType | None = frame or sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.startswith("<hardy plan"):
            plan = getattr(f.f_globals.get("_fail"), "__self__", None)  # the generated code's namespace holds it
            step, item = f.f_locals.get("_s"), f.f_locals.get("_item")
            if plan is not None and isinstance(step, int) and step < len(plan.steps):
                node = plan.steps[step].node
                over = node.on_error if getattr(node, "map_over", None) else None
                chain.append((node.name, item, over, node.timeout))
            batch_seen = False
        elif not batch_seen and "_hardy_batch" in f.f_code.co_varnames:
            batch = f.f_locals.get("_hardy_batch")
            if batch is not None:
                name, rows, offset, timeout = batch  # rows: (item, its values), numbered from offset
                chain.append((name, offset + rows[0][0] if len(rows) == 1 else None, BATCH, timeout))
                batch_seen = True
        f = f.f_back
    chain.reverse()
    return chain



def poisoned_here() -> dict[int | None, Any]:
    """Items of the nested map about to run here that crashed their worker before: the parent
    runs the enclosing item again, and those inner items fail as their crash did instead of
    running (so a nested map with on_error="continue" loses only them). Keyed by the chain of
    plans enclosing the map (`nesting`)."""
    if not POISON:
        return {}
    key = tuple((node, item) for node, item, _, _ in nesting(sys._getframe(1)))
    return POISON.get(key, {})

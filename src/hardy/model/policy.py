"""The failure policy: what every executor does when a node fails, written once.

A node's `retries`, `retry_on`, `backoff` and `timeout` mean the same under every executor:

- an exception whose type is in `retry_on` is retried in place (the node call alone, in whatever
  process it runs), after a backoff delay, up to `retries` times; other exceptions fail the item;
- a crash (the worker process died) or a timeout (the worker was killed) reruns the item on a
  fresh worker, after a backoff delay, up to the crashing node's `retries` times;
- `timeout` (seconds per attempt) is enforced where a call can be stopped: worker processes are
  killed (map_executor="process", isolate=True, and the chunks of Dask, Ray and Daft, which run in
  hardy's workers there); async nodes are cancelled (asyncio). A plain function called in this
  process cannot be stopped, so such a plan is refused when it is built, naming what enforces it.

Backoff: the delay before retry n (1, 2, ...) is drawn uniformly from [d/2, d] with
d = min(BACKOFF_MAX, backoff * 2**(n-1)): exponential, with jitter so that many items failing
together (a flaky service) do not retry in lockstep. `backoff=0` (the default) retries at once.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import Escaped, Exited, NodeDefinitionError, NodeTimeout
from .executor import IsolatedCall

BACKOFF_MAX = 60.0  # seconds: the longest delay before one retry


def delay(backoff: float, retry: int) -> float:
    """Seconds to wait before retry number `retry` (1-based)."""
    if not backoff:
        return 0.0
    import random  # only retries with a backoff pay for importing it
    d: float = min(BACKOFF_MAX, backoff * 2 ** (retry - 1))
    return d * (0.5 + random.random() / 2)


def guard(node: Any, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` (the callable a plan uses for `node`) under the node's policy: retried on its
    `retry_on` exceptions; an async node also stopped at its `timeout`. The function itself when
    there is nothing to do, so ordinary nodes pay nothing per call; a callable that enforces the
    policy itself (a call into a worker process) is left alone."""
    if isinstance(func, IsolatedCall):
        return func
    retry_on, timeout = getattr(node, "retry_on", ()), getattr(node, "timeout", None)
    if node.is_async and (timeout or retry_on and node.retries):
        return _async_guard(node, func, retry_on, timeout)
    if retry_on and node.retries:
        return _sync_guard(node, func, retry_on)
    return func


def _retrying(node: Any, retry: int, what: str) -> float:
    wait = delay(node.backoff, retry)
    import logging  # (here: `import hardy` stays light, and retries are rare)
    logging.getLogger("hardy.policy").warning("node %r: %s; retrying (%d of %d) in %.2g s", node.name, what, retry,
                                              node.retries, wait)
    return wait


def _exhausted(node: Any, exc: BaseException) -> None:
    """Note on the last attempt's exception that every attempt raised (Python prints a note under
    it): its message alone read as a first failure."""
    if hasattr(exc, "add_note"):  # (Python 3.11 on)
        exc.add_note(f"node {node.name!r} was tried {node.retries + 1} times (retries={node.retries}); this is "
                     "the last attempt's error")


def _sync_guard(node: Any, func: Callable[..., Any], retry_on: tuple[type[BaseException], ...]) -> Callable[..., Any]:
    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        retry = 0
        while True:
            try:
                return func(*args, **kwargs)
            except retry_on as exc:
                retry += 1
                if retry > node.retries:
                    _exhausted(node, exc)
                    raise
                time.sleep(_retrying(node, retry, f"{type(exc).__name__}: {exc}"))
    return call


def _async_guard(node: Any, func: Callable[..., Any], retry_on: tuple[type[BaseException], ...],
                 timeout: float | None) -> Callable[..., Any]:
    import asyncio

    @functools.wraps(func)
    async def call(*args: Any, **kwargs: Any) -> Any:
        retry = 0
        while True:
            task = asyncio.ensure_future(_contained(func(*args, **kwargs)))
            try:
                done, _ = await asyncio.wait([task], timeout=timeout)
            except BaseException:
                task.cancel()
                raise
            if not done:  # a timeout of our own, never confused with a TimeoutError the node raises
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                failure = f"ran past its timeout of {timeout:g} s and was cancelled"
                if retry >= node.retries:
                    raise NodeTimeout(node.name, None, failure)
            else:
                try:
                    return task.result()
                except retry_on as exc:
                    if retry >= node.retries:
                        _exhausted(node, exc)
                        raise
                    failure = f"{type(exc).__name__}: {exc}"
            retry += 1
            await asyncio.sleep(_retrying(node, retry, failure))
    return call


def passes(exc: BaseException) -> bool:
    """Whether `exc`, leaving a node's call, goes on up rather than failing its item: a
    KeyboardInterrupt (Ctrl-C, or a node's own: it interrupts the call on every executor), or the
    CancelledError of a cancel asked of the asyncio task it left (a timeout, an interrupted map:
    asyncio's own). Any other, `sys.exit()`, GeneratorExit, a CancelledError the node raised
    itself, a library's `class Stop(BaseException)`, fails the item as an exception does: left
    through, it ended a map on one executor and a worker on another (docs/failures.md)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    asyncio = sys.modules.get("asyncio")  # (not imported: no CancelledError was made)
    if asyncio is None or not isinstance(exc, asyncio.CancelledError):
        return False
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no loop runs in this thread: no task of it was cancelled
        return False
    if task is None:
        return False
    cancelling = getattr(task, "cancelling", None)  # Python 3.11: how many cancels were asked of it
    return cancelling is None or cancelling() > 0  # (3.10 cannot tell: a task's CancelledError is its cancel)


def passes_in_coroutine(exc: BaseException) -> bool:
    """`passes`, in a coroutine, which must also let through its own close (`close()`, a task
    destroyed while it waited): a GeneratorExit raised at its own await, the frame that catches
    it (one a node raised comes up from the node's frames, and fails its item)."""
    tb = exc.__traceback__
    return passes(exc) or isinstance(exc, GeneratorExit) and tb is not None and tb.tb_next is None


def carried(exc: BaseException) -> Exited:
    """A node's BaseException that is no Exception and does not pass (`passes`), as an ordinary
    exception for an asyncio task to end with: asyncio raises a SystemExit out of the event loop
    and takes a CancelledError for the task's cancel. The plan fails the item with the original
    (`Plan._fail`)."""
    return Exited(exc) if isinstance(exc, SystemExit) else Escaped(exc)


async def _contained(coro: Any) -> Any:
    try:
        return await coro
    except BaseException as exc:
        if isinstance(exc, Exception) or passes_in_coroutine(exc):
            raise
        raise carried(exc) from None


def check_timeouts(nodes: Iterable[Any], runner: str | None) -> None:
    """Refuse a plan whose node has a `timeout` nothing would enforce. `runner` names what runs
    the plan's calls in this process (None: something that enforces timeouts runs them)."""
    if runner is None:
        return
    for n in nodes:
        if n.timeout and not n.is_async and not n.isolate:
            raise NodeDefinitionError(
                f"node {n.name!r} has timeout={n.timeout:g}, but {runner} calls it in this process, where a "
                "running function cannot be stopped. Timeouts are enforced by worker processes: "
                "map_executor='process', @node(isolate=True), or the Dask, Ray and Daft executors "
                "(async nodes are cancelled under any executor). Remove timeout= or run it there.")

"""The key formulas of docs/caching.md, and what a compiled plan needs from a cache.

A leaf module: it imports only hashing and node, so the plan generator (which calls these) and the
stores (which keep entries under them) both stand on it and never on each other. Compiled plans,
the Daft engine's keyed stages and `DiskCache` all call these functions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from blake3 import blake3

from ..errors import UnhashableError
from ..hashing import DIGEST, FORMAT, digest
from ..model.node import Node

MISS: Any = object()  # "not in the cache": a node whose result slot holds this must run


class PlanCache(ABC):
    """What a compiled plan calls on its cache (`DiskCache` is the implementation; the engine
    accepts any subclass)."""

    @abstractmethod
    def input_key(self, value: Any, name: str) -> bytes:
        """The key of one input value (`name`: the input's name, for the error of an unhashable one)."""

    @abstractmethod
    def lookup(self, key: bytes) -> Any:
        """The value stored under `key`, or `MISS`."""

    @abstractmethod
    def fetch(self, keys: tuple[bytes, ...]) -> dict[bytes, Any]:
        """The values of those keys that are stored (several outputs of one call, read together)."""

    @abstractmethod
    def fill(self, key: bytes, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`func(*args, **kwargs)`, stored under `key` (once per key, however many callers race)."""

    @abstractmethod
    async def afill(self, key: bytes, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fill` for a coroutine function."""

    @abstractmethod
    def report(self) -> None:
        """Say once what went wrong with the cache during a call (a full disk, an unreachable store)."""


def call_fingerprint(node: Node, given: Sequence[str]) -> bytes:
    """A node's fingerprint with the names of the arguments it is given (defaults not given), and
    the process's settings that change what a node returns (`result_settings`), where they are not
    the defaults. Raised when a plan is built: a global the key cannot hash is named with its node."""
    settings = result_settings()
    try:
        return digest(FORMAT, node.fingerprint(), ",".join(given).encode(), *([settings] if settings else []))
    except UnhashableError as exc:
        raise UnhashableError(f"node {node.name!r} cannot be cached: {exc}") from None


def result_settings() -> bytes:
    """The settings of this process (and thread) that change the value a node returns for the
    same code and inputs, as key bytes; b"" while each is its default, so that keys made without
    them stay the same. Read by the shipping layer's `shipping.context.result_settings`, which
    registers itself here (`settings_from`) as it is imported: this layer reads no process state."""
    return _SETTINGS[0]() if _SETTINGS else b""


def settings_from(source: Callable[[], bytes]) -> None:
    """Make `source` what `result_settings` answers (`shipping.context`)."""
    _SETTINGS[:] = [source]


_SETTINGS: list[Callable[[], bytes]] = []


def call_key(fingerprint: bytes, *arg_keys: bytes) -> bytes:
    """The key of one call: its fingerprint and its arguments' keys (16 bytes each)."""
    return blake3(fingerprint + b"".join(arg_keys)).digest(DIGEST)


def output_key(key: bytes, output: str, n_outputs: int) -> bytes:
    """The key of one output of a call: the call's key itself, or derived for several outputs."""
    return key if n_outputs == 1 else blake3(key + output.encode()).digest(DIGEST)

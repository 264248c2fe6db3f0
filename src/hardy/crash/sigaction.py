"""Signal dispositions as the C library keeps them (`struct sigaction`), for the handlers that
must pass a signal on exactly: Python's `signal` module sees only Python-level handlers, and
`signal()` from C drops a handler's flags (one installed with SA_SIGINFO, a native crash
reporter's or a runtime's, would then be called with garbage for its details)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any


class SigAction(ctypes.Structure):
    """glibc's struct sigaction (x86_64, aarch64); zeroed, the default action."""

    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]


SA_SIGINFO = 4
SA_RESTART = 0x10000000  # (as `signal()` sets it: a system call the signal interrupts goes on)
HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)  # (signum, siginfo, context)


@functools.lru_cache(maxsize=1)
def libc() -> Any:
    lib = ctypes.CDLL(None)
    lib.sigaction.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    return lib


def read(signum: int) -> SigAction:
    """The disposition of `signum` now."""
    action = SigAction()
    libc().sigaction(signum, None, ctypes.byref(action))
    return action


def put(signum: int, action: SigAction) -> SigAction:
    """Install `action` for `signum`; the disposition it replaces."""
    before = SigAction()
    libc().sigaction(signum, ctypes.byref(action), ctypes.byref(before))
    return before


def handling(handler: Any) -> SigAction:
    """The disposition that calls `handler` (a `HANDLER`) with the signal's details."""
    action = SigAction()
    action.handler = ctypes.cast(handler, ctypes.c_void_p).value
    action.flags = SA_SIGINFO | SA_RESTART  # no alternate stack: the interpreter needs more than one gives
    return action


def sent(siginfo: int | None) -> bool:
    """Whether the signal whose details are at `siginfo` was sent (kill, raise, abort: si_code <= 0)
    rather than raised by a fault, whose instruction faults again when its handler returns."""
    return not siginfo or ctypes.c_int.from_address(siginfo + 8).value <= 0

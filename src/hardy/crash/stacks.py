"""Every thread's stack of a hung worker, taken before it is killed.

py-spy (`pip install "hardy[forensics]"`) reads a live process from outside: each thread's Python
frames merged with its native ones (`clock_nanosleep (libc) <- inner_wait (hang.c:4) <- node_fn
(hang.py:8)`), in 0.02-0.4 s (~3 s for a process with torch loaded, whose symbols it reads). It
attaches with ptrace: the same user, and under Yama `ptrace_scope=1` only a process the worker
named, hence `allow_tracing`. Without py-spy, or when it fails, the worker's faulthandler writes
every thread's Python stack on SIGUSR1 (what the parent sends before any kill): no native frames,
and the reason is said with the stacks.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys

from ..errors import install_hint

PY_SPY_DEADLINE = 4.0  # seconds py-spy may take before the worker is killed without its native stacks
_PR_SET_PTRACER = 0x59616D61
_CRED = struct.Struct("3i")


def allow_tracing(fd: int) -> None:
    """Let the process at the other end of socket `fd` (the pool's, which made the socket pair)
    and its children, such as py-spy, ptrace this one under Yama's ptrace_scope=1. Without Yama
    this changes nothing; errors are ignored (the fallback stacks remain)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            pid, _, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        ctypes.CDLL(None).prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def ptrace_scope() -> int | None:
    """Yama's ptrace scope (0 same user, 1 descendants or named tracers, 2 admin, 3 none), None
    without Yama."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def py_spy() -> str | None:
    """The py-spy program: on PATH or beside this interpreter (a virtual environment's bin)."""
    import shutil  # (here: every fork server imports this module; py-spy is looked for once a worker hangs)
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)


def hang_stacks(pid: int, deadline: float = PY_SPY_DEADLINE) -> tuple[str, str]:
    """(every thread's Python + native stack by py-spy, "") or ("", why py-spy gave none)."""
    program = py_spy()
    if program is None:
        return "", f"py-spy is not installed (for native frames: {install_hint('forensics')})"
    import subprocess  # (here: a worker imports this module, and only the parent asks for stacks)
    try:
        done = subprocess.run([program, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=deadline)
    except subprocess.TimeoutExpired:
        return "", f"py-spy took more than {deadline:g} s"
    except OSError as exc:
        return "", f"py-spy could not run: {exc}"
    if done.returncode or not done.stdout.strip():
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        hint = " (ptrace refused: see `hardy doctor`)" if "ermission" in why else ""
        return "", f"py-spy failed: {why}{hint}"
    return "py-spy dump --native: every thread, Python and native frames\n" + done.stdout.strip(), ""

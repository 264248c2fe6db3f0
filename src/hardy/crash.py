"""Turning a dead worker into a sentence a user can act on."""

from __future__ import annotations

import signal

_HINTS = {
    "SIGSEGV": "segmentation fault in native code",
    "SIGABRT": "abort: a failed C/C++ assertion, std::terminate or os.abort()",
    "SIGKILL": "killed from outside, most often by the kernel's out-of-memory killer",
    "SIGBUS": "bus error: a truncated memory-mapped file or misaligned access",
    "SIGFPE": "arithmetic fault in native code",
    "SIGILL": "illegal instruction: a binary built for another CPU",
    "SIGTERM": "terminated from outside",
}


def describe_exit(exitcode: int | None) -> tuple[str | None, str]:
    """(signal name or None, explanation) for a worker's exit code."""
    if exitcode is None:
        return None, "the worker vanished without an exit status"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = _HINTS.get(name)
        return name, f"worker died from {name}" + (f" ({hint})" if hint else "")
    if exitcode > 128 and exitcode - 128 < 65:  # a shell's way of saying "killed by signal N"
        return describe_exit(128 - exitcode)
    return None, f"worker exited with code {exitcode} (sys.exit or os._exit inside a node?)"


_MACHINERY = ("/hardy/workers/", "/hardy/integrations/", "/multiprocessing/", "/site-packages/daft/",
              "<frozen runpy>", "<hardy plan", 'File "<string>"')


def read_stack(path: str, limit: int = 4000) -> str:
    """The Python stack faulthandler wrote when the worker crashed (empty if none).

    Frames of hardy's worker loop and of multiprocessing are dropped: the user's frames remain.
    """
    try:
        with open(path, errors="replace") as f:
            lines = f.read().strip().splitlines()
    except OSError:
        return ""
    kept = [ln for ln in lines if not any(m in ln for m in _MACHINERY)]
    return "\n".join(kept)[-limit:]

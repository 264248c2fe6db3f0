"""The native fatal-signal handler of worker processes, and how it gets onto a machine.

Python's own handlers run between bytecodes, after a crashed process is gone, and faulthandler
(before 3.14) prints only Python frames. So workers install a small C handler in front of
faulthandler's: on SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT it writes the crashing thread's
return addresses, each as library + load base + the exported symbol `dladdr` knows, into the
worker's crash record, then hands the signal on. The parent turns them into names (`symbols.py`).

hardy is pure Python, so the handler reaches a machine in one of two ways, chosen at first use:
- "native": `native_handler.c`, compiled once per user and source version with the system C
  compiler (`$CC`, else `cc`/`gcc`; ~0.2 s) into hardy's cache folder, which must be the user's own
  and writable by no one else (checked before it is loaded). Async-signal-safe: no malloc, a
  warm-up `backtrace()` at install, an alternate stack; the first crashing thread writes, any other
  waits (threads of an OpenMP team fault together; SA_RESETHAND would let the second one end the
  process before the first has written: seen with torch's reductions).
- "ctypes", when there is no compiler (or the build failed): the same steps written in Python and
  installed through ctypes. It runs Python inside the signal handler, as hardy's last-words
  callback already does: not async-signal-safe (a crash while the allocator's lock is held can
  hang it; `signals.LAST_WORDS_LIMIT` then ends the process) and without an alternate stack, so a
  stack overflow leaves no native frames. Shipping prebuilt binaries instead would mean one per
  libc and CPU inside a pure-Python wheel; a compiler is on almost every machine that builds
  native code, and the fallback covers the rest.
`HARDY_NATIVE_HANDLER=ctypes` forces the fallback, `=off` installs neither.

A process a node forks inherits the handler. There it writes nothing: it puts back what the
worker had before hardy's handlers (`remember`) and hands the signal to it. The fallback has to
enter Python to find that out, which a process forked from C (not through `os.fork`, which
resets the interpreter's locks) may never manage: another thread may have held the interpreter's
lock at the fork.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import stat
from collections.abc import Callable, Sequence
from typing import Any

from blake3 import blake3

from . import sigaction

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_handler.c")
SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")
MAX_FRAMES = 64
_PC_OFFSET = {"x86_64": 168, "aarch64": 440}  # the pc in a glibc ucontext_t (REG_RIP; mcontext.pc)
_SIGNAL_ARRAY = ctypes.c_int * 8  # signal numbers for C (the type made in the fork server: 70 us in a worker)


def cache_folder() -> str:
    """hardy's per-user cache folder for built helpers ($XDG_CACHE_HOME/hardy or ~/.cache/hardy)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hardy")


def compiler() -> str | None:
    """The C compiler to build the handler with, or None when this machine has none."""
    import shutil  # (not at the top: a fork server imports this module and finds the handler already built)
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def _trusted(path: str) -> bool:
    """Owned by this user and writable by no one else: safe to load into a process."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def build(preload: bool = False) -> tuple[str | None, str]:
    """(path of the compiled handler, "") or (None, why there is none). Built once per user and
    source version; a build by a concurrent process is atomic (written aside, then renamed).
    `preload`: the variant that installs itself when loaded, writing to stderr (`LD_PRELOAD`, for
    `hardy repeat`'s runs)."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    # blake3, not hashlib: every fork server would load OpenSSL for this
    tag = blake3(source + os.uname().machine.encode()).hexdigest()[:16]
    folder = os.path.join(cache_folder(), "native")
    target = os.path.join(folder, f"{'preload' if preload else 'handler'}-{tag}.so")
    if os.path.exists(target):
        ok = _trusted(folder) and _trusted(target)
        return (target, "") if ok else (None, f"{target} or its folder is not this user's own (or others may "
                                              "write it): not loaded; remove it")
    cc = compiler()
    if cc is None:
        return None, "no C compiler found ($CC, cc, gcc)"
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as exc:
        return None, f"cannot create {folder}: {exc}"
    if not _trusted(folder):
        return None, f"{folder} is not this user's own (or others may write it)"
    import subprocess
    import tempfile
    fd, scratch = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    fd, code = tempfile.mkstemp(dir=folder, suffix=".c")  # the source hashed, not the file (which may change)
    with os.fdopen(fd, "wb") as f:
        f.write(source)
    try:
        done = subprocess.run([cc, "-shared", "-fPIC", "-O2", *(["-DHARDY_PRELOAD"] if preload else []), "-o",
                               scratch, code],
                              capture_output=True, text=True, timeout=60)
        if done.returncode:
            return None, f"{cc} failed: {done.stderr.strip()[-300:]}"
        os.chmod(scratch, 0o700)
        os.replace(scratch, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{cc} failed: {exc}"
    finally:
        for path in (scratch, code):
            if os.path.exists(path):
                os.unlink(path)
    return target, ""


@functools.lru_cache(maxsize=1)
def _native() -> tuple[Any, str]:
    """The loaded C handler library (or None) and why not. The fork server calls this once, so
    its workers start with the library loaded and `backtrace` warm."""
    if os.environ.get("HARDY_NATIVE_HANDLER", "auto") != "auto":
        return None, f"HARDY_NATIVE_HANDLER={os.environ['HARDY_NATIVE_HANDLER']}"
    path, why = build()
    if path is None:
        return None, why
    try:
        lib = ctypes.CDLL(path)
        lib.hardy_native_install.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        lib.hardy_native_remember.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        lib.hardy_native_at_exit.argtypes = (_EXIT_CALLBACK, ctypes.c_uint)
        lib.hardy_native_hold.argtypes = (ctypes.c_int,)
    except (OSError, AttributeError) as exc:  # (a build of another source under this one's name: remove it)
        return None, f"{path} cannot be loaded: {exc}"
    ctypes.CDLL(None).backtrace((ctypes.c_void_p * 4)(), 4)  # loads libgcc_s here, once, not in each worker
    return lib, ""


def prepare() -> tuple[Any, str]:
    """`_native`, with ctypes' handle on the C library loaded: the fork server calls this once, so
    that its workers start with both (each reads its dispositions through it, `remember`)."""
    sigaction.libc()
    return _native()


def mechanism() -> tuple[str, str]:
    """("native" | "ctypes" | "off", why not native) as `install` would choose here."""
    if os.environ.get("HARDY_NATIVE_HANDLER") == "off":
        return "off", "HARDY_NATIVE_HANDLER=off"
    lib, why = _native()
    if lib is not None:
        return "native", ""
    if os.uname().machine not in _PC_OFFSET:
        return "off", f"{why}; the ctypes fallback knows no {os.uname().machine} signal context"
    return "ctypes", why


def _compiled() -> Any:
    """The loaded compiled handler when `install` would use it, else None."""
    return _native()[0] if mechanism()[0] == "native" else None


def _dispositions(signals: Sequence[str]) -> dict[int, sigaction.SigAction]:
    return {n: sigaction.read(n) for n in (int(getattr(signal, name)) for name in signals)}


def remember(signals: Sequence[str]) -> Callable[[int], None]:
    """Note the dispositions of `signals` now, before any of hardy's handlers are installed; returns
    the function that puts one back (by number). A process forked from the one that installs them
    inherits hardy's handlers (a node's helper process, from Python or from C): there each of them
    puts back what was here before and hands the signal to it, writing nothing, as if hardy had
    never been there (the compiled handler from its own copy, `hardy_native_remember`)."""
    saved = _dispositions(signals)
    _ORIGINAL.update(saved)
    lib = _compiled()
    if lib is not None:
        lib.hardy_native_remember(_SIGNAL_ARRAY(*saved), len(saved))

    def put_back(signum: int) -> None:
        sigaction.put(signum, saved[signum])
    return put_back


def hold(signum: int) -> None:
    """Make `signum` wait forever (for the kill that follows it): installed under faulthandler's
    registration with `chain`, so that, once the worker's last words and stacks are written, the
    call the signal interrupted never goes on (a `sleep()` in C returns early when interrupted,
    and its node's result would then come back after its timeout, as a success)."""
    lib = _compiled()
    if lib is not None:
        lib.hardy_native_hold(signum)
        return
    libc = sigaction.libc()

    def waits(signum: int, siginfo: int, context: int) -> None:  # (the fallback: in this thread's handler)
        while True:
            libc.pause()
    callback = sigaction.HANDLER(waits)
    action = sigaction.handling(callback)
    _kept.append((callback, action))
    sigaction.put(signum, action)


def kept(signals: Sequence[str]) -> Callable[[], None]:
    """The function that puts the dispositions of `signals` back as they are now."""
    now = _dispositions(signals)

    def put_back() -> None:
        for n, action in now.items():
            sigaction.put(n, action)
    return put_back


def install(fd: int, signals: Sequence[str] = SIGNALS) -> str:
    """Write native frames to `fd` on a fatal signal, then hand it to the handler installed before.
    Returns the mechanism used ("native", "ctypes" or "off")."""
    kind, _ = mechanism()
    numbers = [int(getattr(signal, name)) for name in signals]
    if kind == "native":
        lib, _ = _native()
        ok = lib.hardy_native_install(fd, _SIGNAL_ARRAY(*numbers), len(numbers)) == 0
        return "native" if ok else "off"
    if kind == "ctypes":
        _install_ctypes(fd, numbers)
    return kind


_EXIT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int)


def at_exit(callback: Callable[[int], None], limit: int) -> bool:
    """Call `callback(status)` when native code calls exit() in this process, after writing the
    frames that called it to the crash record (`install`'s `fd`; install first). Only the
    compiled handler can: it checks in C that the exiting process is this one, so a fork child's
    exit never enters a Python that is already finalised. False without it (no compiler)."""
    lib = _compiled()
    if lib is None:
        return False
    c_callback = _EXIT_CALLBACK(callback)
    _kept.append(c_callback)
    return int(lib.hardy_native_at_exit(c_callback, ctypes.c_uint(limit))) == 0


# --- the fallback: the same steps, in Python, through ctypes --------------------------------------

class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


_kept: list[Any] = []  # the installed callback and its buffers live as long as the process
_ORIGINAL: dict[int, sigaction.SigAction] = {}  # the dispositions before hardy's handlers (`remember`)


def _install_ctypes(fd: int, numbers: Sequence[int]) -> None:
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    frames = (ctypes.c_void_p * MAX_FRAMES)()
    info = _DlInfo()
    previous: dict[int, sigaction.SigAction] = {}
    offset = _PC_OFFSET[os.uname().machine]
    libc.backtrace(frames, MAX_FRAMES)  # warm up: the first call loads libgcc_s

    def frame(address: int) -> bytes:
        known = libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info))
        fname = (info.fname or b"?") if known else b"?"
        return b"hardy-native: %#x %#x %#x %s %s\n" % (
            address, (info.fbase or 0) if known else 0, (info.saddr or 0) if known else 0,
            (info.sname or b"?") if known else b"?", fname or b"?")

    entered: list[bool] = []
    owner = os.getpid()

    def on_signal(signum: int, siginfo: int, context: int) -> None:
        if fd != 2 and os.getpid() != owner:  # a fork child: what was there before hardy (as in C)
            sigaction.put(signum, _ORIGINAL.get(signum, sigaction.SigAction()))
            if sigaction.sent(siginfo):  # (a fault faults again, with its own details)
                getattr(libc, "raise")(signum)
            return
        if entered:  # another thread is writing its record: wait for the process to end with it
            while True:
                libc.pause()
        entered.append(True)
        try:
            pc = ctypes.c_size_t.from_address(context + offset).value
            count = libc.backtrace(frames, MAX_FRAMES)
            addresses = [frames[i] or 0 for i in range(count)]
            chain = addresses[addresses.index(pc):] if pc in addresses else [pc]
            os.write(fd, b"hardy-native: signal %#x\n" % signum + b"".join(map(frame, chain))
                     + b"hardy-native: end\n")
        finally:
            sigaction.put(signum, previous[signum])
            getattr(libc, "raise")(signum)

    callback = sigaction.HANDLER(on_signal)
    action = sigaction.handling(callback)
    for n in numbers:
        previous[n] = sigaction.put(n, action)
    _kept.append((callback, frames, info, previous, action, frame, on_signal))

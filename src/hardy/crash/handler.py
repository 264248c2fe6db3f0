"""The native fatal-signal handler of worker processes, and how it gets onto a machine.

Python's own handlers run between bytecodes, after a crashed process is gone, and faulthandler
(before 3.14) prints only Python frames. So workers install a small C handler in front of
faulthandler's: on SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT it writes the crashing thread's
return addresses, each as library + load base + the exported symbol `dladdr` knows, into the
worker's crash record, then hands the signal on. The parent turns them into names (`symbols.py`).

hardy is pure Python, so the handler reaches a machine in one of two ways, chosen at first use:
- "native": `native_handler.c`, compiled once per user and source version with the system C
  compiler (`$CC`, else `cc`/`gcc`; ~0.2 s) into hardy's cache folder, `hardy/native/`: each level
  is opened without following a link and must be the user's own and writable by no one else
  (`native/` 0700), the file too, checked on its descriptor and loaded through it, never by path
  again (docs/security.md); else the fallback, saying why. Async-signal-safe: no malloc, a
  warm-up `backtrace()` at install, an alternate stack; the first crashing thread writes, any other
  waits (threads of an OpenMP team fault together; SA_RESETHAND would let the second one end the
  process before the first has written: seen with torch's reductions).
- "ctypes", when there is no compiler (or the build failed, or the folder is not trusted): the
  same steps written in Python and installed through ctypes. It runs Python inside the signal
  handler, as hardy's last-words callback already does: not async-signal-safe (a crash while the
  allocator's lock is held can hang it; `signals.LAST_WORDS_LIMIT` then ends the process) and
  without an alternate stack, so a stack overflow leaves no native frames. Shipping prebuilt
  binaries instead would mean one per libc and CPU inside a pure-Python wheel; a compiler is on
  almost every machine that builds native code, and the fallback covers the rest.
`HARDY_NATIVE_HANDLER=ctypes` forces the fallback, `=off` installs neither.

A process a node forks inherits the handler. There it writes nothing: it puts back what the
worker had before hardy's handlers (`remember`) and hands the signal to it. The fallback has to
enter Python to find that out, which a process forked from C (not through `os.fork`, which
resets the interpreter's locks) may never manage: another thread may have held the interpreter's
lock at the fork.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import signal
import stat
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from blake3 import blake3

from ..errors import UntrustedCacheError
from . import sigaction

if TYPE_CHECKING:
    from ..cache.folders import Folder

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_handler.c")
SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")
MAX_FRAMES = 64
NO_COMPILER = "no C compiler found ($CC, cc, gcc)"  # (`open_handler`'s why, for which the doctor's fix is gcc)
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


class _Refused(Exception):
    """Why the native handler is neither built nor loaded where it would be (a sentence for `mechanism`)."""


def _native_folder(create: bool) -> Folder:
    """`<cache_folder()>/native`, opened one level at a time without following a link (`open_named`,
    `Folder.sub`): `hardy/` must be this user's and writable by nobody else, `native/` this user's
    and private (0700). Everything later is reached through the returned descriptor, so nobody can
    swap a level after it was checked (a rename of `native/` between a check by path and the
    load ran another user's code in every worker). FileNotFoundError when a level is missing."""
    from ..cache.folders import open_named
    path = cache_folder()
    fix = "make it yours and private (chmod 700) or set XDG_CACHE_HOME"
    try:
        with open_named(os.path.dirname(path), private=False, create=create, mode=0o700) as base, \
                base.sub(os.path.basename(path), create=create, private=True) as hardy:
            folder = hardy.sub("native", create=create, private=True)
    except UntrustedCacheError as exc:
        raise _Refused(f"{exc}; the native crash handler is neither built nor loaded there") from None
    except (PermissionError, NotADirectoryError) as exc:  # another user's, others may write it, a file
        raise _Refused(f"{exc.filename}: {exc.strerror}: the native crash handler is neither built nor "
                       f"loaded there (whoever can change it could run their code as you); {fix}") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _Refused(f"{exc.filename} is a symbolic link: the native crash handler is neither built nor loaded "
                       f"through it; {fix}") from None
    if stat.S_IMODE(os.fstat(folder.fd).st_mode) != 0o700:  # ours, and nobody else writes it: make it private
        os.fchmod(folder.fd, 0o700)
    return folder


def _open_checked(folder: Folder, name: str) -> int:
    """A read-only descriptor of `name` in `folder`, checked on that descriptor: a regular file of this
    user's that nobody else may write (a link there is not followed). FileNotFoundError if absent."""
    path = os.path.join(folder.path, name)
    refused = f"{path} or its folder is not this user's own (or others may write it): not loaded; remove it"
    try:
        fd = folder.open(name, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Refused(f"{path} is a symbolic link: not followed, not loaded; remove it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise _Refused(refused)
    return fd


def _compile(folder: Folder, name: str, source: bytes, cc: str, preload: bool) -> int:
    """Compile `source` into `name` in `folder`, all through the folder's descriptor: the compiler
    runs inside it (its working directory is the descriptor's own folder, /proc/self/fd/N, entered
    before exec) on scratch names, and the result is renamed into place within it. A concurrent
    build by another process is harmless (each renames its own whole file). Returns its descriptor."""
    import subprocess
    cc = os.path.abspath(cc)  # (found on a relative PATH entry: it runs elsewhere)
    scratch = f".{name}.{os.urandom(8).hex()}"
    fd = folder.open(scratch + ".c", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            with os.fdopen(fd, "wb") as f:  # the source hashed, not the file (which may change)
                f.write(source)
        except OSError as exc:  # (a full disk says so as the file closes)
            raise _Refused(unwritable(os.path.dirname(folder.path), exc)) from None
        done = subprocess.run([cc, "-shared", "-fPIC", "-O2", *(["-DHARDY_PRELOAD"] if preload else []), "-o",
                               scratch + ".so", scratch + ".c"], cwd=f"/proc/self/fd/{folder.fd}",
                              capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise _Refused(f"{cc} failed: {done.stderr.strip()[-300:]}")
        fd = _open_checked(folder, scratch + ".so")
        try:
            os.fchmod(fd, 0o700)
            os.replace(scratch + ".so", name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
        except BaseException:
            os.close(fd)
            raise
        return fd
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _Refused(f"{cc} failed: {exc}") from None
    finally:
        folder.unlink(scratch + ".c")
        folder.unlink(scratch + ".so")


def open_handler(preload: bool = False) -> tuple[int | None, str, str]:
    """(descriptor, path, "") of the compiled handler, checked on that descriptor, or (None, path, why
    there is none). Built once per user and source version (`_compile`) when absent. Load or copy it
    through the descriptor only (`_native`, `doctor.repeat`): its path may name another file by then.
    `preload`: the variant that installs itself when loaded, writing to stderr (`LD_PRELOAD`, for
    `hardy repeat`'s runs)."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    # blake3, not hashlib: every fork server would load OpenSSL for this
    tag = blake3(source + os.uname().machine.encode()).hexdigest()[:16]
    name = f"{'preload' if preload else 'handler'}-{tag}.so"
    path = os.path.join(cache_folder(), "native", name)
    try:
        try:
            with _native_folder(create=False) as folder:
                return _open_checked(folder, name), path, ""
        except FileNotFoundError:
            pass
        cc = compiler()
        if cc is None:
            return None, path, NO_COMPILER
        with _native_folder(create=True) as folder:
            return _compile(folder, name, source, cc, preload), path, ""
    except _Refused as exc:
        return None, path, str(exc)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            return None, path, unwritable(cache_folder(), exc)
        return None, path, f"cannot build or open {path}: {exc}"


def unwritable(folder: str, exc: OSError) -> str:
    """Why the handler is not built when hardy's cache folder cannot take it (a read-only mount, a
    full disk or quota): the folder and the fix, not the compiler, which is there."""
    fix = "free space on its disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
    return (f"hardy's cache folder {folder} cannot be written ({exc.strerror}), so the native handler cannot be "
            f"built there: {fix}, or set XDG_CACHE_HOME to a folder that can be written")


def build(preload: bool = False) -> tuple[str | None, str]:
    """(path of the compiled handler, "") or (None, why there is none): `open_handler`, for a report.
    Never load the path it returns: load through `open_handler`'s descriptor."""
    fd, path, why = open_handler(preload)
    if fd is None:
        return None, why
    os.close(fd)
    return path, ""


@functools.lru_cache(maxsize=1)
def _native() -> tuple[Any, str]:
    """The loaded C handler library (or None) and why not. The fork server calls this once, so
    its workers start with the library loaded and `backtrace` warm."""
    if os.environ.get("HARDY_NATIVE_HANDLER", "auto") != "auto":
        return None, f"HARDY_NATIVE_HANDLER={os.environ['HARDY_NATIVE_HANDLER']}"
    fd, path, why = open_handler()
    if fd is None:
        return None, why
    try:
        # the descriptor checked, not the path again; named with this pid: glibc hands a later dlopen of
        # the same name (a "/proc/self/fd/N" of someone else's) the library already loaded under it
        lib = ctypes.CDLL(f"/proc/{os.getpid()}/fd/{fd}")
        lib.hardy_native_install.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        lib.hardy_native_remember.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        lib.hardy_native_at_exit.argtypes = (_EXIT_CALLBACK, ctypes.c_uint)
        lib.hardy_native_hold.argtypes = (ctypes.c_int,)
    except (OSError, AttributeError) as exc:  # (a build of another source under this one's name: remove it)
        return None, f"{path} cannot be loaded: {exc}"
    finally:
        os.close(fd)
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

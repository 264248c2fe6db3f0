"""Run a command many times, each in a fresh process, and measure how often it crashes.

In the incident behind it, a team re-ran a container 30 times by hand to find that an unused
`import torch` before `cuml` segfaulted 10-30 % of runs. `repeat`
does that for any command, classifies every exit (success, exit code, signal by name — a shell's
`139` included — or timeout), keeps each failing run's output, and reports the failure rate with a
95 % Wilson confidence interval, which stays honest for small N and rates near 0 or 1.

What a crashing run leaves: Python commands run with PYTHONFAULTHANDLER=1 (the Python stack), and
every process of a run gets hardy's native fatal-signal handler through LD_PRELOAD (the variant of
`crash/native_handler.c` that installs itself when loaded, writing to stderr; a copy in a private
temporary folder, removed at the end, never the cache folder's file: `_preloaded`): the crashing
thread's native frames, named from the libraries' symbol tables, so each failing run says which
library and function it died in. LD_PRELOAD is what glibc's own `catchsegv` used (removed in glibc
2.35); it reaches dynamically linked programs, not static or setuid ones.
"""

from __future__ import annotations

import math
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..cache.folders import Folder, open_named
from ..crash.sentence import crash_report, describe_exit
from ..system import others_may_write


@dataclass(frozen=True)
class RunOutcome:
    index: int            # 1-based
    outcome: str          # "success", "exit 3", "SIGSEGV", "SIGSEGV (shell exit 139)", "timeout"
    returncode: int | None
    signal: str | None
    seconds: float
    log: str | None = None
    crashed_in: str = ""  # "libfoo.so (crash_here+0x12)": the native frame a crash is named by
    native_stack: str = ""  # the crashing thread's native frames, numbered, innermost first
    python_stack: str = ""  # faulthandler's text from the run's stderr

    @property
    def ok(self) -> bool:
        return self.outcome == "success"


@dataclass
class RepeatReport:
    command: list[str]
    runs: list[RunOutcome] = field(default_factory=list)
    native: str = ""  # why runs have no native frames ("" when they do)

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.runs:
            out[r.outcome] = out.get(r.outcome, 0) + 1
        return out

    @property
    def failures(self) -> int:
        return sum(not r.ok for r in self.runs)

    @property
    def rate(self) -> float:
        return self.failures / len(self.runs) if self.runs else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.failures, len(self.runs))


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval for k failures out of n runs."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def classify(returncode: int | None, timed_out: bool) -> tuple[str, str | None]:
    """(outcome, signal name) for one finished run."""
    if timed_out:
        return "timeout", None
    if returncode == 0:
        return "success", None
    signame, _ = describe_exit(returncode)
    if signame is None:
        return f"exit {returncode}", None
    if returncode is not None and returncode > 0:  # 128 + N from a shell
        return f"{signame} (shell exit {returncode})", signame
    return signame, signame


@contextmanager
def _preloaded(native: bool) -> Iterator[tuple[dict[str, str], str]]:
    """The environment that gives each run the native handler, and why not when it cannot. The
    runs load it by path, each in its own exec, so the path must name one file nobody else can
    change until the last run has started: not the one in hardy's cache folder (whoever could
    change a folder on its path would choose the code every run loads), but a copy of the bytes
    read from its checked descriptor (`open_handler`), in a private folder made for this call and
    removed when it ends, Ctrl-C included."""
    from ..crash.handler import open_handler
    if not native or os.environ.get("HARDY_NATIVE_HANDLER") == "off":
        yield {}, "native frames off"
        return
    fd, _, why = open_handler(preload=True)
    if fd is None:
        yield {}, f"no native frames: {why}"
        return
    import shutil
    import tempfile
    folder, env = "", {}
    try:
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read()
            parent = os.path.realpath(tempfile.gettempdir())
            why = _unsafe_for_preload(parent)
            if not why:
                folder = tempfile.mkdtemp(prefix="hardy-preload-", dir=parent)  # 0700, ours
                with open_named(folder, private=True) as opened:
                    opened.write("hardy-preload.so", data, mode=0o500)
                path = os.path.join(folder, "hardy-preload.so")
                env = {"LD_PRELOAD": " ".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)}
        except OSError as exc:
            why = f"cannot copy the handler to a private folder: {exc}"
        yield env, f"no native frames: {why}" if why else ""
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def _unsafe_for_preload(folder: str) -> str:
    """Why a file in a new folder under `folder` (a resolved path) could be swapped by another user
    before a run loads it by path, or "": every folder on the way must be this user's or root's, and
    one that others may write must be sticky (as /tmp is), so that none but its owner renames what is in it."""
    me, path = os.geteuid(), "/"
    for part in ["", *folder.strip("/").split("/")]:
        path = os.path.join(path, part)
        st = os.lstat(path)
        if st.st_uid not in (me, 0) or not stat.S_ISDIR(st.st_mode) or (
                st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX):
            return (f"{path} (on the way to the temporary folder {folder}) is another user's or others may "
                    "rename what is in it: set TMPDIR to a folder of your own")
    if set(folder) & set(" :\t\n"):
        return f"{folder!r} holds a space or a colon, which separate LD_PRELOAD's paths: set TMPDIR to another folder"
    if os.statvfs(folder).f_flag & os.ST_NOEXEC:
        return f"{folder} is on a noexec mount: set TMPDIR to a folder of your own on another"
    return ""


def repeat(command: Sequence[str], n: int = 30, jobs: int = 1, stop_on_failure: bool = False,
           timeout: float | None = None, logs: str | os.PathLike[str] | None = None,
           on_run: Callable[[RunOutcome, int], None] | None = None,
           env: dict[str, str] | None = None, native: bool = True) -> RepeatReport:
    """Run `command` n times (jobs at a time). Each run sees HARDY_RUN_INDEX=1..n in its environment.

    `on_run(outcome, n)` is called as each run finishes (the CLI prints its line there). A failing
    run keeps the native frame it crashed in, its native and its Python stack (module docstring);
    `native=False` leaves the native handler out of the runs.
    """
    report = RepeatReport(list(command))
    stop, ended = threading.Event(), threading.Event()
    lock, spawning = threading.Lock(), threading.Lock()
    live: set[subprocess.Popen[bytes]] = set()

    def one(i: int) -> None:
        with spawning:  # (none starts once Ctrl-C has ended the runs)
            if stop.is_set():
                return
            start = time.perf_counter()
            proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1", **preload,
                                                                 **(env or {}), "HARDY_RUN_INDEX": str(i)})
            live.add(proc)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)  # the whole process group: docker, shells, children
            out, err = proc.communicate()
        with spawning:
            live.discard(proc)
        if ended.is_set():  # killed by Ctrl-C: no outcome of the command's
            return
        result = _outcome(command, i, n, proc.returncode, timed_out, out, err, log_dir, start)
        with lock:
            report.runs.append(result)
            if on_run:
                on_run(result, n)
        if stop_on_failure and not result.ok:
            stop.set()

    with _log_folder(logs) as log_dir, _preloaded(native) as (preload, report.native), \
            ThreadPoolExecutor(max(1, jobs)) as pool:
        try:
            list(pool.map(one, range(1, n + 1)))
        except BaseException:  # Ctrl-C: the runs are in sessions of their own, which a terminal's Ctrl-C misses
            with spawning:
                ended.set()
                stop.set()
                for proc in live:
                    _kill_group(proc)
            raise
    report.runs.sort(key=lambda r: r.index)
    return report


@contextmanager
def _log_folder(logs: str | os.PathLike[str] | None) -> Iterator[Folder | None]:
    """--logs FOLDER (made if absent, writable by the user alone), opened once: each log is written
    through its descriptor to a fresh name renamed into place (`Folder.write`), so a link planted at
    a log's name is replaced, never written through. Refused (`InvalidArgument`) where another user
    could choose what the folder is or holds: a link, a folder of another user's (root's aside), or
    one others may write that is not sticky (a team's: anyone there could swap a log; a 0775 folder
    of the user's private group, as umask 002 makes them, is the user's alone: `others_may_write`)."""
    from ..errors import InvalidArgument
    if logs is None:
        yield None
        return
    path = os.path.abspath(logs)
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # a link (ELOOP; ENOTDIR for one to a file, EEXIST for one to nothing), or no folder
        raise InvalidArgument(f"--logs {logs}: {'a symbolic link, not followed' if os.path.islink(path) else exc}"
                              "; give a folder of your own for the logs") from None
    with Folder(fd, str(Path(logs)), False) as folder:  # (named as given: each log's path is said so)
        st = os.fstat(fd)
        if st.st_uid not in (os.geteuid(), 0) or others_may_write(st) and not st.st_mode & stat.S_ISVTX:
            raise InvalidArgument(f"--logs {logs} is uid {st.st_uid}'s folder, mode {stat.S_IMODE(st.st_mode):o}, "
                                  f"group {st.st_gid}: another user could replace or plant the logs there; give a "
                                  "folder of your own "
                                  "that only you can write")
        yield folder


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to a run's whole process group (docker, shells, children), unless it has been waited for."""
    try:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _outcome(command: Sequence[str], i: int, n: int, returncode: int | None, timed_out: bool, out: bytes,
             err: bytes, log_dir: Folder | None, start: float) -> RunOutcome:
    """Run `i`'s outcome from its exit and output (started at `perf_counter()` `start`); a failing
    run's output is kept in `log_dir`."""
    outcome, signame = classify(returncode, timed_out)
    log = None
    named, native_stack, python_stack = crash_report(err.decode(errors="replace")) if outcome != "success" \
        else ("", "", "")
    if signame is None:  # a record in an exit's stderr is a child's (a contained hardy worker's), not the run's
        named = native_stack = ""
    if outcome != "success" and log_dir is not None:
        name = f"run-{i:0{len(str(n))}d}.log"
        log_dir.write(name, [b"$ " + " ".join(command).encode() + f"\n# {outcome}\n--- stdout\n".encode(), out,
                             b"\n--- stderr\n", err, f"\n--- native stack (in {named})\n{native_stack}\n".encode()
                             if native_stack else b""], mode=None)
        log = os.path.join(log_dir.path, name)
    return RunOutcome(i, outcome, returncode, signame, time.perf_counter() - start, log, named, native_stack,
                      python_stack)

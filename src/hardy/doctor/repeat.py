"""Run a command many times, each in a fresh process, and measure how often it crashes.

In the incident behind it, a team re-ran a container 30 times by hand to find that an unused
`import torch` before `cuml` segfaulted 10-30 % of runs. `repeat`
does that for any command, classifies every exit (success, exit code, signal by name — a shell's
`139` included — or timeout), keeps each failing run's output, and reports the failure rate with a
95 % Wilson confidence interval, which stays honest for small N and rates near 0 or 1.

What a crashing run leaves: Python commands run with PYTHONFAULTHANDLER=1 (the Python stack), and
every process of a run gets hardy's native fatal-signal handler through LD_PRELOAD (the variant of
`crash/native_handler.c` that installs itself when loaded, writing to stderr): the crashing
thread's native frames, named from the libraries' symbol tables, so each failing run says which
library and function it died in. LD_PRELOAD is what glibc's own `catchsegv` used (removed in glibc
2.35); it reaches dynamically linked programs, not static or setuid ones.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..crash.sentence import crash_report, describe_exit


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


def _preload(native: bool) -> tuple[dict[str, str], str]:
    """The environment that gives each run the native handler, and why not when it cannot."""
    from ..crash.handler import build
    if not native or os.environ.get("HARDY_NATIVE_HANDLER") == "off":
        return {}, "native frames off"
    path, why = build(preload=True)
    if path is None:
        return {}, f"no native frames: {why}"
    return {"LD_PRELOAD": " ".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)}, ""


def repeat(command: Sequence[str], n: int = 30, jobs: int = 1, stop_on_failure: bool = False,
           timeout: float | None = None, logs: str | os.PathLike[str] | None = None,
           on_run: Callable[[RunOutcome, int], None] | None = None,
           env: dict[str, str] | None = None, native: bool = True) -> RepeatReport:
    """Run `command` n times (jobs at a time). Each run sees HARDY_RUN_INDEX=1..n in its environment.

    `on_run(outcome, n)` is called as each run finishes (the CLI prints its line there). A failing
    run keeps the native frame it crashed in, its native and its Python stack (module docstring);
    `native=False` leaves the native handler out of the runs.
    """
    preload, why = _preload(native)
    report = RepeatReport(list(command), native=why)
    log_dir = Path(logs) if logs is not None else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    lock = threading.Lock()

    def one(i: int) -> None:
        if stop.is_set():
            return
        start = time.perf_counter()
        proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1", **preload,
                                                             **(env or {}), "HARDY_RUN_INDEX": str(i)})
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: docker, shells, children
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        outcome, signame = classify(proc.returncode, timed_out)
        log = None
        named, native_stack, python_stack = crash_report(err.decode(errors="replace")) if outcome != "success" \
            else ("", "", "")
        if signame is None:  # a record in an exit's stderr is a child's (a contained hardy worker's), not the run's
            named = native_stack = ""
        if outcome != "success" and log_dir is not None:
            path = log_dir / f"run-{i:0{len(str(n))}d}.log"
            path.write_bytes(b"$ " + " ".join(command).encode() + f"\n# {outcome}\n--- stdout\n".encode() + out
                             + b"\n--- stderr\n" + err
                             + (f"\n--- native stack (in {named})\n{native_stack}\n".encode() if native_stack else b""))
            log = str(path)
        result = RunOutcome(i, outcome, proc.returncode, signame, time.perf_counter() - start, log, named,
                            native_stack, python_stack)
        with lock:
            report.runs.append(result)
            if on_run:
                on_run(result, n)
        if stop_on_failure and not result.ok:
            stop.set()

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(one, range(1, n + 1)))
    report.runs.sort(key=lambda r: r.index)
    return report

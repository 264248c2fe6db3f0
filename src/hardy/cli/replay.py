"""`hardy replay REPORT --item N [--repeat K | --gdb | --py-spy | --pdb]`: one failed item of a run report, run again.

The item's kept inputs (`hardy.crash.kept`) run through the same pipeline on a process engine with one
worker that serves a single item (`max_tasks_per_worker=1`) and the original engine's worker
options (preload, preload_libs, start method, memory limit), so every run starts as the original
worker did: a fresh process from a clean fork server, the worker environment, the native
handler. One run shows the outcome with its Python and native stacks and the diagnosis; K runs
give the failure rate with its 95 % Wilson interval (`hardy repeat`'s statistics), which tells a
deterministic crash (K of K) from a flaky one.

`--gdb` and `--py-spy` run the item once, in one fresh process started by the tool (`hardy.replay_item`:
the worker environment, the engine's preloads, the nodes in the main thread): gdb in batch mode
(`run`, then `bt` and `info sharedlibrary` where it stopped: at the crash's signal, or at the SIGINT
sent past the node's timeout or `--timeout`), or `py-spy record --native` (where the item's time
went, Python and native frames, summed up from its collapsed stacks, which are kept beside the
inputs). The kept file's owner, mode and signature are checked here first, so a file that would be
refused never reaches the tool.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ..doctor.imports import python_command
from ..doctor.repeat import wilson
from .usage import at_least

if TYPE_CHECKING:
    from ..errors import NodeError


@dataclass
class Replay:
    item: int
    pipeline: str
    outcomes: list[str] = field(default_factory=list)  # "ok", or the failure's signal or error type, per run
    first_failure: NodeError | None = None

    @property
    def failures(self) -> int:
        return sum(o != "ok" for o in self.outcomes)

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.failures, len(self.outcomes))

    def verdict(self) -> str:
        n, k = len(self.outcomes), self.failures
        lo, hi = self.interval
        rate = f"failed {k} of {n} run(s): {k / n:.0%} (95% CI {lo:.0%}-{hi:.0%})"
        if k == 0:
            return rate + ": did not fail again here (flaky, or it depends on what ran before it in its worker)"
        if k == n:
            return rate + (": deterministic" if n > 1 else "")
        return rate + ": flaky"


def replay(report: str | os.PathLike[str], item: int, repeat: int = 1) -> Replay:
    """Run the kept item `repeat` times, each in a fresh worker."""
    from ..crash.kept import load
    from ..engine import Engine
    kept = load(report, item)
    pipeline, inputs = kept["pipeline"], kept["inputs"]
    result = Replay(item, pipeline.name)
    options = {**getattr(pipeline.engine, "process_options", {}), "max_tasks_per_worker": 1}
    with Engine(map_executor="process", workers=1, **options) as engine:  # its preload, start method, libraries
        out = pipeline.map(inputs={k: [v] * repeat for k, v in inputs.items()}, map_over=list(inputs),
                           on_error="continue", progress=False, engine=engine)
    for value in out:
        err: Any = getattr(value, "error", None)
        if err is None:
            result.outcomes.append("ok")
            continue
        result.outcomes.append(getattr(err, "signal", None) or type(err.__cause__ or err).__name__)
        if result.first_failure is None:
            err.item = item  # the run's number for it, not its place among the replays
            result.first_failure = err
    return result


def described(err: NodeError) -> str:
    """A failure as the replay prints it: the message, with a crash's native and Python stacks
    (its message holds them), or an exception's traceback (the worker's frames, `hardy.tracebacks`)."""
    import traceback

    from ..errors import NodeCrashed
    cause = err.__cause__
    if isinstance(err, NodeCrashed) or cause is None:
        return str(err)
    stack = "".join(traceback.format_exception(cause)) if cause.__traceback__ is not None else err.stack
    return f"{stack.rstrip()}\n{err}" if stack else str(err)


def under_pdb(report: str, item: int) -> int:
    """Run the kept item in this process under pdb (`debugging.run_again`); refused, before
    anything runs, for an item that crashed its worker: it would end this process too."""
    from ..api.debugging import run_again
    from ..crash.kept import load
    crash = _crash_of(report, item)
    if crash:
        return _missing(f"item {item} crashed its worker ({crash}): run in this process under pdb it would end "
                        "this process too; --gdb runs it under gdb in a process of its own")
    kept = load(report, item)
    pipeline, inputs = kept["pipeline"], kept["inputs"]
    typer.echo(f"item {item} of pipeline {pipeline.name!r}, run in this process (pid {os.getpid()}), under pdb "
               "where it fails", err=True)
    return 1 if run_again(pipeline, inputs, None, f"item {item}") else 0


def _crash_of(report: str, item: int) -> str | None:
    """The signal item `item` of the report died from (a crash, not a timeout), if it did."""
    from ..observe.report import RunReport
    try:
        failures = RunReport.load(report).data.get("failures", [])
    except (OSError, ValueError):
        return None  # `load` of the kept inputs says what is wrong with the report
    record = next((f for f in failures if isinstance(f, dict) and f.get("item") == item), {})
    signal_name = record.get("signal")
    return str(signal_name) if signal_name and record.get("error") != "NodeTimeout" else None


GDB_COMMANDS = ("set pagination off", "set confirm off", "set debuginfod enabled off", "run", "bt",
                "info sharedlibrary")
_GDB_NOISE = ("[New Thread ", "[Thread ", "[Thread debugging using", "Using host libthread_db",
              "warning: Error disabling address space randomization")
PROFILE_RATE = 200  # py-spy samples per second
PY_SPY_GRACE = 10.0  # seconds py-spy may take to attach, and to write its profile once the process has ended
HELD_LIMIT = 3  # checks, a second apart, that find the item's process stopped by py-spy before py-spy is killed


def _item_command(report: str, item: int, timeout: float) -> list[str]:
    """`python -m hardy.replay_item`, less the working directory `-m` would search first (a team's
    report folder another user can write, where a `hardy/` of theirs would run): `python_command`."""
    run = "import runpy; runpy.run_module('hardy.replay_item', run_name='__main__', alter_sys=True)"
    return [*python_command(run), os.path.abspath(report), str(item), f"{timeout:g}"]


def under_gdb(report: str, item: int, timeout: float) -> int:
    """Run the item under gdb; print its output and what stopped it. The exit code (module docstring)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return _missing("--gdb needs gdb, which is not installed here (Debian/Ubuntu: apt-get install gdb; "
                        "Fedora: dnf install gdb)")
    command = [gdb, "-q", "-batch", "-iex", "set auto-load python-scripts off",
               *(a for c in GDB_COMMANDS for a in ("-ex", c)), "--args", *_item_command(report, item, timeout)]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    out = "\n".join(ln for ln in done.stdout.splitlines() if not ln.startswith(_GDB_NOISE))
    typer.echo(out)
    if "ptrace: Operation not permitted" in out or "Couldn't get registers" in out:
        return _missing("gdb may not trace processes here (a container needs the SYS_PTRACE capability)")
    stopped = re.search(r"(?:received|terminated with) signal (SIG\w+)", out)
    exited = re.search(r"exited with code (\d+)", out)
    if stopped and stopped.group(1) == "SIGINT":
        typer.echo("under gdb: stopped past its deadline (SIGINT): the backtrace above is where it was")
    elif stopped:
        typer.echo(f"under gdb: {stopped.group(1)}: the backtrace above is the crash's")
    elif exited and exited.group(1) == "02":
        return 2  # refused before it ran (its message is above)
    else:
        typer.echo("under gdb: " + (f"exited with code {int(exited.group(1))}" if exited else "exited normally"))
    return 0 if not stopped and not exited else 1


def under_py_spy(report: str, item: int, timeout: float) -> int:
    """Run the item under `py-spy record --native`; print its outcome, a crash's stacks and where the
    time went. The exit code (module docstring). py-spy attaches to the item's process (`--pid`),
    which waits for it before running the item: a spawned child that crashed was seen to leave
    py-spy 0.4 waiting forever, and its own exit status tells the signal."""
    from ..crash.sentence import crash_report
    from ..crash.stacks import py_spy
    from ..errors import install_hint
    program = py_spy()
    if program is None:
        return _missing(f"--py-spy needs py-spy, which is not installed here: {install_hint('forensics')}")
    scratch = Path(tempfile.mkdtemp(prefix="hardy-py-spy-"))  # py-spy writes by path: in a folder of ours alone
    profile = scratch / f"item-{item}.py-spy.txt"
    proc = subprocess.Popen([*_item_command(report, item, timeout), "--wait"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    spy = subprocess.Popen([program, "record", "--pid", str(proc.pid), "--native", "--idle", "--format", "raw",
                            "--rate", str(PROFILE_RATE), "--output", str(profile)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    assert spy.stdout is not None and proc.stdin is not None
    ready, _, _ = select.select([spy.stdout], [], [], PY_SPY_GRACE)
    attached = spy.stdout.readline() if ready else ""  # "py-spy> Sampling process ..." once it samples
    proc.stdin.write("go\n")
    proc.stdin.flush()
    out, err, stuck = _unless_held(proc, spy)
    try:
        said, _ = spy.communicate(timeout=PY_SPY_GRACE)
    except subprocess.TimeoutExpired:
        spy.kill()
        said, _ = spy.communicate()
    if stuck:
        typer.echo("hardy replay: py-spy held the item's process stopped (it stopped sampling as the process "
                   "crashed) and was killed: its profile may be cut short", err=True)
    typer.echo(out.rstrip())
    if proc.returncode == 2 and "hardy replay: " in err:
        typer.echo(err.rstrip(), err=True)
        return 2
    if proc.returncode < 0:
        named, native, python = crash_report(err)
        typer.echo(f"outcome: {signal.Signals(-proc.returncode).name}" + (f" in {named}" if named else ""))
        typer.echo(f"native stack:\n{native}\n{python}" if native else python)
    elif proc.returncode:
        typer.echo(err.rstrip())
    kept = _kept_beside(report, profile)
    typer.echo(_hot_stacks(profile, kept) or f"py-spy recorded nothing of the item: {(attached + said).strip()[-300:]}")
    if kept != profile:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if proc.returncode else 0


def _kept_beside(report: str, profile: Path) -> Path:
    """The profile copied beside the item's kept inputs, `<report>.inputs/item-N.py-spy.txt`,
    through that folder's checked descriptor (ours, private, never through a link: a team's
    report folder lets others swap the folder for a link of theirs between the replay's checks
    and py-spy's write, which would have written the file their link names); where that fails,
    the private copy (said so)."""
    from ..cache.folders import open_named
    from ..crash.kept import folder_of
    from ..errors import UntrustedCacheError
    folder = folder_of(report)
    try:
        data = profile.read_bytes()
        with open_named(str(folder.parent), private=False) as parent, \
                parent.sub(folder.name, private=True) as kept:
            kept.write(profile.name, data, mode=0o600)
    except (OSError, UntrustedCacheError) as exc:
        if profile.exists():
            typer.echo(f"hardy replay: the profile stays in {profile.parent}, not beside the report ({exc})", err=True)
        return profile
    return folder / profile.name


def _unless_held(proc: subprocess.Popen[str], spy: subprocess.Popen[str]) -> tuple[str, str, bool]:
    """The item's output once it ends; (..., True) when py-spy held it stopped (ptrace) for
    HELD_LIMIT checks in a row, a second apart, and was killed to let it go: seen under load when
    the process crashed while py-spy stopped it to sample, both then waiting for the other."""
    held = 0
    while True:
        try:
            out, err = proc.communicate(timeout=1.0)
            return out, err, False
        except subprocess.TimeoutExpired:
            held = held + 1 if spy.poll() is None and _traced_stop(proc.pid) else 0
            if held >= HELD_LIMIT:
                spy.kill()
                out, err = proc.communicate()
                return out, err, True


def _traced_stop(pid: int) -> bool:
    """Whether any thread of `pid` is stopped by its tracer: not only the main one, which may
    instead wait for the GIL that a stopped thread (the deadline's watchdog) holds."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "t":
                    return True
        except (OSError, IndexError):
            continue
    return False


def _hot_stacks(profile: Path, kept: Path, top: int = 5, depth: int = 6) -> str:
    """py-spy's collapsed stacks (`a;b;c count`, outermost first) summed up: those of the item's
    nodes (under hardy's plan function; the process's start is not the item's), busiest first,
    innermost frame first, idle waits included (a hang is mostly those)."""
    counts: Counter[str] = Counter()
    try:
        for line in profile.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if stack and n.isdigit() and "(<hardy plan " in stack:
                counts[stack.partition("(<hardy plan ")[2].partition(";")[2]] += int(n)
    except OSError:
        return ""
    total = sum(counts.values())
    if not total:
        return ""
    lines = [f"py-spy record --native: {total} samples at {PROFILE_RATE}/s while its nodes ran; where the time "
             "went (innermost frame first):"]
    for busy, samples in counts.most_common(top):
        frames = [f.strip() for f in busy.split(";")][::-1]
        more = f" <- ... {len(frames) - depth} more" if len(frames) > depth else ""
        lines.append(f"  {samples / total:4.0%}  " + " <- ".join(frames[:depth]) + more)
    lines.append(f"every stack (collapsed; flamegraph.pl, inferno or speedscope draw it): {kept}")
    return "\n".join(lines)


def _streamed(report: str, item: int, data: dict[str, Any]) -> None:
    """Raises `ReplayError` when `report` is an `imap`'s or a `run`'s (`data`, its `kind`: what `hardy run`
    makes) and has no kept inputs for `item`: those calls keep none (their items stream, and are
    not held), so the generic "inputs are kept for maps run with Engine(report_dir=...)" would tell
    a user who set HARDY_REPORT_DIR to do what they did. Says where that item's inputs are instead."""
    from ..crash.kept import folder_of
    from ..errors import ReplayError
    kind = data.get("kind")
    if (folder_of(report) / f"item-{item}.pkl").exists():
        return
    if kind not in ("imap", "run"):
        return
    raise ReplayError(
        f"no kept inputs for item {item}: {report} is the report of {'an' if kind == 'imap' else 'a'} {kind}() "
        "(as `hardy run` makes), and "
        f"those keep no inputs (their items stream, and are not held). Item {item} of a `hardy run` is "
        f"{_line_of(data, item)}: run it again with `hardy run MODULE:PIPELINE --set NAME=VALUE ...` holding that "
        f"line's values, or from Python with pipeline.map(...) over it under Engine(report_dir=...), which keeps a "
        f"failed item's inputs for `hardy replay`")


def _line_of(data: dict[str, Any], item: int) -> str:
    """Where item `item` of a `hardy run` came from: the line of its --inputs file that its failure
    names (`hardy run` keeps it: blank lines are skipped, so it is not always line N+1), or, in a
    report without it, how to find it."""
    failure = next((f for f in data.get("failures", []) if isinstance(f, dict) and f.get("item") == item), {})
    line, inputs = failure.get("line"), data.get("inputs")
    if isinstance(line, int) and isinstance(inputs, str):
        return f"line {line} of its --inputs file {inputs}"
    return (f"line {item + 1} of its --inputs file, blank lines not counted (a report `hardy run` wrote with "
            f"--inputs names the line itself), or value {item} of a list given with --set")


def _a_run_report(report: str) -> dict[str, Any]:
    """The report's data (its `kind`: `map`, `imap`, `run`); raises `ReplayError` when `report` is not a run
    report hardy can read (not JSON, not hardy's, a FIFO, a sparse or oversized file another user
    left): said as `hardy report` says it, not as "no kept inputs" beside a file that never had any.
    Read once, with `RunReport.load`'s checks: nothing reads it again unchecked."""
    from ..errors import ReplayError
    from ..observe.report import RunReport
    try:
        data: dict[str, Any] = RunReport.load(report).data
    except (OSError, ValueError) as exc:
        raise ReplayError(str(exc)) from None
    return data


def _missing(why: str) -> int:
    typer.echo(f"hardy replay: {why}", err=True)
    return 2


def replay_command(report: str = typer.Argument(..., metavar="REPORT",
                                                help="A run report's JSON (Engine(report_dir=...) writes them)."),
           item: int = typer.Option(..., "--item", metavar="N", callback=at_least(0),
                                     help="The failed item to run again (0 for the first)."),
           repeat: int = typer.Option(1, "--repeat", "-n", metavar="N", callback=at_least(1),
                                      help="Runs, each in a fresh worker: with more "
                                      "than one, the failure rate and its 95% confidence interval."),
           gdb: bool = typer.Option(False, "--gdb", help="Run it once under gdb: the native backtrace where it "
                                    "crashed (or hung, past its timeout) and the loaded libraries."),
           py_spy: bool = typer.Option(False, "--py-spy", help="Run it once under py-spy record --native: where "
                                       "its time went, Python and native frames (hardy[forensics])."),
           pdb: bool = typer.Option(False, "--pdb", help="Run it once in this process and open pdb where it fails, "
                                    "with live locals (not for an item that crashed its worker: use --gdb)."),
           timeout: float = typer.Option(0, "--timeout", metavar="SECONDS", callback=at_least(0),
                                         help="With --gdb or --py-spy: stop it after this many seconds (besides "
                                         "its nodes' own timeouts); 0: no limit.")) -> None:
    """Run a failed item again from its kept inputs; print the outcome, its stacks and the diagnosis.

    Exit code: 0 when every run succeeded, 1 when one failed, 2 when the item cannot be replayed
    (or --gdb / --py-spy's tool is not installed).
    """
    from ..crash.kept import a_report, check
    from ..errors import ReplayError
    from . import quiet_when_the_reader_goes
    if not pdb:  # (`hardy replay R.json --item 3 | head`: its runs have ended as it prints; under pdb the
        quiet_when_the_reader_goes()  # node runs here, where a pipe it writes to must raise BrokenPipeError)
    try:
        a_report(report)
        _streamed(report, item, _a_run_report(report))
    except ReplayError as exc:
        typer.echo(f"hardy replay: {exc}", err=True)
        raise typer.Exit(2) from None
    if gdb or py_spy or pdb:
        if gdb + py_spy + pdb > 1 or repeat > 1:
            typer.echo("hardy replay: --gdb, --py-spy, --pdb and --repeat are one at a time", err=True)
            raise typer.Exit(2)
        try:
            check(report, item)
            code = (under_gdb(report, item, timeout) if gdb else under_py_spy(report, item, timeout) if py_spy
                    else under_pdb(report, item))
        except ReplayError as exc:
            typer.echo(f"hardy replay: {exc}", err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(code)
    try:
        result = replay(report, item, repeat)
    except ReplayError as exc:
        typer.echo(f"hardy replay: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"item {item} of pipeline {result.pipeline!r}, {repeat} run(s), each in a fresh worker: "
               + ", ".join(result.outcomes))
    if result.first_failure is not None:
        typer.echo(described(result.first_failure))
    typer.echo(result.verdict())
    raise typer.Exit(1 if result.failures else 0)

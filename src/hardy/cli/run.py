"""`hardy run` (a pipeline from the shell or a scheduler) and `hardy report` (render a saved report).

Exit codes are what a scheduler branches on: 0 every item succeeded, 1 some failed (each is a
line of the output, and the report says why), 2 the command itself was wrong (a module that
cannot be imported, raises or exits while imported, an unknown pipeline, a malformed input line,
an input no node takes); typer's own usage errors are 2 as well. Interrupted by SIGINT or
SIGTERM, it stops the map and exits 130 or 143; an output that cannot be written stops it too,
at once, workers included: 141 for a closed pipe (`| head`, as SIGPIPE would), 74 for anything
else (a full disk).

Each item's line is written, and flushed, as the item finishes (`imap(ordered=False)`: in
completion order, each line naming its item), so that whatever ends the command (a signal, a
scheduler's kill, a crash of this process when the pipeline runs nodes in it) leaves every
finished item in the output; `--resume` reads those lines back and runs only the other items.
What a line holds, and how outputs are written as JSON: `outputs.py`; what the command is given
(--set, --inputs): `inputs.py`; the MODULE:PIPELINE it runs: `loading.py`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

import typer

from ..errors import Failed
from ..wording import did_you_mean
from .inputs import alongside, parse_sets, read_items
from .loading import load_pipeline
from .outputs import Writer, closing_ends_the_run, failed_line, fresh_results, resumed, written
from .reports import saved_as, writable_report
from .usage import at_least
from .usage import refuse as _fail_usage

EXECUTORS = ("sequential", "threaded", "async", "process")  # what --executor names (the others are objects)


def _said(exc: BaseException) -> str:
    """A usage error as `hardy run` words it: a missing input is given with --set or --inputs here,
    not with Python's `inputs=...` or `bind()`, which the library's message names."""
    from ..errors import MissingInputError
    text = str(exc)
    if isinstance(exc, MissingInputError):
        python = "Pass them in inputs=... or with bind()."
        shell = "Give them with --set NAME=VALUE, or in each line of --inputs FILE (one JSON object per item)."
        text = text.replace(python, shell) if python in text else f"{text} {shell}"
    return text


def run(target: str = typer.Argument(..., metavar="MODULE:PIPELINE", help="MODULE:PIPELINE, e.g. mypkg.flows:pipeline"),
        set_: list[str] = typer.Option([], "--set", metavar="NAME=VALUE",
                                       help="An input NAME=VALUE (JSON or text); repeatable."),
        inputs: str | None = typer.Option(None, "--inputs", metavar="FILE",
                                          help="JSONL file: one object of inputs per item."),
        map_over: list[str] = typer.Option([], "--map-over", metavar="NAME",
                                           help="Inputs that hold one value per item."),
        executor: str | None = typer.Option(None, metavar="EXECUTOR", help="sequential | threaded | async | process "
                                                "(default: the pipeline's own engine's)"),
        workers: int | None = typer.Option(None, metavar="N", callback=at_least(1),
                                            help="Worker threads or processes (1 or more)."),
        cache: str | None = typer.Option(None, metavar="FOLDER", help="A DiskCache directory."),
        report: str | None = typer.Option(None, metavar="FILE", help="Write the run report: FILE.html or FILE.json."),
        output: str | None = typer.Option(None, metavar="FILE", help="Write the JSONL results here instead of stdout."),
        outputs: str | None = typer.Option(None, "--outputs", metavar="NAMES",
                                           help="Compute and write only these outputs (comma-separated)."),
        resume: str | None = typer.Option(None, "--resume", metavar="FILE",
                                          help="Skip the items FILE (an earlier run's --output, same inputs) has a "
                                          "line for; append the others' lines to it."),
        progress: bool | None = typer.Option(None, help="Show the progress bar (default: on a terminal).")) -> None:
    """Run a pipeline once, or map it over --inputs/--map-over; one JSON line per item."""
    if report:
        writable_report(report, "--report")
    results = None  # --resume's file, opened once and checked: read, then appended to
    if resume:
        output, results = resume, _resumed(resume, output)
    if output:
        output_path(output)
    lines = None if output else _results_only()
    pipeline = load_pipeline(target)
    values, over, numbers = _inputs(pipeline, set_, inputs, map_over, output, resume)
    wanted = [o for o in (outputs or "").split(",") if o] or None  # an unknown name: a usage error, from the map
    engine = _engine(pipeline.engine, executor, workers, report is not None)
    if cache:
        from ..cache import DiskCache
        pipeline = pipeline.cached_in(DiskCache(cache))
    before, todo = _resuming(results, resume, values, over)
    with engine, _Interruptible() as interrupted, _opened(output, lines, results) as out, _in_options():
        writer = Writer(out, {name: n.name for name, n in pipeline.graph.producer.items()})
        unwritable = _watched(out, lambda: _items(pipeline, values, over, wanted, (before, todo), engine, progress,
                                                  writer))
    _numbered(pipeline, todo, numbers, inputs)
    done, failed = writer.done + len(before), writer.failed + sum(not ok for ok in before.values())
    if unwritable is not None:
        _unwritable(unwritable, writer.done, output, out)
    if report and (writer.done or not before):
        report = saved_as(pipeline.report(), report, f"each item's line is in {output or 'stdout'}")
    elif report:  # --resume found every item written: nothing ran, nothing to report
        typer.echo(f"hardy: every item had its line in {resume} already: nothing ran, no report written", err=True)
        report = None
    report = report or saved(pipeline)
    where = f"; see {report}" if report else ""
    if interrupted.signal or writer.interrupt is not None:  # Ctrl-C, SIGTERM, or a node's KeyboardInterrupt
        by = interrupted.signal or f"a node's {writer.interrupt!r}"
        typer.echo(f"hardy: interrupted by {by} after {done} item(s) ({failed} failed), each written "
                   f"to {output or 'stdout'}{where}", err=True)
        raise typer.Exit(128 + (interrupted.number if interrupted.signal else signal.SIGINT))
    if failed:
        typer.echo(failed_line(writer, before, (failed, done), output, report), err=True)
    raise typer.Exit(1 if failed else 0)


@contextlib.contextmanager
def _in_options() -> Iterator[None]:
    """While the map runs, a crash of this process (an in-process executor's node) says what would
    contain it as this command's option, --executor process, not as Python's `map_executor=`."""
    from ..crash import signals
    before = dict(signals.REMEDY_WORDS)
    signals.REMEDY_WORDS.update(executor="--executor {}", contains="--executor process (or @node(isolate=True) on "
                                "that node, in its code)")
    try:
        yield
    finally:
        signals.REMEDY_WORDS.update(before)


def _watched(out: IO[str], items: Callable[[], OSError | None]) -> OSError | None:
    """`items()`, ended at once when the output's reader goes away (`closing_ends_the_run`: an
    interrupt, wherever it waits); what made the output unwritable, if anything."""
    with closing_ends_the_run(out) as watched:
        try:
            unwritable = items()
        except KeyboardInterrupt:  # the reader went away while no map ran: it interrupted here
            if not watched.closed:
                raise
            unwritable = None
    if watched.closed and unwritable is None:  # it stopped the map as Ctrl-C would
        return BrokenPipeError(errno.EPIPE, "the output was closed")
    return unwritable


def _inputs(pipeline: Any, set_: list[str], inputs: str | None, map_over: list[str], output: str | None,
            resume: str | None) -> tuple[dict[str, Any], list[str], list[int] | None]:
    """The inputs given (--set, the --inputs lines), the names mapped over, and each item's line of
    the --inputs file (None without one), checked before anything runs; an --inputs file of no
    line ends the command here (`_no_item`)."""
    values = parse_sets(set_)
    over = [n for spec in map_over for n in spec.split(",") if n]
    numbers = None
    if inputs:
        columns, over, numbers = read_items(inputs, over, values)
        if not columns:
            _no_item(inputs, output, resume)
        both = [name for name in values if name in columns]
        if both:  # (the lines' values won, and the --set was dropped without a word)
            given = next(p for p in set_ if p.partition("=")[0] == both[0])
            _fail_usage(f"--set {given} and --inputs {inputs} (each of its lines holds {both[0]!r}) both give input "
                        f"{both[0]!r}: give it in one place (drop the --set, or the key from the lines)")
        alongside(values, [name for name in over if name not in columns], inputs, len(numbers))
        values.update(columns)
    unknown = pipeline.graph.unknown_inputs(values, pipeline.name)
    if unknown is not None:  # a typo in --set or in the input lines: nothing runs
        _fail_usage(str(unknown))
    _mapped(pipeline, over, values)
    return values, over, numbers


def _mapped(pipeline: Any, over: list[str], values: dict[str, Any]) -> None:
    """A usage error for a --map-over name no input given holds, in the command's words (the map's
    own error names Python's `inputs={...}`): the input to give, or, for a name the pipeline does
    not take (a typo), the inputs it does take."""
    for name in (n for n in over if n not in values):
        given = shlex.quote(f"{name}=[...]")
        if name in pipeline.graph.root_inputs:
            _fail_usage(f"--map-over {name} names input {name!r}, which neither --set nor --inputs gives: give it "
                        f"its list of values, --set {given}, or a {name!r} key in each line of --inputs FILE")
        inputs = pipeline.graph.root_args
        _fail_usage(f"--map-over {name} names no input of pipeline {pipeline.name!r}; its inputs: {inputs}"
                    f"{did_you_mean(name, inputs)}: map over one of them, given as a list (--set NAME='[...]', or a "
                    "key of each --inputs line)")


def _no_item(inputs: str, output: str | None, resume: str | None) -> NoReturn:
    """An empty --inputs file: no item, so nothing runs (not one run); an --output file is left
    empty, for the batch job that reads it next."""
    if output and not resume:
        fresh_results(output).close()
    typer.echo(f"hardy: --inputs {inputs} holds no item: nothing ran", err=True)
    raise typer.Exit(0)


def _resumed(resume: str, output: str | None) -> int:
    """--resume FILE: the output is FILE, opened and checked once (`resumed`), read, then appended to."""
    if output and os.path.abspath(output) != os.path.abspath(resume):
        _fail_usage(f"--resume {resume} appends to {resume}; --output {output} names another file")
    return resumed(resume)


def _resuming(results: int | None, resume: str | None, values: dict[str, Any], over: list[str]
              ) -> tuple[dict[int, bool], list[int] | None]:
    """The items --resume's file has a line for (none without it: `written`, which refuses a line
    of an item these inputs do not give) and those left to run (None: every item)."""
    if results is None or resume is None:
        return {}, None
    count = _count(values, over)
    before = written(results, resume, count)
    return before, [i for i in range(count or 0) if i not in before] if before and over else None


def _count(values: dict[str, Any], over: list[str]) -> int | None:
    """How many items the inputs give: one without a map; None where the first name mapped over is
    not a list (the map says what is wrong with it)."""
    if not over:
        return 1
    first = values.get(over[0])
    return len(first) if isinstance(first, list) else None


def _items(pipeline: Any, values: dict[str, Any], over: list[str], wanted: list[str] | None,
           resuming: tuple[dict[int, bool], list[int] | None], engine: Any, progress: bool | None, writer: Writer
           ) -> OSError | None:
    """Run the items not written before (`resuming`: the earlier run's items, and the ones left to
    run, None for all) and write each one's line; the error that stopped the writing (a closed
    pipe, a full disk), after the map was stopped."""
    from ..errors import HardyError
    before, todo = resuming
    if not over:
        return None if 0 in before else _once(pipeline, values, wanted, engine, writer)
    if todo is not None:
        values = {k: [v[i] for i in todo] if k in over else v for k, v in values.items()}
    try:
        rows = pipeline.imap(values, map_over=over, on_error="continue", progress=progress, engine=engine,
                             output_name=wanted, ordered=False, indexed=True)
        for index, row in rows:
            writer.item(index if todo is None else todo[index], row)
    except HardyError as exc:  # a usage error the map only finds running (an input that cannot be sent)
        _fail_usage(_said(exc))
    except (KeyboardInterrupt, _Terminated) as exc:
        writer.interrupt = exc
        rows.close()  # stops the map's workers; every line written so far stays
    except OSError as exc:
        engine.close()  # its workers first: the items they run are not waited for
        rows.close()
        return exc
    return None


def _numbered(pipeline: Any, todo: list[int] | None, numbers: list[int] | None, inputs: str | None) -> None:
    """The run report's items numbered as the output's lines number them: under --resume the map
    ran only `todo` (its item k is item todo[k], which `hardy report --item` and `hardy replay` are
    given); with --inputs, each failure with its line of the file (`numbers`: blank lines are
    skipped, so item N is not always line N+1) and the file, which `hardy replay` names. A report
    a report directory already got is written again (as it was, where that fails)."""
    from ..errors import HardyError
    if todo is None and numbers is None:
        return
    try:
        report = pipeline.report()
    except HardyError:  # no report kept
        return
    item = (lambda k: todo[k]) if todo is not None else (lambda k: k)
    for failure in report.data.get("failures", []):
        failure["item"] = item(failure["item"])
        if numbers is not None:
            failure["line"] = numbers[failure["item"]]
    for row in report.data.get("timeline", []):
        row[0] = item(row[0])
    if inputs:
        report.data["inputs"] = inputs
    if report.path is not None:
        with contextlib.suppress(OSError, HardyError):
            report.save(report.path)


def _once(pipeline: Any, values: dict[str, Any], wanted: list[str] | None, engine: Any, writer: Writer
          ) -> OSError | None:
    from ..errors import HardyError, NodeError
    try:
        row: Any = pipeline.run(values, output_name=wanted, engine=engine)
    except NodeError as err:
        row = Failed(err)
    except HardyError as exc:
        _fail_usage(_said(exc))
    except (KeyboardInterrupt, _Terminated) as exc:
        writer.interrupt = exc
        return None
    try:
        writer.item(0, row)
    except OSError as exc:
        return exc
    return None


def _unwritable(exc: OSError, done: int, output: str | None, out: IO[str]) -> NoReturn:
    """The output cannot be written: a closed pipe (`| head`) ends the command as SIGPIPE would
    (141), anything else (a full disk) with 74 (EX_IOERR), saying so on stderr."""
    closed = isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE
    if output is None:  # stdout stays unwritable: the interpreter's last flush must not complain again
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    what = "the output was closed (a closed pipe)" if closed else f"cannot write {output or 'stdout'}: {exc.strerror}"
    then = "" if closed or output is None else (
        f"; once it can be written (room on its disk), the same command with --resume {shlex.quote(output)} runs "
        "the items that have no line in it yet")
    with contextlib.suppress(OSError):
        typer.echo(f"hardy: {what} after {done} item(s); the map was stopped and its workers with it{then}", err=True)
    raise typer.Exit(141 if closed else 74)


class _Terminated(Exception):
    """SIGTERM, raised where the command waits for the next result, so that the map stops as
    for Ctrl-C."""


class _Interruptible:
    """SIGTERM raises `_Terminated` while the command runs (then the default comes back: a
    second SIGTERM ends it at once); `signal` names what interrupted it, if anything."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.number = 0

    def __enter__(self) -> _Interruptible:
        self._previous = signal.signal(signal.SIGTERM, self._terminate)
        self._previous_int = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def _terminate(self, signum: int, frame: Any) -> None:
        self._record(signum)
        raise _Terminated

    def _interrupt(self, signum: int, frame: Any) -> None:
        self._record(signum)
        raise KeyboardInterrupt

    def _record(self, signum: int) -> None:
        signal.signal(signum, signal.SIG_DFL)
        self.signal, self.number = signal.Signals(signum).name, signum

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGTERM, self._previous)
        signal.signal(signal.SIGINT, self._previous_int)


def _results_only() -> IO[str]:
    """Standard output for the result lines alone: what the pipeline's code prints (its module's
    import, its nodes, in this process or in a worker, from Python or from C) goes to standard
    error from here on, so that every line of standard output is one item's JSON. Closed (`>&-`, a
    daemon's), it has nowhere to put them: a usage error before anything runs."""
    if sys.stdout is None:
        _fail_usage("standard output is closed, so the result lines have nowhere to go: give --output FILE")
    sys.stdout.flush()
    lines = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8", errors=sys.stdout.errors)
    elsewhere = sys.stderr.fileno() if sys.stderr is not None else os.open(os.devnull, os.O_WRONLY)  # (2>&-)
    os.dup2(elsewhere, sys.stdout.fileno())
    return lines


@contextlib.contextmanager
def _opened(output: str | None, lines: IO[str] | None, results: int | None) -> Iterator[IO[str]]:
    """--output, created (emptied) once the map has started without following a link another user
    planted (`fresh_results`), or --resume's file (`results`, its descriptor) appended to, or
    standard output (`lines`, `_results_only`)."""
    if not output:
        assert lines is not None
        yield lines
        return
    with open(results, "a", encoding="utf-8") if results is not None else fresh_results(output) as f:
        yield f


def output_path(path: str) -> None:
    """A usage error, before anything runs, for an --output file that cannot be written (checked
    without creating or emptying it: a usage error leaves an earlier results file as it was)."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        _fail_usage(f"--output {path} is a directory")
    if not folder.is_dir():
        _fail_usage(f"--output {path}: no directory {str(folder)!r}")
    if not os.access(target if target.exists() else folder, os.W_OK):
        _fail_usage(f"--output {path}: not writable here")


def saved(pipeline: Any) -> str | None:
    """Where the engine's report directory (`report_dir=`, HARDY_REPORT_DIR) got this run's report."""
    from ..errors import HardyError
    try:
        path = pipeline.report().path
    except HardyError:  # no report kept
        return None
    return str(path) if path is not None else None


def _engine(own: Any, executor: str | None, workers: int | None, report: bool) -> Any:
    """The pipeline's own engine's settings, with what the command line changes (a usage error
    where they are wrong: an --executor misspelt is named as the flag, with the likely name)."""
    from ..engine import Engine
    from ..errors import HardyError
    if executor is not None and executor not in EXECUTORS:
        _fail_usage(f"--executor {executor!r} is not one of {', '.join(EXECUTORS)}{did_you_mean(executor, EXECUTORS)}")
    try:
        return Engine(node_executor=own.node_executor, map_executor=executor or own.map_executor,
                      workers=workers or own.workers, cache=own.cache, report=report or own.reporting,
                      report_dir=own.report_dir, keep_failed_inputs=own.keep_failed_inputs, **own.process_options)
    except HardyError as exc:
        _fail_usage(str(exc))

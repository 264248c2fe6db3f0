"""`hardy run` (a pipeline from the shell or a scheduler) and `hardy report` (render a saved report).

Exit codes are what a scheduler branches on: 0 every item succeeded, 1 some failed (each is a
line of the output, and the report says why), 2 the command itself was wrong (an unknown
pipeline, a malformed input line, an input no node takes); typer's own usage errors are 2 as well.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer

USAGE = 2


def _fail_usage(message: str) -> NoReturn:
    typer.echo(f"hardy: {message}", err=True)
    raise typer.Exit(USAGE)


def load_pipeline(target: str) -> Any:
    """`pkg.module:name` (a dotted attribute path after the colon) as a Pipeline."""
    from ..pipeline import Pipeline
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        _fail_usage(f"{target!r} is not MODULE:PIPELINE, e.g. mypkg.flows:pipeline")
    if "" not in sys.path:
        sys.path.insert(0, "")  # the current directory, as `python -m` has it
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        _fail_usage(f"cannot import {module_name!r}: {exc}")
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if isinstance(getattr(obj, n, None), Pipeline))
            _fail_usage(f"{module_name!r} has no attribute {attr!r}; pipelines there: {names or 'none'}")
        obj = getattr(obj, part)
    if not isinstance(obj, Pipeline):
        _fail_usage(f"{target} is a {type(obj).__name__}, not a hardy Pipeline")
    return obj


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """NAME=VALUE pairs; a value is read as JSON (numbers, lists, objects) and otherwise as text."""
    values: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            _fail_usage(f"--set {pair!r} is not NAME=VALUE")
        try:
            values[name] = json.loads(raw)
        except ValueError:
            values[name] = raw
    return values


def read_items(path: str, over: list[str]) -> tuple[dict[str, list[Any]], list[str]]:
    """The JSONL file's lines as per-item values; maps over `over`, or every key of the first line."""
    columns: dict[str, list[Any]] = {}
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as exc:
        _fail_usage(f"--inputs {path}: {exc.strerror}")
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError as exc:
            _fail_usage(f"--inputs {path} line {number} is not JSON: {exc}")
        if not isinstance(row, dict):
            _fail_usage(f"--inputs {path} line {number} is not a JSON object of input values")
        over = over or list(row)
        missing = [name for name in over if name not in row]
        if missing:
            _fail_usage(f"--inputs {path} line {number} has no {missing} (each line needs every --map-over name)")
        for name in over:
            columns.setdefault(name, []).append(row[name])
    return columns, over


def _line(i: int, row: Any) -> str:
    from ..errors import Failed
    if isinstance(row, Failed):
        record = {"item": i, "ok": False, **row.error.reported()}
    else:
        record = {"item": i, "ok": True, "outputs": row}
    return json.dumps(record, default=repr)


def run(target: str = typer.Argument(..., help="MODULE:PIPELINE, e.g. mypkg.flows:pipeline"),
        set_: list[str] = typer.Option([], "--set", help="An input NAME=VALUE (JSON or text); repeatable."),
        inputs: str | None = typer.Option(None, "--inputs", help="JSONL file: one object of inputs per item."),
        map_over: list[str] = typer.Option([], "--map-over", help="Inputs that hold one value per item."),
        executor: str | None = typer.Option(None, help="sequential | threaded | async | process "
                                                "(default: the pipeline's own engine's)"),
        workers: int | None = typer.Option(None, min=1, help="Worker threads or processes."),
        cache: str | None = typer.Option(None, help="A DiskCache directory."),
        report: str | None = typer.Option(None, help="Write the run report: FILE.html or FILE.json."),
        output: str | None = typer.Option(None, help="Write the JSONL results here instead of stdout."),
        progress: bool | None = typer.Option(None, help="Show the progress bar (default: on a terminal).")) -> None:
    """Run a pipeline once, or map it over --inputs/--map-over; one JSON line per item."""
    from ..errors import HardyError
    if report:
        report_path(report)
    if output:
        output_path(output)
    pipeline = load_pipeline(target)
    values = parse_sets(set_)
    over = [n for spec in map_over for n in spec.split(",") if n]
    if inputs:
        columns, over = read_items(inputs, over)
        values.update(columns)
    unknown = pipeline._unknown_inputs(values)
    if unknown is not None:  # a typo in --set or in the input lines: nothing runs
        _fail_usage(str(unknown))
    try:
        engine = _engine(pipeline.engine, executor, workers, report is not None)
    except HardyError as exc:
        _fail_usage(str(exc))
    if cache:
        from ..cache import DiskCache
        pipeline = pipeline.with_cache(DiskCache(cache))
    try:
        with engine:
            if over:
                rows = pipeline.map(values, map_over=over, on_error="continue", progress=progress, engine=engine)
            else:
                rows = [_single(pipeline, values, engine)]
    except HardyError as exc:
        _fail_usage(str(exc))
    lines = "".join(_line(i, row) + "\n" for i, row in enumerate(rows))
    if output:
        Path(output).write_text(lines, encoding="utf-8")
    else:
        sys.stdout.write(lines)
    if report:
        pipeline.report().save(report)
    failed = sum(1 for i, row in enumerate(rows) if not isinstance(row, dict))
    if failed:
        typer.echo(f"hardy: {failed} of {len(rows)} item(s) failed" + (f"; see {report}" if report else ""),
                   err=True)
    raise typer.Exit(1 if failed else 0)


def report_path(path: str, suffixes: tuple[str, ...] = (".html", ".json")) -> None:
    """A usage error, before anything runs, for a report file name `RunReport.save` would refuse."""
    if Path(path).suffix.lower() not in suffixes:
        _fail_usage(f"cannot write a run report as {path!r}: use a {' or '.join(suffixes)} file name")


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


def _engine(own: Any, executor: str | None, workers: int | None, report: bool) -> Any:
    """The pipeline's own engine's settings, with what the command line changes."""
    from ..engine import Engine
    return Engine(node_executor=own.node_executor, map_executor=executor or own.map_executor_spec,
                  workers=workers or own.workers, cache=own.cache, report=report or own.reporting,
                  report_dir=own.report_dir, **own.process_options)


def _single(pipeline: Any, values: dict[str, Any], engine: Any) -> Any:
    from ..errors import Failed, NodeError
    try:
        return pipeline.run(values, engine=engine)
    except NodeError as err:
        return Failed(err)


def report(path: str = typer.Argument(..., help="A report's JSON (Engine(report_dir=...) writes them)."),
           html: str | None = typer.Option(None, "--html", help="Also write it as a self-contained page.")) -> None:
    """Show a saved run report as tables; --html renders the page."""
    from rich.console import Console

    from ..observe.report import RunReport
    if html:
        report_path(html, (".html",))
    try:
        loaded = RunReport.load(path)
    except (OSError, ValueError) as exc:
        _fail_usage(str(exc))
    Console(width=120).print(loaded)
    if html:
        loaded.save(html)
        typer.echo(f"wrote {html}")

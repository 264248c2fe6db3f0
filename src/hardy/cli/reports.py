"""Run reports on the command line: `hardy report` (a saved report as tables, one failure's stacks,
the page), and where `hardy run --report` and `hardy report --html` write theirs.

A report file in a folder that cannot be written (a read-only mount, another user's folder) is
refused before anything runs, as an `--output` there is (`writable_report`): found only once
every item had run, it ended the command with a traceback naming a temporary file and exit code 1,
which a scheduler reads as "items failed". A write that still fails at the end (the folder's
permissions changed meanwhile, a full disk) costs nothing that ran: one line on stderr, and the
command's exit code stays the one its items give (`saved_as`).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import typer

from .usage import at_least, refuse

CANNOT_WRITE = 74  # EX_IOERR: `hardy report --html` could not write its page (as `hardy run` an output)


def writable_report(path: str, flag: str, suffixes: tuple[str, ...] = (".html", ".json")) -> None:
    """A usage error, before anything runs, for a report file `RunReport.save` would refuse: a name
    of another suffix, a folder, or a place in a folder this process cannot write (its folders
    that do not exist yet are made, so the nearest one that exists is what must be writable)."""
    target = Path(path)
    if target.suffix.lower() not in suffixes:
        refuse(f"cannot write a run report as {path!r}: use a {' or '.join(suffixes)} file name")
    if target.is_dir():
        refuse(f"{flag} {path} is a folder: give a report file name in it, e.g. {target / ('run' + suffixes[0])}")
    folder = target.parent if str(target.parent) else Path(".")
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        refuse(f"{flag} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        refuse(f"{flag} {path}: the folder {folder} cannot be written here (read-only, or not yours): give a "
               f"{flag} path in a folder you can write")


def saved_as(report: Any, path: str, kept: str) -> str | None:
    """`report` saved to `path`, or, where it cannot be written after all, one line on stderr
    saying why and what was kept (`kept`) and None (the command then names no report)."""
    from ..errors import HardyError
    try:
        report.save(path)
    except (OSError, HardyError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        typer.echo(f"hardy: the run report could not be written to {path} ({why}); {kept}", err=True)
        return None
    return path


def report(path: str = typer.Argument(..., metavar="REPORT",
                                      help="A report's JSON (Engine(report_dir=...) writes them)."),
           html: str | None = typer.Option(None, "--html", metavar="FILE",
                                           help="Also write it as a self-contained page."),
           item: int | None = typer.Option(None, "--item", metavar="N", callback=at_least(0),
                                           help="Print the failure of item N: its error, Python and native stacks.")
           ) -> None:
    """Show a saved run report as tables (--item N: one failure with its stacks); --html renders the page."""
    from ..observe.report import RunReport
    from . import consoles, quiet_when_the_reader_goes
    quiet_when_the_reader_goes()  # (`hardy report R.json | head`)
    if html:
        writable_report(html, "--html", (".html",))
    try:
        loaded = RunReport.load(path)
    except FileNotFoundError:
        refuse(f"{path}: no such report (give a run report's JSON: Engine(report_dir=...) writes them)")
    except IsADirectoryError:
        refuse(f"{path} is a folder: give one of the run reports' JSON files in it")
    except (OSError, ValueError) as exc:
        refuse(str(exc))
    if item is not None:
        typer.echo(_failure_text(loaded.data, item, path))
    else:
        consoles.console().print(loaded)
        if loaded.data.get("failures"):
            typer.echo(f"each failure's stacks: {shlex.join(['hardy', 'report', path])} --item N")
    if html:
        if saved_as(loaded, html, f"{path} itself is unchanged") is None:
            raise typer.Exit(CANNOT_WRITE)
        typer.echo(f"wrote {html}")


def _failure_text(data: dict[str, Any], item: int, path: str) -> str:
    """One failure of a report as text: what failed and why, its diagnosis, where its inputs were
    kept, and its stack (an exception's traceback, or a crash's native and Python stacks)."""
    failures = data.get("failures", [])
    record = next((f for f in failures if isinstance(f, dict) and f.get("item") == item), None)
    if record is None:
        failed = [f.get("item") for f in failures if isinstance(f, dict)]
        refuse(f"{_no_item(data, item, path) or f'item {item} did not fail in {path}'}; the items that failed: "
               f"{failed[:20] or 'none'}")
    signal_name = f", {record['signal']}" if record.get("signal") else ""
    lines = [f"item {item}: node {record.get('node')!r} failed: {record.get('error')}{signal_name}: "
             f"{record.get('message')}"]
    lines += [f"diagnosis: {d}" for d in record.get("diagnosis") or ()]
    if record.get("kept_inputs"):
        again = shlex.join(["hardy", "replay", path, "--item", str(item)])
        lines.append(f"inputs kept: {record['kept_inputs']} ({again} runs it again)")
    stack = str(record.get("stack") or "").rstrip()
    lines.append(stack or "(no stack kept for this failure: reports keep the first failures' stacks)")
    return "\n".join(lines)


def _no_item(data: dict[str, Any], item: int, path: str) -> str | None:
    """"the run in PATH has no item 7 (its items: 0-1)" where the report's run had no such item, or
    None where it had (it did not fail): saying "item 7 did not fail" of a run of 2 items read as
    if it had run. Its items are the report's count, numbered from 0, unless its failures and
    timeline number them further (a `hardy run --resume` ran only some of an earlier run's items,
    each numbered as there); a timeline keeps at most its first items, so past those only the count
    and the highest number seen say whether an item was run."""
    count = data.get("items")
    seen = {row[0] for row in data.get("timeline", []) if isinstance(row, list) and row}
    seen |= {f.get("item") for f in data.get("failures", []) if isinstance(f, dict)}
    numbers = sorted(n for n in seen if isinstance(n, int))
    if not isinstance(count, int) or item in seen:
        return None
    if numbers[-1:] < [count]:  # numbered 0 to count - 1
        if item < count:
            return None
        span = "none" if count == 0 else "0" if count == 1 else f"0-{count - 1}"
        return f"the run in {path} has no item {item} (it had {count} item(s): {span})"
    if len(numbers) >= count or item > numbers[-1]:  # every item seen, or past the highest one
        return f"the run in {path} has no item {item} (its items: {_spans(numbers)})"
    return None


def _spans(numbers: list[int]) -> str:
    """Sorted item numbers as runs of consecutive ones, "0-3, 7, 9-10"; at most ten runs, then "..."."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    said = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:10]]
    return ", ".join(said) + (", ..." if len(runs) > 10 else "")

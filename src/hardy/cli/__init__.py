"""The `hardy` command. Subcommands live in their own modules and import their heavy parts lazily."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import typer

from .. import __version__
from .usage import PlainUsage, at_least

if TYPE_CHECKING:
    from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="hardy: pipelines of plain Python functions that survive native crashes.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hardy {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """hardy: pipelines of plain Python functions that survive native crashes."""


@app.command()
def demo(items: int = typer.Option(3000, metavar="N", callback=at_least(2),
                                         help="How many documents to generate (2 or more)."),
         executor: str = typer.Option("process", metavar="EXECUTOR", help="sequential | threaded | async | process"),
         workers: int = typer.Option(2, metavar="N", callback=at_least(1),
                                           help="Worker threads or processes (1 or more)."),
         progress: bool = typer.Option(True, help="Show the progress bar.")) -> None:
    """Run a real example pipeline: clean -> tokenise -> statistics over generated documents."""
    quiet_when_the_reader_goes()
    if executor not in ("sequential", "threaded", "async", "process"):
        raise typer.BadParameter(f"{executor!r}: one of sequential, threaded, async, process", param_hint="--executor")
    from .demo import run_demo
    raise typer.Exit(run_demo(items, executor, workers, progress))


from .cache import app as cache_app  # noqa: E402
from .doctor import doctor, libs, repeat, wheel_app  # noqa: E402
from .replay import replay_command  # noqa: E402
from .reports import report  # noqa: E402
from .run import run  # noqa: E402

app.add_typer(cache_app, name="cache")
app.add_typer(wheel_app, name="wheel")
app.command()(doctor)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(repeat)
app.command(cls=PlainUsage)(libs)
app.command(cls=PlainUsage)(run)
app.command(cls=PlainUsage)(report)
app.command(name="replay", cls=PlainUsage)(replay_command)


def quiet_when_the_reader_goes() -> None:
    """A reader that goes away (`hardy doctor | head -2`) ends the command as SIGPIPE ends a Unix
    tool (exit status 141), not with click's silent exit code 1, which reads as a failure. For
    commands that only print; `hardy run` stops its map and its workers first."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


@contextlib.contextmanager
def exit_141_once_the_runs_stop(printer: Console) -> Iterator[None]:
    """`quiet_when_the_reader_goes` for a command whose runs go on while it prints (`hardy repeat
    -j 4 -- CMD | head -1`): SIGPIPE's default would end this process at once and leave the runs
    going, in sessions of their own. Instead the closed pipe unwinds through what started them,
    which stops them (rich's `printer` meets it by muting itself, `quiet`, pointing standard output
    at /dev/null and raising SystemExit(1); click's echo raises BrokenPipeError), and the command
    then ends with 141, as SIGPIPE would have."""
    try:
        yield
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (what is left to flush goes nowhere)
        raise typer.Exit(141) from None
    except SystemExit:
        if not printer.quiet:  # (an exit of the command's own)
            raise
        raise typer.Exit(141) from None


def main() -> None:
    app()

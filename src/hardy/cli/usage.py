"""How hardy's commands name their arguments (usage line, help) and refuse a number out of range.

Typer (0.29) writes a required argument in braces: `Usage: hardy wheel index [OPTIONS] {FOLDER}`,
which reads like a set of choices or a placeholder to type literally. hardy's commands write it as
click and most Unix tools do: `FOLDER` when required, `[FOLDER]` when optional, `FOLDER...` when it
takes several. A command with arguments is declared with `cls=PlainUsage` (Typer's documented way
to give a command its own class); `tests/test_cli.py` reads every command's usage line. Its help
lists the argument the same way, by name, where Typer adds the Python type (`FOLDER <list[str]>`).

Typer's `min=` refuses a number below it in pydantic's words ("Input should be greater than or
equal to 1"); `at_least` says it as the command's help does: "must be 1 or more, not 0". What a
command refuses once it reads its arguments together is said by `refuse`: one line, exit code 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import typer
from typer.core import TyperArgument, TyperCommand


class PlainUsage(TyperCommand):
    """A Typer command whose usage line shows each argument by its plain name."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                pieces.append(argument_usage(param))
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """Typer's Arguments and Options sections, each argument by its plain name (`FOLDER`): its
        Python type (`<list[str]>`, `<str>`) says nothing to someone typing a command."""
        arguments, options = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if isinstance(param, TyperArgument):
                arguments.append((_plain_name(param), record[1]))
            else:
                options.append(record)
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def argument_usage(argument: TyperArgument) -> str:
    """`FOLDER`, `[FOLDER]` (optional) or `FOLDER...` (several), as click writes them."""
    plain = _plain_name(argument)
    name = plain if argument.required else f"[{plain}]"
    return f"{name}..." if argument.nargs != 1 else name


def _plain_name(argument: TyperArgument) -> str:
    return argument.metavar if argument.metavar is not None else str(argument.name)  # (no Typer-only attribute)


def at_least(lowest: int) -> Callable[[Any], Any]:
    """An option's callback refusing a number below `lowest` (None, an option left out, passes):
    a usage error, exit code 2, in the words of the help ("2 or more")."""
    def check(value: Any) -> Any:
        if value is not None and value < lowest:
            raise typer.BadParameter(f"must be {lowest} or more, not {value}")
        return value
    return check


USAGE = 2  # the exit code of a command given wrong (click's own usage errors exit 2 too)


def refuse(message: str) -> NoReturn:
    """A usage error found before anything runs: one line, `hardy: ...`, and exit code 2."""
    typer.echo(f"hardy: {message}", err=True)
    raise typer.Exit(USAGE)

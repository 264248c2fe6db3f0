"""How hardy's commands name their arguments in the usage line.

Typer (0.29) writes a required argument in braces: `Usage: hardy wheel index [OPTIONS] {FOLDER}`,
which reads like a set of choices or a placeholder to type literally. hardy's commands write it as
click and most Unix tools do: `FOLDER` when required, `[FOLDER]` when optional, `FOLDER...` when it
takes several. A command with arguments is declared with `cls=PlainUsage` (Typer's documented way
to give a command its own class); `tests/test_cli.py` reads every command's usage line.
"""

from __future__ import annotations

from typing import Any

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


def argument_usage(argument: TyperArgument) -> str:
    """`FOLDER`, `[FOLDER]` (optional) or `FOLDER...` (several), as click writes them."""
    plain = argument.metavar if argument.metavar is not None else str(argument.name)  # (no Typer-only attribute)
    name = plain if argument.required else f"[{plain}]"
    return f"{name}..." if argument.nargs != 1 else name

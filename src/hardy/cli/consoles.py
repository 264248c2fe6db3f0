"""The rich consoles hardy's commands print through, and the escaping of what they print.

On a terminal a console fits its lines to the terminal's width, as rich does. Anywhere else (a
file, a pipe, a CI log) rich would wrap at 80 columns, its default, and break a path or a library
name mid-line (`libc.so.6` and `+0x167ad8` on two lines), which `grep` then misses: there a line
is as long as what it holds (COLUMNS is not read there: readline sets it, at 80, in the environment
it leaves to the processes it starts, as under pytest).

Rich reads `[...]` in printed text as markup and deletes what it takes for a tag: the advice
`pip install -e ".[gpu]"` would print as `pip install -e "."`, which installs nothing. Whatever
a command prints that it did not write itself (a finding, a path, an error, a command line) goes
through `plain`.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

UNWRAPPED = 100_000  # columns of a console that is not a terminal: no line of hardy's is that long


def console(**options: Any) -> Console:
    """A console for a command's output (`options`: rich's, `stderr=True`): the terminal's width
    on a terminal, no wrapping elsewhere (module docstring)."""
    made = Console(**options)
    if made.is_terminal:  # (not COLUMNS alone: readline sets it in the environment of whatever runs us)
        return made
    return Console(width=UNWRAPPED, **options)  # (not soft_wrap: a table would crop its cells with an ellipsis)


def plain(text: Any) -> str:
    """`text` as rich prints it literally: its brackets shown, not read as markup."""
    return escape(str(text))

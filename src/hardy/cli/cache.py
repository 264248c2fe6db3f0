"""`hardy cache ...`: look into and maintain a cache directory."""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from ..cache import DiskCache

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Inspect and maintain a hardy cache.")
DIR = typer.Option(".hardy-cache", "--dir", "-d", help="The cache directory.")


def _open(path: str) -> DiskCache:
    """The cache in `path`; a directory holding none is said so (exit code 2), and left untouched."""
    from ..cache import DiskCache, UntrustedCacheError
    try:
        cache = DiskCache(path)
    except UntrustedCacheError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if not cache.store.exists():
        typer.echo(f"no hardy cache in {path}", err=True)
        raise typer.Exit(2)
    return cache


def _when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds") if ts else "-"


@app.command()
def stats(path: str = DIR, as_json: bool = typer.Option(False, "--json")) -> None:
    """Entries, bytes, inline vs file entries, age."""
    s = _open(path).stats()
    if as_json:
        typer.echo(json.dumps(s.__dict__))
        return
    t = Table(title=f"cache {path}")
    t.add_column("what")
    t.add_column("value", justify="right")
    for k, v in (("entries", s.entries), ("bytes", f"{s.bytes:,}"), ("inline in the index", s.inline),
                 ("in blob files", s.files), ("oldest entry", _when(s.oldest)),
                 ("last access", _when(s.newest_access))):
        t.add_row(k, str(v))
    Console().print(t)


@app.command("ls")
def list_entries(path: str = DIR, limit: int = typer.Option(50, help="Show at most this many.")) -> None:
    """Entries, least recently used first."""
    t = Table()
    for col in ("key", "bytes", "where", "created", "last access"):
        t.add_column(col)
    for e in _open(path).entries()[:limit]:
        t.add_row(e.key.hex(), f"{e.size:,}", "index" if e.inline else "file", _when(e.created), _when(e.accessed))
    Console().print(t)


@app.command()
def verify(path: str = DIR) -> None:
    """Check every entry's MAC; bad entries are deleted. Exit code 1 if any was bad."""
    report = _open(path).verify()
    typer.echo(f"checked {report.checked} entries, {len(report.bad)} bad (deleted)")
    if report.other_secret:
        typer.echo(f"{report.other_secret} entries written under another secret (HARDY_CACHE_KEY): kept, not checked")
    for key in report.bad:
        typer.echo(f"  bad: {key}")
    raise typer.Exit(1 if report.bad else 0)


@app.command()
def prune(path: str = DIR,
          max_size: str = typer.Option(None, help="Keep at most this much, e.g. 10GB (least recently used go)."),
          older_than: float = typer.Option(None, help="Delete entries unused for this many days.")) -> None:
    """Evict least recently used entries and entries not used for a while."""
    days = None if older_than is None else older_than * 86400
    n = _open(path).prune(max_size=max_size, older_than=days)
    typer.echo(f"deleted {n} entries")


@app.command()
def clear(path: str = DIR, yes: bool = typer.Option(False, "--yes", help="Do not ask.")) -> None:
    """Delete every entry."""
    if not yes:
        typer.confirm(f"delete every entry in {path}?", abort=True)
    _open(path).clear()
    typer.echo("cleared")

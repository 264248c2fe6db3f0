"""`hardy cache ...`: look into and maintain a cache directory."""

from __future__ import annotations

import datetime
import json
import math
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from .consoles import console, plain
from .usage import PlainUsage, refuse

if TYPE_CHECKING:
    from ..cache import DiskCache

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Inspect and maintain a hardy cache.")
FOLDER = typer.Argument(None, metavar="FOLDER", show_default=False,
                        help="The cache directory (default: .hardy-cache; -d FOLDER says the same).")
DIR = typer.Option(None, "--dir", "-d", metavar="FOLDER", show_default=False,
                   help="The cache directory (default: .hardy-cache).")
DEFAULT = ".hardy-cache"
REMOTE = typer.Option(None, "--remote", metavar="S3_URL",
                      help="Maintain the entries in a bucket instead, s3://bucket/prefix "
                      "(those signed with HARDY_CACHE_KEY; credentials as for any AWS client: AWS_* variables).")
ENDPOINT = typer.Option(None, "--endpoint-url", metavar="URL", help="With --remote: an S3-compatible server's URL.")


def _open(path: str, remote: str | None = None, endpoint: str | None = None) -> DiskCache:
    """The cache in `path`, or the entries in the bucket `remote` (nothing local is read or made);
    a directory or bucket prefix holding none is said so (exit code 2), and left untouched."""
    from ..cache import DiskCache
    from ..errors import UntrustedCacheError
    if remote is not None:
        return _open_remote(path, remote, endpoint)
    try:
        cache = DiskCache(path)
    except UntrustedCacheError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if not cache.store.exists():
        typer.echo(f"no hardy cache in {path}{_elsewhere(path)}", err=True)
        raise typer.Exit(2)
    return cache


def _folder(folder: str | None, option: str | None) -> str:
    """The cache folder the command names: as its argument or with -d (one of them; both, naming
    two folders, is a usage error: one was silently ignored), or `DEFAULT`."""
    if folder is not None and option is not None and folder != option:
        refuse(f"FOLDER {folder} and -d {option} name two cache folders: give one")
    return folder or option or DEFAULT


def _elsewhere(path: str) -> str:
    """After "no hardy cache in .hardy-cache", the default folder: how to name the one that holds
    the cache (no environment variable names it)."""
    if path != DEFAULT:
        return ""
    return (" (the default folder, in the current directory): give the cache's folder as the command's FOLDER "
            "argument or with -d FOLDER, e.g. the folder `hardy run --cache FOLDER` was given")


def _open_remote(path: str, url: str, endpoint: str | None) -> DiskCache:
    """The bucket's entries as a cache of their own: listed by shard in parallel, verified with the
    secret, deleted only with If-Match on the ETag listed or read (docs/caching.md)."""
    import os

    from ..cache import DiskCache
    from ..cache.objectstore import BucketStore
    from ..errors import CacheUnavailable
    from ..hashing import FORMAT
    secret = os.environ.get("HARDY_CACHE_KEY")
    if not secret:
        typer.echo("--remote needs HARDY_CACHE_KEY, the secret the bucket's entries are signed with", err=True)
        raise typer.Exit(2)
    cache = DiskCache(path, secret=secret)
    options = {"endpoint_url": endpoint} if endpoint else {}
    try:
        cache.store = BucketStore(url, f"{FORMAT.decode()}/{cache.key_id.hex()}", options)
        found = cache.store.exists()
    except (ValueError, CacheUnavailable) as exc:
        typer.echo(f"cannot use {url}: {exc}", err=True)
        raise typer.Exit(2) from None
    if not found:
        typer.echo(f"no hardy cache entries for this HARDY_CACHE_KEY in {url}", err=True)
        raise typer.Exit(2)
    return cache


def _when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds") if ts else "-"


@app.command(cls=PlainUsage)
def stats(folder: str | None = FOLDER, path: str | None = DIR, as_json: bool = typer.Option(False, "--json"),
          remote: str = REMOTE, endpoint: str = ENDPOINT) -> None:
    """Entries, bytes, inline vs file entries, age."""
    path = _folder(folder, path)
    s = _open(path, remote, endpoint).stats()
    if as_json:
        typer.echo(json.dumps(s.__dict__))
        return
    t = Table(title=f"cache {plain(remote or path)}")
    t.add_column("what", overflow="fold")
    t.add_column("value", justify="right", overflow="fold")
    for k, v in (("entries", s.entries), ("bytes", f"{s.bytes:,}"), ("inline in the index", s.inline),
                 ("in blob files", s.files), ("oldest entry", _when(s.oldest)),
                 ("last access", _when(s.newest_access))):
        t.add_row(k, str(v))
    console().print(t)


@app.command("ls", cls=PlainUsage)
def list_entries(folder: str | None = FOLDER, path: str | None = DIR,
                 limit: int = typer.Option(50, metavar="N", help="Show at most this many."),
                 remote: str = REMOTE, endpoint: str = ENDPOINT) -> None:
    """Entries, least recently used first."""
    path = _folder(folder, path)
    t = Table()
    for col in ("key", "bytes", "where", "created", "last access"):
        t.add_column(col, overflow="fold")
    for e in _open(path, remote, endpoint).entries()[:limit]:
        where = "index" if e.inline else "bucket" if remote else "file"
        t.add_row(e.key.hex(), f"{e.size:,}", where, _when(e.created), _when(e.accessed))
    console().print(t)


@app.command(cls=PlainUsage)
def verify(folder: str | None = FOLDER, path: str | None = DIR, remote: str = REMOTE, endpoint: str = ENDPOINT) -> None:
    """Check every entry's MAC; bad entries are deleted. Exit code 1 if any was bad."""
    path = _folder(folder, path)
    report = _open(path, remote, endpoint).verify()
    typer.echo(f"checked {report.checked} entries, {len(report.bad)} bad (deleted)")
    if report.other_secret:
        typer.echo(f"{report.other_secret} entries written under another secret (HARDY_CACHE_KEY): kept, not checked")
    for key in report.bad:
        typer.echo(f"  bad: {key}")
    raise typer.Exit(1 if report.bad else 0)


@app.command(cls=PlainUsage)
def prune(folder: str | None = FOLDER, path: str | None = DIR,
          max_size: str = typer.Option(None, metavar="SIZE",
                                       help="Keep at most this much, e.g. 10GB (least recently used go)."),
          older_than: float = typer.Option(None, metavar="DAYS",
                                           help="Delete entries unused for this many days (--remote: "
                                                      "created that long ago: a bucket keeps no access times)."),
          remote: str = REMOTE, endpoint: str = ENDPOINT) -> None:
    """Evict least recently used entries and entries not used for a while."""
    path = _folder(folder, path)
    days = _limits(max_size, older_than)
    from ..errors import InvalidArgument
    cache = _open(path, remote, endpoint)
    try:
        n = cache.prune(max_size=max_size, older_than=days)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-size") from None
    typer.echo(f"deleted {n} entries")
    cache.report()  # what could not be deleted and why (a full disk's index), in one warning


def _limits(max_size: str | None, older_than: float | None) -> float | None:
    """--older-than DAYS in seconds (None without it), once prune's limits are checked: a usage
    error where there is none (the command deleted nothing and said "deleted 0 entries"), for a
    negative size or number of days, which made every entry too many or too old (all were
    deleted), and for nan or inf days, which made none old enough (nothing was, silently)."""
    if max_size is None and older_than is None:
        refuse("cache prune deletes nothing without a limit: give --max-size SIZE (e.g. 10GB), --older-than DAYS "
               "(e.g. 30), or both")
    if max_size is not None and max_size.strip().startswith("-"):
        raise typer.BadParameter(f"{max_size} is negative: give 0 or more bytes, e.g. --max-size 10GB (least "
                                 "recently used entries go until the cache holds that much; 0 deletes every entry)",
                                 param_hint="--max-size")
    if older_than is None:
        return None
    seconds = older_than * 86400
    if not math.isfinite(seconds) or seconds < 0:
        raise typer.BadParameter(f"{older_than:g} is not a number of days: give 0 or more, e.g. --older-than 30 "
                                 "(entries unused for 30 days go; 0 deletes every entry)", param_hint="--older-than")
    return seconds


@app.command(cls=PlainUsage)
def clear(folder: str | None = FOLDER, path: str | None = DIR,
          yes: bool = typer.Option(False, "--yes", help="Do not ask.")) -> None:
    """Delete every entry."""
    path = _folder(folder, path)
    cache = _open(path)  # first: a folder that holds no cache is said so before anything is asked
    if not yes:
        typer.confirm(f"delete every entry in {path}?", abort=True)
    from ..cache.disk import FAULTS
    from ..cache.tally import full_disk, reason
    try:
        cache.clear()
    except FAULTS as exc:  # its files are deleted; its index could not be written
        why = reason(exc)
        typer.echo(f"cannot clear {path}: {why}" + (f"; {full_disk('cleared', path)}" if why == "disk full" else ""),
                   err=True)
        raise typer.Exit(1) from None
    typer.echo("cleared")

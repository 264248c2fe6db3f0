"""How `hardy run` writes an item's outputs: one line of strict JSON that says what the node returned.

`json.dumps(default=repr)` wrote a 2,000-element array as numpy's abbreviated repr and a NaN as
the bare token `NaN`, which is not JSON (jq and strict parsers reject the line). Instead:

- JSON's own types as themselves (a tuple as a list); numpy and torch scalars as numbers;
- NaN and the infinities as the strings "NaN", "Infinity" and "-Infinity" (the form of the
  proto3 JSON mapping: valid JSON, and told apart from a number by its type);
- numpy arrays and CPU torch tensors of booleans, integers or floats as nested lists, up to
  `LIST_LIMIT` elements; bigger ones as {"$array": {"dtype", "shape", "base64"}}: the C-order
  bytes, little-endian (the dtype says so: "<f4"), base64-encoded (`np.frombuffer(
  base64.b64decode(a["base64"]), a["dtype"]).reshape(a["shape"])`), a third bigger than the
  bytes where a list of floats is three times bigger, and exact;
- an item of a nested map that failed (a `Failed` in an output list) as {"$failed": {node,
  error, message, signal}}, its message cut as a failed item's is;
- anything else (bytes, sets, a DataFrame, your own classes, complex numbers) has no JSON form:
  the item fails (`UnencodableOutput`), its line naming the output, the node that made it and
  the type, with the fix.

A failed item's line stays small whatever its node raised: its `message` is the first
`MESSAGE_CHARACTERS` of the error's text, and its `stack` keeps every frame line while each
stretch of text between frames (a message the traceback quotes: an HTTP error quoting a 12 KB error
page) keeps its first and last characters, `MESSAGE_CHARACTERS` in all; a stack still over
`STACK_CHARACTERS` (many threads' stacks, a long chain) keeps its innermost part (`bounded_stack`).

As the command ends with failed items, `failed_line` names the first of them and where each
one's error and stack are: its line (in --output, or on stdout) and the run report, --report's or
the one a report directory got (`run.saved`).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import math
import os
import re
import select
import shlex
import signal
import stat
import threading
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

from ..errors import Failed, UnencodableOutput
from .usage import refuse

if TYPE_CHECKING:
    from ..cache.folders import Folder

LIST_LIMIT = 10_000  # elements: an array with more is written as base64 bytes ({"$array": ...})
_FLOATS = {math.inf: "Infinity", -math.inf: "-Infinity"}


_SURROGATE = re.compile("[\ud800-\udfff]")


def line(record: dict[str, Any]) -> str:
    """The record as one line of strict JSON (no NaN token can reach it: `encoded` replaced them),
    UTF-8 text but for lone surrogates. A file name from `os.listdir` that is not UTF-8 holds one
    (`os.fsdecode(b"caf\\xe9")` is 'caf\\udce9'), which UTF-8 cannot encode; each is written as its
    JSON escape (`\\udce9`), which `json.loads` reads back as the same str (and `os.fsencode` then
    as the same bytes): the line keeps the output's value, where failing the item would lose it.
    (A surrogate can only stand inside a JSON string: every key is one. `surrogateescape` makes
    low surrogates alone, so no escaped pair can read back as one other character.)"""
    text = json.dumps(record, allow_nan=False, ensure_ascii=False)
    return text if text.isascii() else _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def encoded(value: Any, path: str = "") -> Any:
    """`value` in JSON's types (module docstring); raises UnencodableOutput naming where it cannot be."""
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return value if math.isfinite(value) else _FLOATS.get(value, "NaN")
    if kind is list or kind is tuple:
        return [encoded(v, f"{path}[{k}]") for k, v in enumerate(value)]
    if kind is dict:
        return {_key(k, path): encoded(v, f"{path}[{k!r}]") for k, v in value.items()}
    if kind is Failed:
        return {"$failed": reported(value.error)}
    module = kind.__module__.partition(".")[0]
    if module == "numpy":
        return _numpy(value, path)
    if module == "torch" and kind.__name__ in ("Tensor", "Parameter"):
        tensor = value.detach().cpu()
        return _numpy((tensor.float() if str(tensor.dtype) == "torch.bfloat16" else tensor).numpy(), path)
    for base in (bool, int, float, str):  # a subclass (an IntEnum, a str Enum) as its built-in value
        if isinstance(value, base):
            return encoded(base(value), path)
    raise _unencodable(value, path)


def _key(key: Any, path: str) -> str:
    if type(key) is str:
        return key
    if type(key) in (int, bool) or key is None or type(key) is float and math.isfinite(key):
        return json.dumps(key)  # as json writes such keys
    raise _unencodable(key, f"{path} (a key)")


def _numpy(value: Any, path: str) -> Any:
    import numpy as np
    if isinstance(value, np.generic):  # a scalar
        if value.dtype.kind in "biuf":
            return encoded(value.item(), path)
        if value.dtype.kind in "US":
            return str(value)
        raise _unencodable(value, path)
    if not isinstance(value, np.ndarray):
        raise _unencodable(value, path)
    kind = value.dtype.kind
    if kind in "biuf" and value.size > LIST_LIMIT:
        little = value.astype(value.dtype.newbyteorder("<"), copy=False)
        return {"$array": {"dtype": little.dtype.str, "shape": list(value.shape),
                           "base64": base64.b64encode(np.ascontiguousarray(little).tobytes()).decode()}}
    if kind in "biufUO":
        return encoded(value.tolist(), path)
    raise _unencodable(value, path)


def _unencodable(value: Any, path: str) -> UnencodableOutput:
    kind = type(value)
    return UnencodableOutput(kind.__qualname__ if kind.__module__ == "builtins" else
                             f"{kind.__module__}.{kind.__qualname__}", path)


MESSAGE_CHARACTERS = 2000  # of a failed item's message in its line, and of each text its stack quotes
STACK_CHARACTERS = 8000  # of a failed item's stack in its line (a million failures: 10 GB at most)
_TAIL = 400  # characters of a long text in a stack kept from its end (what follows it: "The above exception...")
_FRAME = re.compile(r'[ |+]*(?:File "|#\d+ )')  # a Python frame's line (a group's under its bars), a native frame's


def reported(error: Any) -> dict[str, Any]:
    """The failure's fields as a line holds them (`NodeError.reported`), its message cut to its
    first `MESSAGE_CHARACTERS` (a 1 MB message made a 1 MB line), saying how much was left out.
    Where hardy said why it failed the item (`reason`: a node's sys.exit(4), whose own text is "4"),
    the message is that sentence, as `str(err)` says it in Python."""
    fields: dict[str, Any] = error.reported()
    if getattr(error, "reason", None) and error.__cause__ is not None:
        fields["message"] = error.reason
    message = fields.get("message")
    if isinstance(message, str) and len(message) > MESSAGE_CHARACTERS:
        left = len(message) - MESSAGE_CHARACTERS
        fields["message"] = f"{message[:MESSAGE_CHARACTERS]} [{left:,} characters left out]"
    return fields


def bounded_stack(stack: str) -> str:
    """A failure's stack for its line: every frame line kept, each stretch of text between frames
    (the source line, and the message of an exception the traceback quotes) cut to its first and
    last characters, `MESSAGE_CHARACTERS` in all; then, still over `STACK_CHARACTERS` (a timeout's
    threads, a long chain), its innermost part. Cut at its end alone, a 12 KB message left no frame."""
    kept: list[str] = []
    text: list[str] = []
    for row in stack.splitlines(keepends=True):
        if _FRAME.match(row):
            kept += [_text_cut("".join(text)), row]
            text = []
        else:
            text.append(row)
    kept.append(_text_cut("".join(text)))
    stack = "".join(kept)
    if len(stack) > STACK_CHARACTERS:
        stack = f"[{len(stack) - STACK_CHARACTERS:,} characters left out]\n{stack[-STACK_CHARACTERS:]}"
    return stack


def _text_cut(text: str) -> str:
    """Text between two frames, over `MESSAGE_CHARACTERS`: its head and its tail (from a line's
    start where the tail holds one: "The above exception was the direct cause ..."), with how much
    was left out between them."""
    if len(text) <= MESSAGE_CHARACTERS:
        return text
    tail = text[-_TAIL:]
    if "\n" in tail[:-1]:
        tail = tail[tail.index("\n") + 1:]
    head = text[:MESSAGE_CHARACTERS - len(tail)]
    return f"{head}\n[{len(text) - len(head) - len(tail):,} characters left out]\n{tail}"


class Writer:
    """`hardy run`'s output: each item's line, written and flushed as the item finishes (whatever
    ends the command then leaves every finished item in it). `producers`: the node that makes each
    output, named by the line of an output that has no JSON form."""

    def __init__(self, out: IO[str], producers: dict[str, str]):
        self.out, self.producers = out, producers
        self.done = self.failed = 0
        self.first_failed: list[int] = []  # the lowest items that failed (`NAMED` of them), for the last word
        self.interrupt: BaseException | None = None  # what stopped the items (a node's KeyboardInterrupt too)

    def item(self, i: int, row: Any) -> None:
        record = self.record(i, row)
        self.out.write(line(record) + "\n")
        self.out.flush()
        self.done += 1
        if not record["ok"]:
            self.failed += 1
            lowest(self.first_failed, i)

    def record(self, i: int, row: Any) -> dict[str, Any]:
        if isinstance(row, Failed):  # with where it failed: the line may be all a batch job keeps
            from ..observe.report import failure_stack  # (only once an item fails: `hardy run` starts faster)
            return {"item": i, "ok": False, **reported(row.error), "stack": bounded_stack(failure_stack(row.error))}
        outputs = {}
        for name, value in row.items():
            try:
                outputs[name] = encoded(value)
            except UnencodableOutput as err:
                return {"item": i, "ok": False, **err.of(name, self.producers.get(name, "?")).reported()}
        return {"item": i, "ok": True, "outputs": outputs}


NAMED = 5  # failed items `hardy run` names on stderr as it ends


def lowest(items: list[int], i: int) -> None:
    """Adds `i` to the sorted `items`, keeping the `NAMED` lowest: a million failures cost no memory."""
    import bisect
    bisect.insort(items, i)
    del items[NAMED:]


def written(fd: int, path: str, count: int | None) -> dict[int, bool]:
    """The items an earlier run's results file (`resumed`'s descriptor, --resume `path`) holds a
    line for, and whether each succeeded, read line by line; a last line cut short by whatever
    ended that run is dropped from the file, so that the lines appended after it are whole. A line
    of an item past the `count` the inputs give is a usage error: the file was written for other
    inputs (its lines name items, nothing else of them), and resuming would mix their results in."""
    seen: dict[int, bool] = {}
    with open(fd, "r+b", closefd=False) as f:
        end = 0
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                f.truncate(end)
                break
            end += len(line)
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("item"), int):
                _of_these_inputs(record["item"], count, path, number)
                seen[record["item"]] = bool(record.get("ok"))
    return seen


def _of_these_inputs(item: int, count: int | None, path: str, number: int) -> None:
    """A usage error, before anything runs, for a --resume line of an item the inputs do not give."""
    if count is not None and not 0 <= item < count:
        given = f"items 0 to {count - 1}" if count else "no item"
        refuse(f"--resume {path} line {number} is the line of item {item}, and these inputs give {count} item(s) "
               f"({given}): {path} was written by a run of other inputs, whose results resuming would mix with "
               f"these; resume with the inputs of the run that wrote it, or give a fresh --output")


# --- the results file, in a folder other users may write (a team's, /tmp) -----------------------
# Opened through its folder's descriptor, the name never followed when it is a link someone else
# could have planted or swapped (`_followable`): --output replaces such a link, or another user's
# file, with a fresh file of the user's (as --report does), and --resume reads and appends only to a
# file of the user's that nobody else can write (anyone who can write it chooses the results kept).


def fresh_results(path: str) -> IO[str]:
    """--output FILE, created or emptied for this run's lines (`_emptied`); a usage error where it
    cannot be (its folder is another user's link, or it can only be written through someone else's file)."""
    name = os.path.basename(path)
    with _folder(path, "--output") as folder:
        try:
            fd = _emptied(folder, name, path)
        except OSError as exc:
            refuse(f"--output {path}{_there(folder, name)} cannot be replaced by a file of yours here "
                   f"({exc.strerror or exc}): remove it, or give an --output in a folder of yours")
    return open(fd, "w", encoding="utf-8")


def _there(folder: Folder, name: str) -> str:
    """What is at `name`, whose (", a symbolic link of uid 1002's, not followed,"), for a message."""
    try:
        st = folder.lstat(name)
    except OSError:
        return ""
    link = stat.S_ISLNK(st.st_mode)
    what = "a symbolic link" if link else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a file"
    return f", {what} of uid {st.st_uid}'s{', not followed,' if link else ''}"


def _emptied(folder: Folder, name: str, path: str) -> int:
    """A descriptor of `name`, emptied, to write: a file of the user's own (its only name) emptied in
    place, a device or a FIFO of the user's or root's (/dev/null) as it is, a link the user made where
    nobody else can swap it (/dev/stdout) followed; anything else (another user's link, file or FIFO:
    a 0666 FIFO planted in /tmp read the user's results; a hard link) is replaced by a fresh file,
    never written through. Opened without blocking (a FIFO nobody reads held the run forever), then
    made blocking."""
    try:
        fd = folder.open(name, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            return _unopened(folder, name, path, exc)
        if not _followable(folder, name):
            return _replaced(folder, name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(name, flags, 0o644, dir_fd=folder.fd)
    else:
        st, me = os.fstat(fd), os.geteuid()
        if stat.S_ISREG(st.st_mode) and st.st_uid == me and st.st_nlink == 1:
            os.ftruncate(fd, 0)
        elif stat.S_ISREG(st.st_mode) or st.st_uid not in (me, 0):
            os.close(fd)
            return _replaced(folder, name)
    os.set_blocking(fd, True)
    return fd


def _unopened(folder: Folder, name: str, path: str, exc: OSError) -> int:
    """What `name`, which could not be opened to write, becomes: nothing or another user's is replaced
    by a fresh file; the user's own file they may not write (0444: a plain open refuses it), and a
    FIFO of the user's or root's that nothing reads (or a socket), are a usage error."""
    if exc.errno == errno.ENOENT:
        return _replaced(folder, name)
    if exc.errno not in (errno.EACCES, errno.EPERM, errno.ENXIO):
        raise exc
    st = folder.lstat(name)
    mine = st.st_uid == os.geteuid()
    if exc.errno != errno.ENXIO and mine:
        refuse(f"--output {path} is a file of yours, mode {stat.S_IMODE(st.st_mode):o}, that you may not write: not "
               f"replaced; give another --output, or make it writable (chmod u+w {path}) to replace its lines")
    if exc.errno != errno.ENXIO or not (mine or st.st_uid == 0):
        return _replaced(folder, name)
    what = "a FIFO that nothing is reading" if stat.S_ISFIFO(st.st_mode) else "a socket, which no file opens"
    refuse(f"--output {path} is {what}: start its reader first (cat {path} &), or give a file")


def _replaced(folder: Folder, name: str) -> int:
    """A fresh file, renamed over `name` (a rename replaces a link, never writes through it): the
    user's, writable by them alone (0644 less the umask), so that --resume may trust it later."""
    tmp = f".{name}.{os.urandom(8).hex()}.tmp"
    fd = folder.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.replace(tmp, name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
    except BaseException:
        folder.unlink(tmp)
        os.close(fd)
        raise
    return fd


def resumed(path: str) -> int:
    """--resume FILE opened once, to read and to append to: a usage error, before anything runs,
    for a file another user owns or may write, a link someone else could have planted or swapped, or
    one no run of hardy wrote (sparse, or past half the memory: `unreadable`)."""
    name = os.path.basename(path)
    with _folder(path, "--resume") as folder:
        try:
            fd = folder.open(name, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            refuse(f"--resume {path}: no such file (an earlier run's --output)")
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                refuse(f"--resume {path}: {exc.strerror or exc} (give an earlier run's --output file)")
            if not _followable(folder, name):
                refuse(f"--resume {path} is a symbolic link of uid {folder.lstat(name).st_uid}'s in a folder others "
                       "may write: not followed; resume from a file only you can write (name the file itself)")
            fd = os.open(name, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC, dir_fd=folder.fd)
    why = _untrusted(os.fstat(fd))
    if why:
        os.close(fd)
        refuse(f"--resume {path} {why}")
    return fd


def _untrusted(st: os.stat_result) -> str:
    """Why a file is no results file to resume from, told by its `fstat` ("" if it may be)."""
    from ..cache.folders import unreadable
    from ..system import others_may_write
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file: give an earlier run's --output file"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or others_may_write(st):
        return (f"is owned by uid {st.st_uid}, mode {mode:o}, group {st.st_gid}: whoever else can write it chooses "
                "the results kept as yours; resume from a file only you can write (one of yours: chmod go-w it)")
    why = unreadable(st)
    return f"is no results file hardy wrote, not read: {why}; give an earlier run's --output file" if why else ""


def _folder(path: str, flag: str) -> Folder:
    """The folder of the results file `path`, opened (its last component may be a link of the
    user's or root's, not anyone else's: `open_named`)."""
    from ..cache.folders import open_named
    from ..errors import UntrustedCacheError
    try:
        return open_named(os.path.dirname(os.path.abspath(path)), private=False)
    except (OSError, UntrustedCacheError) as exc:
        refuse(f"{flag} {path}: {exc}")


def _followable(folder: Folder, name: str) -> bool:
    """Whether the link at `name` is the user's own choice, to follow: made by the user or root
    (/dev/stdout), in a folder of the user's or root's where nobody else can swap it (writable by
    no one else, or sticky). Linux's `fs.protected_symlinks` asks less, and is often off."""
    from ..system import others_may_write
    me, held = os.geteuid(), os.fstat(folder.fd)
    swappable = others_may_write(held) and not held.st_mode & stat.S_ISVTX
    return folder.lstat(name).st_uid in (me, 0) and held.st_uid in (me, 0) and not swappable


class Watched:
    """What `closing_ends_the_run` saw: whether the output's reader went away."""

    closed = False
    armed = True


@contextlib.contextmanager
def closing_ends_the_run(out: IO[str]) -> Iterator[Watched]:
    """An output pipe whose reader goes away (`| head`) ends the command at once, not at its next
    line (which may be an item's hour away): a thread polls the pipe (a closed reader is POLLERR),
    notes it, and signals the main thread (SIGUSR2), whose handler raises KeyboardInterrupt
    wherever the command waits: the map and its workers stop as for Ctrl-C, and the command then
    says the output was closed. (An interrupt, not an exception of its own: hardy's code may catch
    an Exception anywhere, it lets an interrupt through.) Once the block ends, a late signal does
    nothing; the handler stays (putting the default back could let a late one end the process)."""
    watched = Watched()
    try:
        fd = out.fileno()
        pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
    except (OSError, ValueError):  # not a file (a test's StringIO)
        pipe = False
    main = threading.main_thread()
    if not pipe or threading.current_thread() is not main or signal.getsignal(signal.SIGUSR2) != signal.SIG_DFL:
        yield watched
        return
    wake, woken = os.pipe()

    def closed(signum: int, frame: Any) -> None:
        if watched.armed:
            watched.armed = False
            raise KeyboardInterrupt

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
        poller.register(wake, select.POLLIN)
        if any(ready == fd for ready, _ in poller.poll()) and main.ident is not None:
            watched.closed = True
            signal.pthread_kill(main.ident, signal.SIGUSR2)

    signal.signal(signal.SIGUSR2, closed)
    thread = threading.Thread(target=watch, name="hardy-output-watch", daemon=True)
    thread.start()
    try:
        yield watched
    finally:
        watched.armed = False
        os.write(woken, b"x")
        thread.join()
        os.close(wake)
        os.close(woken)


def failed_line(writer: Writer, before: dict[int, bool], counts: tuple[int, int], output: str | None,
                report: str | None) -> str:
    """The last word of a run where items failed: how many, the first of them, and where each one's
    error and stack are (its line; the run report), so that a run writing to a file says what and
    where without a look at every line."""
    first = list(writer.first_failed)
    for i, ok in before.items():  # --resume: the earlier run's failures are this output's too
        if not ok:
            lowest(first, i)
    failed, done = counts
    more = f" and {failed - len(first):,} more" if failed > len(first) else ""
    named = f"item{'s' if failed > 1 else ''} {', '.join(map(str, first))}{more}"
    where = [f"its line in {output}" if output else "its line on stdout"]
    if report:
        command = shlex.join(["hardy", "report", report, "--item", str(first[0])]) if first else ""
        how = f" ({command})" if report.endswith(".json") and first else ""
        where.append(f"the run report {report}{how}")
    return f"hardy: {failed} of {done} item(s) failed ({named}); each one's error and stack: {', and '.join(where)}"

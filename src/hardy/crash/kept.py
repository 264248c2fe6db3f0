"""The inputs of failed items, kept beside a run report so that `hardy replay` (`cli/replay.py`) can run one again.

Kept when an engine writes run reports to a directory (`Engine(report_dir=...)` or
HARDY_REPORT_DIR), or with `Engine(keep_failed_inputs=True)` also without one: a map with failed
items then writes its report to `default_folder()` (`$XDG_STATE_HOME/hardy/reports`, else
~/.local/state/hardy/reports: private to the user, beside the user's own cache key) and logs where.
`keep_failed_inputs=False` keeps none. Each failed item of a map (the first `FAILURES_KEPT`) is
written next to the report's JSON, in `<report>.inputs/item-<N>.pkl`: the interpreter's sys.path
and working directory (which `load` applies first, so the nodes' modules import as they did), the
pipeline (its nodes and engine settings, cloudpickled once per report, as a worker receives them)
and the item's inputs.

Caps: `KEEP_LIMIT` bytes per item and `KEEP_TOTAL` per report; an item past either is listed as
"not kept: N bytes over the cap". Each file is written whole or not at all, readable by its owner
only, in a folder only its owner may write, and signed as a shared cache's entries are: keyed
BLAKE3 under the user's own key (`hardy.cache.trust.user_key`), with a key derived for this purpose
only, so a kept input never verifies as a cache entry nor one as the other. `load` refuses, before
unpickling anything (unpickling runs code), a file or folder that another user owns or may write,
a symbolic link (at the folder or the file: both are reached through their parent's descriptor,
never followed), and a file whose signature does not match.
"""

from __future__ import annotations

import hmac
import io
import os
import pickle
import stat
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..cache.folders import Folder, open_named
from ..cache.trust import check_owned, mac_key, sign, state_folder, user_key, user_key_folder
from ..errors import ReplayError, UntrustedCacheError
from ..hashing import DIGEST

KEEP_LIMIT = 64 << 20  # bytes per kept item
KEEP_TOTAL = 256 << 20  # bytes of kept items per report
FAILURES_KEPT = 100
_MAGIC = b"hardy-replay-2\n"
_PURPOSE = "kept failed-item inputs"
_FIX = "Remove it if you did not make it; hardy replay only loads what you wrote"


def default_folder(create: bool = False) -> Path:
    """Where `Engine(keep_failed_inputs=True)` writes reports when no report directory is given:
    made (`create`) through the user's checked state folder, private."""
    if create:
        with state_folder() as state, state.sub("reports", create=True, mode=0o700, private=True):
            pass
    return Path(user_key_folder()) / "reports"


def folder_of(report: str | os.PathLike[str]) -> Path:
    return Path(f"{Path(report).with_suffix('')}.inputs")


def _key() -> bytes:
    return mac_key(user_key(), _PURPOSE)


def keep(report: str | os.PathLike[str], pipeline: Any, items: Mapping[int, dict[str, Any]],
         dump: Callable[[Any], bytes] | None = None) -> dict[int, str]:
    """Write each item's inputs; {item: file name, or why it was not kept}. `dump` pickles the
    pipeline (the caller's: `observe.report` gives the one workers receive their plans by, whose
    code of `__main__`'s nodes keeps its file and lines, so that a replay's tracebacks and pdb show
    the user's source); cloudpickle's by default. The folder is reached through the report folder's
    descriptor, not following a link (a team's report_dir may be written by others), and must be
    this user's and private."""
    folder = folder_of(report)
    try:
        key = _key()  # first: its folder, made private, may be the report's parent (`default_folder`)
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open_named(str(folder.parent), private=False) as parent:
            kept = parent.sub(folder.name, create=True, mode=0o700, private=True)
    except (OSError, UntrustedCacheError) as exc:
        return dict.fromkeys(items, f"not kept: {exc}")
    with kept:
        return _keep_each(kept, key, pipeline, items, dump)


def discard(report: str | os.PathLike[str]) -> None:
    """Remove what `keep` wrote beside `report`, and its folder once empty: for a report that could
    not be written (a full disk), whose inputs nothing would name (`hardy replay` starts from the
    report). Reached as `keep` reaches it (no link followed, only a private folder of this user's);
    a file of any other name stays, and so does the folder then."""
    folder = folder_of(report)
    try:
        with open_named(str(folder.parent), private=False) as parent:
            with parent.sub(folder.name, private=True) as kept:
                for name in kept.names():
                    if name.startswith(("item-", ".item-")) and name.endswith((".pkl", ".tmp")):
                        kept.unlink(name)
            os.rmdir(folder.name, dir_fd=parent.fd)
    except OSError:  # (nothing there, someone else's, or not empty: left as it is)
        pass


def _keep_each(folder: Folder, key: bytes, pipeline: Any, items: Mapping[int, dict[str, Any]],
               dump: Callable[[Any], bytes] | None) -> dict[int, str]:
    import cloudpickle
    said: dict[int, str] = {}
    try:
        head = pickle.dumps({"sys_path": list(sys.path), "cwd": os.getcwd()}) + (
            dump(pipeline) if dump is not None else cloudpickle.dumps(pipeline, protocol=5))
    except Exception as exc:
        return dict.fromkeys(items, f"not kept: the pipeline cannot be pickled ({type(exc).__name__}: {exc})")
    total = 0
    for i, inputs in items.items():
        try:
            body = head + cloudpickle.dumps({"item": i, "inputs": inputs}, protocol=5)
        except Exception as exc:
            said[i] = f"not kept: its inputs cannot be pickled ({type(exc).__name__}: {exc})"
            continue
        if len(body) > KEEP_LIMIT:
            said[i] = (f"not kept: {len(body) - KEEP_LIMIT:,} bytes over the cap ({len(body):,} bytes pickled; "
                       f"the cap is {KEEP_LIMIT:,} bytes per item)")
            continue
        if total + len(body) > KEEP_TOTAL:
            said[i] = (f"not kept: {total + len(body) - KEEP_TOTAL:,} bytes over the cap of {KEEP_TOTAL:,} bytes "
                       "for one report's kept inputs (the items before it took the rest)")
            continue
        said[i] = _write(folder, i, key, body)
        if not said[i].startswith("not kept"):
            total += len(body)
    return said


def _write(folder: Folder, i: int, key: bytes, body: bytes) -> str:
    name = f"item-{i}.pkl"
    try:
        folder.write(name, [_MAGIC, sign(key, body), body], mode=0o600)
    except OSError as exc:
        return f"not kept: {exc}"
    return f"{os.path.basename(folder.path)}/{name}"


def _read_own(path: Path) -> bytes:
    """The file's bytes, if it and its folder are this user's and nobody else may write them: the
    folder opened through its parent's descriptor and the file through the folder's, neither
    following a link, each checked on what was opened."""
    try:
        with open_named(str(path.parent.parent), private=False) as parent, parent.sub(path.parent.name) as folder:
            check_owned("replay folder", str(path.parent), os.fstat(folder.fd), _FIX)
            fd = folder.open(path.name)
    except UntrustedCacheError as exc:
        raise ReplayError(str(exc)) from None
    except OSError as exc:
        raise ReplayError(f"{path} cannot be opened ({exc.strerror}; a symbolic link is refused): not loaded") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        try:
            if not stat.S_ISREG(st.st_mode):
                raise ReplayError(f"{path} is not a regular file: not loaded")
            check_owned("kept input", str(path), st, _FIX)
        except UntrustedCacheError as exc:
            raise ReplayError(str(exc)) from None
        return f.read()


def a_report(report: str | os.PathLike[str]) -> None:
    """Raises `ReplayError` saying why `report` is not a report's file: a folder, or nothing there."""
    if os.path.isdir(report):
        raise ReplayError(f"{report} is a folder: give one of the run reports' JSON files in it")
    if not os.path.isfile(report):
        raise ReplayError(f"{report}: no such report (give a run report's JSON: Engine(report_dir=...) writes them)")


def check(report: str | os.PathLike[str], item: int) -> bytes:
    """The verified bytes of `item`'s kept file (after its magic line and signature); raises
    `ReplayError` if it is missing, not this user's, writable by others, or not signed by this user."""
    a_report(report)
    path = folder_of(report) / f"item-{item}.pkl"
    if not os.path.lexists(path):
        kept = sorted(int(p.stem[5:]) for p in folder_of(report).glob("item-*.pkl") if p.stem[5:].isdigit())
        shown = ", ".join(map(str, kept[:20])) + (f" and {len(kept) - 20} more" if len(kept) > 20 else "")
        which = f"the items kept there: {shown}" if kept else f"looked for {path}"
        raise ReplayError(f"no kept inputs for item {item} beside {report} ({which}); inputs are kept for failed "
                          "items of maps run with Engine(report_dir=...) or Engine(keep_failed_inputs=True)")
    data = _read_own(path)
    size = len(_MAGIC) + DIGEST
    try:
        key = _key()
    except UntrustedCacheError as exc:
        raise ReplayError(str(exc)) from None
    if not data.startswith(_MAGIC) or not hmac.compare_digest(data[len(_MAGIC):size], sign(key, data[size:])):
        raise ReplayError(f"{path} is not signed with this user's key: written by someone else or changed since; "
                          "not loaded")
    return data[size:]


def load(report: str | os.PathLike[str], item: int) -> dict[str, Any]:
    """The kept pipeline and inputs of `item` ({"pipeline", "item", "inputs"}), after checking
    owner, mode and signature (`check`): nothing is unpickled before all three pass."""
    path = folder_of(report) / f"item-{item}.pkl"
    stream = io.BytesIO(check(report, item))
    where = pickle.load(stream)
    sys.path.extend(p for p in where["sys_path"] if p not in sys.path)
    try:
        os.chdir(where["cwd"])
    except OSError:
        pass
    try:
        pipeline = pickle.load(stream)
        kept: dict[str, Any] = pickle.load(stream)
    except Exception as exc:
        raise ReplayError(f"{path} cannot be unpickled here ({type(exc).__name__}: {exc}); run hardy replay "
                          "where the pipeline's modules are importable") from exc
    return {**kept, "pipeline": pipeline}

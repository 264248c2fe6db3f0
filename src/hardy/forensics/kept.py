"""The inputs of failed items, kept beside a run report so that `hardy replay` (`cli/replay.py`) can run one again.

When an engine writes run reports (`Engine(report_dir=...)`), each failed item of a map (the first
`FAILURES_KEPT`) is written next to the report's JSON, in `<report>.inputs/item-<N>.pkl`: the
pipeline (its nodes and engine settings, cloudpickled as a worker receives them), the item's
inputs, and the interpreter's sys.path and working directory (which `load` applies first, so the
nodes' modules import as they did). Each file is at most `KEEP_LIMIT`
bytes (a larger item is listed as not kept, with its size), written whole or not at all, readable by
its owner only, and signed (HMAC-SHA256) with a key of this user's (`~/.cache/hardy/replay.key`,
0600): `load` refuses a file that another user owns or may write, or whose signature does not
match, before unpickling anything (unpickling runs code).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import secrets
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ReplayError
from .handler import cache_folder

KEEP_LIMIT = 64 << 20  # bytes per kept item
FAILURES_KEPT = 100
_MAGIC = b"hardy-replay-1\n"


def _own(path: str) -> bool:
    st = os.stat(path)
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _key() -> bytes:
    """This user's signing key, made on first use."""
    folder = cache_folder()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, "replay.key")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    except FileExistsError:
        pass
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ReplayError(f"{path} is not this user's own, or others may read it: remove it (a new key is made)")
    with open(path, "rb") as f:
        return f.read()


def folder_of(report: str | os.PathLike[str]) -> Path:
    return Path(f"{Path(report).with_suffix('')}.inputs")


def keep(report: str | os.PathLike[str], pipeline: Any, items: Mapping[int, dict[str, Any]]) -> dict[int, str]:
    """Write each item's inputs; {item: file name, or why it was not kept}."""
    import cloudpickle
    folder = folder_of(report)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = _key()
    said: dict[int, str] = {}
    for i, inputs in items.items():
        try:
            where = pickle.dumps({"sys_path": list(sys.path), "cwd": os.getcwd()})  # read first: imports need it
            body = where + cloudpickle.dumps({"pipeline": pipeline, "item": i, "inputs": inputs}, protocol=5)
        except Exception as exc:
            said[i] = f"not kept: its inputs cannot be pickled ({type(exc).__name__}: {exc})"
            continue
        if len(body) > KEEP_LIMIT:
            said[i] = f"not kept: {len(body):,} bytes pickled, over the limit of {KEEP_LIMIT:,}"
            continue
        path = folder / f"item-{i}.pkl"
        scratch = folder / f".item-{i}.{os.getpid()}.tmp"
        try:
            fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hmac.new(key, body, hashlib.sha256).digest() + body)
            os.replace(scratch, path)
        except OSError as exc:
            scratch.unlink(missing_ok=True)
            said[i] = f"not kept: {exc}"
            continue
        said[i] = f"{folder.name}/{path.name}"
    return said


def load(report: str | os.PathLike[str], item: int) -> dict[str, Any]:
    """The kept inputs of `item`, after checking owner, mode and signature."""
    path = folder_of(report) / f"item-{item}.pkl"
    if not path.exists():
        raise ReplayError(f"no kept inputs for item {item} beside {report} (looked for {path}); inputs are kept "
                          "for failed items of maps run with Engine(report_dir=...)")
    if not _own(str(path)) or not _own(str(path.parent)):
        raise ReplayError(f"{path} (or its folder) is not this user's own, or others may write it: not loaded")
    data = path.read_bytes()
    size = len(_MAGIC) + 32
    if not data.startswith(_MAGIC) or not hmac.compare_digest(
            data[len(_MAGIC):size], hmac.new(_key(), data[size:], hashlib.sha256).digest()):
        raise ReplayError(f"{path} is not signed with this user's key: written by someone else or changed since; "
                          "not loaded")
    stream = io.BytesIO(data[size:])
    where = pickle.load(stream)
    sys.path.extend(p for p in where["sys_path"] if p not in sys.path)
    try:
        os.chdir(where["cwd"])
    except OSError:
        pass
    try:
        kept: dict[str, Any] = pickle.load(stream)
    except Exception as exc:
        raise ReplayError(f"{path} cannot be unpickled here ({type(exc).__name__}: {exc}); run hardy replay "
                          "where the pipeline's modules are importable") from exc
    return kept

"""Single flight: processes that miss on the same key wait for the first one to compute it, and
never for anyone else.

An exclusive flock per key on a lock file: released by the kernel even if its holder is killed.
The holder removes the file once the value is stored (a process still waiting on it then finds
the value). A flock needs only a descriptor of the file, so whoever can open a lock file can hold
it for ever: only a lock file of the current user's that nobody else can open (0600) is waited on.
One another user made, or could open, is not waited on: the node is computed at once and stored as
usual (duplicated work, never a wait on someone else). In a shared directory signed with the user's
own key the lock files live in that key id's 0700 folder, where nobody else can make one; with a
team secret, teammates' processes each compute (a machine's processes of one user still wait for
each other). Across machines, a bucket's leases do the same (`leases.py`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator

from .folders import Folder

NOT_WAITED = "computed at once: their single-flight lock file was made, or can be opened, by another user"


@contextlib.contextmanager
def flight(locks: Folder, key: bytes, notes: dict[str, int]) -> Iterator[None]:
    """Hold the lock of `key` in `locks` (closed here) while the caller computes; counts in `notes`
    a lock not waited on. A folder where locks cannot be made computes without one."""
    name = key.hex()
    with locks:
        try:
            fd = lock_file(locks, name)
        except OSError:
            fd = -1
        if fd is None:
            notes[NOT_WAITED] = notes.get(NOT_WAITED, 0) + 1
        if fd is None or fd < 0:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
            with contextlib.suppress(OSError):
                locks.unlink(name)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def lock_file(locks: Folder, name: str) -> int | None:
    """A descriptor of the lock file `name`, made 0600 (`O_EXCL`) or found so and the current
    user's; None for one another user made or could open (a link fails: ELOOP)."""
    try:
        return locks.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    try:
        fd = locks.open(name, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO planted there: opened without a wait, refused)
    except FileNotFoundError:  # removed by its holder meanwhile: its value is stored
        return locks.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
        return fd
    os.close(fd)
    return None


def sweep(folder: Folder) -> int:
    """Remove lock files nobody holds (left by killed holders). Returns how many. Anything else
    there (a FIFO, which a plain open would wait on for ever) is not a lock file: left alone."""
    removed = 0
    for _, name in folder.files(depth=0):
        try:
            fd = folder.open(name, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            removed += folder.unlink(name)
        except OSError:  # held: a computation is in flight
            pass
        finally:
            os.close(fd)
    return removed

"""What went wrong with a cache during one map, counted as it happens and said once.

The cache never fails a node: a store that cannot be read or written (disk full, read-only mount,
permission, I/O error, a lock held past its timeout, a link where a file should be) makes the node
run uncached, an entry that fails verification is deleted and recomputed, and `DiskCache.report()`
sums all of it up in one warning per map instead of a line per entry.
"""

from __future__ import annotations

import collections
import errno

FAULTS = (OSError,)  # with sqlite3.Error (added by DiskCache): what a store raises when its environment misbehaves
DAMAGED = "damaged"
FORGED = ("whose header named another secret in this secret's own folder (written by someone without the "
          "secret, or damaged)")


def entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


class Tally:
    """Counters of one map's faults (the node ran uncached), deletions (recomputed) and notes
    (done otherwise than asked), by reason."""

    def __init__(self, where: str = "") -> None:
        self.where = where  # the cache's directory, in the fix a full disk's warning gives
        self.faults: collections.Counter[tuple[str, str]] = collections.Counter()  # (action, reason): entries
        self.deleted: collections.Counter[str] = collections.Counter()
        self.notes: collections.Counter[str] = collections.Counter()

    def fault(self, action: str, exc: BaseException, n: int = 1) -> None:
        self.faults[(action, reason(exc))] += n

    def __bool__(self) -> bool:
        return bool(self.faults or self.deleted or self.notes)

    def parts(self, elsewhere: list[str]) -> list[str]:
        """The counts in words, `elsewhere` (a bucket's own) after the faults; then forgotten."""
        faults = self.faults.most_common()
        ran = said([(fault, n) for fault, n in faults if fault[0] != "pruned"])
        if ran:  # (pruning runs in `put` too: its faults cost no node its cache)
            ran[-1] += "; those nodes ran uncached"
        parts = ran + said([(fault, n) for fault, n in faults if fault[0] == "pruned"])
        parts += dict.fromkeys(full_disk(action, self.where) for action, why in self.faults if why == "disk full")
        parts += elsewhere
        parts += [f"{n} {what} entr{'y' if n == 1 else 'ies'} deleted and recomputed" if what == DAMAGED else
                  f"{entries(n)} {what} deleted and recomputed" for what, n in self.deleted.most_common()]
        parts += [f"{entries(n)} {what}" for what, n in self.notes.most_common()]
        self.faults.clear()
        self.deleted.clear()
        self.notes.clear()
        return parts


# what befell an entry, in words; an entry that failed verification but could not be deleted is
# not said to be deleted (it is still there, and the next run finds it again)
ACTIONS = {"deleted": "could not be deleted after failing verification"}


def said(faults: list[tuple[tuple[str, str], int]]) -> list[str]:
    """Faults of one reason said together, the reason once: "3 entries could not be read and 3 could
    not be written (permission denied: <which folder, whose, the fix>)"."""
    by_reason: dict[str, list[str]] = {}
    for (action, why), n in faults:
        done = by_reason.setdefault(why, [])
        done.append(f"{entries(n) if not done else n} {ACTIONS.get(action, f'could not be {action}')}")
    return [f"{' and '.join(done)} ({why})" for why, done in by_reason.items()]


def full_disk(action: str, where: str) -> str:
    """What to do when the disk of the cache `where` is full and an entry could not be `action`."""
    if action in ("read", "written"):
        return (f"free space on its disk: `hardy cache prune {where} --max-size SIZE` deletes this cache's least "
                "recently used entries (`DiskCache(max_size=...)` keeps it under a size)")
    return ("its index needs room on the disk to record a deletion: free space elsewhere on that disk, or delete "
            f"{where} while no process uses it")


def reason(exc: BaseException) -> str:
    """A fault in a few words, the same for SQLite's and the filesystem's spelling of it."""
    name = getattr(exc, "sqlite_errorname", "")
    code = getattr(exc, "errno", None)
    if name == "SQLITE_FULL" or code in (errno.ENOSPC, errno.EDQUOT):
        return "disk full"
    if name.startswith("SQLITE_READONLY") or code == errno.EROFS:
        return "read-only"
    if name.startswith("SQLITE_CANTOPEN"):
        return "cannot open the index: read-only or no permission"
    if name in ("SQLITE_PERM", "SQLITE_AUTH") or code in (errno.EACCES, errno.EPERM):
        refusal = getattr(exc, "refusal", None)  # which folder refused, whose it is, the fix (`files._Refused`)
        return f"permission denied: {refusal}" if refusal else "permission denied"
    if name.startswith("SQLITE_IOERR") or code == errno.EIO:
        return "I/O error"
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return "index locked past the timeout"
    if code == errno.ELOOP:
        return "a symbolic link where a file or folder should be: not followed"
    return f"{type(exc).__name__}: {exc}"

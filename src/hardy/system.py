"""The operating system hardy needs: Linux, checked first thing at `import hardy`.

Why Linux only, rather than the in-process executors elsewhere: hardy's default executor, the
one every map and run uses unless told otherwise, is built on Linux interfaces, and so are its
crash reports. The in-process executors are mostly pure Python, but a hardy whose default fails
at the first `map`, or whose segfault reports lose their native frames, would be a worse
HyperNodes, whose API hardy follows and which runs there. So other platforms get one clear error
at import, naming what is missing, instead of a failure deep inside a run.
"""

from __future__ import annotations

import os
import stat
import sys

NEEDS = (
    "memfd segments (memfd_create) for the big buffers sent to and from workers",
    "file descriptors passed over Unix sockets (SCM_RIGHTS): segments, and workers' sockets from the fork servers",
    "prctl (a parent-death signal, child subreapers) so that no worker outlives its parent",
    "/proc, to read a worker's memory, maps and state",
    "ELF libraries, whose symbols name the native frame a worker died in",
)


def require_linux() -> None:
    """Raise ImportError on any platform but Linux, saying what hardy needs of it and what to use."""
    if sys.platform.startswith("linux"):
        return
    needs = "".join(f"\n  - {need}" for need in NEEDS)
    raise ImportError(
        f"hardy runs on Linux only, and this is {sys.platform!r}. Its crash-containing workers need:{needs}\n"
        "Run it in a Linux container or WSL 2; HyperNodes, whose API hardy follows, runs here without "
        "crash containment.")
require_linux()  # at import: `import hardy` imports this module first


def others_may_write(st: os.stat_result) -> bool:
    """Whether someone other than the user (and root) may write the file or folder `st` describes:
    anyone may, or its group may and is not the user's private group. umask 002 with a group per
    user (Debian's and Ubuntu's default) makes 0664 files and 0775 folders nobody else can write."""
    return bool(st.st_mode & stat.S_IWOTH or st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid))


def _private_group(gid: int) -> bool:
    """Whether group `gid` is the user's alone: named as the user, no other member, and nobody
    else's primary group (a group per user, as `useradd` makes by default)."""
    import grp  # (here: `import hardy` reads this module first thing)
    import pwd

    me = os.geteuid()
    try:
        name, group = pwd.getpwuid(me).pw_name, grp.getgrgid(gid)
    except KeyError:
        return False
    return group.gr_name == name and set(group.gr_mem) <= {name} and \
        all(user.pw_gid != gid or user.pw_uid == me for user in pwd.getpwall())

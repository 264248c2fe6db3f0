"""`hardy libs` (and `preload_libs=`, `hardy.native.preload`) over folders other users can write,
acted out: another local uid (setpriv) plants a FIFO named like a library, or leaves a library
whose constructor runs as whoever loads it. Rows of docs/security.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import build_library
from test_cache_trust import ATTACKER, area, needs_root  # noqa: F401  (area: a fixture)

# Its constructor runs when it is loaded, as the process that loads it: it writes the file HARDY_TEST_MARK names.
EVIL = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void ran(void) {
    const char *mark = getenv("HARDY_TEST_MARK");
    FILE *f = mark ? fopen(mark, "w") : NULL;
    if (f) { fputs("their code ran", f); fclose(f); }
}
"""


def hardy_libs(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m hardy libs ARGS`; one still running after 60 s fails the test (a liveness bound:
    it takes about a second unless something blocks it)."""
    try:
        return subprocess.run([sys.executable, "-m", "hardy", "libs", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "COLUMNS": "1000", **env})
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"hardy libs {' '.join(args)} still running after 60 s") from exc


def test_a_fifo_named_like_a_library_is_skipped_not_waited_on(tmp_path: Path) -> None:
    """A plain open() of a FIFO waits for a writer for ever: `hardy libs` over a folder where
    anyone planted `libfast.so` as a FIFO hung."""
    folder = tmp_path / "libs"
    folder.mkdir()
    os.mkfifo(folder / "libfast.so")
    build_library(folder, "libok.so", "int ok(void) { return 1; }")
    out = hardy_libs(str(folder), "--order")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 libraries indexed" in out.stdout and f"{folder}/libok.so" in out.stdout


@needs_root
def test_preload_never_loads_a_library_another_user_owns_or_could_replace(area: Path,  # noqa: F811
                                                                         tmp_path: Path) -> None:
    """`hardy libs --preload` walked its folders recursively and loaded every library: one another
    user left in a subfolder of a shared working folder ran its constructor as the victim. Now a
    folder of theirs is not searched, a library in a folder anyone may write (without the sticky
    bit) is skipped, and each is named with why; the user's own library beside them still loads."""
    evil = build_library(tmp_path, "evil.so", EVIL)
    (area / "evil.so").write_bytes(evil.read_bytes())
    (area / "evil.so").chmod(0o644)
    theirs = area / "mallory" / "old-build"
    subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "sh", "-c",
                    f"mkdir -p {theirs} && cp {area}/evil.so {theirs}/libtbb.so.12"], check=True, timeout=60,
                   env={"PATH": os.environ["PATH"]})
    (area / "evil.so").unlink()
    build_library(area / "scratch", "libmine.so", "int mine(void) { return 1; }").chmod(0o755)
    (area / "scratch").chmod(0o755)
    (area / "open").mkdir(mode=0o777)
    (area / "open").chmod(0o777)  # (whatever the umask)
    (area / "open" / "libopen.so").write_bytes(evil.read_bytes())
    mark = tmp_path / "ran"
    out = hardy_libs(str(area), "--preload", HARDY_TEST_MARK=str(mark))
    assert not mark.exists(), "a library another user could replace was loaded: " + out.stdout + out.stderr
    assert "preloaded 1 libraries" in out.stdout, out.stdout + out.stderr
    said = " ".join(out.stderr.split())
    assert f"{area}/mallory/ (a folder owned by nobody (uid {ATTACKER}): not searched)" in said, said
    assert f"{area}/open/libopen.so (in {area}/open, which anyone can write (mode 777))" in said, said


@needs_root
def test_scan_names_what_it_skipped(area: Path, tmp_path: Path) -> None:  # noqa: F811
    """`scan(skipped=)` hands the skipped libraries and folders to its caller (the CLI's listing)."""
    from hardy.native.libs import scan
    lib = build_library(tmp_path, "libx.so", "int x(void) { return 1; }")
    (area / "libtheirs.so").write_bytes(lib.read_bytes())
    os.chown(area / "libtheirs.so", ATTACKER, ATTACKER)
    skipped: list[str] = []
    assert scan([str(area)], skipped=skipped) == []
    assert skipped == [f"{area}/libtheirs.so (owned by nobody (uid {ATTACKER}), not by you or root)"]


def test_hardy_libs_lists_what_it_skipped(area: Path, tmp_path: Path) -> None:  # noqa: F811
    """`hardy libs FOLDER` said nothing of a library it left out (only a log line on stderr): it is
    listed as skipped, and in `--json` too."""
    import json
    import subprocess
    import sys
    lib = build_library(tmp_path, "libx.so", "int x(void) { return 1; }")
    (area / "libtheirs.so").write_bytes(lib.read_bytes())
    os.chown(area / "libtheirs.so", ATTACKER, ATTACKER)
    out = subprocess.run([sys.executable, "-m", "hardy", "libs", str(area)], capture_output=True, text=True, timeout=120)
    assert f"skipped {area}/libtheirs.so (owned by nobody" in " ".join(out.stdout.split()), out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "hardy", "libs", str(area), "--json"], capture_output=True, text=True,
                         timeout=120)
    assert json.loads(out.stdout)["skipped"] == [f"{area}/libtheirs.so (owned by nobody (uid {ATTACKER}), not by you "
                                                 "or root)"]


@needs_root
def test_a_library_a_team_group_may_write_is_skipped(area: Path, tmp_path: Path) -> None:  # noqa: F811
    """A setgid team folder (2775) and its 664 files, as umask 002 makes them: any member of the
    group could replace the library, and only anyone-writable ones were skipped."""
    from hardy.native.libs import scan
    team = area / "team"
    team.mkdir()
    os.chown(team, 0, 100)  # (group `users`: not root's own group)
    team.chmod(0o2775)
    lib = build_library(tmp_path, "libx.so", "int x(void) { return 1; }")
    (team / "libteam.so").write_bytes(lib.read_bytes())
    os.chown(team / "libteam.so", 0, 100)
    (team / "libteam.so").chmod(0o664)
    skipped: list[str] = []
    assert scan([str(area)], skipped=skipped) == []
    assert skipped == [f"{team}/libteam.so (writable by group users (mode 664))"]
    (team / "libteam.so").chmod(0o644)
    skipped.clear()
    assert scan([str(area)], skipped=skipped) == []
    assert skipped == [f"{team}/libteam.so (in {team}, which group users can write (mode 2775))"]

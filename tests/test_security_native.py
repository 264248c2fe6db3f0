"""Another local user against hardy's compiled crash handler, acted out by a real second uid (setpriv):
the shared object every fork server loads and `hardy repeat` preloads into every run. Its name is
public (a hash of hardy's source), so whoever can change a folder on its path, or swap one between
hardy's check and its load, chooses the code that runs as you. Each planted library is a real
gcc-built .so whose constructor writes a marker file: loaded even once, anywhere, the marker
appears. The victim is root (as in CI), in fresh processes; rows of docs/security.md.

Each test fails on the handler that checked paths with `os.stat` and then loaded by path."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from blake3 import blake3

import hardy
from hardy.crash import handler
from test_cache_trust import ATTACKER, needs_root

pytestmark = [needs_root, pytest.mark.skipif(shutil.which("gcc") is None, reason="builds real libraries with gcc"),
              pytest.mark.timeout(300)]

SRC = str(Path(hardy.__file__).resolve().parents[1])  # the hardy under test, for the victim's processes
TAG = blake3(Path(handler.SOURCE).read_bytes() + os.uname().machine.encode()).hexdigest()[:16]  # public
RACES = 400  # fresh victim processes against the swapper (a check by path lost within 40, once only at 199)

MARKER_C = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    FILE *f = fopen(MARKER, "a");
    if (f) { fprintf(f, "planted code ran as uid %d in pid %d\n", (int)getuid(), (int)getpid()); fclose(f); }
}
"""

# The attacker's swapper (standard library only): exchanges two names in a folder of theirs, forever.
SWAP = """
import ctypes, os, sys
os.chdir(sys.argv[1])
renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
print("ready", flush=True)
while True:
    renameat2(-100, b"native", -100, b"evil", 2)  # AT_FDCWD, RENAME_EXCHANGE
"""


def gcc(out: Path, source: str, *flags: str) -> Path:
    c = out.with_suffix(".c")
    c.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", *flags, "-o", str(out), str(c)], check=True)
    return out


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder like /tmp, both users' to create in (sticky: only owners rename or remove)."""
    path = Path(tempfile.mkdtemp(prefix="native-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def planted(shared: Path) -> tuple[Path, Path]:
    """(a marker library, the marker it writes when anything loads it), readable by the attacker."""
    marker = shared / "PWNED"
    lib = gcc(shared / "planted.so", MARKER_C, f'-DMARKER="{marker}"')
    lib.chmod(0o755)
    return lib, marker


def as_attacker(script: str, *args: str, wait: bool = True) -> subprocess.Popen[str] | None:
    command = ["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups",
               sys.executable, "-I", "-c", textwrap.dedent(script), *args]
    if wait:
        done = subprocess.run(command, capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, timeout=60)
        assert done.returncode == 0, done.stderr
        return None
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": os.environ["PATH"]})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
    return proc


def victim(script: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`script` run by the victim in a fresh interpreter, with `cache` as XDG_CACHE_HOME."""
    environ = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": SRC, **env}
    environ.pop("HARDY_NATIVE_HANDLER", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=environ, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def genuine_handler(folder: Path) -> None:
    """The victim's own compiled handler, as an earlier run of hardy built it into `folder`."""
    folder.mkdir(mode=0o700)
    gcc(folder / f"handler-{TAG}.so", Path(handler.SOURCE).read_text()).chmod(0o700)
    (folder / f"handler-{TAG}.c").unlink()


def test_a_cache_folder_another_user_made_first_is_neither_built_in_nor_loaded(shared, tmp_path):
    """They made `$XDG_CACHE_HOME/hardy` first (0777, in a sticky shared folder): hardy says why and
    falls back to the ctypes handler, which still names the library a map's crash happened in."""
    as_attacker("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", str(shared / "hardy"))
    crashy = gcc(tmp_path / "libcrashy.so", "void crash_here(int x) { *(volatile int *)(long)x = 1; }\n")
    done = victim(f"""
        import ctypes
        from hardy import Engine, Pipeline, node
        from hardy.crash import handler

        @node(output_name="y")
        def crash(x: int) -> int:
            if x == 1:
                ctypes.CDLL({str(crashy)!r}).crash_here(0)
            return x

        print(handler.mechanism())
        out = Pipeline(nodes=[crash], engine=Engine(map_executor="process", workers=1)).map(
            inputs={{"x": [0, 1, 2]}}, map_over="x", on_error="continue")
        print(out[0], out[2])
        print(str(out[1].error).splitlines()[0])
    """, shared)
    mechanism, results, crash = done.stdout.splitlines()
    assert mechanism.startswith("('ctypes', ") and f"{shared}/hardy" in mechanism, done.stdout
    assert "uid 65534, mode 777" in mechanism and "chmod 700" in mechanism and "XDG_CACHE_HOME" in mechanism
    assert results == "{'y': 0} {'y': 2}"
    assert "worker died from SIGSEGV in libcrashy.so (crash_here+0x" in crash, done.stdout
    assert os.listdir(shared / "hardy") == []  # nothing built in their folder


def test_a_native_folder_swapped_between_check_and_load_is_never_loaded(shared, planted):
    """The race of the report: in their `hardy/`, beside the victim's genuine `native/`, they keep
    `evil/` holding their library under the handler's name, and exchange the two names without
    pause (renameat2 RENAME_EXCHANGE) while the victim's fresh processes load the handler (fresh: a
    process opens a library's path once, a later dlopen of the same name reuses what it loaded)."""
    lib, marker = planted
    as_attacker("""
        import os, shutil, sys
        hardy, lib, name = sys.argv[1:]
        os.mkdir(hardy); os.chmod(hardy, 0o777)
        os.mkdir(os.path.join(hardy, "evil"), 0o755)
        shutil.copy(lib, os.path.join(hardy, "evil", name))
    """, str(shared / "hardy"), str(lib), f"handler-{TAG}.so")
    genuine_handler(shared / "hardy" / "native")
    swapper = as_attacker(SWAP, str(shared / "hardy"), wait=False)
    assert swapper is not None
    try:
        done = victim(f"""
            import os
            from hardy.crash import handler
            for i in range({RACES}):
                pid = os.fork()
                if pid == 0:
                    lib, why = handler._native()
                    if i == 0:
                        print(why, flush=True)
                    os._exit(0)
                os.waitpid(pid, 0)
                if os.path.exists({str(marker)!r}):
                    print("loaded in process", i + 1)
                    break
        """, shared)
    finally:
        swapper.kill()
        swapper.wait()
    assert not marker.exists(), marker.read_text() + done.stdout
    assert f"{shared}/hardy" in done.stdout and "neither built nor loaded" in done.stdout, done.stdout


def _plant(state: str, cache: Path, lib: Path, theirs: Path) -> None:
    """One state of `cache/hardy/native` (the victim's own private `hardy/`): a link where a folder or
    the library should be, each leading through `theirs` (a folder the attacker writes, holding a
    library of the victim's), or a folder or library of the attacker's."""
    hardy_dir = cache / "hardy"
    hardy_dir.mkdir(parents=True, mode=0o700)
    names = [f"handler-{TAG}.so", f"preload-{TAG}.so"]
    if state == "link as native/":
        (theirs / "folder").mkdir(mode=0o700)
        for name in names:
            (theirs / "folder" / name).write_bytes(lib.read_bytes())
            (theirs / "folder" / name).chmod(0o700)
        (hardy_dir / "native").symlink_to(theirs / "folder")
        return
    native = hardy_dir / "native"
    native.mkdir(mode=0o700)
    for name in names:
        if state == "link as the library":
            (theirs / name).write_bytes(lib.read_bytes())
            (theirs / name).chmod(0o700)
            (native / name).symlink_to(theirs / name)
        else:
            (native / name).write_bytes(lib.read_bytes())
            (native / name).chmod(0o700)
            os.chown(native / name, ATTACKER, ATTACKER)
    if state == "their native/":
        os.chown(native, ATTACKER, ATTACKER)


def test_links_and_another_users_files_in_the_native_folder_are_never_loaded(shared, planted):
    """In the victim's own private `hardy/`: a link in place of `native/` or of the library (into a
    folder the attacker can change at will, though what it holds now is the victim's), a `native/`
    of the attacker's, a library of the attacker's. Neither a map's handler nor `hardy repeat`'s
    preload loads any; each says why."""
    lib, marker = planted
    theirs = shared / "theirs"
    theirs.mkdir()
    os.chown(theirs, ATTACKER, ATTACKER)
    theirs.chmod(0o777)
    states = {"link as native/": "native is a symbolic link", "link as the library": "is a symbolic link: not followed",
              "their native/": "not a private folder of the current user's (uid 65534", "their library": "not this "
              "user's own"}
    for i, (state, why) in enumerate(states.items()):
        cache = shared / f"cache-{i}"
        _plant(state, cache, lib, theirs)
        done = victim("""
            from hardy.crash import handler
            from hardy.doctor.repeat import repeat
            print(handler.mechanism())
            print(repeat(["true"], n=1).native)
        """, cache)
        assert not marker.exists(), (state, marker.read_text())
        mechanism, native = done.stdout.splitlines()
        assert mechanism.startswith("('ctypes', ") and native.startswith("no native frames: "), (state, done.stdout)
        assert why in mechanism and why in native, (state, done.stdout)


RECORD = 'echo "$LD_PRELOAD" > "$OUT/env-$HARDY_RUN_INDEX"; grep -F hardy-preload /proc/$$/maps > "$OUT/maps-$HARDY_RUN_INDEX"'


def test_repeat_preloads_a_private_copy_never_the_cache_folders_file_and_removes_it(tmp_path):
    """Each run of `hardy repeat` execs afresh and loads LD_PRELOAD by path: the path must be one
    nobody else can change (a copy in a private temporary folder), gone when repeat ends."""
    temp, out, cache = tmp_path / "temp", tmp_path / "out", tmp_path / "cache"
    temp.mkdir(mode=0o700)
    out.mkdir()
    done = victim(f"""
        from hardy.doctor.repeat import repeat
        report = repeat(["sh", "-c", {RECORD!r}], n=2)
        print(report.native, [r.outcome for r in report.runs])
    """, cache, TMPDIR=str(temp), OUT=str(out))
    assert done.stdout.strip() == "['success', 'success']", done.stdout + done.stderr
    for i in (1, 2):
        preload = (out / f"env-{i}").read_text().split()[0]
        assert preload.startswith(f"{temp}/hardy-preload-") and not preload.startswith(str(cache)), preload
        assert preload in (out / f"maps-{i}").read_text()  # loaded: each run has the handler
    assert (cache / "hardy" / "native" / f"preload-{TAG}.so").exists()  # built there, copied from there
    assert os.listdir(temp) == []


def test_ctrl_c_ends_repeats_runs_and_leaves_no_temporary_folder(tmp_path):
    """Ctrl-C while a run lives: the runs (in sessions of their own, out of a terminal's reach) are
    ended, and the private copy of the handler is removed before repeat gives up."""
    temp, out = tmp_path / "temp", tmp_path / "out"
    temp.mkdir(mode=0o700)
    out.mkdir()
    environ = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": SRC, "TMPDIR": str(temp),
               "OUT": str(out)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        from hardy.doctor.repeat import repeat
        repeat(["sh", "-c", 'echo $$ > "$OUT/started.tmp"; mv "$OUT/started.tmp" "$OUT/started"; exec sleep 600'],
               n=3)
    """)], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = None
    try:
        deadline = time.monotonic() + 120  # a liveness bound: the first run starts in well under a second
        while not (out / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        run = int((out / "started").read_text())
        assert os.listdir(temp) != []  # the private copy, while the run lives
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)  # (a liveness bound too)
        left = _running(run)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if run is not None:
            try:
                os.killpg(run, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert "KeyboardInterrupt" in err, err
    assert os.listdir(temp) == []
    assert not left  # the run was ended, not left behind in its own session


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

# Tests rewrite a module and run it again within the same second. Python's own bytecode cache
# checks a source by its mtime (to the second) and size, so a same-sized edit would run the old
# code from __pycache__: a stale .pyc, not what these tests examine (hardy's code fingerprints).
# Every process the tests start inherits this.
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"


def _refuse_outside(pid: int) -> object:
    if os.getpid() != pid:
        raise RuntimeError("this object only exists in the process that made it")
    return Unloadable()


class Unloadable:
    """Pickles fine in the worker; unpickling it anywhere else raises (like a handle to a local GPU)."""

    def __reduce__(self):
        return _refuse_outside, (os.getpid(),)


NATIVE_SOURCE = r"""
#include <signal.h>
#include <stddef.h>

/* Spins forever inside C: no Python bytecode runs, so only killing the process stops it. */
void spin_forever(void) { volatile unsigned long x = 0; for (;;) { x++; } }

/* Returns normally; the crash comes later, when the process exits and destructors run
   (seed 000: a segfault during clean-up, after the work was done). */
int work_then_crash_at_exit(int x) { return x * 2; }

__attribute__((destructor)) static void crash_on_unload(void) {
    volatile int *p = NULL;
    *p = 42;
}
"""


def build_library(folder: Path, name: str, source: str, *flags: str) -> Path:
    """A real ELF shared library `folder/name`, compiled from C `source` with gcc (`flags`: more of
    its options, -O0 unless one is given)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("gcc is needed to build the test's native library")
    src = folder / f"{name}.c"
    src.write_text(source)
    lib = folder / name
    optimised = [f for f in flags if f.startswith("-O")] or ["-O0"]
    subprocess.run([cc, *optimised, "-shared", "-fPIC", *(f for f in flags if not f.startswith("-O")), "-o",
                    str(lib), str(src)], check=True)
    return lib


@pytest.fixture(scope="session")
def native_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ELF shared library, compiled with gcc for the test run."""
    return build_library(tmp_path_factory.mktemp("native"), "libcrashy.so", NATIVE_SOURCE)


@pytest.fixture
def in_process_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelines made without an engine run in this process (the default runs them in worker
    processes): for modules that test rules of their own (the cache's counters and warnings, node
    events with their inputs) which the calling process observes directly. Each such module says
    so with `pytestmark = pytest.mark.usefixtures("in_process_default")`; what the same features
    do in worker processes is tested beside the workers."""
    import hardy.pipeline
    from hardy import Engine
    monkeypatch.setattr(hardy.pipeline, "_DEFAULT_ENGINE", Engine(map_executor="sequential"))


def needs_torch() -> None:
    """Skip without torch. Never imports it here: torch's OpenMP pool would be a fork hazard in
    this test process for every test that follows (those that use torch run it in a subprocess)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0)")

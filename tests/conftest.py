from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

# A suite started in the background by a non-interactive shell (`pytest &`, a CI step's `&`)
# inherits SIGINT ignored, and so would every script a Ctrl-C test starts: Python installs its
# KeyboardInterrupt handler only where SIGINT is not ignored. A handler here is reset to the
# default in each child at exec, so those scripts get Ctrl-C as a terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Tests rewrite a module and run it again within the same second. Python's own bytecode cache
# checks a source by its mtime (to the second) and size, so a same-sized edit would run the old
# code from __pycache__: a stale .pyc, not what these tests examine (hardy's code fingerprints).
# Every process the tests start inherits this.
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"

# Every process the test run starts carries this mark in its environment, also one that left the
# run's process group and session (hardy's workers call setsid) or was reparented to init when
# its parent died: how `leaves_nothing` tells them from the machine's other processes.
RUN_MARK = "HARDY_TEST_RUN"
GRACE = 15.0  # seconds a process or folder has to go away after the last test (dying workers, a closing server)
if RUN_MARK not in os.environ:  # the test run itself (a process it starts may import this module too)
    os.environ[RUN_MARK] = uuid.uuid4().hex
    # The run's temporary files go to a folder of its own (TMPDIR, inherited by every process it
    # starts), so that what is left there is this run's, whatever else the machine runs at the
    # same time; pytest's own tmp_path folders stay where they were. Writable by all, sticky, as
    # /tmp is: tests run processes as a second user.
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    os.environ["TMPDIR"] = tempfile.tempdir = tempfile.mkdtemp(prefix="hardy-test-run-")
    os.chmod(os.environ["TMPDIR"], 0o1777)
RUN_TMP = os.environ["TMPDIR"]


def _ours(process: psutil.Process, pgid: int) -> bool:
    try:
        if process.ppid() == os.getpid() and "multiprocessing.resource_tracker" in " ".join(process.cmdline()):
            return False  # multiprocessing's, of this process: it ends as this process closes its pipe
        return process.status() != psutil.STATUS_ZOMBIE and (
            os.getpgid(process.pid) == pgid or process.environ().get(RUN_MARK) == os.environ[RUN_MARK])
    except (psutil.Error, OSError):
        return False


def _left(before: set[int]) -> tuple[list[psutil.Process], list[str]]:
    """The processes this run started that are still alive, and hardy's temporary files it left."""
    pgid, me = os.getpgid(0), os.getpid()
    alive = [p for p in psutil.process_iter() if p.pid not in before and p.pid != me and _ours(p, pgid)]
    return alive, sorted(str(f) for f in Path(RUN_TMP).rglob("hardy-*"))


@pytest.fixture(scope="session", autouse=True)
def leaves_nothing():
    """Fails the suite if a test leaves a process behind (by process group, and by the run's mark
    for one that left the group and session or lost its parent) or one of hardy's temporary
    files; then ends what it found and removes the run's temporary folder, so that nothing
    outlives the run either way. hardy's own servers and workers, which this process holds until
    it exits, are stopped first."""
    before = {p.pid for p in psutil.process_iter()}
    yield
    from hardy.workers import launch
    launch._stop_everything()  # what this process would stop at its exit
    deadline = time.monotonic() + GRACE
    alive, stale = _left(before)
    while (alive or stale) and time.monotonic() < deadline:
        time.sleep(0.2)
        alive, stale = _left(before)
    said = []
    for p in alive:
        try:
            said.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.Error:
            pass
    shutil.rmtree(RUN_TMP, ignore_errors=True)  # with what other tools left there (Ray's sessions)
    assert not said and not stale, f"the tests left processes {said} and folders {stale}"


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
    import hardy.api.pipeline
    from hardy import Engine
    monkeypatch.setattr(hardy.api.pipeline, "_DEFAULT_ENGINE", Engine(map_executor="sequential"))


# The fast loop, `python -m pytest -m fast` (CONTRIBUTING.md): the tests of these files, the core
# of hardy (the API, plans, the executors and worker processes, crash handling, the cache, the
# layering rules), less those marked slow. Every other file runs in the whole suite, or by name.
CORE = frozenset({
    "test_pipeline.py", "test_errors.py", "test_execution.py", "test_plan_source.py", "test_policy.py",
    "test_streaming.py", "test_hypernodes_compat.py", "test_system.py", "test_layering.py",
    "test_workers.py", "test_calls.py", "test_containment.py", "test_lifecycle.py", "test_exits.py",
    "test_transport.py", "test_outcomes.py", "test_same_answer.py",
    "test_forensics.py", "test_fault_record.py", "test_thread_crashes.py", "test_bad_items.py",
    "test_cache.py", "test_cache_keys.py", "test_cache_code_kinds.py", "test_cache_code_edits.py",
    "test_cache_faults.py", "test_cache_mmap.py", "test_cache_trust.py", "test_cache_collisions.py",
    "test_cache_distributions.py", "test_settings_keys.py", "test_shipped_exceptions.py", "test_input_keys.py",
})


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in CORE and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)


CLUSTERS = ("dask", "ray", "daft")


def executors(*names: str) -> list:
    """`names` to parametrize a test over, those that start a Dask, Ray or Daft cluster marked slow:
    `-m "not slow"` and the fast loop run the test on the others."""
    return [pytest.param(n, marks=pytest.mark.slow) if n.split("-")[0] in CLUSTERS else n for n in names]


def engine_named(name: str) -> Any:
    """A fresh engine on the executor `executors` names: the three in-process ones, "process",
    or one on a Dask, Ray or Daft cluster (skipped where its extra is not installed)."""
    from hardy import Engine
    if name in ("sequential", "threaded", "async", "process"):
        return Engine(map_executor=name, workers=2)
    if name == "dask":
        pytest.importorskip("distributed")
        from hardy.integrations.dask import DaskExecutor
        return Engine(map_executor=DaskExecutor(workers=2))
    if name == "ray":
        pytest.importorskip("ray")
        from hardy.integrations.ray import RayExecutor
        return Engine(map_executor=RayExecutor(workers=2))
    pytest.importorskip("daft")
    from hardy.integrations.daft import daft_engine
    return daft_engine()


def needs_torch() -> None:
    """Skip without torch. Never imports it here: torch's OpenMP pool would be a fork hazard in
    this test process for every test that follows (those that use torch run it in a subprocess)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0)")

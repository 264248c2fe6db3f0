"""Native crash forensics with real crashes and hangs in gcc-built libraries (and one in torch):
the library and function a worker died in, its native stack, every thread's stack of a hung
worker, and what those frames say about the hazards hardy knows."""

from __future__ import annotations

import ctypes
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import needs_torch
from hardy import DiskCache, Engine, NodeCrashed, NodeTimeout, Pipeline, node
from hardy.crash import frames, handler, record, stacks, symbols
from hardy.errors import InvalidArgument, InvalidArgumentType, install_hint
from hardy.native.loaded import loaded_libraries

C_SOURCE = r"""
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

/* static: only the library's .symtab names it (dladdr sees exported symbols only) */
__attribute__((noinline)) static int crash_inner(volatile int *p) { return *p + 1; }
int crash_here(long address) { return crash_inner((volatile int *)address) * 2; }
void check_or_abort(int ok) { if (!ok) abort(); }
__attribute__((noinline)) static void inner_wait(void) { for (;;) sleep(1); }
void hang_here(void) { inner_wait(); }
static void *crash_later(void *arg) { (void)arg; usleep(200000); crash_inner(NULL); return NULL; }
void start_crashing_thread(void) { pthread_t t; pthread_create(&t, NULL, crash_later, NULL); pthread_detach(t); }
"""

CPP_SOURCE = r"""
namespace geo {
template <class T> __attribute__((noinline)) T area(const T *side) { return side[0] * side[1]; }
}
extern "C" float crash_cpp(void) { return geo::area<float>((const float *)0); }
"""

OMP_SOURCE = r"""
double parallel_sum(int n) {
    double s = 0;
    #pragma omp parallel for num_threads(4) reduction(+:s)
    for (int i = 0; i < n; i++) s += i * 0.5;
    return s;
}
"""


def _compile(folder: Path, name: str, source: str, *flags: str, suffix: str = ".c") -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("gcc is needed to build the crashing libraries of these tests")
    src = folder / f"{name}{suffix}"
    src.write_text(source)
    lib = folder / name
    subprocess.run([cc, "-O1", "-shared", "-fPIC", *flags, "-o", str(lib), str(src)], check=True)
    return str(lib)


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("forensics")
    twin_a, twin_b = folder / "a", folder / "b"
    twin_a.mkdir()
    twin_b.mkdir()
    return {
        "c": _compile(folder, "libforensic.so", C_SOURCE, "-pthread"),
        "cpp": _compile(folder, "libgeo.so", CPP_SOURCE, suffix=".cc"),
        "cuda": _compile(folder, "libcublasLt.so.12", C_SOURCE, "-pthread"),  # a crash inside "cuBLAS"
        "twin_a": _compile(twin_a, "libtwin.so", C_SOURCE, "-pthread"),
        "twin_b": _compile(twin_b, "libtwin.so", C_SOURCE, "-pthread"),
        "omp": _compile(folder, "libompsum.so", OMP_SOURCE, "-fopenmp"),
    }


@pytest.fixture(scope="module")
def engine():
    e = Engine(map_executor="process", workers=1)
    yield e
    e.close()


@node(output_name="y")
def call_native(x: int, lib: str, function: str) -> int:
    if x == 1:
        getattr(ctypes.CDLL(lib), function)(0)
    return x


def _crash(engine: Engine, lib: str, function: str) -> NodeCrashed:
    out = Pipeline(nodes=[call_native], engine=engine).map(
        inputs={"x": [0, 1, 2], "lib": lib, "function": function}, map_over="x", on_error="continue")
    assert out[0] == {"y": 0} and out[2] == {"y": 2}
    err = out[1].error
    assert isinstance(err, NodeCrashed)
    return err


def test_a_segfault_names_the_library_and_the_static_function(engine, libs):
    assert handler.mechanism()[0] == "native"  # gcc is here: the compiled handler
    err = _crash(engine, libs["c"], "crash_here")
    first = str(err).splitlines()[0]
    assert "worker died from SIGSEGV in libforensic.so (crash_inner+0x" in first, first
    assert "called from node 'call_native' (test_forensics.py:" in first, first
    names = [f.function for f in err.native_frames[:2]]
    assert names == ["crash_inner", "crash_here"], err.native_frames
    assert err.native_frames[0].library == libs["c"] and err.native_frames[0].offset > 0
    assert "worker's native stack at the crash:\n  #0 libforensic.so +0x" in str(err)


def test_an_abort_is_named_by_the_library_that_called_it_not_libc(engine, libs):
    err = _crash(engine, libs["c"], "check_or_abort")
    first = str(err).splitlines()[0]
    assert "SIGABRT in libforensic.so (check_or_abort+0x" in first, first
    assert err.native_frames[0].name.startswith("libc.so")  # abort() itself is libc's


def test_cpp_names_are_demangled(engine, libs):
    err = _crash(engine, libs["cpp"], "crash_cpp")
    assert "in libgeo.so (float geo::area<float>(float const*)+0x" in str(err).splitlines()[0], str(err)


def test_a_crash_in_a_cuda_library_gets_the_cuda_advice(engine, libs):
    err = _crash(engine, libs["cuda"], "crash_here")
    assert "SIGSEGV in libcublasLt.so.12 (crash_inner" in str(err)
    assert any("inside the CUDA stack (libcublasLt.so.12" in d and "CUDA_LAUNCH_BLOCKING=1" in d
               for d in err.diagnosis), err.diagnosis


def test_a_library_loaded_from_another_directory_than_here_is_named(engine, libs):
    ctypes.CDLL(libs["twin_a"])  # this process has a/libtwin.so; the node loads b/libtwin.so
    err = _crash(engine, libs["twin_b"], "crash_here")
    said = [d for d in err.diagnosis if d.startswith("libtwin.so was loaded from")]
    assert said and os.path.dirname(libs["twin_b"]) in said[0] and os.path.dirname(libs["twin_a"]) in said[0]
    assert not any("loaded from" in d for d in _crash(engine, libs["c"], "crash_here").diagnosis)


def test_two_copies_are_named_when_the_worker_loaded_a_sonames_link(engine, tmp_path):
    """This process's libraries are read from its memory map, which names files by their real
    path: a worker that loaded `libsoname.so.1` (a link to `libsoname.so.1.0`) names the same one."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    ctypes.CDLL(_compile(here, "libsoname.so.1.0", C_SOURCE, "-pthread"))
    _compile(there, "libsoname.so.1.0", C_SOURCE, "-pthread")
    (there / "libsoname.so.1").symlink_to("libsoname.so.1.0")
    err = _crash(engine, str(there / "libsoname.so.1"), "crash_here")
    said = [d for d in err.diagnosis if " was loaded from " in d]
    assert said and f"from {there} in the worker but from {here} in this process" in said[0], err.diagnosis



def test_two_builds_of_one_soname_are_named_as_two_copies(engine, tmp_path):
    """The classic mix: an environment's libstdc++.so.6 (6.0.32) here, the system's (6.0.30) in the
    worker. Their files' names differ; the library is one, up to its major version."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    _compile(here, "libbuilds.so.1.0", C_SOURCE, "-pthread")
    (here / "libbuilds.so.1").symlink_to("libbuilds.so.1.0")
    ctypes.CDLL(str(here / "libbuilds.so.1"))
    _compile(there, "libbuilds.so.1.1", C_SOURCE, "-pthread")
    (there / "libbuilds.so.1").symlink_to("libbuilds.so.1.1")
    err = _crash(engine, str(there / "libbuilds.so.1"), "crash_here")
    said = [d for d in err.diagnosis if " was loaded from " in d]
    assert said and f"from {there} in the worker but from {here} in this process" in said[0], err.diagnosis

def test_the_loaded_libraries_are_listed_by_real_path_even_once_removed(tmp_path):
    folder = tmp_path / "a folder"
    folder.mkdir()
    lib = _compile(folder, "liblisted.so.2.1", C_SOURCE, "-pthread")
    (folder / "liblisted.so.2").symlink_to("liblisted.so.2.1")
    ctypes.CDLL(str(folder / "liblisted.so.2"))
    assert lib in loaded_libraries()
    os.unlink(lib)  # mapped still: " (deleted)" in the map
    assert lib in loaded_libraries() and loaded_libraries().count(lib) == 1


@node(output_name="y")
def jit_crash(x: int) -> int:
    import numba
    import numpy as np

    @numba.njit(boundscheck=False)
    def scribble(a):
        a[1 << 40] = 1.0  # far outside the array: a segfault inside JIT-compiled code
        return a[0]
    return int(scribble(np.zeros(2))) if x == 1 else x


def test_a_frame_in_jit_code_says_so(engine):
    out = Pipeline(nodes=[jit_crash], engine=engine).map(inputs={"x": [0, 1]}, map_over="x", on_error="continue")
    err = out[1].error
    assert err.native_frames[0].library == ""
    assert "SIGSEGV in JIT-compiled code (no library: numba" in str(err).splitlines()[0], str(err)


@node(output_name="y")
def torch_sum(x: int) -> float:
    import numpy as np
    import torch
    t = torch.ones(4)
    if x == 1:  # strides far outside the buffer, which numpy does not check: torch's kernel reads there
        t = torch.from_numpy(np.lib.stride_tricks.as_strided(np.ones(4, np.float32), (1 << 20,), (1 << 22,)))
    return float(t.sum())


@pytest.mark.slow
def test_a_crash_inside_a_torch_kernel_is_named(engine):
    needs_torch()
    out = Pipeline(nodes=[torch_sum], engine=engine).map(inputs={"x": [0, 1]}, map_over="x", on_error="continue")
    assert out[0] == {"y": 4.0}
    first = str(out[1].error).splitlines()[0]
    assert "SIGSEGV in libtorch_cpu.so (" in first and "at::native::" in first, first


def test_without_a_compiler_the_ctypes_handler_names_the_crash(tmp_path, libs):
    script = tmp_path / "nocc.py"
    script.write_text(textwrap.dedent(f"""
        import ctypes
        from hardy import Engine, Pipeline, node
        from hardy.crash import handler
        print(handler.mechanism())

        @node(output_name="y")
        def embed(x: int) -> int:
            if x == 1:
                ctypes.CDLL({libs["c"]!r}).crash_here(0)
            return x

        out = Pipeline(nodes=[embed], engine=Engine(map_executor="process", workers=1)).map(
            inputs={{"x": [0, 1, 2]}}, map_over="x", on_error="continue")
        print(out[0], out[2])
        print(out[1].error)
    """))
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update(PATH=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"))  # no cc, no gcc, no built handler
    run = subprocess.run([sys.executable, "-"], stdin=script.open(), capture_output=True, text=True, env=env,
                         timeout=120)
    lines = run.stdout.splitlines()
    assert lines[0] == "('ctypes', 'no C compiler found ($CC, cc, gcc)')", run.stdout + run.stderr
    assert lines[1] == "{'y': 0} {'y': 2}"
    assert "worker died from SIGSEGV in libforensic.so (crash_inner+0x" in lines[2], run.stdout
    assert not (tmp_path / "cache" / "hardy" / "native").exists() or not list((tmp_path / "cache").rglob("*.so"))


def test_a_handler_others_may_write_is_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path, why = handler.build()
    assert path is not None and why == "" and Path(path).stat().st_mode & 0o077 == 0
    os.chmod(path, 0o777)
    assert handler.build() == (None, f"{path} or its folder is not this user's own (or others may write it): "
                                     "not loaded; remove it")
    os.chmod(path, 0o700)
    os.chown(path, 65534, 65534)  # another user's file
    assert handler.build()[0] is None
    os.chown(path, os.getuid(), os.getgid())
    assert handler.build() == (path, "")


def test_a_handler_built_from_another_source_is_not_loaded(tmp_path):
    """A library under this source's name that lacks one of its functions (built from another
    source, as a build that raced an upgrade of hardy could leave it) is not loaded: workers fall
    back to the ctypes handler and a map runs. Before, the missing function ended the fork server,
    and every map failed saying a preload= module crashed."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    built = subprocess.run([sys.executable, "-c", "from hardy.crash import handler; print(handler.build()[0])"],
                           capture_output=True, text=True, env=env, timeout=120)
    path = Path(built.stdout.strip())
    assert path.exists(), built.stdout + built.stderr
    other = tmp_path / "other.c"
    other.write_text("int hardy_native_install(int fd, const int *s, int n) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(other)], check=True)
    os.chmod(path, 0o700)
    run = subprocess.run([sys.executable, "-"], input=textwrap.dedent("""
        from hardy import Engine, Pipeline, node
        from hardy.crash import handler

        @node(output_name="y")
        def double(x):
            return 2 * x

        kind, why = handler.mechanism()
        print(kind, "cannot be loaded" in why and "hardy_native_remember" in why)
        print(Pipeline(nodes=[double], engine=Engine(map_executor="process", workers=1)).map(
            inputs={"x": [1, 2]}, map_over="x"))
    """), capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == ["ctypes True", "[{'y': 2}, {'y': 4}]"], run.stdout + run.stderr


def test_symbols_are_read_from_the_symtab_and_cached(libs):
    text = "\n".join(["hardy-native: signal 0xb",
                      f"hardy-native: 0x{0x10000 + 0x1000:x} 0x10000 0x0 ? {libs['c']}",
                      "hardy-native: 0x1234 0x0 0x0 ? ?"])
    frames = record.parse(text).frames
    assert frames[0].library == libs["c"] and frames[0].offset == 0x1000
    assert frames[1].library == "" and "JIT" in str(frames[1])
    assert symbols.table(libs["c"]) is symbols.table(libs["c"])  # one read per build-id
    assert symbols.demangle("_ZN3geo4areaIfEET_PKS1_") == "float geo::area<float>(float const*)"
    assert symbols.demangle("crash_here") == "crash_here"


@node(output_name="y", timeout=1)
def hang(x: int, lib: str) -> int:
    if x == 1:
        ctypes.CDLL(lib).hang_here()
    return x


@pytest.mark.slow  # py-spy
def test_a_hung_worker_s_stacks_come_from_py_spy(engine, libs):
    if stacks.py_spy() is None:
        pytest.skip("py-spy is not installed (pip install py-spy)")
    out = Pipeline(nodes=[hang], engine=engine).map(inputs={"x": [0, 1, 2], "lib": libs["c"]}, map_over="x",
                                                    on_error="continue")
    assert out[0] == {"y": 0} and out[2] == {"y": 2}
    err = out[1].error
    assert isinstance(err, NodeTimeout)
    assert err.stacks.startswith("py-spy dump --native"), err.stacks
    assert "inner_wait (libforensic.so)" in err.stacks and "hang (test_forensics.py:" in err.stacks
    assert "worker's stacks before the kill:\npy-spy" in str(err)


def test_without_py_spy_the_python_stacks_say_why(engine, libs, monkeypatch):
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    out = Pipeline(nodes=[hang], engine=engine).map(inputs={"x": [1], "lib": libs["c"]}, map_over="x",
                                                    on_error="continue")
    err = out[0].error
    assert err.stacks.startswith("faulthandler, Python frames only (py-spy is not installed"), err.stacks
    assert "in hang" in err.stacks


@pytest.mark.slow  # py-spy
def test_a_hang_in_openmp_after_a_fork_is_named(tmp_path, libs):
    if stacks.py_spy() is None:
        pytest.skip("py-spy is not installed (pip install py-spy)")
    script = tmp_path / "forkomp.py"
    script.write_text(textwrap.dedent(f"""
        import ctypes, warnings
        from hardy import Engine, Pipeline, node
        warnings.simplefilter("ignore")
        lib = ctypes.CDLL({libs["omp"]!r})
        lib.parallel_sum.restype = ctypes.c_double
        lib.parallel_sum(1000)  # this process's OpenMP pool now has threads

        @node(output_name="y", timeout=2)
        def total(x: int) -> float:
            f = ctypes.CDLL({libs["omp"]!r}).parallel_sum
            f.restype = ctypes.c_double
            return f(1000 + x)

        engine = Engine(map_executor="process", workers=1, start_method="fork!")
        out = Pipeline(nodes=[total], engine=engine).map(inputs={{"x": [1]}}, map_over="x", on_error="continue")
        print(out[0].error)
    """))
    run = subprocess.run([sys.executable, "-"], stdin=script.open(), capture_output=True, text=True, timeout=120)
    assert "node ran past its timeout of 2 s" in run.stdout, run.stdout + run.stderr
    assert "diagnosis: waits in an OpenMP barrier or lock: the fork-after-OpenMP hazard" in run.stdout, run.stdout


@node(output_name="y")
def leaves_a_crashing_thread(x: int, lib: str) -> int:
    ctypes.CDLL(lib).start_crashing_thread()
    return x


def test_a_crash_after_the_node_returned_keeps_the_result_and_names_the_library(libs, caplog):
    with Engine(map_executor="process", workers=1) as e:
        p = Pipeline(nodes=[leaves_a_crashing_thread], engine=e)
        assert p.map(inputs={"x": [5], "lib": libs["c"]}, map_over="x") == [{"y": 5}]
        import time
        time.sleep(1.0)  # the library's thread crashes the idle worker
        with caplog.at_level("WARNING", logger="hardy.workers"):
            assert p.map(inputs={"x": [6], "lib": libs["c"]}, map_over="x") == [{"y": 6}]
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "died while idle" in said and "crash at exit: the node had returned and its results were kept" in said
    assert "libforensic.so (crash_inner+0x" in said, said


def test_repeat_keeps_the_native_and_python_stack_of_a_crashing_run(tmp_path, libs):
    from hardy.doctor.repeat import repeat
    script = tmp_path / "crashy.py"
    script.write_text(f"import ctypes\n\ndef parse():\n    ctypes.CDLL({libs['c']!r}).crash_here(0)\n\nparse()\n")
    report = repeat([sys.executable, str(script)], n=2, logs=tmp_path / "logs")
    assert report.failures == 2 and report.native == ""
    run = report.runs[0]
    assert run.crashed_in.startswith("libforensic.so (crash_inner+0x"), run
    assert run.native_stack.startswith("  #0 libforensic.so +0x") and "(crash_here+0x" in run.native_stack
    assert run.python_stack.startswith("Fatal Python error: Segmentation fault")
    assert 'crashy.py", line 4 in parse' in run.python_stack
    log = Path(run.log).read_text()
    assert 'crashy.py", line 4 in parse' in log and "--- native stack (in libforensic.so (crash_inner+0x" in log
    # the command line: each failing run names the function, the first one's stacks follow
    cli = subprocess.run([sys.executable, "-m", "hardy.cli", "repeat", "-n", "2", "--", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120)
    lines = cli.stdout.splitlines()
    assert cli.returncode == 1 and "SIGSEGV" in lines[0] and "in libforensic.so (crash_inner+0x" in lines[0], cli.stdout
    assert lines[2].startswith("run 1 (SIGSEGV) died in libforensic.so (crash_inner+0x") and lines[3] == "native stack:"
    assert 'crashy.py", line 4 in parse' in cli.stdout
    # without the handler: the Python stack only, and the output says why
    plain = repeat([sys.executable, str(script)], n=1, native=False)
    assert plain.runs[0].crashed_in == "" and plain.runs[0].native_stack == "" and plain.native == "native frames off"
    assert 'line 4 in parse' in plain.runs[0].python_stack


def test_doctor_says_whether_native_frames_and_hang_stacks_work_here(monkeypatch, tmp_path):
    from hardy.doctor.checkup import examine_forensics
    found = [f.message for f in examine_forensics()]
    assert found[0] == "native frames of crashes: the compiled handler is installed in workers"
    if stacks.py_spy() is not None:
        assert found[1].startswith("stacks of hung items: py-spy")
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    assert install_hint("forensics") in examine_forensics()[1].message
    assert found[2] == (f"hardy replay --gdb: gdb is {shutil.which('gdb')}" if shutil.which("gdb") else
                        "hardy replay --gdb: gdb is not installed (optional: apt-get install gdb, dnf install gdb)")
    run = subprocess.run([sys.executable, "-m", "hardy.cli", "doctor", "--json"], capture_output=True, text=True,
                         env={**{k: v for k, v in os.environ.items() if k != "CC"}, "PATH": str(tmp_path),
                              "XDG_CACHE_HOME": str(tmp_path)}, timeout=120)
    import json
    said = [f for f in json.loads(run.stdout)["findings"] if f["topic"] == "forensics"]
    assert said[0]["severity"] == "warning" and "the ctypes fallback (no C compiler found" in said[0]["message"]


@node(output_name="y")
def crash_on(x: int, lib: str, counter: str) -> int:
    """Crashes on item 3; with a counter file, only on every other call (a flaky crash)."""
    if x == 3:
        calls = 1
        if counter:
            with open(counter, "a+") as f:
                f.write(".")
                f.seek(0)
                calls = len(f.read())
        if calls % 2 == 1:
            ctypes.CDLL(lib).crash_here(0)
    return x


def _failed_map(tmp_path: Path, lib: str, counter: str = "", cache: DiskCache | None = None) -> Path:
    with Engine(map_executor="process", workers=1, report_dir=tmp_path / "reports") as e:
        out = Pipeline(nodes=[crash_on], engine=e, name="embed", cache=cache).map(
            inputs={"x": list(range(5)), "lib": lib, "counter": counter}, map_over="x", on_error="continue")
    assert [o["y"] for i, o in enumerate(out) if i != 3] == [0, 1, 2, 4]
    (report,) = (tmp_path / "reports").glob("*.json")
    return report


def _replay(report: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hardy.cli", "replay", str(report), *args], capture_output=True,
                          text=True, timeout=180)


def test_replay_runs_a_failed_item_again_and_tells_a_deterministic_crash(tmp_path, libs):
    import json
    report = _failed_map(tmp_path, libs["c"])
    (failure,) = json.loads(report.read_text())["failures"]
    assert failure["item"] == 3 and failure["kept_inputs"] == f"{report.stem}.inputs/item-3.pkl"
    kept = report.parent / failure["kept_inputs"]
    assert kept.stat().st_mode & 0o777 == 0o600
    run = _replay(report, "--item", "3", "--repeat", "3")
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "item 3 of pipeline 'embed', 3 run(s), each in a fresh worker: SIGSEGV, SIGSEGV, SIGSEGV"
    assert "SIGSEGV in libforensic.so (crash_inner+0x" in lines[1]
    assert "worker's native stack at the crash:" in run.stdout and "in crash_on" in run.stdout
    assert lines[-1] == "failed 3 of 3 run(s): 100% (95% CI 44%-100%): deterministic"


def test_replay_of_a_cached_map_runs_the_item_with_its_own_inputs(tmp_path, libs):
    """A cached map's items carry their inputs' cache keys beside the inputs (hashed once per map, or
    ahead of the items by a shared cache's read-ahead): replay runs the item on its inputs alone."""
    report = _failed_map(tmp_path, libs["c"], cache=DiskCache(tmp_path / "cache", secret="s"))
    run = _replay(report, "--item", "3")
    assert run.stdout.splitlines()[-1] == "failed 1 of 1 run(s): 100% (95% CI 21%-100%)", run.stdout + run.stderr


def test_replay_tells_a_flaky_crash(tmp_path, libs):
    counter = tmp_path / "calls"
    report = _failed_map(tmp_path, libs["c"], str(counter))
    run = _replay(report, "--item", "3", "--repeat", "4")
    last = run.stdout.splitlines()[-1] if run.stdout else run.stderr
    assert last.startswith("failed 2 of 4 run(s): 50% (95% CI ") and last.endswith(": flaky"), run.stdout


HEAD = len(b"hardy-replay-2\n") + 16  # a kept input's magic line and signature


class _Marker:
    """Unpickling it creates a file: proof that a refused kept input was never unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
    """`command` as another real user (uid 65534), with the standard library only."""
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command],
                          capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})


@pytest.fixture
def shared_folder():
    """A folder everybody may write, as a team's report directory on a shared disk (/tmp-like, sticky)."""
    import tempfile
    folder = tempfile.mkdtemp(prefix="team-reports-")
    os.chmod(folder, 0o1777)
    yield Path(folder)
    shutil.rmtree(folder)


@pytest.mark.slow  # a second uid
def test_replay_refuses_kept_inputs_it_cannot_trust(tmp_path, libs, shared_folder):
    from hardy.crash import kept
    report = _failed_map(tmp_path, libs["c"])
    path = kept.folder_of(report) / "item-3.pkl"
    assert _replay(report, "--item", "2").stderr.startswith("hardy replay: no kept inputs for item 2")
    assert "(the items kept there: 3)" in _replay(report, "--item", "2").stderr
    data = path.read_bytes()
    marker = tmp_path / "unpickled"
    evil = pickle.dumps({"sys_path": [], "cwd": "/"}) + pickle.dumps(_Marker(str(marker)))
    path.write_bytes(data[:HEAD] + evil)  # a real signature, another body
    run = _replay(report, "--item", "3")
    assert run.returncode == 2 and "is not signed with this user's key" in run.stderr, run.stderr
    assert not marker.exists()
    path.write_bytes(data)
    os.chmod(path.parent, 0o777)  # others may write the folder: they could swap the file
    run = _replay(report, "--item", "3")
    assert run.returncode == 2 and "hardy replay folder" in run.stderr and "is writable by others (mode 777)" \
        in run.stderr, run.stderr
    os.chmod(path.parent, 0o700)
    assert _replay(report, "--item", "3").returncode == 1  # trusted again: it runs (and crashes)

    # another real user puts a report and its "kept input" where this user will look: refused unread
    theirs = shared_folder / "embed.json"
    done = _as_nobody(sys.executable, "-I", "-c", "import os\n"
                      f"open({str(theirs)!r}, 'w').write({report.read_text()!r})\n"
                      f"os.makedirs({str(kept.folder_of(theirs))!r}, mode=0o755)\n"
                      f"open({str(kept.folder_of(theirs) / 'item-3.pkl')!r}, 'wb').write({data[:HEAD] + evil!r})\n")
    assert done.returncode == 0, done.stderr
    run = _replay(theirs, "--item", "3")
    assert run.returncode == 2 and "hardy replay folder" in run.stderr and "belongs to nobody (uid 65534)" in \
        run.stderr, run.stderr
    assert not marker.exists()

    # the same bytes read under another user's key (their own $XDG_STATE_HOME/hardy/cache.key; hardy's
    # packages are not readable by uid 65534 here, so this side runs as this uid): not verified
    run = subprocess.run([sys.executable, "-m", "hardy.cli", "replay", str(report), "--item", "3"],
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "someone-else")})
    assert run.returncode == 2 and "is not signed with this user's key" in run.stderr, run.stderr


def test_keep_failed_inputs_without_a_report_dir(tmp_path, libs, monkeypatch, caplog):
    import json
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    folder = tmp_path / "state" / "hardy" / "reports"
    p = Pipeline(nodes=[crash_on], name="embed")
    inputs = {"x": list(range(5)), "lib": libs["c"], "counter": ""}
    with Engine(workers=1) as e:  # the default: no report directory, nothing kept
        p.map(inputs=inputs, map_over="x", on_error="continue", engine=e)
    assert not folder.exists()
    with Engine(workers=1, keep_failed_inputs=True) as e, caplog.at_level("WARNING", logger="hardy.report"):
        assert p.map(inputs={**inputs, "x": [0, 1]}, map_over="x", engine=e) == [{"y": 0}, {"y": 1}]
        assert not folder.exists()  # nothing failed: nothing written
        out = p.map(inputs=inputs, map_over="x", on_error="continue", engine=e)
    assert isinstance(out[3].error, NodeCrashed)
    (report,) = folder.glob("*.json")
    assert (folder.stat().st_mode & 0o777, folder.parent.stat().st_mode & 0o777) == (0o700, 0o700)
    (failure,) = json.loads(report.read_text())["failures"]
    assert failure["kept_inputs"] == f"{report.stem}.inputs/item-3.pkl"
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == f"inputs of 1 failed item(s) of pipeline 'embed' kept; run one again with: hardy replay " \
                   f"{report} --item 3"
    run = _replay(report, "--item", "3")
    assert run.returncode == 1 and "SIGSEGV in libforensic.so (crash_inner+0x" in run.stdout, run.stdout + run.stderr

    with Engine(workers=1, report_dir=tmp_path / "reports", keep_failed_inputs=False) as e:
        p.map(inputs=inputs, map_over="x", on_error="continue", engine=e)
    (report,) = (tmp_path / "reports").glob("*.json")
    assert "kept_inputs" not in json.loads(report.read_text())["failures"][0]
    assert not kept_folder(report).exists()
    with pytest.raises(InvalidArgumentType, match=r"Engine: keep_failed_inputs='yes' is not valid; "
                                                  r"keep_failed_inputs must be True or False\."):
        Engine(keep_failed_inputs="yes")


def kept_folder(report: Path) -> Path:
    from hardy.crash import kept
    return kept.folder_of(report)


def test_kept_inputs_are_capped_per_item_and_per_report(tmp_path, monkeypatch):
    from hardy.crash import kept
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    small = kept.keep(tmp_path / "probe.json", None, {0: {"x": b""}})
    assert small == {0: "probe.inputs/item-0.pkl"}
    size = (kept.folder_of(tmp_path / "probe.json") / "item-0.pkl").stat().st_size - HEAD
    monkeypatch.setattr(kept, "KEEP_LIMIT", size + 999)
    monkeypatch.setattr(kept, "KEEP_TOTAL", 2 * size + 1500)
    said = kept.keep(tmp_path / "r.json", None, {1: {"x": b"x" * 2000}, 2: {"x": b""}, 3: {"x": b"y" * 600},
                                                  4: {"x": b"z" * 900}})
    assert said[1].startswith("not kept: 1,0") and " bytes over the cap (" in said[1]
    assert said[1].endswith(f" bytes pickled; the cap is {size + 999:,} bytes per item)")
    assert said[2] == "r.inputs/item-2.pkl" and said[3] == "r.inputs/item-3.pkl"
    assert said[4].startswith("not kept: ") and said[4].endswith(
        f" bytes over the cap of {2 * size + 1500:,} bytes for one report's kept inputs (the items before it "
        "took the rest)")
    assert sorted(p.name for p in kept.folder_of(tmp_path / "r.json").iterdir()) == ["item-2.pkl", "item-3.pkl"]


@node(output_name="y")
def slow_in_c(x: int, lib: str) -> int:
    if x == 1:
        ctypes.CDLL(lib).spin_a_while(3)
    return x


@pytest.mark.slow  # py-spy, and an item left running on purpose
def test_a_long_running_item_has_its_stacks_logged_and_goes_on(tmp_path, libs, caplog):
    if stacks.py_spy() is None:
        pytest.skip("py-spy is not installed (pip install py-spy)")
    lib = _compile(tmp_path, "libslow.so", "#include <unistd.h>\nvoid spin_a_while(int s) { sleep(s); }\n")
    with Engine(map_executor="process", workers=1, stall_report=1) as e, \
            caplog.at_level("WARNING", logger="hardy.workers"):
        out = Pipeline(nodes=[slow_in_c], engine=e).map(inputs={"x": [0, 1, 2], "lib": lib}, map_over="x")
    assert out == [{"y": 0}, {"y": 1}, {"y": 2}]  # reported, not stopped
    said = [r.getMessage() for r in caplog.records if "stall_report=1 s" in r.getMessage()]
    assert len(said) == 1, said  # once per call
    assert said[0].startswith("item 1: node 'slow_in_c' has been running for ")
    assert "its stacks:\npy-spy dump --native" in said[0] and "spin_a_while (libslow.so)" in said[0]
    with pytest.raises(InvalidArgument, match=r"Engine: stall_report=0 is not valid; stall_report must be a "
                                              r"finite number of seconds > 0 or None \(no limit\)\."):
        Engine(stall_report=0)


def test_the_run_report_keeps_the_native_stack_and_the_diagnosis(tmp_path, libs):
    import json
    report = _failed_map(tmp_path, libs["cuda"])
    (failure,) = json.loads(report.read_text())["failures"]
    assert failure["stack"].startswith("native stack:\n  #0 libcublasLt.so.12 +0x")
    assert "Python stack:" in failure["stack"] and "in crash_on" in failure["stack"]
    assert any("inside the CUDA stack" in d for d in failure["diagnosis"])


@node(output_name="y", timeout=1)
def crash_or_hang(x: int, lib: str) -> int:
    if x == 1:
        ctypes.CDLL(lib).crash_here(0)
    if x == 2:
        ctypes.CDLL(lib).hang_here()
    return x


@pytest.fixture(scope="module")
def crash_and_hang_report(tmp_path_factory, libs) -> Path:
    """A run report whose item 1 crashed in a gcc-built library and item 2 hung in one."""
    folder = tmp_path_factory.mktemp("replay-tools")
    with Engine(workers=1, report_dir=folder) as e:
        out = Pipeline(nodes=[crash_or_hang], engine=e, name="embed").map(
            inputs={"x": [0, 1, 2], "lib": libs["c"]}, map_over="x", on_error="continue")
    assert isinstance(out[1].error, NodeCrashed) and isinstance(out[2].error, NodeTimeout)
    (report,) = folder.glob("*.json")
    return report


@pytest.mark.slow  # gdb
def test_replay_under_gdb_prints_the_native_backtrace_of_the_crash_and_of_the_hang(crash_and_hang_report, libs):
    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed (apt-get install gdb; .ci/run installs it)")
    run = _replay(crash_and_hang_report, "--item", "1", "--gdb")
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("item 1 of pipeline 'embed', run in one fresh process (pid ")
    assert 'received signal SIGSEGV, Segmentation fault.' in run.stdout
    frames = [ln for ln in lines if ln.startswith("#")]
    assert "in crash_inner () from " + libs["c"] in frames[0] and "in crash_here () from " in frames[1], frames
    listed = lines.index(next(ln for ln in lines if ln.startswith("From ") and "Shared Object Library" in ln))
    assert any(ln.endswith(libs["c"]) for ln in lines[listed:]), "info sharedlibrary lists the crashing library"
    assert lines[-1] == "under gdb: SIGSEGV: the backtrace above is the crash's"
    # a hang: stopped (SIGINT) past the node's timeout of 1 s, where it waits
    run = _replay(crash_and_hang_report, "--item", "2", "--gdb")
    assert run.returncode == 1 and "outcome: ran past its node's timeout: SIGINT to the main thread" in run.stdout
    frames = [ln for ln in run.stdout.splitlines() if ln.startswith("#")]
    assert any("in inner_wait () from " + libs["c"] in f for f in frames), frames
    assert run.stdout.splitlines()[-1] == "under gdb: stopped past its deadline (SIGINT): the backtrace above is " \
                                          "where it was"


def test_a_process_with_one_thread_stopped_by_its_tracer_counts_as_held():
    """`hardy replay --py-spy` kills py-spy when it holds the item's process stopped. The thread
    it holds may not be the main one, which then waits (for the GIL) in an ordinary sleep: a
    real process whose second thread alone is stopped by ptrace (PTRACE_SEIZE, then INTERRUPT)."""
    from hardy.cli.replay import _traced_stop
    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                              "print('ready', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert not _traced_stop(child.pid)
        (second,) = [int(t) for t in os.listdir(f"/proc/{child.pid}/task") if int(t) != child.pid]
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        if libc.ptrace(0x4206, second, None, None) != 0:  # PTRACE_SEIZE
            pytest.skip(f"ptrace is not allowed here: {os.strerror(ctypes.get_errno())}")
        try:
            assert libc.ptrace(0x4207, second, None, None) == 0  # PTRACE_INTERRUPT: this thread alone stops
            for _ in range(100):
                if _traced_stop(child.pid):
                    break
                time.sleep(0.02)
            with open(f"/proc/{child.pid}/stat") as f:
                assert f.read().rpartition(")")[2].split()[0] != "t"  # the main thread is not stopped
            assert _traced_stop(child.pid)
        finally:
            os.waitpid(second, 0x40000000)  # (__WALL) its stop, reported to us, its tracer
            libc.ptrace(17, second, None, None)  # PTRACE_DETACH: a traced thread would keep its process a zombie
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow  # py-spy
def test_replay_under_py_spy_names_the_crash_and_where_a_hang_spent_its_time(crash_and_hang_report):
    if stacks.py_spy() is None:
        pytest.skip("py-spy is not installed (pip install 'hardy[forensics]')")
    run = _replay(crash_and_hang_report, "--item", "1", "--py-spy")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "outcome: SIGSEGV in libforensic.so (crash_inner+0x" in run.stdout
    assert "native stack:\n  #0 libforensic.so +0x" in run.stdout and "in crash_or_hang" in run.stdout
    run = _replay(crash_and_hang_report, "--item", "2", "--py-spy")
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "outcome: ran past its node's timeout: SIGINT to the main thread" in lines
    assert [ln for ln in lines if ln.startswith("outcome:")] == [  # (the stop's KeyboardInterrupt: no second one)
        "outcome: ran past its node's timeout: SIGINT to the main thread"], lines
    raised = re.findall(r'^  File "(.*)", line \d+, in ', run.stdout + run.stderr, re.MULTILINE)  # (not faulthandler's)
    assert not [f for f in raised if "/hardy/" in f], raised  # where the node was, if it got back to Python
    top = lines.index(next(ln for ln in lines if ln.startswith("py-spy record --native: ")))
    assert "while its nodes ran; where the time went" in lines[top]
    assert "inner_wait (libforensic.so)" in lines[top + 1], lines[top:]  # the busiest stack: the hang
    profile = Path(lines[-1].rpartition(": ")[2])
    assert lines[-1].startswith("every stack (collapsed") and profile.is_file()
    assert profile.parent == crash_and_hang_report.parent / f"{crash_and_hang_report.stem}.inputs"


def test_replay_under_py_spy_writes_no_file_a_link_beside_the_report_names(crash_and_hang_report, tmp_path):
    """py-spy wrote its profile by path into the folder beside the report, which a team's report
    folder lets another user swap for a link of theirs while the replay runs: the file that link
    named was overwritten (any file the replaying user may write). The profile is recorded in a
    private folder and copied beside the report through the checked folder: a link found there
    is replaced, never followed. (The link is planted here by this user; the probe that found it
    swapped the folder as another one.)"""
    if stacks.py_spy() is None:
        pytest.skip("py-spy is not installed (pip install 'hardy[forensics]')")
    target = tmp_path / "somebody_elses_file"
    target.write_text("ORIGINAL")
    link = crash_and_hang_report.parent / f"{crash_and_hang_report.stem}.inputs" / "item-1.py-spy.txt"
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    run = _replay(crash_and_hang_report, "--item", "1", "--py-spy")
    assert run.returncode == 1, run.stdout + run.stderr
    assert target.read_text() == "ORIGINAL"
    assert not link.is_symlink() and link.is_file()


def test_replay_says_when_gdb_or_py_spy_is_missing(crash_and_hang_report, tmp_path, monkeypatch, capsys):
    no_gdb = subprocess.run([sys.executable, "-m", "hardy.cli", "replay", str(crash_and_hang_report), "--item",
                             "1", "--gdb"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PATH": str(tmp_path)})
    assert no_gdb.returncode == 2 and no_gdb.stdout == ""
    assert no_gdb.stderr == "hardy replay: --gdb needs gdb, which is not installed here (Debian/Ubuntu: apt-get " \
                            "install gdb; Fedora: dnf install gdb)\n"
    from hardy.cli.replay import under_py_spy
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    assert under_py_spy(str(crash_and_hang_report), 1, 0) == 2
    assert capsys.readouterr().err == f"hardy replay: --py-spy needs py-spy, which is not installed here: " \
                                      f"{install_hint('forensics')}\n"
    both = _replay(crash_and_hang_report, "--item", "1", "--gdb", "--repeat", "2")
    assert both.returncode == 2 and both.stderr == "hardy replay: --gdb, --py-spy, --pdb and --repeat are one at a time\n"


def test_the_crash_line_names_the_nodes_own_line_not_the_librarys_wrapper(tmp_path):
    """ctypes.string_at(0) dies inside ctypes/__init__.py: the first line names the node's line."""
    import ctypes

    script = tmp_path / "pipeline_file.py"
    script.write_text("import ctypes\n\ndef parse(doc):\n    return ctypes.string_at(0)\n")
    stack = ("Fatal Python error: Segmentation fault\n\n"
             "Current thread 0x00007f (most recent call first):\n"
             f'  File "{ctypes.__file__}", line 519 in string_at\n'
             f'  File "{script}", line 4 in parse\n'
             f'  File "{frames.__file__}", line 10 in run\n')
    assert frames.python_site(stack) == "pipeline_file.py:4"
    only_library = "Current thread 0x1 (most recent call first):\n" f'  File "{ctypes.__file__}", line 519 in string_at\n'
    assert frames.python_site(only_library) == "__init__.py:519"  # no code of the user's: the innermost
    in_a_package = stack.replace(str(script), os.path.join(os.path.dirname(frames.__file__), "demo.py"))
    assert frames.python_site(in_a_package, "prep/parse") == "demo.py:4"  # hardy's demo: the node's own line


VERSION_1 = r"""
__attribute__((noinline)) static int crash_inner(volatile int *p) { return *p + 1; }
int crash_here(long address) { return crash_inner((volatile int *)address) * 2; }
int innocent_helper(int x) { return x + 1; }
"""

# the same functions, and before them one long enough to cover where the first version had them
VERSION_2 = r"""
int innocent_helper(int x) {
    volatile int y = x;
    y = y * 3 + 7; y = y ^ 5; y = y * 11 + x; y = y - 3; y = y * 7 + 1; y = y ^ 9; y = y * 13 + x;
    y = y * 3 + 7; y = y ^ 5; y = y * 11 + x; y = y - 3; y = y * 7 + 1; y = y ^ 9; y = y * 13 + x;
    return y + 1;
}
__attribute__((noinline)) static int crash_inner(volatile int *p) { return *p + 1; }
int crash_here(long address) { return crash_inner((volatile int *)address) * 2; }
"""

REBUILT = """
import ctypes, os, subprocess, sys
from hardy import Engine, Pipeline, node

folder = sys.argv[1]
lib = os.path.join(folder, "libver.so")

def build(version):
    subprocess.run(["gcc", "-O0", "-shared", "-fPIC", "-o", lib, os.path.join(folder, version)], check=True)

build("v1.c")

@node(output_name="y")
def call(x):
    native = ctypes.CDLL(lib)
    if x == 1:
        build("v2.c")  # a rebuild at the same path while the worker holds the first build
        native.crash_here(0)
    return x

with Engine(map_executor="process", workers=1) as engine:
    out = Pipeline(nodes=[call], engine=engine).map(inputs={"x": [0, 1, 2]}, map_over="x", on_error="continue")
print(out[0], out[2])
print(out[1].error)
print("diagnosis:", *out[1].error.diagnosis)
"""


@pytest.mark.parametrize("privileged", [True, False])
def test_a_library_replaced_after_it_was_loaded_is_never_named_from_the_new_file(tmp_path, privileged):
    """A rebuild at the same path between load and crash: the names come from the mapped file,
    read through /proc/self/map_files where the process may (CAP_SYS_ADMIN: root here), else from
    what the worker's memory holds (its exported symbols), else "library replaced since it was
    loaded"; the new file's `innocent_helper`, which now covers those offsets, is never named."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the library")
    (tmp_path / "v1.c").write_text(VERSION_1)
    (tmp_path / "v2.c").write_text(VERSION_2)
    prefix = [] if privileged else ["setpriv", "--bounding-set=-sys_admin,-checkpoint_restore"]  # as any user
    if not privileged and (os.geteuid() != 0 or shutil.which("setpriv") is None):
        pytest.skip("needs root and setpriv to drop the capability")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    run = subprocess.run([*prefix, sys.executable, "-", str(tmp_path)], input=REBUILT, capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "{'y': 0} {'y': 2}", run.stdout
    assert "innocent_helper" not in run.stdout, run.stdout
    stack = lines[lines.index("worker's native stack at the crash:") + 1:]
    if privileged:
        assert "worker died from SIGSEGV in libver.so (crash_inner+0x" in lines[1], run.stdout
        assert stack[0].startswith("  #0 libver.so +0x") and "(crash_inner+0x" in stack[0], run.stdout
    else:
        assert "worker died from SIGSEGV in libver.so +0x" in lines[1], run.stdout
        assert "(library replaced since it was loaded), called from node 'call'" in lines[1], run.stdout
        assert stack[0].endswith("(library replaced since it was loaded)"), run.stdout
    assert stack[1].startswith("  #1 libver.so +0x") and "(crash_here+0x" in stack[1], run.stdout  # exported: read from memory
    assert "diagnosis: libver.so was replaced on disk after the worker loaded it" in run.stdout, run.stdout


SLEEPS_PAST_ITS_TIMEOUT = """
import sys, time
from hardy import Engine, Pipeline, node

@node(output_name="n", timeout=1)
def embed(doc: str) -> int:
    if doc == "slow":
        time.sleep(60)
    return len(doc)

Pipeline([embed], name="embed", engine=Engine(workers=1, report_dir=sys.argv[1])).map(
    inputs={"doc": ["a", "slow"]}, map_over="doc", on_error="continue")
"""


@pytest.mark.slow  # py-spy
def test_replay_of_an_item_past_its_timeout_says_one_outcome_and_where_its_node_was(tmp_path):
    """Stopped past its node's timeout, the replayed item said its outcome twice ("ran past its
    node's timeout", then "KeyboardInterrupt:", which is only how it was stopped), and the stack
    of where the node was began in hardy's frames. One outcome; the node's frames alone."""
    if stacks.py_spy() is None:
        pytest.skip("py-spy is not installed (pip install 'hardy[forensics]')")
    (tmp_path / "hang.py").write_text(SLEEPS_PAST_ITS_TIMEOUT)
    subprocess.run([sys.executable, str(tmp_path / "hang.py"), str(tmp_path / "reports")], check=True,
                   capture_output=True, timeout=120)
    (report,) = (tmp_path / "reports").glob("*.json")
    run = _replay(report, "--item", "1", "--py-spy")  # (the item runs in the replay's own process: `replay_item`)
    assert run.returncode != 0, run.stdout + run.stderr
    outcomes = [ln for ln in run.stdout.splitlines() if ln.startswith("outcome:")]
    assert outcomes == ["outcome: ran past its node's timeout: SIGINT to the main thread"], run.stdout
    raised = re.findall(r'^  File "(.*)", line \d+, in (\w+)', run.stdout + run.stderr, re.MULTILINE)
    assert raised == [(str(tmp_path / "hang.py"), "embed")], raised  # time.sleep is C: no frame of its own

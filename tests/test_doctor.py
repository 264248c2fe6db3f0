"""The doctor's tools on real processes, real ELF libraries built with gcc, and a real wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import needs_torch
from hardy import Engine, Pipeline, node
from hardy.doctor import import_matrix
from hardy.doctor.repeat import repeat, wilson
from hardy.errors import WorkerStartError

# The doctor examines environments, not pipelines: commands run over and over for a crash rate,
# import orders tried in processes of their own, libraries built with gcc.
pytestmark = pytest.mark.slow


def hardy_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hardy.cli", *args], capture_output=True, text=True, **kw)


def python_path(folder: object) -> str:
    """PYTHONPATH with `folder` in front of the one this run has (which may be where hardy is)."""
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


# --- repeat ---------------------------------------------------------------------------------------

FLAKY = "import os, signal\nif int(os.environ['HARDY_RUN_INDEX']) % 3 == 0:\n    os.kill(os.getpid(), signal.SIGSEGV)\n"


def test_repeat_counts_a_fixed_crash_fraction_exactly(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    report = repeat([sys.executable, str(script)], n=12, jobs=2, logs=tmp_path / "logs")
    assert report.counts == {"success": 8, "SIGSEGV": 4}
    assert [r.index for r in report.runs if not r.ok] == [3, 6, 9, 12]
    assert report.interval == wilson(4, 12)
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["run-03.log", "run-06.log", "run-09.log",
                                                                      "run-12.log"]
    lo, hi = wilson(4, 12)
    assert 0.13 < lo < 0.14 and 0.60 < hi < 0.61  # the textbook Wilson interval for 4/12


def test_repeat_cli_shell_exit_codes_timeouts_and_exit_status(tmp_path):
    shell = hardy_cli("repeat", "-n", "3", "--", "sh", "-c", "exit 139")
    assert shell.returncode == 1
    assert shell.stdout.count("SIGSEGV (shell exit 139)") == 4  # three runs and the summary row
    ok = hardy_cli("repeat", "-n", "2", "--", "true")
    assert ok.returncode == 0 and "failure rate 0/2" in ok.stdout
    hung = hardy_cli("repeat", "-n", "2", "--timeout", "0.5", "--", "sleep", "30")
    assert hung.returncode == 1 and hung.stdout.count("timeout") >= 2
    code = hardy_cli("repeat", "-n", "2", "--", "sh", "-c", "exit 3")
    assert "exit 3" in code.stdout


def test_repeat_stops_on_first_failure(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    report = repeat([sys.executable, str(script)], n=30, jobs=1, stop_on_failure=True)
    assert len(report.runs) == 3 and report.runs[-1].outcome == "SIGSEGV"


# --- the import-order crash matrix ----------------------------------------------------------------

def test_import_matrix_finds_the_order_that_crashes(tmp_path, native_lib, monkeypatch):
    # modb crashes the interpreter at exit, but only when moda was imported before it (the shape of the torch-before-cuml incident)
    (tmp_path / "moda.py").write_text("VALUE = 1\n")
    (tmp_path / "modb.py").write_text(
        "import ctypes, sys\n"
        f"if 'moda' in sys.modules:\n    ctypes.CDLL({str(native_lib)!r})\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cells = {c.modules: c for c in import_matrix(["moda", "modb"], repeat=4)}
    assert set(cells) == {("moda",), ("modb",), ("moda", "modb"), ("modb", "moda")}
    culprit = cells[("moda", "modb")]
    assert culprit.crashes == {"SIGSEGV": 4} and culprit.stages == {"at interpreter exit": 4}
    assert all(c.failures == 0 for k, c in cells.items() if k != ("moda", "modb"))
    # a crash inside the snippet is told apart from one at exit
    snippet = import_matrix(["moda"], then="import ctypes; ctypes.string_at(0)", repeat=2)
    assert snippet[0].stages == {"running the snippet": 2}


def test_doctor_cli_matrix_table(tmp_path, monkeypatch):
    (tmp_path / "moda.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", python_path(tmp_path))
    out = hardy_cli("doctor", "--matrix", "moda,json", "--repeat", "2", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["modules"] for r in rows] == [["moda"], ["json"], ["moda", "json"], ["json", "moda"]]
    # the flag's old name, one letter from --import, still works for scripts (hidden from --help)
    old = hardy_cli("doctor", "--imports", "moda,json", "--repeat", "1", "--json")
    assert old.returncode == 0 and len(json.loads(old.stdout)) == 4, old.stderr
    assert "--imports" not in hardy_cli("doctor", "--help").stdout


# --- the environment report -----------------------------------------------------------------------

def test_doctor_json_lists_openmp_runtimes_and_hazards(tmp_path):
    needs_torch()
    # a module standing for user code that has run torch: its OpenMP pool is alive afterwards
    (tmp_path / "used_torch.py").write_text("import torch\ntorch.set_num_threads(2)\nx = torch.randn(512, 512)\n(x @ x).sum()\n")
    out = hardy_cli("doctor", "--import", "numpy,used_torch", "--json", timeout=300,
                    env={**os.environ, "PYTHONPATH": python_path(tmp_path)})
    report = json.loads(out.stdout)
    assert report["imported"] == ["numpy", "used_torch"]
    assert any("libgomp" in p for p in report["openmp"])
    assert report["packages"]["torch"] and report["packages"]["numpy"]
    assert report["cuda"] == {"torch_cuda_compiled": False, "torch_cuda_initialized": False}
    assert report["threads"]["torch_threads"] >= 1
    findings = {f["topic"]: f for f in report["findings"]}
    assert "versions" in findings and "fork hazard: openmp-pool" in findings
    assert findings["fork hazard: openmp-pool"]["severity"] == "warning"
    assert out.returncode == {"ok": 0, "warning": 1, "error": 2}[report["worst"]] == 1


def test_doctor_prints_a_findings_install_command_as_written(tmp_path):
    """The findings table read `[forensics]` in `pip install -e ".[forensics]"` as rich markup and
    deleted it: the advice it printed installed nothing (`--json` had it right). Here py-spy is out
    of reach (this interpreter through a link in a folder of its own, PATH without py-spy) and
    HARDY_ASSUME_GPUS holds brackets too; printed to a file, each finding is one line, unwrapped."""
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.symlink_to(sys.executable)  # py-spy is looked for beside the interpreter, and on PATH
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update(PATH=os.pathsep.join([str(python.parent), "/usr/bin", "/bin"]), HARDY_ASSUME_GPUS="[gpu]")
    if shutil.which("py-spy", path=env["PATH"]):
        pytest.skip("py-spy is installed system-wide here: no finding to install it")
    out = subprocess.run([str(python), "-m", "hardy.cli", "doctor"], capture_output=True, text=True, env=env,
                         timeout=300)
    data = json.loads(subprocess.run([str(python), "-m", "hardy.cli", "doctor", "--json"], capture_output=True,
                                     text=True, env=env, timeout=300).stdout)
    said = {f["message"] for f in data["findings"]}
    hint = next(m for m in said if m.startswith("stacks of hung items: Python frames only"))
    assert 'pip install -e ".[forensics]"' in hint and "HARDY_ASSUME_GPUS='[gpu]' must be a number" in " ".join(said)
    lines = out.stdout.splitlines()
    for message in said:
        assert any(message in line for line in lines), f"{message!r} not on one line of:\n{out.stdout}"
    assert out.returncode == 2, out.stderr  # the GPU finding is an error


def test_doctor_reports_a_version_outside_the_known_range(monkeypatch):
    import hardy.doctor.checkup as doctor
    monkeypatch.setitem(doctor.KNOWN_RANGES, "numba", (">=0.1,<0.2", "a test internal"))
    report = doctor.examine()
    if report.packages.get("numba") is None:
        pytest.skip("numba not installed")
    assert any(f.severity == "warning" and "outside the range" in f.message for f in report.findings)
    assert report.exit_code >= 1


# --- shared libraries across split directories ----------------------------------------------------

@pytest.fixture(scope="module")
def split_libs(tmp_path_factory):
    """libC needs libA needs libB, each in its own directory, no RPATH: a Bazel-style layout."""
    root = tmp_path_factory.mktemp("split")
    src = {"b": "int b(void){return 2;}", "a": "int b(void); int a(void){return b()+1;}",
           "c": "int a(void); int c(void){return a()*10;}"}
    for name in ("b", "a", "c"):
        (root / name).mkdir()
        (root / f"{name}.c").write_text(src[name])
    build = [("b", []), ("a", ["-L", str(root / "b"), "-lB"]), ("c", ["-L", str(root / "a"), "-lA"])]
    for name, extra in build:
        upper = name.upper()
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(root / name / f"lib{upper}.so"),
                        f"-Wl,-soname,lib{upper}.so", str(root / f"{name}.c"), *extra], check=True)
    return root


def test_libs_order_missing_and_preload(split_libs):
    dirs = [str(split_libs / d) for d in ("c", "a", "b")]
    libc = str(split_libs / "c" / "libC.so")
    naive = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({libc!r})"], capture_output=True,
                           text=True)
    assert naive.returncode != 0 and "libA.so: cannot open shared object file" in naive.stderr
    order = hardy_cli("libs", *dirs, "--order")
    assert order.returncode == 0, order.stdout + order.stderr
    listed = [ln.split()[1] for ln in order.stdout.splitlines() if ln.startswith("   ")]
    assert listed == ["libB.so", "libA.so", "libC.so"]
    assert "needs preload" in order.stdout
    fixed = subprocess.run([sys.executable, "-c", "import ctypes\nfrom hardy.native import preload\n"
                            f"preload(paths={dirs!r})\nprint(ctypes.CDLL({libc!r}).c())"],
                           capture_output=True, text=True)
    assert fixed.stdout.strip() == "30", fixed.stderr
    # only libC's directory indexed: libA is reported missing, with the directory that has it
    missing = hardy_cli("libs", str(split_libs / "c"), "--json", env={**os.environ,
                                                                    "PYTHONPATH": python_path(split_libs / "a")})
    data = json.loads(missing.stdout)
    assert missing.returncode == 2
    assert data["missing"] == [{"library": libc, "needed": "libA.so", "elsewhere": str(split_libs / "a")}]


def test_libs_walks_exactly_sys_path_and_names_the_interpreter(split_libs, tmp_path):
    """A venv's sys.path holds the base interpreter's standard library, whose folder holds the
    base's own site-packages, which is not on the venv's sys.path: its libraries are not the venv's."""
    import shutil
    std, own = tmp_path / "std", tmp_path / "own"
    (std / "site-packages").mkdir(parents=True)
    own.mkdir()
    shutil.copy(split_libs / "a" / "libA.so", std / "libA.so")  # needs libB.so
    shutil.copy(split_libs / "b" / "libB.so", std / "site-packages" / "libB.so")  # another environment's copy
    shutil.copy(split_libs / "b" / "libB.so", own / "libB.so")  # this environment's
    walk = (f"import sys; sys.path[:0] = [{str(std)!r}, {str(own)!r}]; sys.argv = ['hardy', 'libs', '--json']\n"
            "from hardy.cli import main; main()")
    out = subprocess.run([sys.executable, "-c", walk], capture_output=True, text=True, timeout=300)
    data = json.loads(out.stdout)
    assert data["python"] == sys.executable and data["directories"][:2] == [str(std), str(own)]
    assert not [p for p in data["order"] if "site-packages" in p and p.startswith(str(std))]
    assert {"library": str(std / "libA.so"), "needed": "libB.so", "provided_by": str(own)} in data["needs_preload"]
    said = hardy_cli("libs", str(own), env={**os.environ, "COLUMNS": "60"})
    assert f"of {sys.executable} (Python {sys.version.split()[0]})" in " ".join(said.stdout.split())


def test_doctor_notes_an_optional_layer_that_is_never_loaded(tmp_path):
    """numba's TBB layer (tbbpool.so, needing libtbb.so.12) on a numba that runs on its OpenMP
    layer: a library of an imported package that nothing loads, whose dependency is missing."""
    package = tmp_path / "layered"
    package.mkdir()
    (package / "__init__.py").write_text("")  # loads no native layer unless asked
    (tmp_path / "dep.c").write_text("int dep(void){return 1;}")
    (tmp_path / "layer.c").write_text("int dep(void); int layer(void){return dep();}")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libgone.so.12"), "-Wl,-soname,libgone.so.12",
                    str(tmp_path / "dep.c")], check=True)
    layer = package / "an_optional_threading_layer_with_a_long_file_name.cpython-311-x86_64-linux-gnu.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(layer), str(tmp_path / "layer.c"),
                    str(tmp_path / "libgone.so.12")], check=True)
    (tmp_path / "libgone.so.12").unlink()
    env = {**os.environ, "PYTHONPATH": python_path(tmp_path), "COLUMNS": "80"}
    out = hardy_cli("doctor", "--import", "layered", "--json", env=env, timeout=300)
    report = json.loads(out.stdout)
    [finding] = [f for f in report["findings"] if f["topic"] == "shared libraries"]
    assert finding["severity"] == "note" and f"{layer} needs libgone.so.12: not found; it is not loaded" in \
        finding["message"]
    assert out.returncode < 2  # a note is not an error
    table = hardy_cli("doctor", "--import", "layered", env=env, timeout=300)
    assert "…" not in table.stdout  # long paths fold over lines, never cut off


@node(output_name="value")
def call_libc(x: int, lib: str) -> int:
    import ctypes
    return ctypes.CDLL(lib).c() + x


def test_engine_preloads_libraries_in_every_worker(split_libs):
    dirs = [str(split_libs / d) for d in ("c", "a", "b")]
    libc = str(split_libs / "c" / "libC.so")
    with Engine(map_executor="process", workers=2, preload_libs=dirs) as e:
        out = Pipeline(nodes=[call_libc], engine=e).map(inputs={"x": [1, 2], "lib": libc}, map_over="x")
    assert [o["value"] for o in out] == [31, 32]
    with Engine(map_executor="process", workers=1, preload_libs=[str(split_libs / "c")]) as e:
        with pytest.raises(WorkerStartError, match="preload_libs"):
            Pipeline(nodes=[call_libc], engine=e).map(inputs={"x": [1], "lib": libc}, map_over="x")


def test_cycles_are_reported_not_looped_on(tmp_path):
    (tmp_path / "x.c").write_text("int y(void); int x(void){return y();}")
    (tmp_path / "y.c").write_text("int x(void); int y(void){return 1;} int y2(void){return x();}")

    def gcc(lib: str, src: str, *extra: str) -> None:
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / lib), f"-Wl,-soname,{lib}",
                        str(tmp_path / src), "-Wl,--no-as-needed", "-L", str(tmp_path), *extra], check=True)

    gcc("libY.so", "y.c", "-Wl,--unresolved-symbols=ignore-all")  # a first libY, to link libX against
    gcc("libX.so", "x.c", "-lY")
    gcc("libY.so", "y.c", "-lX")                                   # libY needs libX needs libY
    from hardy.native import analyse, scan
    plan = analyse(scan([str(tmp_path)]))
    assert plan.cycles and set(plan.cycles[0]) == {"libX.so", "libY.so"}
    assert len(plan.order) == 2


def test_help_explains_every_command():
    for cmd in (["doctor"], ["repeat"], ["libs"], ["wheel", "patch"], ["wheel", "verify"], ["cache", "prune"]):
        out = hardy_cli(*cmd, "--help")
        assert out.returncode == 0 and "Usage" in out.stdout, cmd


def test_the_import_matrix_imports_nothing_from_the_working_directory(tmp_path, monkeypatch):
    """`hardy doctor --matrix json` run from a shared folder: its interpreters (`python -c`) looked
    in the working directory first, so a `json.py` left there was what they imported, and ran."""
    (tmp_path / "json.py").write_text(f"open({str(tmp_path / 'planted-ran')!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    (cell,) = import_matrix(["json"], repeat=1)
    assert cell.failures == 0
    assert not (tmp_path / "planted-ran").exists()


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_a_cache_folder_that_cannot_be_written_is_named_not_the_compiler_and_keeps_no_scratch(tmp_path, how):
    """XDG_CACHE_HOME on a read-only mount or a full disk, with gcc installed: the doctor names the
    folder and the fix, not "install a C compiler"; and neither it nor a process's first map leaves
    the handler's scratch source behind (a full disk takes the file, then refuses its bytes)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is the compiler the doctor must not advise: it has to be installed")
    disk, source = tmp_path / "cache", tmp_path / "source"
    disk.mkdir()
    source.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)] if how == "full" else \
        ["mount", "--bind", "-o", "ro", str(source), str(disk)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("needs root, to mount a full or read-only file system")
    try:
        if how == "full":
            with open(disk / "fill", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                except OSError:
                    pass
        env = {**os.environ, "XDG_CACHE_HOME": str(disk), "HARDY_NATIVE_HANDLER": "auto"}
        run = hardy_cli("doctor", "--json", env=env, timeout=120)
        mapped = subprocess.run([sys.executable, "-c", "from hardy import Pipeline, node\n"
                                 "f = node(output_name='y')(lambda x: x + 1)\n"
                                 "print(Pipeline([f]).map(inputs={'x': [1, 2]}, map_over='x'))"],
                                capture_output=True, text=True, env=env, timeout=120)
        assert mapped.stdout == "[{'y': 2}, {'y': 3}]\n", mapped.stderr
        left = sorted(p.name for p in disk.rglob("*"))
        assert left == (["fill", "hardy", "native"] if how == "full" else []), left
        said = [f["message"] for f in json.loads(run.stdout)["findings"] if f["topic"] == "forensics"][0]
        reason = "No space left on device" if how == "full" else "Read-only file system"
        fix = "free space on its disk" if how == "full" else "make it writable"
        assert said.startswith(f"native frames of crashes: the ctypes fallback (hardy's cache folder {disk}/hardy "
                               f"cannot be written ({reason}), so the native handler cannot be built there: {fix}, "
                               "or set XDG_CACHE_HOME to a folder that can be written): "), said
        assert "C compiler" not in said
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)

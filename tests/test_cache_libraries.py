"""Library situations in a real virtual environment: each changes what an installed library
computes, and the cached map must recompute (or, for a change that cannot reach the node, keep
its entries).

One venv for the module (`--system-site-packages`, so hardy's dependencies come from the test's
interpreter), tiny packages built here into wheels with `pip wheel` (no index is reached), installed,
upgraded and downgraded with `pip install --no-index --find-links`, as a user would from a
registry. Each situation is a user's script, run with `python - < script` before and after the
change against one cache directory; its node logs every call, so a served entry and a
recomputation are told apart, and it prints what the library computes when called directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from test_cache_code_kinds import CASES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SRC = str(Path(__file__).resolve().parent.parent / "src")

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[project]
name = "{name}"
version = "{version}"
dependencies = {dependencies}
"""

C_SETUP = """
from setuptools import Extension, setup
setup(ext_modules=[Extension("s4cext._impl", ["s4cext/_impl.c"])])
"""

C_IMPL = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject* count(PyObject* self, PyObject* arg) { return PyLong_FromSsize_t(PyObject_Length(arg) - OFFSET); }
static PyMethodDef methods[] = {{"count", count, METH_O, "count"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_impl", NULL, -1, methods};
PyMODINIT_FUNC PyInit__impl(void) { return PyModule_Create(&mod); }
"""

# distribution -> version -> {file: text}; version 2 counts one less (a library's behaviour change)
PACKAGES: dict[str, dict[str, dict[str, str]]] = {
    "s4nolib": {v: {"s4nolib/__init__.py": f"import dataclasses\ndef tok(s):\n    return len(s.split()) - {k}\n\n"
                    f"@dataclasses.dataclass\nclass Counter:\n    by: str\n"
                    f"    def count(self, s):\n        return len(s.split(self.by)) - {k}\n"}
                for v, k in (("1.0", 0), ("2.0", 1))},
    "s4vers": {v: {"s4vers/__init__.py": f"__version__ = {v!r}\ndef tok(s):\n    return len(s) - {k}\n"}
               for v, k in (("1.0", 0), ("2.0", 1))},
    "s4ns-tok": {v: {"s4ns/tok/__init__.py": f"def count(s):\n    return len(s.split()) - {k}\n"}
                 for v, k in (("1.0", 0), ("2.0", 1))},
    "s4ns-other": {v: {"s4ns/other/__init__.py": f"def count(s):\n    return len(s) - {k}\n"}
                   for v, k in (("1.0", 0), ("2.0", 1))},
    "s4dep": {v: {"s4dep/__init__.py": f"OFFSET = {k}\n"} for v, k in (("1.0", 0), ("2.0", 1))},
    "s4app": {"1.0": {"s4app/__init__.py": "import s4dep\ndef tok(s):\n    return len(s.split()) - s4dep.OFFSET\n"}},
    "s4cext": {v: {"s4cext/__init__.py": "from ._impl import count\n", "s4cext/_impl.c": C_IMPL.replace("OFFSET", k),
                   "setup.py": C_SETUP} for v, k in (("1.0", "0"), ("2.0", "1"))},
}
DEPENDENCIES = {"s4app": ["s4dep"]}


@dataclass
class Venv:
    python: Path
    wheels: Path
    root: Path
    env: dict[str, str] = field(default_factory=dict)

    def pip(self, *args: str) -> None:
        subprocess.run([str(self.python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(self.wheels),
                        "--no-build-isolation", "--disable-pip-version-check", *args], check=True, env=self.env,
                       capture_output=True)

    def project(self, name: str, files: dict[str, str], version: str = "1.0") -> Path:
        """A package folder of the user's, for editable, path and wheel installs."""
        folder = self.root / "projects" / name
        write(folder, name, version, files)
        return folder


def write(folder: Path, name: str, version: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    deps = json.dumps(DEPENDENCIES.get(name, []))
    (folder / "pyproject.toml").write_text(PYPROJECT.format(name=name, version=version, dependencies=deps))


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("libraries")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root / "env")],
                   check=True)
    wheels = root / "wheels"
    builds: dict[str, list[str]] = {}  # one `pip wheel` per version: one call cannot build two of a name
    for name, versions in PACKAGES.items():
        for version, files in versions.items():
            folder = root / "build" / f"{name}-{version}"
            write(folder, name, version, files)
            builds.setdefault(version, []).append(str(folder))
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONDONTWRITEBYTECODE": "1", "PIP_NO_INPUT": "1"}
    for folders in builds.values():
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        "--disable-pip-version-check", "-w", str(wheels), *folders], check=True, capture_output=True,
                       env=env)
    made = Venv(root / "env" / "bin" / "python", wheels, root, env)
    made.pip("s4nolib==1.0", "s4vers==1.0", "s4ns-tok==1.0", "s4ns-other==1.0", "s4app==1.0", "s4dep==1.0",
             "s4cext==1.0")
    return made


SCRIPT = """
import json, sys
from hardy import DiskCache, Engine, Pipeline, node
{code}
LOG = sys.argv[2]

@node(output_name="n")
def step(s{extra}):
    with open(LOG, "a") as f:
        f.write("call\\n")
    return compute(s{extra})

TEXTS = ["a b c", "d e"]
out = Pipeline(nodes=[step], cache=DiskCache(sys.argv[1]), engine=Engine(map_executor="sequential")).map(
    inputs={{"s": TEXTS{inputs}}}, map_over="s")
print(json.dumps({{"out": [o["n"] for o in out], "direct": [compute(s{extra}) for s in TEXTS]}}))
"""


def run(venv: Venv, name: str, code: str, extra: str = "", inputs: str = "") -> dict:
    folder = venv.root / "runs" / name.replace(" ", "-").replace("/", "-")
    folder.mkdir(parents=True, exist_ok=True)
    script = SCRIPT.format(code=textwrap.dedent(code), extra=extra, inputs=inputs)
    done = subprocess.run([str(venv.python), "-", str(folder / "cache"), str(folder / "log")], input=script,
                          capture_output=True, text=True, env=venv.env, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["calls"] = len((folder / "log").read_text().split())
    return result


def check(venv: Venv, name: str, code: str, change, invalidated: bool = True, **kw: str) -> None:
    """Run, change, run again: a change the node can reach recomputes (and the library really
    changed what it computes); one it cannot reach serves the entries."""
    before = run(venv, name, code, **kw)
    assert before["out"] == before["direct"] and before["calls"] == 2
    change()
    after = run(venv, name, code, **kw)
    assert after["out"] == after["direct"], "an entry computed by the library before the change was served"
    if invalidated:
        assert after["direct"] != before["direct"], "the change did not change what the library computes"
        assert after["calls"] == 4
    else:
        assert after["calls"] == 2, "a change the node cannot reach recomputed it"


USES_NOLIB = "import s4nolib\ndef compute(s):\n    return s4nolib.tok(s)\n"
USES_NAMESPACE = "import s4ns.tok\ndef compute(s):\n    return s4ns.tok.count(s)\n"
USES_OBJECT = "import s4nolib\ndef compute(s, counter):\n    return counter.count(s)\ncounter = s4nolib.Counter(' ')\n"

# situation -> (the user's code, installed before, installed as the change, whether the node must recompute)
VERSIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], bool]] = {
    "no __version__, upgraded": (USES_NOLIB, ("s4nolib==1.0",), ("s4nolib==2.0",), True),
    "no __version__, downgraded": (USES_NOLIB, ("s4nolib==2.0",), ("s4nolib==1.0",), True),
    "with __version__, upgraded": ("import s4vers\ndef compute(s):\n    return s4vers.tok(s)\n", ("s4vers==1.0",),
                                   ("s4vers==2.0",), True),
    "a namespace package's part, upgraded": (USES_NAMESPACE, ("s4ns-tok==1.0",), ("s4ns-tok==2.0",), True),
    "a namespace package's part, downgraded": (USES_NAMESPACE, ("s4ns-tok==2.0",), ("s4ns-tok==1.0",), True),
    "another part of the namespace package, upgraded": (USES_NAMESPACE, ("s4ns-tok==1.0", "s4ns-other==1.0"),
                                                        ("s4ns-other==2.0",), False),
    "an unrelated library, upgraded": (USES_NOLIB, ("s4nolib==1.0", "s4vers==1.0"), ("s4vers==2.0",), False),
    "a library's requirement, upgraded (s4app calls s4dep)": (
        "import s4app\ndef compute(s):\n    return s4app.tok(s)\n", ("s4app==1.0", "s4dep==1.0"), ("s4dep==2.0",), True),
    "a library imported only inside the node, upgraded": (
        "def compute(s):\n    import s4nolib\n    return s4nolib.tok(s)\n", ("s4nolib==1.0",), ("s4nolib==2.0",), True),
    "a function imported from a library, upgraded": ("from s4nolib import tok\ndef compute(s):\n    return tok(s)\n",
                                                     ("s4nolib==1.0",), ("s4nolib==2.0",), True),
    "an object of a library's class given as an input, upgraded": (USES_OBJECT, ("s4nolib==1.0",), ("s4nolib==2.0",),
                                                                    True),
    "a C extension library, upgraded": ("import s4cext\ndef compute(s):\n    return s4cext.count(s)\n",
                                        ("--force-reinstall", "s4cext==1.0"), ("s4cext==2.0",), True),
}


@pytest.mark.parametrize("situation", list(VERSIONS))
def test_a_library_installed_from_an_index_changes_version(venv, situation):
    code, before, after, invalidated = VERSIONS[situation]
    venv.pip(*before)
    given = {"extra": ", counter", "inputs": ', "counter": counter'} if "counter" in code else {}
    check(venv, situation, code, lambda: venv.pip(*after), invalidated, **given)


def test_an_editable_install_edited_in_place(venv):
    folder = venv.project("s4edit", {"s4edit/__init__.py": "def tok(s):\n    return len(s.split())\n"})
    venv.pip("--no-deps", "-e", str(folder))
    edit = folder / "s4edit" / "__init__.py"
    check(venv, "editable", "import s4edit\ndef compute(s):\n    return s4edit.tok(s)\n",
          lambda: edit.write_text(edit.read_text().replace("split())", "split()) - 1")))


def test_a_path_install_edited_and_installed_again_with_the_same_version(venv):
    folder = venv.project("s4path", {"s4path/__init__.py": "def tok(s):\n    return len(s.split())\n"})
    venv.pip("--no-deps", str(folder))
    edit = folder / "s4path" / "__init__.py"

    def change() -> None:
        edit.write_text(edit.read_text().replace("split())", "split()) - 1"))
        venv.pip("--no-deps", "--force-reinstall", str(folder))

    check(venv, "path", "import s4path\ndef compute(s):\n    return s4path.tok(s)\n", change)


def test_a_local_wheel_rebuilt_and_installed_again_with_the_same_version(venv):
    folder = venv.project("s4wheel", {"s4wheel/__init__.py": "def tok(s):\n    return len(s.split())\n"})
    out = venv.root / "built"

    def build_and_install() -> None:
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(out), str(folder)], check=True, capture_output=True, env=venv.env)
        venv.pip("--no-deps", "--force-reinstall", str(next(out.glob("*.whl"))))

    build_and_install()
    edit = folder / "s4wheel" / "__init__.py"

    def change() -> None:
        edit.write_text(edit.read_text().replace("split())", "split()) - 1"))
        build_and_install()

    check(venv, "wheel", "import s4wheel\ndef compute(s):\n    return s4wheel.tok(s)\n", change)


def test_a_c_extension_of_a_path_install_rebuilt_with_the_same_version(venv):
    files = dict(PACKAGES["s4cext"]["1.0"])
    folder = venv.project("s4cext", files)  # installed from the folder: the user's own build
    (folder / "s4cext" / "__init__.py").write_text("from ._impl import count\n")
    venv.pip("--no-deps", "--force-reinstall", str(folder))
    impl = folder / "s4cext" / "_impl.c"

    def change() -> None:
        impl.write_text(impl.read_text().replace("PyObject_Length(arg) - 0", "PyObject_Length(arg) - 1"))
        shutil.rmtree(folder / "build", ignore_errors=True)
        venv.pip("--no-deps", "--force-reinstall", str(folder))

    check(venv, "cext-path", "import s4cext\ndef compute(s):\n    return s4cext.count(s)\n", change)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed to install from a repository")
def test_a_git_install_at_another_commit_with_the_same_version(venv):
    repo = venv.project("s4git", {"s4git/__init__.py": "def tok(s):\n    return len(s.split())\n"})
    git = ["git", "-C", str(repo), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)

    def commit_and_install() -> None:
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", "change"], check=True)
        sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
        venv.pip("--no-deps", "--force-reinstall", f"git+file://{repo}@{sha}")

    commit_and_install()
    edit = repo / "s4git" / "__init__.py"

    def change() -> None:
        edit.write_text(edit.read_text().replace("split())", "split()) - 1"))
        commit_and_install()

    check(venv, "git", "import s4git\ndef compute(s):\n    return s4git.tok(s)\n", change)


# --- every case of the issue, on every executor, through every kind of cache ----------------------

EVERYWHERE = """
import functools, json, sys, threading
import numpy as np
from sklearn.linear_model import LinearRegression
import helpers, s4edit, s4nolib, s4ns.tok
from hardy import DiskCache, Engine, Pipeline, node
from hardy.errors import UnhashableError
from hardy.integrations.dask import DaskExecutor
from hardy.integrations.ray import RayExecutor

factor, root, endpoint = int(sys.argv[1]), sys.argv[2], sys.argv[3]

def mul(x, k):
    return x * k

class Scaler:
    def __init__(self, factor):
        self.factor = factor
    def apply(self, x):
        return x * self.factor

class Locked:
    def __init__(self):
        self.lock = threading.Lock()
    def apply(self, x):
        return x

def dispatched(x):
    return helpers.scale(x)

def counted(s):
    return s4nolib.tok(s)

def namespaced(s):
    return s4ns.tok.count(s)

def edited(x):
    return s4edit.tok(x)

model = LinearRegression().fit(np.array([[1.0], [2.0]]), np.array([1.0, 2.0]) * factor)
CASES = {"partial": (functools.partial(mul, k=factor), [10, 20]), "fitted model": (model.predict, [np.ones((1, 1))]),
         "instance": (Scaler(factor).apply, [1, 2]), "singledispatch": (dispatched, [1, 2]),
         "no __version__": (counted, ["a b c"]), "namespace package": (namespaced, ["a b c"]),
         "editable install": (edited, ["a b c"])}
S3 = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}

def caches(where):
    return {"local": DiskCache(f"{root}/{where}/local"),
            "shared=True": DiskCache(f"{root}/{where}/shared", store="files", shared=True),
            "s3": DiskCache(f"s3://everywhere/{where}", storage_options=S3, secret="team",
                            local=f"{root}/{where}/s3-front-{factor}")}  # another machine each time

results, refused = {}, {}
for name, executor in (("sequential", "sequential"), ("threaded", "threaded"), ("process", "process"),
                       ("dask", DaskExecutor(workers=1)), ("ray", RayExecutor(workers=1))):
    with Engine(map_executor=executor, workers=1 if isinstance(executor, str) else None) as engine:
        for kind, cache in caches(name).items():
            for case, (func, inputs) in CASES.items():
                n = node(func, output_name="y", name="step")
                over = n.inputs[0]
                out = Pipeline(nodes=[n], cache=cache, engine=engine).map(inputs={over: inputs}, map_over=over)
                results[f"{name} / {kind} / {case}"] = [repr([o["y"] for o in out]), repr([func(x) for x in inputs])]
            try:
                Pipeline(nodes=[node(Locked().apply, output_name="y")], cache=cache, engine=engine).map(
                    inputs={"x": [1]}, map_over="x")
            except UnhashableError as exc:
                refused[f"{name} / {kind}"] = str(exc)
print(json.dumps({"results": results, "refused": refused}))
"""

HELPERS, HELPERS_EDIT = CASES["singledispatch, implementation edited"]  # a module with a singledispatch `scale`


def test_every_case_of_the_issue_on_every_executor_and_cache(venv, tmp_path):
    """The reported cases, each refused or recomputed after its change — partial(mul, k=2) then
    k=3, a model fitted on 2x then 3x, an instance with factor 2 then 3, a singledispatch
    implementation edited, a library without __version__ and a namespace package's part
    upgraded, an editable install edited — on the sequential, threaded, process, Dask and Ray
    executors, through a local cache, a `shared=True` file store and an S3 bucket (moto's server)."""
    from test_cache_s3 import S3, start_moto, stop
    proc, endpoint = start_moto()
    try:
        S3(endpoint).client.create_bucket(Bucket="everywhere")
        folder = venv.project("s4edit", {"s4edit/__init__.py": "def tok(s):\n    return len(s.split())\n"})
        venv.pip("--no-deps", "-e", str(folder))
        venv.pip("s4nolib==1.0", "s4ns-tok==1.0")
        helpers = tmp_path / "helpers"
        helpers.mkdir()
        (helpers / "helpers.py").write_text(HELPERS)
        env = {**venv.env, "PYTHONPATH": f"{SRC}{os.pathsep}{helpers}"}  # the workers import helpers too

        def everywhere(factor: int) -> dict:
            done = subprocess.run([str(venv.python), "-", str(factor), str(tmp_path / "caches"), endpoint],
                                  input=EVERYWHERE, capture_output=True, text=True, env=env, cwd=tmp_path,
                                  timeout=500)
            assert done.returncode == 0, done.stderr[-4000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        before = everywhere(2)
        (helpers / "helpers.py").write_text(HELPERS.replace(*HELPERS_EDIT))
        edit = folder / "s4edit" / "__init__.py"
        edit.write_text(edit.read_text().replace("split())", "split()) - 1"))
        venv.pip("s4nolib==2.0", "s4ns-tok==2.0")
        after = everywhere(3)
    finally:
        stop(proc)
    assert len(after["results"]) == 5 * 3 * 7
    for where, (out, direct) in before["results"].items():
        assert out == direct, where
    for where, (out, direct) in after["results"].items():
        assert direct != before["results"][where][1], f"{where}: the change did not change the result"
        assert out == direct, f"{where}: served the entry computed before the change"
    assert len(after["refused"]) == 15
    for where, message in after["refused"].items():
        assert "the bound method" in message and "Locked.apply" in message and "__cache_key__" in message \
            and "input of the node" in message, where

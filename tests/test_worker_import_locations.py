"""A worker imports each module its caller has loaded from where the caller loaded it.

A script read from stdin (`python - < job.py`), `python -c` and a notebook kernel have `''` first
on `sys.path`: the working directory at each import. After `os.chdir` (a notebook's `%cd` into a
team's data folder), a worker that looked there would import a `numpy.py` another user left in
that folder, or another copy of the script's own `helpers.py`, as the caller. These run a real
script in a real subprocess (the planter a real second uid, made here when the tests run as root)
and look for the planted module's mark.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
PLANTER = "hardy-planter"  # the other user, made for these tests where it does not exist

pytestmark = pytest.mark.timeout(240)

PLANTED = """
import os
with open({marker!r}, "a") as f:
    f.write(f"{{__name__}} planted in the data folder ran as uid {{os.getuid()}} pid {{os.getpid()}}\\n")
raise ImportError("planted")
"""

# Read from stdin (sys.path[0] == ''): the node's module and its package come from the project
# folder and the library folder, numpy from site-packages; then the script changes into the data
# folder, and maps there in worker processes and in this process.
SCRIPT = """
import json, os, sys
import numpy as np
import helpers
from hardy import Engine, Pipeline

os.chdir(sys.argv[2])
inputs = {"a": [np.arange(n) for n in range(1, 7)]}
answers = {}
for executor in ("process", "sequential"):
    out = Pipeline([helpers.total], engine=Engine(map_executor=executor)).map(inputs=inputs, map_over="a")
    answers[executor] = [r["s"] for r in out]
print(json.dumps(answers))
"""

HELPERS = """
import numpy as np
import tablekit.ops
from hardy import node

@node(output_name="s")
def total(a):
    import localconf  # only in the data folder: found through '' there, as in the caller
    return float(np.sum(a)) * tablekit.ops.SCALE + localconf.OFFSET
"""


def _layout(base: Path) -> tuple[Path, Path, Path]:
    """The project folder (the script's `helpers.py`), a library folder on PYTHONPATH (package
    `tablekit`), and the data folder the script changes into (`localconf.py`, the caller's own)."""
    project, library, data = base / "project", base / "library", base / "data"
    for folder in (project, library / "tablekit", data):
        folder.mkdir(parents=True)
    (project / "helpers.py").write_text(HELPERS)
    (library / "tablekit" / "__init__.py").write_text("")
    (library / "tablekit" / "ops.py").write_text("SCALE = 2\n")
    (data / "localconf.py").write_text("OFFSET = 1\n")
    return project, library, data


def _run_from_stdin(script: str, project: Path, library: Path, data: Path, marker: Path) -> dict[str, list[float]]:
    """The script's answers, once sure that no planted module ran (first: it may fail the map)."""
    out = subprocess.run([sys.executable, "-", str(project), str(data)], input=script, cwd=project,
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": f"{SRC}:{library}"})
    assert not marker.exists() or marker.read_text() == "", marker.read_text()
    assert out.returncode == 0, out.stderr
    answers: dict[str, list[float]] = json.loads(out.stdout.strip().splitlines()[-1])
    return answers


EXPECTED = [float(sum(range(n))) * 2 + 1 for n in range(1, 7)]


def test_a_shadow_of_the_scripts_own_module_in_the_new_working_directory_is_never_imported(tmp_path):
    """The same user: a stale copy of `helpers.py` and a `tablekit.py` in the folder the script
    changed into are not what the caller imported, so no worker imports them; a module the caller
    never loaded (`localconf`) is still found there, through `''`, as the caller finds it."""
    pytest.importorskip("numpy")
    project, library, data = _layout(tmp_path)
    marker = tmp_path / "planted-ran"
    for name in ("helpers", "tablekit", "numpy"):
        (data / f"{name}.py").write_text(PLANTED.format(marker=str(marker)))
    answers = _run_from_stdin(SCRIPT, project, library, data, marker)
    assert answers["process"] == answers["sequential"] == EXPECTED


# The workers start in the data folder; the script imports its module from the project folder
# between two maps, and comes back: the second map's workers are told where that module came from.
BETWEEN_MAPS = """
import json, os, sys
import numpy as np
from hardy import Engine, Pipeline, node

@node(output_name="y")
def same(x):
    return x

project, data = sys.argv[1], sys.argv[2]
os.chdir(data)
with Engine(workers=2) as engine:
    assert [r["y"] for r in Pipeline([same], engine=engine).map(inputs={"x": [1, 2, 3]}, map_over="x")] == [1, 2, 3]
    os.chdir(project)
    import helpers
    os.chdir(data)
    inputs = {"a": [np.arange(n) for n in range(1, 7)]}
    answers = {}
    for executor in ("process", "sequential"):
        pipeline = Pipeline([helpers.total], engine=engine if executor == "process" else Engine(map_executor=executor))
        answers[executor] = [r["s"] for r in pipeline.map(inputs=inputs, map_over="a")]
print(json.dumps(answers))
"""


def test_a_module_imported_between_two_maps_is_found_where_the_caller_found_it(tmp_path):
    """The caller's state looks as it did at the first map (same folder, variables, sys.path), but it
    loaded `helpers` since, from another folder: the running workers learn where from."""
    pytest.importorskip("numpy")
    project, library, data = _layout(tmp_path)
    marker = tmp_path / "planted-ran"
    for name in ("helpers", "tablekit", "numpy"):
        (data / f"{name}.py").write_text(PLANTED.format(marker=str(marker)))
    answers = _run_from_stdin(BETWEEN_MAPS, project, library, data, marker)
    assert answers["process"] == answers["sequential"] == EXPECTED


@pytest.fixture
def planter():
    """A second local user (made here, and removed after, where it does not exist yet)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    try:
        pwd.getpwnam(PLANTER)
        made = False
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PLANTER],
                       check=True, capture_output=True)
        made = True
    yield PLANTER
    if made:
        subprocess.run(["userdel", PLANTER], check=False, capture_output=True)


def test_another_users_module_in_a_shared_folder_the_script_changes_into_never_runs(planter):
    """Another user leaves `numpy.py`, `helpers.py` and `tablekit.py` in a shared data folder (mode
    1777); the victim's script, read from stdin, changes into it and maps with worker processes.
    Before, each worker imported them (as the victim): the caller loaded its own from elsewhere."""
    pytest.importorskip("numpy")
    base = Path(tempfile.mkdtemp(prefix="hardy-import-locations-", dir="/tmp"))  # (the planter reaches it)
    try:
        base.chmod(0o755)
        project, library, data = _layout(base / "victim")
        data.chmod(0o1777)
        marker = base / "planted-ran"
        marker.touch(mode=0o666)
        marker.chmod(0o666)  # (the planted code runs as the victim; the mark must be writable)
        for name in ("numpy", "helpers", "tablekit"):
            subprocess.run(["setpriv", f"--reuid={planter}", f"--regid={planter}", "--init-groups",
                            "sh", "-c", 'cat > "$1"', "sh", str(data / f"{name}.py")],
                           input=PLANTED.format(marker=str(marker)), text=True, check=True)
            assert (data / f"{name}.py").stat().st_uid == pwd.getpwnam(planter).pw_uid
        answers = _run_from_stdin(SCRIPT, project, library, data, marker)
        assert answers["process"] == answers["sequential"] == EXPECTED
    finally:
        shutil.rmtree(base)

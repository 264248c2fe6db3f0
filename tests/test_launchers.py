"""Scripts a launcher runs: `runpy.run_path("train.py")` (a profiler's or a job runner's way, no
`run_name`) names the script's module `<run_path>`. Its nodes compute what they compute in the
launcher's process, and the script runs once: a worker never runs its file again (which would
repeat its side effects: training, writing files, a second map of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")

TRAIN = """
import os
from hardy import Pipeline, node

with open("runs.log", "a") as f:
    f.write(f"{os.getpid()}\\n")
SCALE = 3

@node(output_name="y")
def scaled(x):
    return x * SCALE

SCALE = 5  # set after the node, as a script's configuration is
print([o["y"] for o in Pipeline([scaled]).map(inputs={"x": [1, 2, 3, 4]}, map_over="x")], flush=True)
"""


@pytest.mark.parametrize("run_name", [None, "train", "experiment"])
def test_a_script_run_by_runpy_run_path_runs_once_and_its_nodes_read_its_state(tmp_path, run_name):
    """Named `<run_path>`, or by a `run_name` (which may be the file's own name, importable)."""
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    launcher = f"import runpy; runpy.run_path('train.py', run_name={run_name!r})" if run_name else \
        "import runpy; runpy.run_path('train.py')"
    out = subprocess.run([sys.executable, "-c", launcher], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[5, 10, 15, 20]"
    ran_in = (tmp_path / "runs.log").read_text().split()
    assert len(ran_in) == 1, f"the script's top level ran in {len(ran_in)} processes"


JOB = """
import os
from hardy import Pipeline, node

with open("runs.log", "a") as f:
    f.write(f"{os.getpid()}\\n")
SCALE = 3

@node(output_name="y")
def scaled(x):
    return x * SCALE

pipeline = Pipeline([scaled])
print([o["y"] for o in pipeline.map(inputs={"x": [1, 2, 3, 4]}, map_over="x")], flush=True)
"""


@pytest.mark.parametrize("command", [[sys.executable, "-c", "import job"],
                                     [sys.executable, "-m", "hardy.cli", "run", "job:pipeline", "--set", "x=7"]])
def test_a_module_whose_top_level_maps_runs_once_when_imported(tmp_path, command):
    """A file with no `__main__` guard imported (in a notebook, by `hardy run job:pipeline`): each
    worker imported it to find the node, ran its top level, and so the whole map again in itself,
    side effects included (three processes wrote the log, and `double` ran 60 times for 20 items)."""
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(tmp_path)])})
    assert out.returncode == 0, out.stderr
    if "run" in command:  # (`hardy run` keeps its standard output for the results: the script's print goes to stderr)
        assert '"y": 21' in out.stdout and "[3, 6, 9, 12]" in out.stderr, out
    else:
        assert out.stdout.split("\n")[0] == "[3, 6, 9, 12]"
    ran_in = (tmp_path / "runs.log").read_text().split()
    assert len(ran_in) == 1, f"the module's top level ran in {len(ran_in)} processes"


def test_a_module_another_thread_is_importing_is_not_taken_for_one_that_maps_at_import(tmp_path, monkeypatch):
    """A module counts as one whose top level ran a map only where its top level runs in the thread
    that compiles the plan: marked while merely imported by another thread at that moment, it was
    never imported by a worker again, its state sent as a script's is."""
    import threading

    from hardy.shipping.replica import is_script
    (tmp_path / "gate.py").write_text("import threading\ninside, go = threading.Event(), threading.Event()\n")
    (tmp_path / "half_imported.py").write_text("import gate\ngate.inside.set()\ngate.go.wait(60)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gate
    importing = threading.Thread(target=lambda: __import__("half_imported"))
    importing.start()
    try:
        assert gate.inside.wait(60)
        assert is_script("half_imported") is False
    finally:
        gate.go.set()
        importing.join()
    assert is_script("half_imported") is False
    for name in ("gate", "half_imported"):
        sys.modules.pop(name, None)

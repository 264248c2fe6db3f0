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

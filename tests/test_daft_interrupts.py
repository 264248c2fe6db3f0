"""Ctrl-C and crashes on daft_engine(), with real Daft processes: what finished is kept, nothing
outlives the driver, and a crash names its item's inputs as the process executor does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("daft")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = """
import os, sys, time
from pathlib import Path
from hardy import Pipeline, node
from hardy.integrations.daft import daft_engine
marks = Path(sys.argv[1])

@node(output_name="y")
def step(x: int) -> int:
    if x >= 2:
        (marks / f"hung{x}").touch()
        time.sleep(3600)
    (marks / f"done{x}").touch()
    return x + 1

Pipeline(nodes=[step], engine=daft_engine(max_concurrency=2)).map(inputs={"x": list(range(4))}, map_over="x")
"""


def _tagged(tag: str) -> list[int]:
    """The live processes whose environment holds `tag` (the script's and all it started)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if tag.encode() in f.read():
                    with open(f"/proc/{name}/stat") as s:
                        if s.read().rpartition(")")[2].split()[0] not in "ZX":
                            found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


def _interrupt(tmp_path: Path, group: bool) -> tuple[str, list[int]]:
    """The script run until items 0 and 1 finished and 2 and 3 hang, then a SIGINT to its pid
    (or its process group): its output, and the processes tagged as its own still alive once it
    ended (the kill of an orphan takes the kernel a moment: looked for until none, or a minute)."""
    (tmp_path / "s.py").write_text(textwrap.dedent(SCRIPT))
    tag = f"HARDY_DAFT_TEST={uuid.uuid4().hex}"
    env = {**os.environ, tag.split("=")[0]: tag.split("=")[1]}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "s.py"), str(tmp_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=group)
    wanted = {"done0", "done1", "hung2", "hung3"}
    while not wanted <= {p.name for p in tmp_path.iterdir()}:
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    left = _tagged(tag)
    for _ in range(600):
        if not left:
            break
        time.sleep(0.1)
        left = _tagged(tag)
    for pid in left:  # (clean up after a failure)
        os.kill(pid, signal.SIGKILL)
    return out, left


def test_daft_a_sigint_to_the_driver_keeps_what_finished_and_leaves_no_process(tmp_path):
    out, left = _interrupt(tmp_path, group=False)
    assert "MapInterrupted: map interrupted: 2 of 4 items completed" in out, out
    assert left == [], f"processes outlived the driver: {left}"


def test_daft_a_ctrl_c_to_the_group_is_an_interrupt_not_a_result(tmp_path):
    """Daft takes the group's SIGINT itself and ends its query early, without an error: the map
    must still say it was interrupted, not hand back None for the items not run."""
    out, left = _interrupt(tmp_path, group=True)
    assert "MapInterrupted: map interrupted: 2 of 4 items completed" in out, out
    assert left == [], f"processes outlived the driver: {left}"


def test_daft_a_crash_names_the_items_inputs():
    from hardy import Pipeline, node
    from hardy.integrations.daft import daft_engine

    @node(output_name="y")
    def danger(x: int) -> int:
        if x == 1:
            os._exit(7)
        return x

    out = Pipeline(nodes=[danger], engine=daft_engine(max_concurrency=1)).map(
        inputs={"x": [0, 1, 2]}, map_over="x", on_error="continue")
    assert out[0] == {"y": 0} and out[2] == {"y": 2}
    assert "node 'danger' failed on item 1 (inputs: x=1)" in str(out[1].error), str(out[1].error)

"""A batched node's outputs are read by rows on every executor: pandas DataFrames and Series,
dicts of columns, Arrow tables and arrays, numpy arrays and torch tensors hand row i to item i, or
fail the call's items with one `BatchShapeError`; a `sys.exit()` or another BaseException in a
batch call is bisected like any failure and never ends the caller. Each case runs as a user's
script (`python -`, no `__main__` guard) on the sequential, threaded and process executors and on
Dask and Ray, and every executor must print what the sequential one prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import executors

pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

SRC = str(Path(__file__).resolve().parent.parent / "src")

SCRIPT = r'''
import json
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from hardy import Engine, Failed, Pipeline, node

EXECUTOR = sys.argv[1]
if EXECUTOR == "dask":
    from hardy.integrations.dask import DaskExecutor
    EXECUTOR = DaskExecutor(workers=1)
if EXECUTOR == "ray":
    from hardy.integrations.ray import RayExecutor
    EXECUTOR = RayExecutor(workers=1)


@node(output_name="feat", batch_size=3)
def frame(x):  # as many columns as items: iterating it would give the column labels
    return pd.DataFrame({"double": [v * 2 for v in x], "square": [v * v for v in x], "text": [str(v) for v in x]})


@node(output_name="feat", batch_size=3)
def series(x):
    return pd.Series([v + 0.5 for v in x], index=[f"r{v}" for v in x])


@node(output_name="feat", batch_size=3)
def columns(x):
    return {"double": np.array([v * 2 for v in x]), "text": [str(v) for v in x]}


@node(output_name="feat", batch_size=3)
def arrow_table(x):
    return pa.table({"double": [v * 2 for v in x], "text": [str(v) for v in x]})


@node(output_name="feat", batch_size=3)
def arrow_array(x):
    return pa.array([v * 3 for v in x])


@node(output_name="feat", batch_size=3)
def matrix(x):
    return np.array([[v, v * v] for v in x])


@node(output_name="feat", batch_size=3)
def tensor(x):
    return torch.tensor([[float(v), float(-v)] for v in x])


@node(output_name=("a", "b"), batch_size=3)
def two(x):
    return pd.Series([v * 2 for v in x]), pa.table({"n": list(x)})


@node(output_name="feat", batch_size=3)
def short_frame(x):  # a row short: the function's mistake, every item of the call says so
    return pd.DataFrame({"double": [v * 2 for v in x][1:]})


@node(output_name="feat", batch_size=3)
def ragged(x):
    return {"double": [v * 2 for v in x], "text": ["only one"]}


class Stop(BaseException):
    pass


@node(output_name="feat", batch_size=4)
def quits(x):
    if 2 in x:
        sys.exit(7)
    if 5 in x:
        raise Stop("item five")
    return [v + 1 for v in x]


def plain(value):
    """JSON-able, types kept: what each item received."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return [type(value).__module__.partition(".")[0], value.tolist()]
    return value


with Engine(map_executor=EXECUTOR, workers=1) as engine:
    for n in (frame, series, columns, arrow_table, arrow_array, matrix, tensor, two, short_frame, ragged, quits):
        out = Pipeline(nodes=[n], engine=engine).map(inputs={"x": list(range(7))}, map_over="x",
                                                     on_error="continue")
        print(json.dumps([n.name, [
            [type(o.error).__name__, type(o.error.__cause__).__name__, o.error.reason or str(o.error.__cause__)]
            if isinstance(o, Failed) else plain(o) for o in out]]))
print("the caller goes on")
'''


def _run(executor: str) -> dict[str, list[object]]:
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-", executor], input=SCRIPT, capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("the caller goes on"), done.stdout + done.stderr
    return dict(json.loads(line) for line in done.stdout.splitlines()[:-1])


@pytest.fixture(scope="module")
def sequential() -> dict[str, list[object]]:
    return _run("sequential")


def test_tables_frames_and_arrays_hand_out_one_row_per_item(sequential):
    out = sequential
    assert out["frame"][4] == {"feat": {"double": 8, "square": 16, "text": "4"}}
    assert out["series"][6] == {"feat": 6.5}  # by position, whatever the index
    assert out["columns"][1] == {"feat": {"double": ["numpy", 2], "text": "1"}}
    assert out["arrow_table"][5] == {"feat": {"double": 10, "text": "5"}}
    assert out["arrow_array"][2] == {"feat": 6}
    assert out["matrix"][3] == {"feat": ["numpy", [3, 9]]}
    assert out["tensor"][2] == {"feat": ["torch", [2.0, -2.0]]}
    assert out["two"][4] == {"a": 8, "b": {"n": 4}}


def test_a_wrong_shape_fails_the_calls_items_with_one_sentence(sequential):
    failed = sequential["short_frame"]
    assert all(f[0] == "NodeError" and f[1] == "BatchShapeError" for f in failed)
    assert failed[0][2] == ("batched node 'short_frame' was called with 3 item(s) and returned a DataFrame of 2 "
                            "row(s); return one entry per item, in the items' order: a list, an array or tensor "
                            "with a row per item, a DataFrame or Arrow table with a row per item, or a dict of such "
                            "columns"), failed[0]
    assert "called with 1 item(s)" in failed[6][2]  # the last call, of the seventh item alone
    assert "returned a dict of columns whose 'text' is a list of length 1" in sequential["ragged"][0][2]


def test_sys_exit_and_other_base_exceptions_in_a_batch_call_fail_their_item_alone(sequential):
    out = sequential["quits"]
    assert out[2] == ["NodeError", "SystemExit", "called sys.exit(7); a node cannot end the process that runs it: "
                      "raise an exception instead"]
    assert out[5] == ["NodeError", "Stop", "item five"]
    assert [o for k, o in enumerate(out) if k not in (2, 5)] == [{"feat": v + 1} for v in (0, 1, 3, 4, 6)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("executor", executors("threaded", "process", "dask", "ray"))
def test_every_executor_gives_the_sequential_answer(executor, sequential):
    if executor in ("dask", "ray"):
        pytest.importorskip("distributed" if executor == "dask" else "ray")
    assert _run(executor) == sequential

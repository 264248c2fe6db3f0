"""A bad item costs that item, on the process executor: inputs that cannot be pickled here or
unpickled (imported, rebuilt) in the worker, whose unpickling crashes the worker, results whose
pickling crashes it. Each becomes one `Failed` naming node, item, the input and its type and the
cause; every other item's result is kept, and nothing blames `preload=`. Real worker processes,
real segfaults (null-pointer reads). The engines' executors: tests/test_distributed.py."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import Unloadable, needs_torch
from hardy import Engine, Failed, NodeCrashed, Pipeline, node
from hardy.errors import ShippingError

SRC = str(Path(__file__).resolve().parents[1] / "src")


class SegfaultsWhenUnpickled:
    """Pickles fine; reading it back is a null-pointer read, wherever that happens."""

    def __reduce__(self):
        return ctypes.string_at, (0,)


class SegfaultsWhenPickled:
    def __reduce__(self):
        ctypes.string_at(0)


@node(output_name="y")
def plus_one(x):
    return x + 1 if isinstance(x, int) else 0


@node(output_name="y")
def bad_result_at_7(x: int):
    return SegfaultsWhenPickled() if x == 7 else x


def _deep(n: int) -> list:
    value: list = []
    for _ in range(n):
        value = [value]
    return value


@pytest.fixture(scope="module")
def engine():
    with Engine(map_executor="process", workers=2) as engine:
        yield engine


def _split(out: list) -> tuple[list, dict]:
    return [o for o in out if not isinstance(o, Failed)], {i: o.error for i, o in enumerate(out) if isinstance(o, Failed)}


def _hidden_class(tmp_path: Path) -> type:
    """A class from a module loaded from a file not on sys.path, then deleted: importable here only."""
    path = tmp_path / "hardy_hidden_mod.py"
    path.write_text("class Hidden:\n    pass\n")
    spec = importlib.util.spec_from_file_location("hardy_hidden_mod", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hardy_hidden_mod"] = module
    spec.loader.exec_module(module)
    path.unlink()  # (a worker imports a module from where this process loaded it: gone, it cannot)
    return module.Hidden


@pytest.mark.parametrize("bad, kind, cause", [
    (threading.Lock(), "_thread.lock", "cannot pickle '_thread.lock' object"),
    (_deep(20_000), "list", "recursion"),
])
def test_an_input_that_cannot_be_pickled_costs_its_item(engine, bad, kind, cause):
    items = list(range(200))
    items[150] = bad
    out = Pipeline(nodes=[plus_one], engine=engine).map(inputs={"x": items}, map_over="x", on_error="continue")
    ok, failed = _split(out)
    assert ok == [{"y": x + 1} for x in range(200) if x != 150] and list(failed) == [150]
    err = failed[150]
    assert isinstance(err, ShippingError) and err.node == "plus_one" and err.item == 150
    assert f"input 'x' ({kind})" in str(err) and cause in str(err)


def test_inputs_the_worker_cannot_unpickle_cost_their_items(engine, tmp_path):
    items: list = list(range(300))
    items[0] = SegfaultsWhenUnpickled()  # the first chunk of the map: it once blamed preload=
    items[100] = [_hidden_class(tmp_path)()]  # (inside a list: code given bare is fingerprinted, its module sent)
    items[200] = Unloadable()
    items[250] = SegfaultsWhenUnpickled()
    out = Pipeline(nodes=[plus_one], engine=engine).map(inputs={"x": items}, map_over="x", on_error="continue")
    ok, failed = _split(out)
    assert ok == [{"y": x + 1} for x in range(300) if x not in (0, 100, 200, 250)]
    assert sorted(failed) == [0, 100, 200, 250] and all(e.node == "plus_one" for e in failed.values())
    missing = failed[100]
    assert isinstance(missing, ShippingError) and missing.item == 100
    assert "input 'x' (list)" in str(missing) and "No module named 'hardy_hidden_mod'" in str(missing)
    assert "make module 'hardy_hidden_mod' importable" in str(missing)
    raised = failed[200]
    assert isinstance(raised, ShippingError) and "input 'x' (conftest.Unloadable)" in str(raised)
    assert "RuntimeError: this object only exists in the process that made it" in str(raised)
    for i in (0, 250):
        crashed = failed[i]
        assert isinstance(crashed, NodeCrashed) and crashed.item == i and crashed.signal == "SIGSEGV"
        assert f"while unpickling its input 'x' ({__name__}.SegfaultsWhenUnpickled)" in str(crashed)
        assert "preload" not in str(crashed)


def test_a_result_whose_pickling_crashes_the_worker_costs_its_item(engine):
    out = Pipeline(nodes=[bad_result_at_7], engine=engine).map(inputs={"x": list(range(40))}, map_over="x",
                                                               on_error="continue")
    ok, failed = _split(out)
    assert ok == [{"y": x} for x in range(40) if x != 7] and list(failed) == [7]
    err = failed[7]
    assert isinstance(err, NodeCrashed) and err.node == "bad_result_at_7" and err.signal == "SIGSEGV"
    assert "while pickling the item's result" in str(err)


CRASHES_ON_IMPORT = """
import ctypes, os
if str(os.getpid()) != os.environ.get("HARDY_TEST_IMPORTER"):  # any process but the test's: its workers
    ctypes.string_at(0)
from hardy import node

@node(output_name="y")
def double(x):
    return 2 * x
"""


def test_a_node_module_whose_import_crashes_the_worker_fails_the_chunks_items(tmp_path, monkeypatch):
    """The worker dies loading the pipeline (importing the node's module), before any item runs:
    each item of the chunk fails with the crash, named as the pipeline's, and the map ends."""
    (tmp_path / "hardy_crashes_on_import.py").write_text(CRASHES_ON_IMPORT)
    monkeypatch.setenv("HARDY_TEST_IMPORTER", str(os.getpid()))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hardy_crashes_on_import", raising=False)
    from hardy_crashes_on_import import double
    with Engine(map_executor="process", workers=1) as engine:
        out = Pipeline(nodes=[double], engine=engine).map(inputs={"x": [1, 2, 3]}, map_over="x", on_error="continue")
    ok, failed = _split(out)
    assert ok == [] and sorted(failed) == [0, 1, 2]
    for i, err in failed.items():
        assert isinstance(err, NodeCrashed) and err.node == "<pipeline>" and err.item == i and err.signal == "SIGSEGV"
        assert "died (worker died from SIGSEGV (segmentation fault in native code)) while loading the pipeline " \
               "(unpickling its nodes, importing their modules)" in str(err), err


def test_a_poison_input_fails_the_map_at_once_under_on_error_raise(engine):
    from hardy import MapError
    items: list = list(range(50))
    items[20] = threading.Lock()
    with pytest.raises(MapError) as info:
        Pipeline(nodes=[plus_one], engine=engine).map(inputs={"x": items}, map_over="x")
    assert list(info.value.failures) == [20] and isinstance(info.value.failures[20], ShippingError)


SPARSE = """
import torch
from hardy import Engine, Pipeline, node

@node(output_name="total")
def total(t):
    return float(t.to_dense().sum())

big = torch.sparse_coo_tensor([[0, 1999], [1999, 0]], [1.0, 2.0], (2000, 2000))
items = [big, torch.ones(300_000), big.to_sparse_csr()]
with Engine(map_executor="process", workers=2) as engine:
    print([o["total"] for o in Pipeline(nodes=[total], engine=engine).map(inputs={"t": items}, map_over="t")])
"""


@pytest.mark.slow  # torch in a subprocess
def test_sparse_tensors_travel_by_torchs_own_pickling():
    needs_torch()
    done = subprocess.run([sys.executable, "-"], input=SPARSE, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[3.0, 300000.0, 3.0]"


def test_an_input_whose_class_is_in_a_module_only_this_process_can_import_runs_as_here(engine, tmp_path):
    """A class from a file that is not on sys.path, given bare: its module is loaded in the worker
    from the file this process loaded it from, as a node's own module is (the item failed)."""
    items: list = [1, _hidden_class(tmp_path)(), 3]
    out = Pipeline(nodes=[plus_one], engine=engine).map(inputs={"x": items}, map_over="x", on_error="continue")
    assert out == [{"y": 2}, {"y": 0}, {"y": 4}]

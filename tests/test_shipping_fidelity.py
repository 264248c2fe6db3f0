"""What crosses to a worker and back is what the sequential executor hands over, or a clear refusal
(docs/same-answer.md): values whose libraries' own pickling loses part of them, through real
worker processes, each compared with the sequential executor's answer.

- an open text file: cloudpickle would send a `StringIO` copy of what is left to read; it is
  refused as a binary file is (an input: the item fails, or the call before anything runs; a
  result: its item fails);
- an ndarray subclass's instance attributes (numpy's pickle drops them): they arrive;
- a tensor's `.grad` (torch's pickle drops it), a module's parameters' too: it arrives;
- a result attached to an autograd graph (a loss without `torch.no_grad()`): its graph cannot
  leave the worker, so it arrives detached, with a warning naming the node and the fixes;
- a module that made itself an instance of its own class (`torch.backends.cudnn`), read by a
  script's node: it travels by reference (cloudpickle pickled its attributes, and failed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_torch
from hardy import Engine, Failed, Pipeline, node
from hardy.buffers import THRESHOLD
from hardy.errors import PicklingError

pytestmark = pytest.mark.timeout(180)

SRC = str(Path(__file__).resolve().parent.parent / "src")


@pytest.fixture(scope="module")
def engines():
    process = Engine(map_executor="process", workers=2)
    yield {"sequential": Engine(map_executor="sequential"), "process": process}
    process.close()


@node(output_name="f")
def opened(mode: str):
    return open(__file__, mode)


@node(output_name="kind")
def kind_of(fh, x):
    return type(fh).__name__


def test_an_open_text_file_returned_fails_its_item_as_a_binary_file_does(engines):
    got = Pipeline([opened], engine=engines["process"]).map(inputs={"mode": ["r", "rb"]}, map_over="mode",
                                                           on_error="continue")
    assert all(isinstance(o, Failed) for o in got), got  # (a StringIO copy came back before)
    for o, kind, mode in zip(got, ("_io.TextIOWrapper", "_io.BufferedReader"), ("r", "rb")):
        assert f"its output 'f' ({kind}) cannot be pickled back to the parent process" in str(o.error)
        assert f"failed on item {o.error.item} (inputs: mode={mode!r}):" in str(o.error)  # (as other failures say)
        assert f"cannot pickle '{kind}' object" in str(o.error)
    here = Pipeline([opened], engine=engines["sequential"]).map(inputs={"mode": ["r"]}, map_over="mode")
    assert type(here[0]["f"]).__name__ == "TextIOWrapper"  # (what a worker cannot hand back)
    here[0]["f"].close()


@pytest.mark.parametrize("mode", ["r", "rb"])
def test_an_open_text_file_given_is_refused_as_a_binary_file_is(engines, mode):
    pipeline = Pipeline([kind_of], engine=engines["process"])
    with open(__file__, mode) as one, open(__file__, mode) as two:
        got = pipeline.map(inputs={"fh": [one, two], "x": 1}, map_over="fh", on_error="continue")
        assert all(isinstance(o, Failed) for o in got), got  # (the node saw a StringIO before)
        kind = type(one).__name__
        for o in got:
            assert f"input 'fh' (_io.{kind}) cannot be pickled to be sent" in str(o.error)
            assert "Pass plain data (or a path) instead" in str(o.error)
        with pytest.raises(PicklingError, match=rf"input 'fh' \(_io.{kind}, given to every item\) cannot be sent"):
            pipeline.map(inputs={"fh": one, "x": [1, 2]}, map_over="x")  # before anything runs
        here = Pipeline([kind_of], engine=engines["sequential"]).map(inputs={"fh": [one], "x": 1}, map_over="fh")
        assert here[0]["kind"] == kind


class Image(np.ndarray):
    """numpy's subclassing recipe: an attribute set in `__array_finalize__`."""

    def __new__(cls, a, meta=None):
        obj = np.asarray(a).view(cls)
        obj.meta = meta
        return obj

    def __array_finalize__(self, obj):
        self.meta = getattr(obj, "meta", None)


@node(output_name="cam")
def camera(img):
    return (type(img).__name__, img.meta, float(img.sum()))


@node(output_name="img")
def load(i: int):
    return {"small": Image(np.full(3, i), meta={"camera": f"cam{i}"}),
            "big": Image(np.full(THRESHOLD // 8 + 1, float(i)), meta=f"big{i}")}  # (> 1 MiB: the big path)


def test_an_ndarray_subclass_keeps_its_attributes_both_ways(engines):
    images = [Image([1, 2], meta={"camera": "left"}), Image(np.ones(THRESHOLD // 8 + 1), meta="big")]
    answers = {}
    for name, engine in engines.items():
        read = Pipeline([camera], engine=engine).map(inputs={"img": images}, map_over="img")
        made = Pipeline([load], engine=engine).map(inputs={"i": [7]}, map_over="i")[0]["img"]
        answers[name] = ([r["cam"] for r in read],
                         [(type(a).__name__, a.meta, float(a.sum())) for a in (made["small"], made["big"])])
    assert answers["process"] == answers["sequential"]  # (meta None in a worker, and back, before)
    assert answers["sequential"][0][0] == ("Image", {"camera": "left"}, 3.0)


SALIENCY = """
    import torch
    from hardy import Engine, Pipeline, node

    @node(output_name="image")
    def saliency(model, seed):
        image = torch.rand(4, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        model(image).sum().backward()
        return image                        # the caller reads image.grad

    @node(output_name="trained")
    def one_step(model, seed):
        m = torch.nn.Linear(4, 1)
        m.load_state_dict(model.state_dict())
        m(torch.ones(4)).sum().backward()
        return m                            # the caller reads m.weight.grad

    @node(output_name="grads")
    def grads_of(x, w):
        return (x.grad.tolist(), w.grad.tolist(), type(w).__name__)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.rand(3, requires_grad=True)
    (x * 2).sum().backward()
    w = torch.nn.Parameter(torch.ones(2))
    (w * 3).sum().backward()
    big = torch.rand(300_000, requires_grad=True)   # over 1 MiB: out of band
    big.sum().backward()
    for name in ("sequential", "process"):
        engine = Engine(map_executor=name, workers=2)
        out = Pipeline(nodes=[saliency], engine=engine).map(inputs={"model": model, "seed": [1, 2]}, map_over="seed")
        print(name, "image.grad", [r["image"].grad.tolist() for r in out])
        t = Pipeline(nodes=[one_step], engine=engine).run(inputs={"model": model, "seed": 0})
        print(name, "weight.grad", t["trained"].weight.grad.tolist(), t["trained"].bias.grad.tolist())
        g = Pipeline(nodes=[grads_of], engine=engine).map(inputs={"x": [x, x], "w": w}, map_over="x")
        print(name, "inputs' grads", [r["grads"] for r in g])
        b = Pipeline(nodes=[grads_of], engine=engine).run(inputs={"x": big, "w": w})
        print(name, "big input's grad", b["grads"][0] == big.grad.tolist())
        engine.close()
"""


def test_a_tensor_keeps_its_grad_both_ways(tmp_path):
    """torch in a subprocess (conftest.needs_torch): a leaf's `.grad`, a node's input and its
    result, a module's parameters' grads, a `Parameter` and a tensor over 1 MiB."""
    needs_torch()
    out = subprocess.run([sys.executable, "-"], input=textwrap.dedent(SALIENCY), text=True, capture_output=True,
                         timeout=150, cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    seq = [line.split(" ", 1)[1] for line in lines if line.startswith("sequential ")]
    process = [line.split(" ", 1)[1] for line in lines if line.startswith("process ")]
    assert len(seq) == 4 and "None" not in " ".join(seq), lines
    assert process == seq  # (every grad None in a worker, and back, before)
    assert seq[-1] == "big input's grad True"


DETACHED = """
    import warnings
    import torch
    from hardy import Engine, Pipeline, node

    torch.manual_seed(0)
    NET = torch.nn.Linear(3, 1)

    @node(output_name="loss")
    def loss(x):                            # a forward pass without torch.no_grad()
        return (NET(torch.full((1, 3), float(x))) ** 2).mean()

    @node(output_name="value")
    def value(x):                           # inference done right: no graph
        with torch.no_grad():
            return NET(torch.full((1, 3), float(x)))

    for name in ("sequential", "process"):
        engine = Engine(map_executor=name, workers=2)
        for nodes in ([loss], [value]):
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                out = Pipeline(nodes=nodes, engine=engine).map(inputs={"x": [1, 2, 3, 4, 5, 6]}, map_over="x")
                again = Pipeline(nodes=nodes, engine=engine).run(inputs={"x": 7})
            first = list(out[0].values())[0]
            print(name, nodes[0].name, [round(float(list(o.values())[0]), 4) for o in out],
                  round(float(list(again.values())[0]), 4), first.requires_grad, first.grad_fn is not None)
            for w in got:
                print(name, "warned", w.category.__name__, str(w.message))
        engine.close()
"""


def test_a_result_attached_to_its_autograd_graph_comes_back_with_a_warning(tmp_path):
    """A node's result attached to an autograd graph (a loss computed without `torch.no_grad()`)
    cannot take its graph out of a worker: it arrives a leaf, and `backward()` in the caller
    silently filled no `.grad`. Not an error (inference code that forgets `no_grad` only reads
    the values, which are the same): a warning naming the node and the fixes, once per node in a
    worker (two workers: at most twice, however many items and calls), none for a result without
    a graph."""
    needs_torch()
    out = subprocess.run([sys.executable, "-"], input=textwrap.dedent(DETACHED), text=True, capture_output=True,
                         timeout=150, cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    answers = {name: [line.split(" ", 1)[1] for line in lines if line.startswith(name) and " warned " not in line]
               for name in ("sequential", "process")}
    assert answers["sequential"][0].endswith("True True") and answers["process"][0].endswith("True False")
    assert [a.rsplit(" ", 2)[0] for a in answers["process"]] == [a.rsplit(" ", 2)[0] for a in answers["sequential"]]
    warned = [line for line in lines if " warned " in line]
    assert not [w for w in warned if w.startswith("sequential")], warned
    assert 1 <= len(warned) <= 2, warned  # (once per worker that ran the node)
    message = warned[0]
    assert message.startswith("process warned UserWarning node 'loss' returned a torch tensor attached to an "
                              "autograd graph"), message
    for part in ("backward()", "torch.no_grad()", "torch.inference_mode()", ".detach()",
                 'map_executor="sequential"'):
        assert part in message, (part, message)


FLAGS = """
import sys
from hardy import Engine, Pipeline, node

open("flags.py", "w").write('''
import sys, types

class _Flags(types.ModuleType):  # a module made an instance of its own class, for a property
    @property
    def strict(self):
        return self.level > 1

level = 0
sys.modules[__name__].__class__ = _Flags
''')
import flags
flags.level = 2

@node(output_name="y")
def checked(x):
    return [flags.strict, x]

@node(output_name="y")
def cudnn_flags(x):
    return [torch.backends.cudnn.deterministic, torch.backends.cudnn.is_available(), x]

nodes = [checked]
if sys.argv[1] == "torch":
    import torch
    torch.backends.cudnn.deterministic = True
    nodes = [checked, cudnn_flags]
for name in ("sequential", "process"):
    engine = Engine(map_executor=name)
    for n in nodes:
        print(name, Pipeline(nodes=[n], engine=engine).map(inputs={"x": [1, 2]}, map_over="x"))
    engine.close()
"""


@pytest.mark.parametrize("library", ["own", "torch"])
def test_a_script_node_reading_a_module_that_replaced_itself_travels(tmp_path, library):
    """A module replaced in `sys.modules` by an instance of its own subclass (for properties: the
    user's own, or torch's `torch.backends.cudnn`), read by a node of a script: it travels by
    reference, as a module does, where cloudpickle pickled its attributes and failed."""
    if library == "torch":
        needs_torch()
    out = subprocess.run([sys.executable, "-", library], input=textwrap.dedent(FLAGS), text=True,
                         capture_output=True, timeout=150, cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    seq = [line.split(" ", 1)[1] for line in lines if line.startswith("sequential ")]
    assert [line.split(" ", 1)[1] for line in lines if line.startswith("process ")] == seq
    assert seq[0] == "[{'y': [True, 1]}, {'y': [True, 2]}]"
    assert len(seq) == (2 if library == "torch" else 1)


LOOKS_ITSELF_UP = """
import sys
from hardy import Engine, Pipeline, node

class Settings:  # answers unknown names from its own dict, as pydantic's ConfigWrapper does
    def __init__(self, **config):
        self.config = config

    def __getattr__(self, name):
        try:
            return self.config[name]
        except KeyError:
            raise AttributeError(name) from None

SETTINGS = Settings(scale=3)

@node(output_name="y")
def scaled(x):
    return x * SETTINGS.scale

nodes = [scaled]
if sys.argv[1] == "pydantic":
    import pydantic

    @node(output_name="y")
    @pydantic.validate_call
    def parsed(x: float):
        return repr(x)
    nodes = [parsed]
for name in ("sequential", "process"):
    engine = Engine(map_executor=name)
    print(name, Pipeline(nodes=nodes, engine=engine).map(inputs={"x": ["2"] if nodes[0] is not scaled else [2]},
                                                           map_over="x"))
    engine.close()
"""


@pytest.mark.parametrize("library", ["own", "pydantic"])
def test_an_object_whose_getattr_reads_its_own_attributes_travels(tmp_path, library):
    """An object whose `__getattr__` reads one of its own attributes (pydantic's `ConfigWrapper`,
    held by every `@validate_call` function) cannot be unpickled the default way: pickle looks
    `__setstate__` up on it before its state is set, and the look-up recursed until RecursionError,
    so a script's `@validate_call` node could not be loaded in a worker."""
    if library == "pydantic":
        pytest.importorskip("pydantic")
    out = subprocess.run([sys.executable, "-", library], input=textwrap.dedent(LOOKS_ITSELF_UP), text=True,
                         capture_output=True, timeout=150, cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    expected = "[{'y': '2.0'}]" if library == "pydantic" else "[{'y': 6}]"
    assert lines == [f"sequential {expected}", f"process {expected}"], lines



class _Registered:
    """A `__getattr__` of its own and a reduction registered with copyreg (which wins)."""

    def __init__(self, v: int):
        self.v = v

    def __getattr__(self, name: str):
        raise AttributeError(name)


def _module_named(name: str) -> object:
    import types
    return types.ModuleType(name)


def _made(v: int) -> _Registered:
    made = _Registered(v)
    made.via_copyreg = True
    return made


def test_copyreg_registrations_and_a_modules_own_reduction_are_kept():
    """hardy's reductions step aside for a class registered with copyreg, and for a module subclass
    with a reduction of its own (its module not in sys.modules): the first was pickled by hardy's
    rule for classes with a `__getattr__`, the second raised in the worker transport's pickler."""
    import copyreg
    import pickle
    import types

    from hardy.shipping import out_of_band
    from hardy.shipping.pickling import pickled_by_value

    copyreg.pickle(_Registered, lambda o: (_made, (o.v,)))
    try:
        back = pickle.loads(pickled_by_value(_Registered(5)))
        assert vars(back) == {"v": 5, "via_copyreg": True}
    finally:
        del copyreg.dispatch_table[_Registered]

    class Own(types.ModuleType):
        def __reduce__(self):
            return _module_named, ("rebuilt",)

    data = out_of_band(Own("nowhere"), lambda buffer: True)
    assert pickle.loads(data).__name__ == "rebuilt"

"""Never stale in one process: a pipeline that is called again after its code changed (a global
reassigned, a helper redefined, a module reloaded, a notebook cell run again) computes — and keys —
with the new code, on in-process and process executors, with and without a cache. Real scripts,
real edited files, a real Jupyter kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")

EDIT_BETWEEN_MAPS = """
from hardy import DiskCache, Engine, Pipeline, node
import sys

FACTOR = 2

def helper(x):
    return 100 * x + 1

@node(output_name="y")
def scaled(x):
    return helper(x) * FACTOR

executor, cache = sys.argv[1], sys.argv[2]
p = Pipeline([scaled], engine=Engine(map_executor=executor), cache=DiskCache(cache) if cache != "-" else None)
first = p.map(inputs={"x": [1, 1]}, map_over="x")

FACTOR = 3

def helper(x):
    return 1000 * x + 1

second = p.map(inputs={"x": [1, 1]}, map_over="x")
third = p.run(inputs={"x": 1})
print([r["y"] for r in first], [r["y"] for r in second], third["y"])
"""


def _first_line(script: str, executor: str, cache: Path | None) -> str:
    """The first line `script` prints, run as `python - EXECUTOR CACHE` (`-`: no cache)."""
    out = subprocess.run([sys.executable, "-", executor, str(cache) if cache else "-"], input=script, text=True,
                         capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")[0]


@pytest.mark.parametrize("executor", ["sequential", "process"])
@pytest.mark.parametrize("cached", [False, True])
def test_a_global_reassigned_and_a_helper_redefined_between_two_maps(tmp_path, executor, cached):
    assert _first_line(EDIT_BETWEEN_MAPS, executor, tmp_path / "c" if cached else None) == "[202, 202] [3003, 3003] 3003"


MODULE = """
OFFSET = {offset}

def helper(x):
    return x + OFFSET
"""

RELOAD = """
import importlib, sys
sys.path.insert(0, sys.argv[1])
import helpers
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="y")
def shifted(x):
    return helpers.helper(x)

engine = Engine(map_executor="process")
cache = DiskCache(sys.argv[2]) if sys.argv[2] != "-" else None
p = Pipeline([shifted], engine=engine, cache=cache)
first = p.map(inputs={"x": [1, 2]}, map_over="x")
with open(sys.argv[1] + "/helpers.py", "w") as f:
    f.write(sys.argv[3])
importlib.reload(helpers)
second = p.map(inputs={"x": [1, 2]}, map_over="x")
other = Pipeline([shifted], engine=engine).map(inputs={"x": [1, 2]}, map_over="x")  # the same workers
print([r["y"] for r in first], [r["y"] for r in second], [r["y"] for r in other])
"""


@pytest.mark.parametrize("cached", [False, True])
def test_importlib_reload_between_two_process_maps_on_one_engine(tmp_path, cached):
    (tmp_path / "helpers.py").write_text(MODULE.format(offset=10))
    out = subprocess.run([sys.executable, "-", str(tmp_path), str(tmp_path / "c") if cached else "-",
                          MODULE.format(offset=1000)], input=RELOAD, text=True, capture_output=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[11, 12] [1001, 1002] [1001, 1002]"


def test_a_module_edited_on_disk_but_not_reloaded_is_never_run_by_a_fresh_worker(tmp_path):
    """The parent runs the code it loaded; a worker that imports the edited file is given the
    parent's code for every name the plan reads, and computes what the parent would."""
    (tmp_path / "helpers.py").write_text(MODULE.format(offset=10))
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import helpers
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def shifted(x):
            return helpers.helper(x)

        with open(sys.argv[1] + "/helpers.py", "w") as f:
            f.write(sys.argv[2])
        p = Pipeline([shifted], engine=Engine(map_executor="process"))
        out = p.map(inputs={"x": [1]}, map_over="x", on_error="continue")
        here = p.run(inputs={"x": 1}, engine=Engine(map_executor="sequential"))["y"]  # the code this process loaded
        print(here, out[0])
    """)
    out = subprocess.run([sys.executable, "-", str(tmp_path), MODULE.format(offset=1000)], input=script, text=True,
                         capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "11 {'y': 11}", out.stdout


CELLS = [
    "import os, sys\nsys.path.insert(0, {src!r})\nfrom hardy import DiskCache, Engine, Pipeline, node",
    "FACTOR = 2\ndef helper(x):\n    return 100 * x + 1",
    "@node(output_name='y')\ndef scaled(x):\n    return helper(x) * FACTOR",
    "p = Pipeline([scaled], engine=Engine(map_executor='process'), cache={cache})",
    "print([r['y'] for r in p.map(inputs={{'x': [1, 1]}}, map_over='x')])",
    "FACTOR = 3\ndef helper(x):\n    return 1000 * x + 1",  # the helper cell, edited and run again
    "print([r['y'] for r in p.map(inputs={{'x': [1, 1]}}, map_over='x')])",
]


@pytest.mark.slow  # a Jupyter kernel
@pytest.mark.parametrize("cached", [False, True])
def test_a_notebook_cell_run_again(tmp_path, cached):
    """A real ipykernel: the cell defining a helper and a global is edited and run again, then
    the map cell: the process executor's workers compute with the new ones, and the cache keys them."""
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        printed = []
        cache = f"DiskCache({str(tmp_path / 'c')!r})" if cached else "None"
        for cell in CELLS:
            reply = kc.execute_interactive(cell.format(src=SRC, cache=cache), timeout=240,
                                           output_hook=lambda msg: printed.append(msg["content"].get("text", ""))
                                           if msg["msg_type"] == "stream" else None)
            assert reply["content"]["status"] == "ok", reply["content"]
        assert "".join(printed).split() == ["[202,", "202]", "[3003,", "3003]"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


MUTATED_BETWEEN_MAPS = """
import functools, sys
from hardy import DiskCache, Engine, Pipeline, node

class Scaler:
    def __init__(self, factor):
        self.factor = factor
    def apply(self, x):
        return x * self.factor
    def __call__(self, x):
        return x * self.factor

def mul(x, k):
    return x * k

scaler, caller, bound = Scaler(2), Scaler(2), functools.partial(mul, k=2)
executor, cache = sys.argv[1], sys.argv[2]
pipelines = [Pipeline([node(f, output_name="y")], engine=Engine(map_executor=executor),
                      cache=DiskCache(f"{cache}/{i}") if cache != "-" else None)
             for i, f in enumerate((scaler.apply, caller, bound))]
first = [[r["y"] for r in p.map(inputs={"x": [1, 2]}, map_over="x")] for p in pipelines]
scaler.factor = caller.factor = 3
bound.keywords["k"] = 3
second = [[r["y"] for r in p.map(inputs={"x": [1, 2]}, map_over="x")] for p in pipelines]
print(first, second)
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
@pytest.mark.parametrize("cached", [False, True])
def test_an_object_a_node_is_bound_to_changed_between_two_maps(tmp_path, executor, cached):
    """`scaler.factor = 3` on the instance of `node(scaler.apply)`, on a callable object, a partial's
    keyword: the pipeline sees it as it sees a global rebound."""
    assert _first_line(MUTATED_BETWEEN_MAPS, executor, tmp_path / "c" if cached else None) == "[[2, 4], [2, 4], [2, 4]] [[3, 6], [3, 6], [3, 6]]"


PARTIAL_ARGUMENTS_CHANGED_IN_PLACE = """
import functools, sys
import numpy as np
from hardy import DiskCache, Engine, Pipeline, node

class Model:
    def __init__(self, w):
        self.w = w

def predict(model, x):
    return model.w * x

def dot(weights, x):
    return int(weights.sum()) * x

model, weights = Model(2), np.array([1, 1])
executor, cache = sys.argv[1], sys.argv[2]
pipelines = [Pipeline([node(f, output_name="y")], engine=Engine(map_executor=executor),
                      cache=DiskCache(f"{cache}/{i}") if cache != "-" else None)
             for i, f in enumerate((functools.partial(predict, model), functools.partial(dot, weights)))]
first = [[r["y"] for r in p.map(inputs={"x": [1, 2]}, map_over="x")] for p in pipelines]
model.w = 3          # (a training step on the model a partial binds positionally)
weights *= 2         # (an array it binds, written in place)
second = [[r["y"] for r in p.map(inputs={"x": [1, 2]}, map_over="x")] for p in pipelines]
print(first, second)
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
@pytest.mark.parametrize("cached", [False, True])
def test_what_a_partial_binds_positionally_changed_in_place_between_two_maps(tmp_path, executor, cached):
    """`node(functools.partial(predict, model))` then the model trained in place: only a partial's
    keywords were watched, so the second map was served the first model's entries (or its workers
    ran their copy of it). Its positional arguments are watched by content, as its keywords."""
    assert _first_line(PARTIAL_ARGUMENTS_CHANGED_IN_PLACE, executor, tmp_path / "c" if cached else None) == "[[2, 4], [2, 4]] [[3, 6], [4, 8]]"


ODD_SYS_MODULES = """
import sys
from hardy import Pipeline, node

class Registry:  # a library may put any object in sys.modules: this one has no __dict__
    __slots__ = ("__name__",)

odd = Registry()
odd.__name__ = "odd_registry"
sys.modules["odd_registry"] = odd
FACTOR = 2

@node(output_name="y")
def scaled(x):
    return x * FACTOR

p = Pipeline([scaled])
first = p.map(inputs={"x": [1, 2]}, map_over="x")
FACTOR = 3
print([r["y"] for r in first], [r["y"] for r in p.map(inputs={"x": [1, 2]}, map_over="x")])
"""


def test_an_object_without_a_namespace_in_sys_modules_does_not_stop_a_map():
    out = subprocess.run([sys.executable, "-"], input=ODD_SYS_MODULES, text=True, capture_output=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[2, 4] [3, 6]"


ADDED_OR_SLOTTED_BETWEEN_MAPS = """
import dataclasses, sys
from hardy import DiskCache, Engine, Pipeline, node

class Slotted:
    __slots__ = ("k", "ks")
    def __init__(self):
        self.k, self.ks = 2, [2]
    def apply(self, x):
        return x * self.k + sum(self.ks)

@dataclasses.dataclass(slots=True)
class Scale:
    k: int = 2
    def __call__(self, x):
        return x * self.k

class Shadowed:
    F = 2
    def apply(self, x):
        return x * self.F

class Optional:
    def __call__(self, x):
        return x * getattr(self, "extra", 2)

def helper(x):
    return x * getattr(helper, "k", 2)

slotted, scale, shadowed, optional = Slotted(), Scale(), Shadowed(), Optional()
executor, cache = sys.argv[1], sys.argv[2]
nodes = [node(f, output_name="y") for f in (slotted.apply, scale, shadowed.apply, optional)]
nodes.append(node(lambda x: helper(x), output_name="y"))
pipelines = [Pipeline([n], engine=Engine(map_executor=executor),
                      cache=DiskCache(f"{cache}/{i}") if cache != "-" else None) for i, n in enumerate(nodes)]
first = [[r["y"] for r in p.map(inputs={"x": [1, 2]}, map_over="x")] for p in pipelines]
slotted.k = 3          # a slot set again
slotted.ks.append(1)   # a slot's list changed in place
scale.k = 3            # a field of a @dataclass(slots=True)
shadowed.F = 3         # an instance attribute added over the class's
optional.extra = 3     # an attribute added to a callable object
helper.k = 3           # an attribute set on a function after its first run
second = [[r["y"] for r in p.map(inputs={"x": [1, 2]}, map_over="x")] for p in pipelines]
print(first, second)
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
@pytest.mark.parametrize("cached", [False, True])
def test_a_slot_set_or_an_attribute_added_between_two_maps(tmp_path, executor, cached):
    """Only an instance's `__dict__` was noted: a slot set again (`o.k = 3`, a `@dataclass(slots=True)`'s
    field) on the object a node is bound to, an attribute added that shadows the class's or that the
    code reads with `getattr(self, name, default)`, and an attribute set on a helper function after
    the first map kept the first map's plan (its entries served, or its workers' copies run)."""
    assert _first_line(ADDED_OR_SLOTTED_BETWEEN_MAPS, executor, tmp_path / "c" if cached else None) == ("[[4, 6], [2, 4], [2, 4], [2, 4], [2, 4]] "
                                         "[[6, 9], [3, 6], [3, 6], [3, 6], [3, 6]]")


ENVIRONMENT_READ = """
import os, sys
from os import environ, getenv
from hardy import DiskCache, Engine, Pipeline, node

SCALE = "SCALE"  # (a name read through a global)

def helper():
    return getenv(SCALE, "1")

@node(output_name="y")
def read(x):
    key = "MODE"
    return f"{x}:{os.environ.get(key, 'none')}:{environ.get('SUFFIX', '-')}:{helper()}"

@node(output_name="z")
def exports(y):
    os.environ["LAST_STEP"] = y  # (set by a node in this process: its own, as in a loop; nothing stale)
    return y

executor, cache = sys.argv[1], sys.argv[2]
p = Pipeline([read, exports], engine=Engine(map_executor=executor), cache=DiskCache(cache))
compiled = []
seen = [p.run(inputs={"x": 1})["y"]]
p.run(inputs={"x": 1})
compiled.append(len(p._plans._items))
os.environ["MODE"] = "exact"
seen.append(p.run(inputs={"x": 1})["y"])
os.environ["SUFFIX"] = "s"
seen.append(p.map(inputs={"x": [1]}, map_over="x")[0]["y"])
os.environ["SCALE"] = "2"
seen.append(p.run(inputs={"x": 1})["y"])
del os.environ["MODE"]
seen.append(p.run(inputs={"x": 1})["y"])
print(" ".join(seen), compiled)
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_an_environment_variable_a_node_reads_is_in_its_key(tmp_path, executor):
    """`os.environ.get("MODE")` in a node (or a helper, through `from os import getenv`): a value
    set between two calls is computed with, never served from the entry of the one before; a second
    process that starts with a variable already set finds its own entries, not the first's."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODE", "SUFFIX", "SCALE", "LAST_STEP")}
    cache = str(tmp_path / "c")
    runs = []
    for extra in ({}, {}, {"MODE": "exact", "SCALE": "2"}):
        out = subprocess.run([sys.executable, "-", executor, cache], input=ENVIRONMENT_READ, text=True,
                             capture_output=True, timeout=300, env={**env, **extra, "PYTHONPATH": SRC})
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.split())
        assert runs[-1][-1] == "[1]"  # (one plan: what `exports` set made nothing stale)
        del runs[-1][-1]
    assert runs[0] == ["1:none:-:1", "1:exact:-:1", "1:exact:s:1", "1:exact:s:2", "1:none:s:2"]
    assert runs[1] == runs[0]  # (every entry found again: the same variables, the same keys)
    assert runs[2] == ["1:exact:-:2", "1:exact:-:2", "1:exact:s:2", "1:exact:s:2", "1:none:s:2"]


CHANGED_IN_PLACE_UNDER_A_CACHE = """
import sys
from hardy import DiskCache, Engine, Pipeline, node

K = 2

@node(output_name="y")
def scale(x, k=2):
    return x * k

def scale_edited(x, k=2):
    return x * k + 1

def inner_times(x):
    return x * K

class Base:
    def run(self, x):
        return x * self.k()
    def k(self):
        return 2

class Other(Base):
    def k(self):
        return 3

executor, cache = sys.argv[1], sys.argv[2]
obj = Base()
pipelines = [Pipeline([n], engine=Engine(map_executor=executor), cache=DiskCache(cache) if cache != "-" else None)
             for n in (scale, Pipeline([node(inner_times, output_name="y")]).as_node(), node(obj.run, output_name="y"))]
seen = [p.run(inputs={"x": 10})["y"] for p in pipelines]
scale.func.__code__ = scale_edited.__code__  # what IPython's autoreload does to an edited module's function
K = 3
obj.__class__ = Other
seen += [p.run(inputs={"x": 10})["y"] for p in pipelines]
scale.func.__defaults__ = (5,)
seen.append(pipelines[0].map(inputs={"x": [10]}, map_over="x")[0]["y"])
print(seen)
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
@pytest.mark.parametrize("cached", [False, True])
def test_a_nodes_own_code_a_nested_pipelines_global_and_a_bound_objects_class_changed(tmp_path, executor, cached):
    """Changed between two calls of one pipeline: the node's own function's code and defaults
    replaced in place (autoreload), a global an inner node of a nested pipeline reads, the class
    of the object a bound-method node runs on. With a cache, each of these was served from the
    first call's plan (its keys, and its nested pipeline's shipped plan)."""
    assert _first_line(CHANGED_IN_PLACE_UNDER_A_CACHE, executor, tmp_path / "c" if cached else None) == "[20, 20, 20, 21, 30, 30, 51]"


SET_BY_A_NODE = """
import os, sys
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="a")
def setter(v):
    os.environ["XMODE"] = str(v)
    return 0

@node(output_name="b")
def reader(w):
    return os.environ.get("XMODE", "unset") + f"/{w}"

os.environ.pop("XMODE", None)
cache, engine = DiskCache(sys.argv[1]), Engine(map_executor="sequential")
if sys.argv[2] == "first":  # the second call's reader computes with what the first call's setter set
    p = Pipeline([setter, reader], cache=cache, engine=engine)
    print(p.run(inputs={"v": 1, "w": 0})["b"], p.run(inputs={"v": 1, "w": 5})["b"])
else:
    print(Pipeline([reader], cache=cache, engine=engine).run(inputs={"w": 5})["b"])
"""


def test_a_variable_a_node_set_in_this_process_keys_the_next_calls_with_its_new_value(tmp_path):
    """A node sets XMODE; the next call's reader computes with it and must be keyed with it: its
    entry was stored under "XMODE unset", and served to a process where XMODE is unset."""
    cache = str(tmp_path / "c")
    env = {**{k: v for k, v in os.environ.items() if k != "XMODE"}, "PYTHONPATH": SRC}
    runs = [subprocess.run([sys.executable, "-", cache, which], input=SET_BY_A_NODE, text=True, capture_output=True,
                           timeout=300, env=env) for which in ("first", "fresh")]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    assert [r.stdout.split() for r in runs] == [["1/0", "1/5"], ["unset/5"]]


def test_a_replaced_os_environ_is_read_as_the_process_environment(tmp_path):
    """`monkeypatch.setattr(os, "environ", {...})` (a dict): a cached node reading a variable raised
    AttributeError from the key's watch, and a change in the new mapping must make the plan stale."""
    script = f"""
import os
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="y")
def read(x):
    return os.environ.get("XMODE", "unset")

os.environ = dict(os.environ)
p = Pipeline([read], cache=DiskCache({str(tmp_path / "c")!r}), engine=Engine(map_executor="sequential"))
first = p.run(inputs={{"x": 1}})["y"]
os.environ["XMODE"] = "set"
print(first, p.run(inputs={{"x": 1}})["y"])
"""
    out = subprocess.run([sys.executable, "-"], input=script, text=True, capture_output=True, timeout=300,
                         env={**{k: v for k, v in os.environ.items() if k != "XMODE"}, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["unset", "set"]


NAMES_IN_CONTAINERS = """
import os
from hardy import DiskCache, Engine, Pipeline, node

KEYS = ("XMODE", "YMODE")

@node(output_name="a")
def looped(x):
    return [os.environ.get(k, "-") for k in ("XMODE", "YMODE")]

@node(output_name="b")
def through_a_global(x):
    return [os.environ.get(k, "-") for k in KEYS]

@node(output_name="c")
def by_default(x, key="XMODE"):
    return os.environ.get(key, "-")

p = Pipeline([looped, through_a_global, by_default], cache=DiskCache({cache!r}), engine=Engine(map_executor="sequential"))
first = p.run(inputs={{"x": 1}})
os.environ["XMODE"] = "on"
print(first, p.run(inputs={{"x": 1}}))
"""


def test_variables_named_in_a_tuple_a_global_tuple_or_a_default_are_keyed(tmp_path):
    script = NAMES_IN_CONTAINERS.format(cache=str(tmp_path / "c"))
    out = subprocess.run([sys.executable, "-"], input=script, text=True, capture_output=True, timeout=300,
                         env={**{k: v for k, v in os.environ.items() if k not in ("XMODE", "YMODE")}, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("{'a': ['-', '-'], 'b': ['-', '-'], 'c': '-'} "
                                  "{'a': ['on', '-'], 'b': ['on', '-'], 'c': 'on'}")


LAMBDAS_PER_CALL = """
import gc, weakref
from hardy import Pipeline, node

@node(output_name="y")
def apply(x, f):
    return f(x)

class Big:
    factor = 2

p = Pipeline([apply])
kept = []
for k in range(4):
    big = Big()
    kept.append(weakref.ref(big))
    assert p.run(inputs={"x": k, "f": lambda v, big=big: v * big.factor})["y"] == 2 * k
    del big
gc.collect()
print(len(p._plans), sum(r() is not None for r in kept))
"""


def test_a_lambda_made_anew_at_each_call_shares_one_plan_and_is_not_kept(tmp_path):
    """Code given as an input keys the plan a call runs: keyed by the function object, each new
    lambda compiled and shipped a plan of its own, and each plan kept what it closed over."""
    out = subprocess.run([sys.executable, "-"], input=LAMBDAS_PER_CALL, text=True, capture_output=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": SRC}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]  # (one plan, and the one function it was compiled with)

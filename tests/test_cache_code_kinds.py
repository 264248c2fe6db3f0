"""Every kind of callable, its behaviour edited: the key changes and a stale hit is impossible.

Each case is a user module defining `target`; its edit changes what `target` computes while
every name stays (the module, the function, the class). For each case, in one fresh interpreter
(torch and numba are never imported by the test process itself): the module as written is
imported, keyed and mapped through a disk cache; imported again from a copy elsewhere (the key
must not move: it is no id, path or address); then the edited module, mapped through the same
cache, must return what the edited code computes, never the entries of the first. Each case runs
twice: the callable as the node (`node(target)`, where its signature allows) and reached as a
global by a node (`def via(x): return target(x)`). A last test checks that the table reaches every
kind of `hardy.hashing.code`'s dispatch: no branch keys a callable by its name alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")

CEXT = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject* scale(PyObject* self, PyObject* arg) { return PyLong_FromLong(PyLong_AsLong(arg) * FACTOR); }
static PyMethodDef methods[] = {{"scale", scale, METH_O, "scale"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "NAME", NULL, -1, methods};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&mod); }
"""

SCALER = '''
class Scaler:
    def __init__(self, factor):
        self.factor = factor
    def apply(self, x):
        return x * self.factor
target = Scaler(2).apply
'''
CALLABLE = '''
class Scale:
    def __init__(self, k):
        self.k = k
    def __call__(self, x):
        return x * self.k
target = Scale(2)
'''
DECORATED = '''
import functools
def deco(f):
    @functools.wraps(f)
    def wrapper(x):
        return f(x) + 1
    return wrapper
@deco
def target(x):
    return x * 2
'''

# name -> (module source defining `target`, the edit (old, new)); INPUTS overrides the items [1, 2, 3]
CASES: dict[str, tuple[str, tuple[str, str]]] = {
    "function": ("def target(x):\n    return x * 2\n", ("x * 2", "x * 3")),
    "lambda": ("target = lambda x: x * 2\n", ("x * 2", "x * 3")),
    "async function": ("async def target(x):\n    return x * 2\nasync def via(x):\n    return await target(x)\n",
                       ("x * 2", "x * 3")),
    "closure cell": ("def make(k):\n    def inner(x):\n        return x * k\n    return inner\ntarget = make(2)\n",
                     ("make(2)", "make(3)")),
    "closure over a closure": ("""
def make(k):
    def helper(x):
        return x * k
    def inner(x):
        return helper(x) + 1
    return inner
target = make(2)
""", ("make(2)", "make(3)")),
    "default argument": ("def target(x, k=2):\n    return x * k\n", ("k=2", "k=3")),
    "keyword-only default": ("def target(x, *, k=2):\n    return x * k\n", ("k=2", "k=3")),
    "lambda as a default": ("def target(x, f=lambda v: v * 2):\n    return f(x)\n", ("v * 2", "v * 3")),
    "module constant": ("K = 2\ndef target(x):\n    return x * K\n", ("K = 2", "K = 3")),
    "helper function": ("def helper(x):\n    return x * 2\ndef target(x):\n    return helper(x)\n",
                        ("x * 2", "x * 3")),
    "table of lambdas": ("OPS = {'scale': lambda v: v * 2}\ndef target(x):\n    return OPS['scale'](x)\n",
                         ("v * 2", "v * 3")),
    "bound method, instance state": (SCALER, ("Scaler(2)", "Scaler(3)")),
    "bound method, method code": (SCALER, ("x * self.factor", "x * self.factor + 1")),
    "bound method, __slots__ instance": ("""
class Scaler:
    __slots__ = ("factor",)
    def __init__(self, factor):
        self.factor = factor
    def apply(self, x):
        return x * self.factor
target = Scaler(2).apply
""", ("Scaler(2)", "Scaler(3)")),
    "bound method, dataclass instance": ("""
import dataclasses
@dataclasses.dataclass(frozen=True)
class Scaler:
    factor: int
    def apply(self, x):
        return x * self.factor
target = Scaler(2).apply
""", ("Scaler(2)", "Scaler(3)")),
    "bound method of a fitted scikit-learn model": ("""
import numpy as np
from sklearn.linear_model import LinearRegression
target = LinearRegression().fit(np.array([[1.0], [2.0]]), np.array([1.0, 2.0]) * 2).predict
INPUTS = [np.array([[1.0]]), np.array([[2.0]])]
""", ("* 2).predict", "* 3).predict")),
    "types.MethodType": ("""
import types
class Box:
    def __init__(self, k):
        self.k = k
def scale(self, x):
    return x * self.k
target = types.MethodType(scale, Box(2))
""", ("Box(2)", "Box(3)")),
    "global bound method": ("""
class Scaler:
    def __init__(self, factor):
        self.factor = factor
    def apply(self, x):
        return x * self.factor
apply = Scaler(2).apply
def target(x):
    return apply(x)
""", ("Scaler(2)", "Scaler(3)")),
    "classmethod": ("""
class Model:
    FACTOR = 2
    @classmethod
    def apply(cls, x):
        return x * cls.FACTOR
target = Model.apply
""", ("FACTOR = 2", "FACTOR = 3")),
    "staticmethod through its class": ("""
class Model:
    @staticmethod
    def apply(x):
        return x * 2
target = Model.apply
""", ("x * 2", "x * 3")),
    "staticmethod object": ("def base(x):\n    return x * 2\ntarget = staticmethod(base)\n", ("x * 2", "x * 3")),
    "partial, keyword": ("import functools\ndef mul(x, k):\n    return x * k\ntarget = functools.partial(mul, k=2)\n",
                         ("k=2", "k=3")),
    "partial, function edited": ("import functools\ndef mul(x, k):\n    return x * k\n"
                                 "target = functools.partial(mul, k=2)\n", ("return x * k", "return x * k + 1")),
    "partial, positional": ("import functools\ndef mul(k, x):\n    return x * k\ntarget = functools.partial(mul, 2)\n",
                            ("partial(mul, 2)", "partial(mul, 3)")),
    "partial of a partial": ("import functools\ndef mul(x, k, j):\n    return x * k + j\n"
                             "target = functools.partial(functools.partial(mul, j=1), k=2)\n", ("j=1", "j=2")),
    "partial of a bound method": ("""
import functools
class Scaler:
    def __init__(self, factor):
        self.factor = factor
    def apply(self, x, offset):
        return x * self.factor + offset
target = functools.partial(Scaler(2).apply, offset=1)
""", ("Scaler(2)", "Scaler(3)")),
    "partialmethod through an instance": ("""
import functools
class Model:
    def _scale(self, x, k):
        return x * k
    scale = functools.partialmethod(_scale, k=2)
target = Model().scale
""", ("k=2", "k=3")),
    "partialmethod read through its class": ("""
import functools
class Model:
    def _scale(self, x, k):
        return x * k
    scale = functools.partialmethod(_scale, k=2)
def target(x):
    return Model().scale(x)
""", ("k=2", "k=3")),
    "singledispatch, implementation edited": ("""
import functools
@functools.singledispatch
def scale(x):
    raise TypeError(x)
@scale.register
def _(x: int):
    return x * 2
def target(x):
    return scale(x)
""", ("x * 2", "x * 3")),
    "singledispatch as the node": ("""
import functools
@functools.singledispatch
def target(x):
    return x
@target.register
def _(x: int):
    return x * 2
""", ("x * 2", "x * 3")),
    "singledispatch, implementation registered": ("""
import functools
@functools.singledispatch
def target(x):
    return x * 2
""", ("""    return x * 2
""", """    return x * 2
@target.register
def _(x: int):
    return x * 3
""")),
    "singledispatchmethod": ("""
import functools
class Model:
    @functools.singledispatchmethod
    def scale(self, x):
        return x
    @scale.register
    def _(self, x: int):
        return x * 2
target = Model().scale
""", ("x * 2", "x * 3")),
    "callable object, state": (CALLABLE, ("Scale(2)", "Scale(3)")),
    "callable object, __call__ edited": (CALLABLE, ("x * self.k", "x * self.k + 1")),
    "class as the node": ("class target(int):\n    def __new__(cls, x):\n        return int.__new__(cls, x * 2)\n",
                          ("x * 2", "x * 3")),
    "decorator with functools.wraps, function edited": (DECORATED, ("x * 2", "x * 3")),
    "decorator with functools.wraps, decorator edited": (DECORATED, ("f(x) + 1", "f(x) + 2")),
    "decorator without wraps": ("""
def deco(f):
    def wrapper(x):
        return f(x) + 1
    return wrapper
@deco
def target(x):
    return x * 2
""", ("x * 2", "x * 3")),
    "class-based decorator": ("""
import functools
class Deco:
    def __init__(self, f):
        functools.update_wrapper(self, f)
        self.f = f
    def __call__(self, x):
        return self.f(x) + 1
@Deco
def target(x):
    return x * 2
""", ("x * 2", "x * 3")),
    "decorator configured by an argument": ("""
import functools
def shift(by):
    def deco(f):
        @functools.wraps(f)
        def wrapper(x):
            return f(x) + by
        return wrapper
    return deco
@shift(1)
def target(x):
    return x * 2
""", ("shift(1)", "shift(2)")),
    "library decorator (reprlib.recursive_repr)": ("""
import reprlib
@reprlib.recursive_repr()
def target(x):
    return x * 2
""", ("x * 2", "x * 3")),
    "functools.lru_cache": ("import functools\n@functools.lru_cache(maxsize=None)\ndef target(x):\n    return x * 2\n",
                            ("x * 2", "x * 3")),
    "functools.cache": ("import functools\n@functools.cache\ndef target(x):\n    return x * 2\n", ("x * 2", "x * 3")),
    "lru_cache typed": ("import functools\n@functools.lru_cache(typed=False)\ndef target(x):\n    return x * 2\n",
                        ("typed=False", "typed=True")),
    "lru_cache method read through its class": ("""
import functools
class Model:
    @functools.lru_cache(maxsize=None)
    def scale(self, x):
        return x * 2
    def __hash__(self):
        return 0
    def __eq__(self, other):
        return isinstance(other, Model)
def target(x):
    return Model().scale(x)
""", ("x * 2", "x * 3")),
    "hardy node as a helper": ("""
from hardy import node
@node(output_name="h")
def helper(x):
    return x * 2
def target(x):
    return helper(x)
""", ("x * 2", "x * 3")),
    "numba njit": ("import numba\n@numba.njit\ndef target(x):\n    return x * 2\n", ("x * 2", "x * 3")),
    "numba njit options": ("""
import numba
@numba.njit(fastmath=False)
def target(x):
    return (x + 1e16) - 1e16
INPUTS = [1.0, 3.0]
""", ("fastmath=False", "fastmath=True")),
    "numba njit calling an njit helper": ("""
import numba
@numba.njit
def helper(x):
    return x * 2
@numba.njit
def target(x):
    return helper(x)
""", ("x * 2", "x * 3")),
    "numba njit explicit signatures": ("""
import numba
@numba.njit("float64(float64)")
def target(x):
    return x / 2
""", ('"float64(float64)"', '"int64(int64)"')),
    "numba vectorize signatures": ("""
import numba
@numba.vectorize(["int64(int64)"])
def target(x):
    return x * 2
""", ('["int64(int64)"]', '["float64(float64)"]')),
    "np.vectorize, function": ("import numpy as np\ndef base(x):\n    return x * 2\ntarget = np.vectorize(base)\n",
                               ("x * 2", "x * 3")),
    "np.vectorize, otypes": ("import numpy as np\ndef base(x):\n    return x * 2.5\n"
                             "target = np.vectorize(base, otypes=[int])\n", ("otypes=[int]", "otypes=[float]")),
    "torch.jit.script": ("""
import torch
@torch.jit.script
def target(x: int) -> int:
    return x * 2
""", ("x * 2", "x * 3")),
    "torch.jit.script module's method": ("""
import torch
class Net(torch.nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.k = k
    def forward(self, x: int) -> int:
        return x * self.k
target = torch.jit.script(Net(2)).forward
""", ("Net(2)", "Net(3)")),
    "torch.compile": ("""
import torch
@torch.compile(backend="eager")
def target(x):
    return x * 2
""", ("x * 2", "x * 3")),
    "torch.no_grad decorator": ("""
import torch
@torch.no_grad()
def target(x):
    return x * 2
""", ("x * 2", "x * 3")),
    "torch module's forward": ("""
import torch
class Net(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(float(k)))
    def forward(self, x):
        return float(self.w.detach() * x)
target = Net(2).forward
""", ("Net(2)", "Net(3)")),
    "C method bound to data (dict.get)": ("TABLE = {1: 10, 2: 20, 3: 30}\ntarget = TABLE.get\n", ("2: 20", "2: 21")),
    "C method-wrapper bound to data": ("target = (2).__mul__\n", ("(2)", "(3)")),
    "C method bound to a callable": ("import functools\ndef mul(x, k):\n    return x * k\n"
                                     "target = functools.partial(mul, k=2).__call__\n", ("k=2", "k=3")),
    "C function of Python, swapped": ("import math\ntarget = math.floor\nINPUTS = [1.5, 2.5]\n",
                                      ("math.floor", "math.ceil")),
    "ufunc, swapped": ("import numpy as np\ntarget = np.negative\n", ("np.negative", "np.positive")),
    "library function, swapped": ("import json\ntarget = json.dumps\nINPUTS = ['a', 'b']\n", ("json.dumps", "repr")),
    "library class, swapped": ("import fractions\ntarget = fractions.Fraction\n", ("fractions.Fraction", "float")),
    "library closure (shutil.ignore_patterns)": ("""
import shutil
_ignore = shutil.ignore_patterns("*.py")
def target(x):
    return sorted(_ignore(".", ["a.py", "b.txt", str(x)]))
""", ('"*.py"', '"*.txt"')),
    "library callable object (numpy Polynomial)": ("import numpy as np\ntarget = np.polynomial.Polynomial([0, 2])\n",
                                                   ("[0, 2]", "[0, 3]")),
    "operator.itemgetter": ("import operator\nGET = operator.itemgetter(0)\ndef target(x):\n    return GET((x, -x))\n",
                            ("itemgetter(0)", "itemgetter(1)")),
    "class made at run time with a library's module": ("""
Dyn = type("Dyn", (), {"__module__": "json", "scale": 2})
def target(x):
    return x * Dyn.scale
""", ('"scale": 2', '"scale": 3')),
    "user C extension rebuilt": ("import NAME_cext\ntarget = NAME_cext.scale\nCEXT_FACTOR = 2\n",
                                 ("CEXT_FACTOR = 2", "CEXT_FACTOR = 3")),
}

DRIVER = r'''
import asyncio, importlib, json, os, re, shutil, subprocess, sys, sysconfig, warnings
warnings.simplefilter("ignore")
from hardy import DiskCache, Engine, Pipeline, node
from hardy.cache.keys import call_fingerprint
from hardy.errors import NodeDefinitionError
from hardy.hashing.callables import kind_of
import hardy.hashing.code as code

VISITED = set()
def noting(kind, handler):
    def handle(*args):
        VISITED.add(kind)
        return handler(*args)
    return handle
code._KINDS.update({k: noting(k, h) for k, h in code._KINDS.items()})  # which branches each case reaches

cases, cext, root = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
SEQ = Engine(map_executor="sequential")

def build_ext(folder, name, factor):
    include = sysconfig.get_paths()["include"]
    source = os.path.join(folder, name + ".c")
    open(source, "w").write(cext.replace("NAME", name).replace("FACTOR", str(factor)))
    out = os.path.join(folder, name + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["gcc", "-shared", "-fPIC", "-I" + include, "-o", out, source], check=True)

def load(name, source, folder):
    os.makedirs(folder)
    source = source.replace("NAME_cext", name + "_cext")
    with open(os.path.join(folder, name + ".py"), "w") as f:
        f.write(source)
    factor = re.search(r"CEXT_FACTOR = (\d+)", source)
    if factor:
        build_ext(folder, name + "_cext", int(factor.group(1)))
    for m in [m for m in sys.modules if m == name or m.startswith(name + "_")]:
        del sys.modules[m]
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)

def nodes(mod):
    made = {}
    try:
        n = node(mod.target, output_name="y", name="step")
        if len([p for p in n.inputs if p not in n.defaults]) == 1:  # else its signature is not its call's
            made["node"] = n
    except NodeDefinitionError:
        pass  # a C function without a signature, a method-wrapper: only reached as a global
    made["global"] = node(mod.via, output_name="y", name="step")
    return made

def given(n):
    return next(p for p in n.inputs if p not in n.defaults)

def key(n):
    return call_fingerprint(n, [given(n)]).hex()

def mapped(n, inputs, folder):
    p = Pipeline(nodes=[n], cache=DiskCache(folder), engine=SEQ)
    return repr([r["y"] for r in p.map(inputs={given(n): inputs}, map_over=given(n))])

def direct(mod, inputs):
    out = [mod.target(x) for x in inputs]
    return [asyncio.run(o) if asyncio.iscoroutine(o) else o for o in out]

def case(i, kind, source, old, new):
    assert old in source, kind
    name = f"kind_{i}"
    if "def via" not in source:
        source += "\ndef via(x):\n    return target(x)\n"
    edited = source.replace(old, new)
    VISITED.clear()
    first = load(name, source, f"{root}/{i}/a")
    inputs = getattr(first, "INPUTS", [1, 2, 3])
    out = {"kind": kind_of(first.target), "keys_a": {route: key(n) for route, n in nodes(first).items()}}
    out["runs_a"] = {route: mapped(n, inputs, f"{root}/{i}/cache-{route}") for route, n in nodes(first).items()}
    out["expected_a"] = repr(direct(first, inputs))
    again = load(name, source, f"{root}/{i}/a2")
    out["keys_again"] = {route: key(n) for route, n in nodes(again).items()}
    second = load(name, edited, f"{root}/{i}/b")
    out["keys_b"] = {route: key(n) for route, n in nodes(second).items()}
    out["runs_b"] = {route: mapped(n, inputs, f"{root}/{i}/cache-{route}") for route, n in nodes(second).items()}
    out.update(expected_b=repr(direct(second, inputs)), visited=sorted(VISITED))
    return out

results = {}
for i, (kind, (source, (old, new))) in enumerate(cases.items()):
    try:
        results[kind] = case(i, kind, source, old, new)
    except Exception as exc:
        results[kind] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("kinds")
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONDONTWRITEBYTECODE": "1", "NUMBA_CACHE_DIR": str(root / "numba")}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(CASES), CEXT, str(root)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_table_has_forty_kinds_or_more():
    assert len(CASES) >= 40


@pytest.mark.slow  # every kind of callable, edited and run again in one long process
@pytest.mark.parametrize("kind", list(CASES))
def test_editing_what_a_callable_runs_changes_its_key_and_no_stale_entry_is_served(kind, table):
    case = table[kind]
    assert "error" not in case, case.get("error")
    assert case["keys_a"] == case["keys_again"], "the key of the same code moved"
    for route, key in case["keys_b"].items():
        assert key != case["keys_a"][route], f"{route}: the edit left the key unchanged"
    assert set(case["runs_a"].values()) == {case["expected_a"]}
    assert case["expected_b"] != case["expected_a"] or kind in SAME_RESULTS
    assert set(case["runs_b"].values()) == {case["expected_b"]}, "an entry of the code before the edit was served"


# Edits that change what the callable is without changing these inputs' results (a new registration
# for another type, `typed=True`): the key must change all the same.
SAME_RESULTS = {"singledispatch, implementation registered", "lru_cache typed"}


@pytest.mark.slow  # the same table
def test_the_table_reaches_every_kind_of_the_fingerprint(table):
    """Every branch of the dispatch keys some case of the table above, whose edit changed the key
    under unchanged names: no kind is keyed by its name alone (the one kind left, "not callable",
    is a refusal: tests/test_cache_keys.py)."""
    from hardy.hashing.code import _KINDS
    reached = set().union(*(case.get("visited", ()) for case in table.values()))
    assert set(_KINDS) - reached == {"not callable"}


def test_cases_are_valid_python():
    for kind, (source, (old, new)) in CASES.items():
        compile(textwrap.dedent(source), kind, "exec")
        compile(textwrap.dedent(source.replace(old, new)), kind, "exec")


# --- refusals: what cannot be keyed is named, with the fixes ---------------------------------------

class _Session:
    def __init__(self):
        import threading
        self.lock = threading.Lock()


class _Model:
    def __init__(self):
        self.session = _Session()

    def predict(self, x):
        return x

    def __call__(self, x):
        return x


def _refusal(func) -> str:
    from hardy import node
    from hardy.cache.keys import call_fingerprint
    from hardy.errors import UnhashableError
    with pytest.raises(UnhashableError) as caught:
        call_fingerprint(node(func, output_name="y", name="step"), ["x"])
    return str(caught.value)


def test_a_bound_method_of_an_object_without_content_is_refused_with_the_fixes():
    message = _refusal(_Model().predict)
    assert message.startswith("node 'step' cannot be cached: the bound method ")
    assert "_Model.predict" in message and "the instance it is bound to.session.lock is a _thread.lock" in message
    assert "give test_cache_code_kinds._Model a __cache_key__()" in message
    assert "pass the object as an input of the node" in message and "@node(cache=False)" in message


def test_a_callable_object_without_content_is_refused_with_the_fixes():
    message = _refusal(_Model())
    assert "the callable test_cache_code_kinds._Model object" in message and "the object.session.lock" in message


def test_a_partial_binding_an_object_without_content_is_refused():
    import functools
    import threading

    def use(x, lock):
        return x
    message = _refusal(functools.partial(use, lock=threading.Lock()))
    assert "the partial functools.partial" in message and "its bound arguments" in message


def test_a_c_function_made_at_run_time_is_refused():
    import numpy as np

    from hardy.errors import UnhashableError
    from hardy.hashing import code_fingerprint
    with pytest.raises(UnhashableError, match="numpy.ufunc"):
        code_fingerprint(np.frompyfunc(lambda v: v, 1, 1))


def test_what_is_not_callable_is_refused():
    from hardy.errors import UnhashableError
    from hardy.hashing import code_fingerprint
    with pytest.raises(UnhashableError, match="it is not a function"):
        code_fingerprint(property(lambda self: 1))

"""Keys follow user code however it is reached, and ML values hash out of the box: an edit to any
code a node can run invalidates it; what cannot be hashed is an error before anything runs."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import needs_torch
from hardy import DiskCache, Engine, NodeError, Pipeline, node
from hardy.errors import UnhashableError
from hardy.hashing import code_fingerprint, hash_value

pytestmark = pytest.mark.usefixtures("in_process_default")  # what a key covers, counted in this process

# Three user modules a node reaches only through attribute chains, a package, a class, a partial
# and an import inside the function.
PROJECT = {
    "utils.py": """
        import deep
        def clean(x):
            return deep.level(x) + {clean}
        def scale(x, factor):
            return x * factor * {scale}
        def unrelated():
            return {unrelated}
    """,
    "deep.py": """
        def level(x):
            return x * {deep}
    """,
    "pkg/__init__.py": "",
    "pkg/sub.py": """
        def fn(x):
            return x - {sub}
    """,
    "models.py": """
        class Model:
            @staticmethod
            def method(x):
                return x + {method}
    """,
    "helpers/__init__.py": "",
    "helpers/inner.py": """
        def twice(x):
            return 2 * x + {inner}
    """,
}

SCRIPT = """
import functools, json, os, sys
sys.path.insert(0, sys.argv[1])
import utils, pkg.sub
from models import Model
from hardy import DiskCache, Pipeline, node

SCALED = functools.partial(utils.scale, factor=3)

def log(name):
    with open(os.environ["CALLS"], "a") as f:
        f.write(name + "\\n")

@node(output_name="a")
def via_module(x):
    log("a")
    return utils.clean(x)

@node(output_name="b")
def via_package(x):
    log("b")
    return pkg.sub.fn(x)

@node(output_name="c")
def via_class(x):
    log("c")
    return Model.method(x)

@node(output_name="d")
def via_partial(x):
    log("d")
    return SCALED(x)

@node(output_name="e")
def via_local_import(x):
    log("e")
    from helpers.inner import twice
    return twice(x)

p = Pipeline(nodes=[via_module, via_package, via_class, via_partial, via_local_import],
             cache=DiskCache(sys.argv[2]))
print(json.dumps(p.run(inputs={"x": 10})))
"""

BASE = dict(clean=1, scale=1, unrelated=0, deep=1, sub=1, method=1, inner=1)


def expected(v: dict[str, int]) -> dict[str, int]:
    x = 10
    return {"a": x * v["deep"] + v["clean"], "b": x - v["sub"], "c": x + v["method"],
            "d": x * 3 * v["scale"], "e": 2 * x + v["inner"]}


def test_edits_reached_through_modules_packages_classes_partials_and_local_imports(tmp_path):
    src, calls = tmp_path / "src", tmp_path / "calls.txt"

    def run(**changes: int) -> tuple[set[str], dict[str, int]]:
        values = {**BASE, **changes}
        for name, text in PROJECT.items():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_text(textwrap.dedent(text).format(**values))
        calls.write_text("")
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(tmp_path / "c")], check=True,
                             capture_output=True, text=True, env={**os.environ, "CALLS": str(calls)}).stdout
        result = json.loads(out)
        assert result == expected(values), changes  # never a stale result
        return set(calls.read_text().split()), result

    assert run()[0] == set("abcde")
    assert run()[0] == set()
    assert run(unrelated=5)[0] == set()  # code the nodes cannot reach invalidates nothing
    assert run(clean=2)[0] == {"a"}
    assert run(clean=2, deep=3)[0] == {"a"}  # two modules away, through utils
    assert run(clean=2, deep=3, sub=4)[0] == {"b"}
    assert run(clean=2, deep=3, sub=4, method=5)[0] == {"c"}
    assert run(clean=2, deep=3, sub=4, method=5, scale=6)[0] == {"d"}
    assert run(clean=2, deep=3, sub=4, method=5, scale=6, inner=7)[0] == {"e"}


def test_instances_key_by_their_class_code():
    class Scaler:
        def __init__(self, k):
            self.k = k

        def apply(self, x):
            return x * self.k

    before = hash_value(Scaler(2))
    Scaler.apply = lambda self, x: x + self.k  # what a re-run cell or an edited file does
    assert hash_value(Scaler(2)) != before


def test_decorated_helpers_key_by_the_code_they_wrap():
    import functools

    def make(offset):
        @functools.lru_cache
        def helper(x):
            return x + offset

        def uses(x):
            return helper(x)
        return uses

    assert code_fingerprint(make(1)) == code_fingerprint(make(1)) != code_fingerprint(make(2))


CONFIG = {"b": 2, "a": 1}
LOCK = threading.Lock()


def reads_lock(x):
    with LOCK:
        return x


def test_a_global_that_cannot_be_hashed_fails_when_the_plan_is_built(tmp_path):
    ran = []

    @node(output_name="y")
    def guarded(x):
        ran.append(x)
        return reads_lock(x)

    p = Pipeline(nodes=[guarded], cache=DiskCache(tmp_path / "c"))
    with pytest.raises(UnhashableError) as info:
        p.map(inputs={"x": [1, 2, 3]}, map_over="x")
    message = str(info.value)
    for part in ("node 'guarded'", "LOCK", "_thread.lock", "test_cache_keys.reads_lock",
                 "__cache_key__", "cache=False"):
        assert part in message, part
    assert ran == []
    assert Pipeline(nodes=[node(output_name="y", cache=False)(guarded.func)],
                    cache=DiskCache(tmp_path / "c")).map(inputs={"x": [1]}, map_over="x") == [{"y": 1}]


def test_global_dict_order_is_part_of_the_key():
    def first_key():
        return next(iter(CONFIG))

    before = code_fingerprint(first_key)
    CONFIG.clear()
    CONFIG.update({"a": 1, "b": 2})
    try:
        assert code_fingerprint(first_key) != before
    finally:
        CONFIG.clear()
        CONFIG.update({"b": 2, "a": 1})


class Session:
    """A handle with no content to hash, deep inside an object."""

    __slots__ = ()


class Encoder:
    def __init__(self):
        self.width = 4
        self._session = Session()


class Model:
    def __init__(self):
        self.encoder = Encoder()


def test_an_unhashable_input_fails_the_map_once_naming_class_and_path(tmp_path):
    ran = []

    @node(output_name="y")
    def predict(x, model):
        ran.append(x)
        return x

    p = Pipeline(nodes=[predict], cache=DiskCache(tmp_path / "c"))
    with pytest.raises(UnhashableError) as info:
        p.map(inputs={"x": list(range(50)), "model": Model()}, map_over="x")
    message = str(info.value)
    assert "model.encoder._session is a test_cache_keys.Session" in message
    assert "node 'predict'" in message and "test_cache_keys.Model" in message
    assert "__cache_key__" in message and "register" in message
    assert ran == []


def test_a_nested_maps_failed_items_key_the_node_that_reads_them(tmp_path):
    """A nested map with on_error="continue" hands `Failed` placeholders on; a cached node reading
    them is keyed by the failures: the same failure again is a hit, the item succeeding a miss."""
    calls, broken = [], {3}

    @node(output_name="y")
    def double(z: int) -> int:
        if z in broken:
            raise ValueError(f"no {z}")
        return 2 * z

    @node(output_name="n")
    def count_ok(ys: list) -> int:
        calls.append(ys)
        return sum(1 for y in ys if isinstance(y, int))

    each = Pipeline([double], name="inner").as_node(name="each", input_mapping={"zs": "z"},
                                                     output_mapping={"y": "ys"}, map_over="zs", on_error="continue")
    p = Pipeline([each, count_ok], cache=DiskCache(tmp_path / "c"))
    assert [p.run(inputs={"zs": [1, 2, 3]})["n"] for _ in range(2)] == [2, 2]
    assert len(calls) == 1  # the second run found the result of the same failure
    broken.clear()
    assert p.run(inputs={"zs": [1, 2, 3]})["n"] == 3 and len(calls) == 2


def test_an_unhashable_output_is_the_fault_of_the_cached_node_reading_it(tmp_path):
    @node(output_name="handles", cache=False)
    def open_handles(x: int) -> list:
        return [Session()]

    @node(output_name="n")
    def count(handles: list) -> int:
        return len(handles)

    p = Pipeline([open_handles, count], cache=DiskCache(tmp_path / "c"))
    with pytest.raises(NodeError) as info:
        p.run(inputs={"x": 1})
    assert info.value.node == "count" and "handles[0] is a test_cache_keys.Session" in str(info.value)


def test_error_summaries_say_not_computed_yet(tmp_path):
    @node(output_name="features")
    def featurize(x):
        return x

    @node(output_name="y")
    def predict(features, handle):
        return features

    p = Pipeline(nodes=[featurize, predict], cache=DiskCache(tmp_path / "c"))
    with pytest.raises(Exception) as info:
        p.run(inputs={"x": 1, "handle": Session()})
    assert "features=(not computed yet)" in str(info.value) and "None" not in str(info.value)


def test_ordinary_module_level_values_hash():
    import argparse
    import logging
    import re
    import types

    import numpy as np

    values = [re.compile("a+", re.I), re.compile("a+"), range(3), range(4), types.SimpleNamespace(lr=0.1),
              types.SimpleNamespace(lr=0.2), argparse.Namespace(lr=0.1), logging.getLogger("a"),
              logging.getLogger("b"), np.dtype("float32"), np.dtype("float64")]
    assert len({hash_value(v) for v in values}) == len(values)
    assert hash_value(re.compile("a+", re.I)) == hash_value(re.compile("a+", re.I))


def test_registered_library_types_hash_by_what_identifies_them():
    import collections

    from hardy.hashing.values import _ENCODERS, _RESOLVED, register

    def event(is_set: bool) -> threading.Event:  # a library's class: no __cache_key__() to add
        e = threading.Event()
        if is_set:
            e.set()
        return e

    with pytest.raises(UnhashableError):
        hash_value(event(True))
    register(threading.Event, threading.Event.is_set)
    # built-in types sit in the same table: a registered subclass of one is hashed the registered way
    ordered = collections.OrderedDict(a=1)
    as_dict = hash_value(ordered)
    register(collections.OrderedDict, lambda d: sorted(d.items()))
    try:
        assert hash_value(event(True)) == hash_value(event(True)) != hash_value(event(False))
        assert hash_value(ordered) != as_dict
        assert hash_value(ordered) == hash_value(collections.OrderedDict(a=1))
    finally:
        del _ENCODERS[threading.Event], _ENCODERS[collections.OrderedDict]
        _RESOLVED.clear()


TORCH_SCRIPT = """
import json, os, sys, threading
import torch
from hardy import DiskCache, Engine, Pipeline, node

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1))
        self.head = torch.nn.Linear(8, 1)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return self.head(self.encoder(x)) * self.scale

calls = []

@node(output_name="y")
def predict(x, model):
    calls.append(x)
    with torch.no_grad():
        return float(model(torch.full((1, 4), float(x))))

torch.manual_seed(0)
model = Net().eval()
p = Pipeline(nodes=[predict], cache=DiskCache(sys.argv[1]), engine=Engine(map_executor="sequential"))  # counts `calls`
out = {}
def run(label):
    calls.clear()
    p.map(inputs={"x": list(range(20)), "model": model}, map_over="x")
    out[label] = len(calls)

run("cold"); run("warm")
with torch.no_grad():
    model.head.weight += 1          # trained further: new weights
run("weights")
model.scale.fill_(2.0)             # a buffer
run("buffer")
model.train()                      # dropout on: behaves differently
run("mode")
model.eval(); run("back")          # the earlier state again: hits
def fresh(seed):
    torch.manual_seed(seed)
    return Net().eval()
out["same_init"] = len({DiskCache.input_key(fresh(0), "m"), DiskCache.input_key(fresh(0), "m")})
out["other_init"] = len({DiskCache.input_key(fresh(0), "m"), DiskCache.input_key(fresh(1), "m")})
out["devices"] = len({DiskCache.input_key(v, "d") for v in (torch.device("cpu"), torch.device("meta"), torch.float32)})
model.encoder._session = threading.Lock()
try:
    run("unhashable")
except TypeError as exc:
    out["error"] = str(exc)
    out["ran"] = len(calls)
print(json.dumps(out))
"""


@pytest.mark.slow  # torch in a subprocess
def test_torch_modules_hash_by_class_configuration_and_weights(tmp_path):
    needs_torch()  # torch runs in its own process: its OpenMP pool would be a fork hazard here
    out = json.loads(subprocess.run([sys.executable, "-c", TORCH_SCRIPT, str(tmp_path / "c")], check=True,
                                    capture_output=True, text=True).stdout.strip().splitlines()[-1])
    assert (out["cold"], out["warm"], out["weights"], out["buffer"], out["mode"], out["back"]) == (20, 0, 20, 20, 20, 0)
    assert out["same_init"] == 1 and out["other_init"] == 2 and out["devices"] == 3
    assert "model.encoder._session is a _thread.lock" in out["error"] and "__main__.Net" in out["error"]
    assert out["ran"] == 0


SKLEARN_SCRIPT = """
import json, sys
import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.tree import DecisionTreeClassifier
from hardy.hashing import hash_value

X = np.random.default_rng(0).random((40, 3)); y = (X[:, 0] > 0.5).astype(int)
def fitted(model, rows=40):
    return model.fit(X[:rows], y[:rows])
out = {
    "params": hash_value(LogisticRegression(C=1.0)) != hash_value(LogisticRegression(C=2.0)),
    "unfitted_vs_fitted": hash_value(LogisticRegression()) != hash_value(fitted(LogisticRegression())),
    "refit_same": hash_value(fitted(LogisticRegression())) == hash_value(fitted(LogisticRegression())),
    "other_data": hash_value(fitted(LogisticRegression())) != hash_value(fitted(LogisticRegression(), 30)),
    "tree": hash_value(fitted(DecisionTreeClassifier(random_state=0)))
            != hash_value(fitted(DecisionTreeClassifier(random_state=0), 30)),
    "pipeline": hash_value(fitted(make_pipeline(StandardScaler(), LogisticRegression())))
                != hash_value(fitted(make_pipeline(StandardScaler(), LogisticRegression()), 30)),
}
print(json.dumps(out))
"""


@pytest.mark.slow  # scikit-learn and SciPy imported
def test_scikit_learn_estimators_hash_by_parameters_and_fitted_state():
    if importlib.util.find_spec("sklearn") is None:  # not imported here: its OpenMP runtime would be a fork hazard
        pytest.skip("scikit-learn is not installed (pip install scikit-learn)")
    out = json.loads(subprocess.run([sys.executable, "-c", SKLEARN_SCRIPT], check=True, capture_output=True,
                                    text=True).stdout.strip().splitlines()[-1])
    assert out == {k: True for k in out} and len(out) == 6, out


def test_settings_changed_after_a_run_take_effect(tmp_path):
    from hardy import PipelineCallback

    ran = []

    @node(output_name="y")
    def double(x):
        ran.append(x)
        return 2 * x

    class Seen(PipelineCallback):
        def __init__(self):
            self.nodes = []

        def on_node_end(self, node_id, outputs, duration, ctx):
            self.nodes.append(node_id)

    p = Pipeline(nodes=[double])
    assert p.run(inputs={"x": 1}) == {"y": 2}
    p.cache = DiskCache(tmp_path / "a")  # set after a first run: used from the next call on
    p.run(inputs={"x": 1})
    p.run(inputs={"x": 1})
    assert ran == [1, 1] and p.cache.stats().entries == 1
    seen = Seen()
    p.callbacks.append(seen)
    p.map(inputs={"x": [5, 6]}, map_over="x")
    assert seen.nodes == ["double", "double"]
    p.cache = None
    p.engine = Engine(map_executor="sequential", cache=DiskCache(tmp_path / "b"))  # the engine's cache now applies
    p.run(inputs={"x": 3})
    assert p.engine.cache.stats().entries == 1
    p.engine.cache = None  # changed on the engine itself
    before = len(ran)
    p.run(inputs={"x": 3})
    p.run(inputs={"x": 3})
    assert len(ran) == before + 2


LOCAL_IMPORT = """
import sys
from hardy import node
from hardy.cache.keys import call_fingerprint

@node(output_name="y")
def embed(x):
    import torch  # imported in the worker that runs the node, never in the parent
    return torch.tensor([x]).sum().item()

call_fingerprint(embed, ["x"])
print("torch" in sys.modules)
"""


def test_a_library_imported_inside_a_node_is_not_imported_to_key_it():
    needs_torch()
    out = subprocess.run([sys.executable, "-c", LOCAL_IMPORT], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


# Digests (key format 3, BLAKE3) computed before value hashing became a registry: a cache filled by
# an earlier version stays valid only while these do not move. Values holding code (a partial of a
# builtin) are not pinned: their keys hold the version of Python or of the library that runs them.
PINNED = {
    "none": (None, "34ab8b65c2622b75106dba567a23b032"),
    "true": (True, "3d5ce082d3e6c13e406b078e5157bb6a"),
    "false": (False, "542a1d6b133a93a2b22779029c14f780"),
    "int": (42, "3f0883692869192e985c8f324f270280"),
    "bigint": (10**30, "339e661877bab262649709feaf397988"),
    "float": (1.5, "10e89e40829072e8e54de0990cab6c3f"),
    "nan": (float("nan"), "665d1c692d80c38bee4d4137488d70b2"),
    "neg_zero": (-0.0, "a594bd6ebc9b4bcf4071402ba6b8ba41"),
    "inf": (float("inf"), "7652379dfa990afa6ed0e5f3e317b021"),
    "str": ("héllo", "512774e3d725632c9ddec5e1ffcd0ab3"),
    "bytes": (b"ab", "a38e64a514aa3da8d0e423b38267fc00"),
    "tuple": ((1, "a"), "61b380ee6f3542843a50354decb66f08"),
    "list": ([1, 2.0, None], "2f3d005ea23cb1cc5c2f68e9f940c940"),
    "empty_list": ([], "a4ab81ab4318ea4199220b63d8f36d3d"),
    "dict": ({"a": 1, "b": [2]}, "6ae25080605b1841687a6488fb5d5240"),
    # re-pinned when the iteration order of a set of ints (not salted: the same in every process)
    # joined its key (`list({1, 9})` and `list({9, 1})` shared it): such entries were recomputed once
    "set": ({1, 2, 3}, "e00878b5311994f7fd8eafac205ada9c"),
    "set_of_strings": ({"x", "y"}, "99cdea889edc26e5f9e52788f3cc6547"),
    "frozenset": (frozenset({"x"}), "a5a96139a8dc8f85f7a1b25ee247d93a"),
    "complex": (1 + 2j, "85758725309220f0d976951da0e0d18e"),
    "bytearray": (bytearray(b"xy"), "db4937fb1705c9fc89e8793a5116499b"),
    # re-pinned when a memoryview's format and shape joined its key (a cast, and a bytearray of the
    # same bytes, shared it): a cache's entries keyed by memoryviews were recomputed once
    "memoryview": (memoryview(b"mv"), "47ac3e4fbb40125dc1a78dbdec53260f"),
    "nested": ({"k": (1, [2, {3}]), "d": {"x": None}}, "c28fe971efe027256192941c288e3ed8"),
}


def _pinned_library_values() -> dict:
    import datetime
    import decimal
    import http
    import pathlib
    import re

    import numpy as np
    import pandas as pd
    return {
        "intenum": (http.HTTPStatus.OK, "d65855d72e43b3a4968c40b68ab1c921"),
        "flag_enum": (re.RegexFlag.IGNORECASE, "8a3ea9828e3d155c25291c462cae568e"),
        "tuple_subclass": (os.terminal_size((80, 24)), "8b8ec931c432ec3a8a39ea27c9e48f97"),
        "path": (pathlib.PurePosixPath("/a/b"), "5d7625271197503b519f1cbc4ea6d9f5"),
        "date": (datetime.date(2024, 1, 2), "bcba9058e1d411643c1864c53548e443"),
        "decimal": (decimal.Decimal("1.10"), "0673a0726749c43836cf4cff107d96c6"),
        "range": (range(1, 10, 2), "563c3d03435f84a55ed679ac170495bd"),
        "regex": (re.compile("a+b", re.I), "62ce18feeb8bcdb6ad63d41e982b2d7b"),
        "np_array": (np.arange(6, dtype=np.int32).reshape(2, 3), "064787f3a825730bc03ee293d7cf616b"),
        "np_scalar": (np.float64(2.5), "7e8365dd22dc9345ae4d5996728b92a9"),
        "np_dtype": (np.dtype("float32"), "e57302b8851e2e37f0b98cbb12efcf82"),
        "np_object": (np.array([1, "a"], dtype=object), "e0c4ba8736d236dabe4e432f1eeb0393"),
        # re-pinned when labels, object values and attrs became typed (the old keys let a column `1`
        # be served for a column `"1"`): a cache's pandas entries were recomputed once; and when
        # extension columns (pandas 3's `str` labels and values among them) were keyed by their data,
        # not pandas' 64-bit row hashes (which equate -0.0 and 0.0): recomputed once again
        "pandas_df": (pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}), "902cebc78c13c08fd5f52315a629a82e"),
        "pandas_series": (pd.Series([1.0, 2.0], name="s"), "2d91c1c20ff7243af03664d6a252c9f6"),
    }


def test_value_digests_do_not_move():
    """Keys written by earlier versions stay valid: the encoding of built-in and library values is pinned."""
    moved = {name: hash_value(value).hex() for name, (value, pinned) in {**PINNED, **_pinned_library_values()}.items()
             if hash_value(value).hex() != pinned}
    assert moved == {}


def test_a_class_is_fingerprinted_once_per_hashing_pass_and_again_after_it_changed(tmp_path):
    """Values of a user class are keyed by its code: once per class in one pass over a list of
    them (10,000 named tuples fingerprinted their class 10,000 times, 60 times slower), and afresh
    in the next pass, where a method changed in place since gives another key."""
    (tmp_path / "points.py").write_text(textwrap.dedent("""
        import typing

        class Point(typing.NamedTuple):
            x: int

            def scaled(self):
                return 2 * self.x
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        import points

        from hardy.hashing import code as code_module
        from hardy.hashing import hash_value
        calls = []
        real = code_module.code_fingerprint
        classes = importlib.import_module("hardy.hashing.classes")
        classes.install_code_fingerprint(lambda obj: calls.append(obj) or real(obj))
        try:
            before = hash_value([points.Point(i) for i in range(100)])
            assert calls.count(points.Point) == 1
            points.Point.scaled = lambda self: 3 * self.x
            assert hash_value([points.Point(i) for i in range(100)]) != before
        finally:
            classes.install_code_fingerprint(real)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("points", None)


def _cutter(window: object) -> object:
    """A node bound to a class whose class attribute is `window` (the same names each time)."""
    class Cfg:
        W = window

        def cut(self, x):
            return self.W[x] if hasattr(self.W, "keys") else x[self.W]
    return node(Cfg().cut, output_name="y", name="cut")


def test_class_attributes_that_are_slices_or_mappingproxies_are_keyed_by_value(tmp_path):
    """`W = slice(0, 2)` and `W = slice(0, 3)`, or two `MappingProxyType`s, were keyed as "?" (present
    only): the second class was served the first one's entries. Now by value; and code indexing
    with `...` (a constant of its bytecode) was refused, now keyed."""
    import types

    def mapped(n, xs):
        p = Pipeline([n], cache=DiskCache(tmp_path / "c"), engine=Engine(map_executor="sequential"))
        return [r["y"] for r in p.map(inputs={"x": xs}, map_over="x")]
    assert mapped(_cutter(slice(0, 2)), [[1, 2, 3]]) == [[1, 2]]
    assert mapped(_cutter(slice(0, 3)), [[1, 2, 3]]) == [[1, 2, 3]]
    assert mapped(_cutter(slice(0, 3, 2)), [[1, 2, 3]]) == [[1, 3]]
    assert mapped(_cutter(types.MappingProxyType({"a": 1})), ["a"]) == [1]
    assert mapped(_cutter(types.MappingProxyType({"a": 2})), ["a"]) == [2]

    @node(output_name="y")
    def whole(x):
        return x[...] if hasattr(x, "shape") else x
    assert mapped(whole, [1, 2]) == [1, 2]


ANNOTATED = """
import functools, typing
T = {kind}
def coerce(fn):
    @functools.wraps(fn)
    def wrapper(x):
        return fn(typing.get_type_hints(fn)["x"](x))
    return wrapper
@coerce
def show(x: T):
    return repr(x)
"""


def test_a_functions_annotations_are_part_of_its_key(tmp_path):
    """A decorator that converts arguments by the annotations (`typing.get_type_hints` at call time,
    as `pydantic.validate_call` does): `x: int` and `x: float` run the same bytecode, and shared a key,
    so the second was served '7' for '7.0'."""
    import __future__

    def made(kind: str, flags: int = 0) -> object:
        namespace: dict = {"__name__": "annotated_helpers"}  # (no `from __future__ import annotations` here)
        exec(compile(ANNOTATED.format(kind=kind), "annotated_helpers.py", "exec", flags, dont_inherit=True), namespace)
        return namespace["show"]

    def run(show) -> object:
        n = node(show, output_name="y", name="show")
        return Pipeline([n], cache=DiskCache(tmp_path / "c"), engine=Engine(map_executor="sequential")).run(
            inputs={"x": "7"})["y"]
    assert run(made("int")) == "7"
    assert run(made("float")) == "7.0"
    assert code_fingerprint(made("int")) == code_fingerprint(made("int"))  # (a stable text: no address)
    assert code_fingerprint(made("list[int]")) != code_fingerprint(made("list[float]"))
    # a compiler flag moves no key: `x: T` as text ("T") is read as get_type_hints reads it
    assert code_fingerprint(made("int", __future__.annotations.compiler_flag)) == code_fingerprint(made("int"))
    assert code_fingerprint(made("typing.Annotated[int, frozenset({'a', 'b', 'c'})]")) \
        == code_fingerprint(made("typing.Annotated[int, frozenset({'c', 'b', 'a'})]"))


USER_TZ = """
import datetime, sys
sys.path.insert(0, sys.argv[1])
from user_tz import Offset
from hardy.hashing import hash_value
print(hash_value(datetime.datetime(2024, 1, 1, 12, tzinfo=Offset(2))).hex())
"""


def test_a_datetime_with_a_users_tzinfo_is_keyed_by_the_tzinfo_not_its_repr(tmp_path):
    """A datetime's key was its repr: a user's tzinfo whose `__repr__` hides its state gave two
    instants one key (a wrong hit), and one with the default repr, an address, a key per process."""
    (tmp_path / "user_tz.py").write_text(textwrap.dedent("""
        import datetime

        class Offset(datetime.tzinfo):
            def __init__(self, hours):
                self.hours = hours

            def utcoffset(self, dt):
                return datetime.timedelta(hours=self.hours)

        class Hidden(Offset):
            def __repr__(self):
                return "Hidden()"
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        import datetime

        from user_tz import Hidden
        at = datetime.datetime(2024, 1, 1, 12)
        assert hash_value(at.replace(tzinfo=Hidden(1))) != hash_value(at.replace(tzinfo=Hidden(2)))
        assert hash_value(at.replace(tzinfo=Hidden(1))) == hash_value(at.replace(tzinfo=Hidden(1)))
        utc = datetime.timezone.utc  # (the standard library's: by its repr, as before)
        assert hash_value(at.replace(tzinfo=utc)) != hash_value(at)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_tz", None)
    keys = {subprocess.run([sys.executable, "-c", USER_TZ, str(tmp_path)], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)}
    assert len(keys) == 1, keys


LOCAL_ZONE = """
import datetime
from dateutil import tz
from hardy.hashing import hash_value
print(hash_value(datetime.datetime(2020, 1, 1, 12, tzinfo=tz.tzlocal())).hex())
"""


def test_a_datetime_in_the_local_zone_is_keyed_by_what_the_zone_computes(tmp_path):
    """dateutil's `tzlocal()` reprs alike in every zone: a datetime in it was keyed alike under
    TZ=UTC and TZ=Asia/Tokyo, and one machine served the other its `timestamp()`. Its offset,
    DST and name at the datetime now join the key; the same zone keeps one key."""
    pytest.importorskip("dateutil")
    keys = [subprocess.run([sys.executable, "-c", LOCAL_ZONE], capture_output=True, text=True, check=True,
                           env={**os.environ, "TZ": zone}).stdout for zone in ("UTC", "Asia/Tokyo", "UTC")]
    assert keys[0] == keys[2] != keys[1]


def zone_file(name: str) -> str:
    """The path of a compiled zone `name` on this machine (the system's database or tzdata's)."""
    import zoneinfo
    for root in zoneinfo.TZPATH:
        if os.path.isfile(os.path.join(root, name)):
            return os.path.join(root, name)
    tzdata = pytest.importorskip("tzdata")
    return os.path.join(os.path.dirname(tzdata.__file__), "zoneinfo", name)


def test_a_zone_read_from_a_file_is_keyed_by_what_it_computes_or_refused(tmp_path):
    """A zone made from a file reprs a key or a path whatever the file held: dateutil's
    `tzfile(path)` after the file changed, and `ZoneInfo.from_file(f, key=...)`, shared the key of
    the zone they claimed. A datetime in them is keyed by what they compute; a bare ZoneInfo by its
    key, and one made from a file (no key names its rules) refused, saying so."""
    import datetime
    import shutil
    import zoneinfo
    dateutil_tz = pytest.importorskip("dateutil.tz")
    at = datetime.datetime(2020, 1, 1, 12)
    path = tmp_path / "zone"
    shutil.copy(zone_file("Europe/Paris"), path)
    paris = hash_value(at.replace(tzinfo=dateutil_tz.tzfile(str(path))))
    shutil.copy(zone_file("Asia/Tokyo"), path)
    assert hash_value(at.replace(tzinfo=dateutil_tz.tzfile(str(path)))) != paris
    with open(zone_file("Asia/Tokyo"), "rb") as f:
        posing = zoneinfo.ZoneInfo.from_file(f, key="Europe/Paris")
    assert repr(posing) == repr(zoneinfo.ZoneInfo("Europe/Paris"))
    assert hash_value(at.replace(tzinfo=posing)) != hash_value(at.replace(tzinfo=zoneinfo.ZoneInfo("Europe/Paris")))
    assert hash_value(zoneinfo.ZoneInfo("Europe/Paris")) == hash_value(zoneinfo.ZoneInfo.no_cache("Europe/Paris"))
    with pytest.raises(UnhashableError, match=r"from_file.*ZoneInfo\(key\)"):
        hash_value(posing)


def test_pandas_values_once_refused_or_failing_are_keyed_and_served(tmp_path):
    """An Arrow list column failed with a raw `TypeError: unhashable type` from pandas' row hashes;
    pandas' scalars, an object column holding `pd.NA` and a ZoneInfo were refused. Each now runs
    once through a cached node and is served the second time."""
    import zoneinfo

    import pandas as pd
    pa = pytest.importorskip("pyarrow")
    values = [pd.Series([[1, 2]], dtype=pd.ArrowDtype(pa.list_(pa.int64()))),
              pd.Series([1, pd.NA], dtype="Int64").astype(object), pd.Timestamp("2020-01-01", tz="Europe/Paris"),
              pd.Timestamp("2020-01-01"), pd.Timedelta(1, "ns"), pd.NaT, pd.NA, pd.Period("2020-01", freq="M"),
              pd.Interval(pd.Timestamp("2020"), pd.Timestamp("2021")), pd.CategoricalDtype(["a", "b"]),
              zoneinfo.ZoneInfo("Asia/Tokyo")]
    calls = tmp_path / "calls"  # (a path: a list the node appends to would be in its key, and change it)

    @node(output_name="y")
    def kind(v):
        with open(calls, "a") as f:
            f.write("x")
        return type(v).__name__

    def run() -> list[str]:
        p = Pipeline(nodes=[kind], cache=DiskCache(tmp_path / "c"), engine=Engine(map_executor="sequential"))
        return [p.run(inputs={"v": v})["y"] for v in values]
    assert run() == run() and len(calls.read_text()) == len(values)


TENSORS = """
import json, sys, warnings
import torch
from hardy import DiskCache, Engine, Pipeline, node
from hardy.errors import UnhashableError
from hardy.hashing import hash_value
warnings.simplefilter("ignore")
CALLS = sys.argv[1] + ".calls"

@node(output_name="y")
def total(t):
    with open(CALLS, "a") as f:
        f.write("x")
    return float(t.to_dense().sum()) if t.layout != torch.strided else float(t.sum())

values = [torch.tensor([1 + 2j]).conj().imag, torch.zeros(1, 3)[:, 0], torch.tensor([1 + 2j]).real,
          torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)), torch.eye(2).to_sparse_csr(), torch.eye(2).to_sparse_csc(),
          torch.eye(2).to_sparse_bsr((1, 1))]
out = {}
for label in ("cold", "warm"):
    p = Pipeline(nodes=[total], cache=DiskCache(sys.argv[1]), engine=Engine(map_executor="sequential"))
    out[label] = [p.run(inputs={"t": t})["y"] for t in values]
out["ran"] = len(open(CALLS).read())
try:
    hash_value(torch.ones(2).to_mkldnn())
except UnhashableError as exc:
    out["mkldnn"] = str(exc)
except RuntimeError:  # (a build of torch without mkldnn)
    out["mkldnn"] = "no mkldnn"
print(json.dumps(out))
"""


@pytest.mark.slow  # torch in a subprocess
def test_tensors_whose_hashing_raised_are_keyed_and_served(tmp_path):
    """A one-element tensor at another stride (`.contiguous()` returns it as it is, and its byte
    view raised) and sparse COO and CSR tensors raised a RuntimeError from hashing, reported as the
    node's failure. Each now runs once and is served the second time; a layout hardy cannot read
    is refused, naming it."""
    needs_torch()
    out = json.loads(subprocess.run([sys.executable, "-c", TENSORS, str(tmp_path / "c")], check=True,
                                    capture_output=True, text=True).stdout.strip().splitlines()[-1])
    assert out["cold"] == out["warm"] == [-2.0, 0.0, 1.0, 3.0, 2.0, 2.0, 2.0]
    assert out["ran"] == 7
    assert "mkldnn" in out["mkldnn"]


def test_a_function_using_local_time_is_keyed_by_the_zone_and_no_other_is():
    """A node formatting `datetime.fromtimestamp(ts)` was keyed alike under TZ=UTC and, after
    `time.tzset()`, under Asia/Tokyo: a cache served the UTC text. Code that computes with the
    local zone, however it reaches it, now has the zone in its key; code that never does keeps one
    key in every zone, so a cache shared across zones keeps its entries."""
    import datetime
    import time
    from datetime import datetime as dt_class
    from time import localtime

    to_local = dt_class.fromtimestamp

    def formatted(ts):
        return datetime.datetime.fromtimestamp(ts).strftime("%H:%M")

    def through_helper(ts):
        return formatted(ts) + "!"

    def given(at):  # a datetime given as an input: a naive one's timestamp() is local
        return at.timestamp()

    def named(ts):
        return localtime(ts).tm_hour

    def module_format(t):
        return time.strftime("%Z", t)

    def held(ts):
        return to_local(ts).hour

    def imported_inside(ts):
        from time import mktime
        return mktime(ts)

    to_local_partial = functools.partial(dt_class.fromtimestamp, tz=None)
    converters = {"local": dt_class.fromtimestamp}

    def through_a_partial(ts):
        return to_local_partial(ts).hour

    def through_a_dict(ts):
        return converters["local"](ts).hour

    def utc_only(ts):  # the same in every zone
        return datetime.datetime.fromordinal(ts).strftime("%Y") + str(time.time() > 0)

    def plain(x):
        return x * 2

    zoned = [formatted, through_helper, given, named, module_format, held, imported_inside, through_a_partial,
             through_a_dict]
    before = os.environ.get("TZ")
    keys = []
    try:
        for zone in ("UTC", "Asia/Tokyo", "Japan", "UTC"):
            os.environ["TZ"] = zone
            time.tzset()
            keys.append([code_fingerprint(f) for f in [*zoned, utc_only, plain]])
    finally:
        if before is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = before
        time.tzset()
    utc, tokyo, japan, utc_again = keys
    assert utc == utc_again and tokyo == japan  # one zone, one key; two names of one zone, one key
    assert all(a != b for a, b in zip(utc[:len(zoned)], tokyo[:len(zoned)]))
    assert utc[len(zoned):] == tokyo[len(zoned):]


TORCHSCRIPT_LIB = """
import torch
@torch.jit.script
def scale(x):
    return x * FACTOR
@torch.jit.script
def score(x):
    return scale(x) + 1
def shift(x):
    return x * FACTOR
class Net(torch.nn.Module):
    def forward(self, x):
        return shift(x) + 1
NET = torch.jit.script(Net())
class Classifier(torch.nn.Module):
    def __init__(self, threshold: float):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(2, 1)
        self.threshold = threshold  # a TorchScript attribute: no parameter, no buffer
    def forward(self, x):
        return (self.lin(x) > self.threshold).float()

class Normalize(torch.nn.Module):
    def __init__(self, mean: float):
        super().__init__()
        self.mean = torch.full((2,), mean)  # a plain tensor attribute: a constant of the trace
    def forward(self, x):
        return x - self.mean
"""

TORCHSCRIPT = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
sys.path.insert(0, sys.argv[1])
import userlib
from userlib import Classifier, Normalize
from hardy import DiskCache, Engine, Pipeline, node
value, calls = float(sys.argv[2]), sys.argv[3] + ".calls"

def direct(model, x):
    with torch.no_grad():
        return model(x).tolist()

def apply(model, x):
    with open(calls, "a") as f:
        f.write("x")
    return direct(model, x)

def via_global(x):
    return userlib.score(x).tolist()

SHIFT = torch.full((2,), value)
X = torch.tensor([[0.5, -1.0]])
models = {"attribute": torch.jit.script(Classifier(value - 1.5)),
          "traced module's constant": torch.jit.trace(Normalize(value), torch.zeros(2)),
          "traced function's constant": torch.jit.trace(lambda x: x - SHIFT, torch.zeros(2)),
          "scripted function calling a scripted one": userlib.score,
          "scripted module calling a compiled helper": userlib.NET,
          "scripted module's method": torch.jit.script(Classifier(value - 1.5)).forward}
engine = Engine(map_executor="sequential")
p = Pipeline(nodes=[node(apply, output_name="y")], cache=DiskCache(sys.argv[3]), engine=engine)
out = {name: [p.map(inputs={"x": [X], "model": m}, map_over="x")[0]["y"], direct(m, X)] for name, m in models.items()}
g = Pipeline(nodes=[node(via_global, output_name="y")], cache=DiskCache(sys.argv[3]), engine=engine)
out["read as a global"] = [g.run(inputs={"x": X})["y"], via_global(X)]

MODEL = torch.jit.script(Classifier(-10.0))  # in one process: changed between two maps
TRACED = torch.jit.trace(lambda x: x - SHIFT, torch.zeros(2))
def by_model(x):
    with torch.no_grad():
        return [MODEL(x).tolist(), TRACED(x).tolist()]
q = Pipeline(nodes=[node(by_model, output_name="y")], cache=DiskCache(sys.argv[3] + "-one"), engine=engine)
first = q.run(inputs={"x": X})["y"]
MODEL.threshold = 10.0
SHIFT.add_(1.0)
out["changed in one process"] = [[first, q.run(inputs={"x": X})["y"]], [first, by_model(X)]]
SCALED = torch.jit.script(Classifier(-100.0))  # a Python attribute set after compiling, read by the node
SCALED.scale = value
def by_scale(x):
    with torch.no_grad():
        return (SCALED(x) * SCALED.scale).tolist()
s = Pipeline(nodes=[node(by_scale, output_name="y")], cache=DiskCache(sys.argv[3]), engine=engine)
out["Python attribute set after compiling"] = [s.run(inputs={"x": X})["y"], by_scale(X)]
SCALED.scale = value + 10
out["Python attribute changed in one process"] = [s.run(inputs={"x": X})["y"], by_scale(X)]
out["same model, one key"] = len({DiskCache.input_key(torch.jit.script(Classifier(0.5)), "m") for _ in range(2)})
print(json.dumps(out))
"""


@pytest.mark.slow  # torch in subprocesses
def test_torchscript_attributes_constants_and_called_code_are_keyed_across_processes(tmp_path):
    """A TorchScript module or function was keyed by its own `.code`, its submodules' mode and its
    `state_dict()`: a script attribute (`self.threshold`), a trace's tensor constants and the code
    of the compiled functions it calls were in none, and a fresh process whose model differed in
    them was served the first one's results; so was a Python attribute a script sets on a compiled
    module (`model.scale = 3.0`), which lives outside the archive that keys it now. Each run here is a fresh process on one cache, the
    second with other values and other helpers; the third is the first again, and is served."""
    needs_torch()

    def run(value: float, factor: float) -> dict:
        (tmp_path / "lib").mkdir(exist_ok=True)
        (tmp_path / "lib" / "userlib.py").write_text(TORCHSCRIPT_LIB.replace("FACTOR", str(factor)))
        done = subprocess.run([sys.executable, "-c", TORCHSCRIPT, str(tmp_path / "lib"), str(value),
                               str(tmp_path / "c")], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    for value, factor in ((1.0, 2.0), (2.0, 3.0), (1.0, 2.0)):
        calls = tmp_path / "c.calls"
        calls.write_text("")
        out = run(value, factor)
        assert out.pop("same model, one key") == 1
        for name, (served, direct) in out.items():
            assert served == direct, f"{name}: a stale entry was served ({value=}, {factor=})"
    assert calls.read_text() == ""  # the first run again: every entry served


BUILTINS_SCRIPT = """
import builtins, json, sys
from hardy import DiskCache, Engine, Pipeline, node
from hardy.hashing import code_fingerprint

def flag(x):
    return x > THRESHOLD

def measured(x):
    return len(x) + abs(min(x))

plain = code_fingerprint(measured)
builtins.THRESHOLD = float(sys.argv[2])
p = Pipeline(nodes=[node(flag, output_name="y")], cache=DiskCache(sys.argv[1]), engine=Engine(map_executor="sequential"))
out = {"fresh process": [p.map(inputs={"x": [0.7]}, map_over="x")[0]["y"], flag(0.7)]}
builtins.THRESHOLD = 1.4 - builtins.THRESHOLD
out["changed in the process"] = [p.map(inputs={"x": [0.7]}, map_over="x")[0]["y"], flag(0.7)]

def attribute(x):
    return x > builtins.LIMIT

builtins.LIMIT = float(sys.argv[2])
a = Pipeline(nodes=[node(attribute, output_name="y")], cache=DiskCache(sys.argv[1]),
             engine=Engine(map_executor="sequential"))
out["read as builtins.LIMIT"] = [a.map(inputs={"x": [0.7]}, map_over="x")[0]["y"], attribute(0.7)]
out["interpreter's own builtins keep their keys"] = [code_fingerprint(measured) == plain, True]
print(json.dumps(out))
"""


def test_a_name_set_in_builtins_is_keyed_across_processes(tmp_path):
    """A node reading a name its module does not bind but `builtins` does (`builtins.THRESHOLD =
    0.5`, a notebook's shared setting), by name or as `builtins.LIMIT`, was keyed without it: a
    fresh process that set 0.9 was served the result of 0.5. It is keyed as a global is, in fresh
    processes and in one."""
    for threshold in ("0.5", "0.9"):
        done = subprocess.run([sys.executable, "-c", BUILTINS_SCRIPT, str(tmp_path / "c"), threshold],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        for name, (served, direct) in json.loads(done.stdout.strip().splitlines()[-1]).items():
            assert served == direct, f"{name}: a stale entry was served (THRESHOLD={threshold})"


OWN_MODULE_BY_ATTRIBUTE = """
import importlib, sys
from hardy import DiskCache, Engine, Pipeline, node
K = int(sys.argv[1])

def by_sys_modules(x):
    return x * sys.modules[__name__].K

def by_importlib(x):
    return x * importlib.import_module(__name__).K

def by_alias(x):
    m = sys.modules[__name__]
    return x * m.K

nodes = [node(f, output_name=f.__name__) for f in (by_sys_modules, by_importlib, by_alias)]
print(Pipeline(nodes, engine=Engine(map_executor="sequential"), cache=DiskCache(sys.argv[2])).run(inputs={"x": 1}))
"""


def test_a_global_read_as_an_attribute_of_its_own_module_is_keyed_across_processes(tmp_path):
    """`sys.modules[__name__].K` reads the global K through an object no chain follows: its key
    has it because every name the code names that its module binds counts (`co_names`, attribute
    names too). Keying only the globals the bytecode loads served the first process's result to a
    second with another K; the names' over-counting costs a miss at most."""
    for k in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", OWN_MODULE_BY_ATTRIBUTE, k, str(tmp_path / "c")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == str({"by_sys_modules": int(k), "by_importlib": int(k), "by_alias": int(k)})


PATCHED_LIBRARY = """
import functools, json, math, sys
from unittest import mock
from hardy import DiskCache, Engine, Pipeline, node

def root(x):
    return math.sqrt(x)

def dumped(x):
    return json.dumps(x)

engine = Engine(map_executor="sequential")
p = Pipeline(nodes=[node(root, output_name="y")], cache=DiskCache(sys.argv[1]), engine=engine)
d = Pipeline(nodes=[node(dumped, output_name="y")], cache=DiskCache(sys.argv[1]), engine=engine)
out = {"the library's own": [p.run(inputs={"x": 4.0})["y"], root(4.0)]}
own = math.sqrt
math.sqrt = lambda v: VALUE
out["patched by the script"] = [p.run(inputs={"x": 4.0})["y"], root(4.0)]
math.sqrt = lambda v: VALUE * 10
out["patched again"] = [p.run(inputs={"x": 4.0})["y"], root(4.0)]
math.sqrt = math.exp
out["another library's function"] = [p.run(inputs={"x": 4.0})["y"], root(4.0)]
math.sqrt = functools.partial(math.pow, 2.0)
out["a partial"] = [p.run(inputs={"x": 4.0})["y"], root(4.0)]

class Plain:
    def __init__(self, k):
        self.k = k

    def halved(self, v):
        return v / 2 + self.k

for k in (1, 2):
    math.sqrt = Plain(k).halved
    out[f"a bound method of an object holding {k}"] = [p.run(inputs={"x": 4.0})["y"], root(4.0)]
math.sqrt = own
out["put back"] = [p.run(inputs={"x": 4.0})["y"], root(4.0)]
with mock.patch("json.dumps", return_value="VALUE"):
    out["mock.patch"] = [d.run(inputs={"x": 1})["y"], dumped(1)]
out["after mock.patch"] = [d.run(inputs={"x": 1})["y"], dumped(1)]

def argued(x):
    return x * int(sys.argv[2])

a = Pipeline(nodes=[node(argued, output_name="y")], cache=DiskCache(sys.argv[1]), engine=engine)
out["sys.argv"] = [a.run(inputs={"x": 2})["y"], argued(2)]
sys.argv[2] = str(int(sys.argv[2]) + 1)
out["sys.argv changed"] = [a.run(inputs={"x": 2})["y"], argued(2)]
print(json.dumps(out))
"""


def test_a_library_function_the_script_patches_and_sys_argv_are_keyed_by_what_they_hold(tmp_path):
    """A node reading `math.sqrt` was keyed by the library's distribution alone: after a script's
    `math.sqrt = my_sqrt` (or `mock.patch`), the library's own result was served, in one process
    and across two. What the script put there is keyed as its code; put back, the library's own.
    So was a node reading `sys.argv`: a library's small plain value is keyed by its content."""
    for value in ("-1.0", "-20.0"):
        done = subprocess.run([sys.executable, "-c", PATCHED_LIBRARY.replace("VALUE", value), str(tmp_path / "c"),
                               str(len(value))],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        for name, (served, direct) in json.loads(done.stdout.strip().splitlines()[-1]).items():
            assert served == direct, f"{name}: a stale entry was served (patched to {value})"


NESTED = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from hardy import DiskCache, Engine, Pipeline, node
v = float(sys.argv[2])

def total(t):
    return [float(x.sum()) for x in t.unbind()]

def shape(t):
    return [list(t.shape), t.stride(), str(t.dtype)]

values = {"nested": (total, torch.nested.nested_tensor([torch.full((1,), v), torch.full((2,), v)])),
          "jagged": (total, torch.nested.nested_tensor([torch.full((1,), v), torch.full((2,), v)], layout=torch.jagged)),
          "meta": (shape, torch.empty(int(v), 3, device="meta").t())}
out = {}
for name, (f, t) in values.items():
    p = Pipeline(nodes=[node(f, output_name="y")], cache=DiskCache(sys.argv[1]), engine=Engine(map_executor="sequential"))
    try:
        out[name] = [p.run(inputs={"t": t})["y"], f(t)]
    except Exception as exc:
        out[name] = [f"{type(exc).__name__}: {exc}", f(t)]
print(json.dumps(out))
"""


@pytest.mark.slow  # torch in subprocesses
def test_nested_and_meta_tensors_are_keyed_by_what_they_hold(tmp_path):
    """A nested tensor given to a cached node raised torch's RuntimeError out of hashing ("NestedTensorImpl
    doesn't support sizes"), a meta tensor its NotImplementedError. A nested tensor is keyed by its
    components, a meta tensor by its dtype, shape and strides: two fresh processes with other values
    on one cache each get their own results."""
    needs_torch()
    for v in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", NESTED, str(tmp_path / "c"), v], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        for name, (served, direct) in json.loads(done.stdout.strip().splitlines()[-1]).items():
            assert served == direct, f"{name} ({v=}): {served}"


WRAPT_SCRIPT = """
import json, sys
import wrapt
from hardy import DiskCache, Engine, Pipeline, node
F = int(sys.argv[2])

@wrapt.decorator
def scaled(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * F * SIGN

SIGN = int(sys.argv[3])

@scaled
def plus_one(x):
    return x + 1

p = Pipeline([node(plus_one, output_name="y")], cache=DiskCache(sys.argv[1]),
             engine=Engine(map_executor=sys.argv[4]))
got = [[p.run(inputs={"x": 2})["y"], plus_one(2)]]
F = F * 10  # the decorator's global changed in the same process
got.append([p.run(inputs={"x": 2})["y"], plus_one(2)])
print(json.dumps(got))
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_a_wrapt_decorators_code_and_globals_are_keyed(tmp_path, executor):
    """A `@wrapt.decorator` poses as the function it wraps (its `__class__`), so its key walked that
    function and never the decorator: a fresh process whose decorator read another global, or
    whose decorator's code changed, and a second call after the global changed in the same
    process, were all served the first result. Its own code and what it reads are keyed."""
    pytest.importorskip("wrapt")
    for f, sign in (("2", "1"), ("3", "1"), ("2", "-1")):
        done = subprocess.run([sys.executable, "-c", WRAPT_SCRIPT, str(tmp_path / "c"), f, sign, executor],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        for served, direct in json.loads(done.stdout.strip().splitlines()[-1]):
            assert served == direct, f"a stale entry was served (F={f}, SIGN={sign}): {done.stdout}"


def _root(x):
    import math
    return math.sqrt(x)


def test_a_bare_mock_patched_into_a_library_is_refused_naming_what_the_node_reads(tmp_path):
    """A `mock.patch("math.sqrt")` MagicMock cannot be keyed by what it returns: the refusal named
    `MagicMock._mock_return_value` alone, not the library function the node reads, now the mock."""
    from unittest import mock

    from hardy import DiskCache, Engine, Pipeline, node
    from hardy.errors import UnhashableError
    p = Pipeline([node(_root, output_name="y")], engine=Engine(map_executor="sequential"), cache=DiskCache(tmp_path))
    with mock.patch("math.sqrt"), pytest.raises(UnhashableError, match=(
            r"node '_root' cannot be cached: it reads math\.sqrt, which this process replaced with a MagicMock "
            r"\(.*@node\(cache=False\)")):
        p.run(inputs={"x": 4.0})
    assert p.run(inputs={"x": 4.0}) == {"y": 2.0}

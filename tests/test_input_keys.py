"""Keys of data inputs a node reads differently: a probe found each pair below sharing a key (a
wrong hit), or an identical input keyed otherwise in every process (never a hit), or hashing
changing the input. Two fresh processes sharing one cache where the difference lies in what a
process builds (a set's insertion order, x87 padding bytes); torch and scikit-learn run in
subprocesses only (their OpenMP pools would be a fork hazard in this process)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_torch
from hardy import DiskCache, Engine, Pipeline, node
from hardy.hashing import hash_value

pytestmark = pytest.mark.usefixtures("in_process_default")


def _served(tmp_path: Path, func: typing.Callable[..., object], inputs: list[object]) -> list[object]:
    """What a cached node returns for each input `x` in turn, one cache on disk: a wrong hit returns
    an earlier input's result."""
    p = Pipeline([node(func, output_name="y")], cache=DiskCache(tmp_path / "cache"),
                 engine=Engine(map_executor="sequential"))
    return [p.run(inputs={"x": x})["y"] for x in inputs]


def _processes(tmp_path: Path, script: str, variants: list[str], seeded: bool = False) -> list[typing.Any]:
    """The JSON each fresh process running `script` with one cache folder and a variant prints last;
    `seeded`: the variant is also the process's PYTHONHASHSEED (its salt of str and bytes hashes)."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    return [json.loads(subprocess.run([sys.executable, str(path), str(tmp_path / "cache"), variant], check=True,
                                      capture_output=True, text=True, timeout=300,
                                      env={**os.environ, "PYTHONHASHSEED": variant} if seeded else None,
                                      ).stdout.strip().splitlines()[-1])
            for variant in variants]


SET_ORDER = """
import datetime, decimal, fractions, json, sys, uuid
import numpy as np
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="listed")
def listed(ids):
    return ",".join(map(str, ids))  # the order the set holds them in

order = [1, 9] if sys.argv[2] == "fwd" else [9, 1]
sets = {"numpy": set(np.array(order)), "float32": {np.float32(x) / 2 for x in order},
        "decimal": set(map(decimal.Decimal, order)), "fraction": {fractions.Fraction(x, 7) for x in order},
        "timedelta": {datetime.timedelta(days=x) for x in order}, "uuid": {uuid.UUID(int=x) for x in order},
        "tuple": {(np.int64(x), 0.5) for x in order}}
p = Pipeline(nodes=[listed], cache=DiskCache(sys.argv[1]), engine=Engine(map_executor="sequential"))
print(json.dumps({k: [p.run(inputs={"ids": s})["listed"], listed.func(s)] for k, s in sets.items()}))
"""


def test_a_set_of_numpy_numbers_decimals_or_fractions_is_keyed_in_its_iteration_order(tmp_path):
    """`set(df["id"].to_numpy())` built from `[1, 9]` in one process and `[9, 1]` in another
    iterates in two orders, as a set of ints does: their hashes are not salted. It was keyed by
    its members sorted, and the second process was served the first's `"1,9"` for its `"9,1"`;
    likewise a set of Decimals, Fractions, timedeltas, UUIDs, or tuples holding numpy ints."""
    first, second = _processes(tmp_path, SET_ORDER, ["fwd", "rev"])
    assert {k: hardy for k, (hardy, _) in second.items()} == {k: plain for k, (_, plain) in second.items()}
    assert second["numpy"][1] != first["numpy"][1], "the two processes' sets iterate alike: no case"


def test_sets_whose_order_is_salted_keep_their_keys():
    """Sets of strings, dates and NaNs iterate in an order no key can hold (their hashes are
    salted, or a NaN's is its address): keyed by their members sorted, as before."""
    import datetime
    assert hash_value({"a", "b"}) == hash_value({"b", "a"})
    days = [datetime.date(2020, 1, 1), datetime.date(2021, 1, 1)]
    assert hash_value(set(days)) == hash_value(set(days[::-1]))
    assert hash_value({np.float64("nan"), np.float64(1)}) == hash_value({np.float64(1), np.float64("nan")})
    assert hash_value({np.int64(1)}).hex() == "a89efe6c628935601764b12285b593f4"  # one member: one order


ESTIMATORS = """
import json, sys
import numpy as np
from blake3 import blake3
from sklearn.base import BaseEstimator
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from hardy.hashing import hash_value
from hardy.hashing.values import DIGEST, encode_object

class MonotoneCalibrator(IsotonicRegression):  # a user's subclass: sklearn's __getstate__ pops `f_`
    pass

class Vocab(BaseEstimator):  # a user's __getstate__ that leaves out what it rebuilds on unpickling
    def fit(self, words):
        self._words = sorted(set(words))
        self.index_ = {w: i for i, w in enumerate(self._words)}
        return self
    def __getstate__(self):
        state = dict(super().__getstate__()); state.pop("index_", None)
        return state

def old_key(v):  # the estimator's key as its __getstate__ shows it
    h = blake3(); encode_object(v, b"SK", v.__getstate__(), h.update, set()); return h.digest(DIGEST)

X = np.array([0., 1., 2., 3.]); y = np.array([0., 0.2, 0.7, 1.])
model = MonotoneCalibrator(out_of_bounds="clip").fit(X, y)
hash_value(model)
a, b = Vocab().fit(["cat", "dog"]), Vocab().fit(["cat", "dog"])
b.index_ = {"cat": 7, "dog": 8}
plain = [IsotonicRegression().fit(X, y), LogisticRegression().fit(X[:, None], y > 0.5), StandardScaler(),
         make_pipeline(StandardScaler(), LogisticRegression()).fit(X[:, None], y > 0.5)]
print(json.dumps({"f_ kept": hasattr(model, "f_"), "predicts": model.predict(np.array([0.5])).tolist(),
                  "vocabs apart": hash_value(a) != hash_value(b),
                  "sklearn's keys stay": [hash_value(v) == old_key(v) for v in plain]}))
"""


@pytest.mark.slow  # scikit-learn imported
def test_hashing_an_estimator_changes_nothing_and_keys_what_it_holds(tmp_path):
    """Hashing a user's subclass of IsotonicRegression called its `__getstate__`, which popped `f_`
    from the live `__dict__`: the model could no longer predict. A user's `__getstate__` that left
    `index_` out (rebuilt on unpickling) let two vocabularies share a key. An estimator is keyed by
    what it holds; scikit-learn's own estimators keep their keys."""
    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed (pip install scikit-learn)")
    out, = _processes(tmp_path, ESTIMATORS, ["-"])
    assert out == {"f_ kept": True, "predicts": [0.1], "vocabs apart": True, "sklearn's keys stay": [True] * 4}


TORCH = """
import json, sys
import torch
from hardy import DiskCache, Engine, Pipeline, node
from hardy.hashing import hash_value

@node(output_name="g")
def grad_of_square(w):
    (w ** 2).sum().backward()
    return None if w.grad is None else w.grad.tolist()  # a non-leaf tensor gets no .grad

@node(output_name="keys")
def checkpoint_keys(model):
    return sorted(model.state_dict())

class Net(torch.nn.Module):
    def __init__(self, persistent):
        super().__init__()
        self.register_buffer("running", torch.zeros(1), persistent=persistent)

def weight(v):
    return torch.ones(3, requires_grad=True) if v == "a" else torch.ones(3, requires_grad=True) * 1

v = sys.argv[2]
p = Pipeline(nodes=[grad_of_square, checkpoint_keys], cache=DiskCache(sys.argv[1]),
             engine=Engine(map_executor="sequential"))
out = p.run(inputs={"w": weight(v), "model": Net(persistent=v == "a")})
print(json.dumps({"hardy": out, "plain": {"g": grad_of_square.func(weight(v)),
                                          "keys": sorted(Net(persistent=v == "a").state_dict())},
                  "pinned": [hash_value(torch.ones(3, requires_grad=True)).hex(),
                             hash_value(torch.arange(6.).reshape(2, 3)).hex()]}))
"""


def test_tensors_and_modules_are_keyed_by_what_backward_and_state_dict_read(tmp_path):
    """A leaf tensor with `requires_grad` and one made by an operation (`.grad` filled after
    `backward()`, or None) shared a key; so did modules whose buffer is persistent or not (in
    `state_dict()` or not). Leaf tensors and modules without such buffers keep their keys."""
    needs_torch()
    first, second = _processes(tmp_path, TORCH, ["a", "b"])
    assert first["hardy"] == first["plain"] and second["hardy"] == second["plain"]
    assert second["pinned"] == ["d53935a5abc86968b46fb145faa9327f", "41bcefc6a1e8367585097e25167f252d"]


@dataclasses.dataclass
class Prices:
    values: list

    @functools.cached_property
    def total(self) -> int:
        return sum(self.values)


def test_a_dataclass_is_keyed_with_the_cached_property_value_it_holds(tmp_path):
    """A dataclass's key left out a `cached_property`'s value in its `__dict__`: one read and then
    made stale (`values` reassigned) was served the fresh one's result. A plain object's key has
    always held it; a dataclass whose property was never read keeps its key."""
    stale = Prices([1, 2])
    assert stale.total == 3
    stale.values = [10, 20]
    fresh = Prices([10, 20])
    before = hash_value(fresh)

    def total(x: Prices) -> int:
        return x.total
    assert _served(tmp_path, total, [fresh, stale]) == [30, 3]
    assert hash_value(Prices([10, 20])) == before


def test_an_object_array_is_keyed_by_its_memory_order(tmp_path):
    """An object array in C and in Fortran order shared a key (`ravel("K")` reads them apart; a
    numeric array's key already said it). Said only when not C-ordered: other arrays keep their keys."""
    grid = np.array([["a", "b"], ["c", "d"]], dtype=object)

    def flat(x: np.ndarray) -> list:
        return x.ravel("K").tolist()
    assert _served(tmp_path, flat, [grid, np.asfortranarray(grid)]) == [list("abcd"), list("acbd")]
    assert {hash_value(grid).hex(), hash_value(np.asfortranarray(np.arange(6.).reshape(2, 3))).hex()} == \
        {"d909596ac2195ba2a757a6a1fa1962ed", "301a7c87be1a056091337fbeae54f11c"}


def test_a_read_only_array_is_keyed_apart_from_a_writable_one(tmp_path):
    """A writable and a read-only array shared a key (`x *= 2` raises on one), as a memoryview's
    does not. Said only when read-only: writable arrays keep their keys."""
    frozen = np.ones(2)
    frozen.setflags(write=False)

    def doubled(x: np.ndarray) -> str:
        try:
            x *= 2
        except ValueError:
            return "read-only"
        return "doubled"
    assert _served(tmp_path, doubled, [np.ones(2), frozen]) == ["doubled", "read-only"]
    assert hash_value(np.arange(6, dtype=np.int32).reshape(2, 3)).hex() == "064787f3a825730bc03ee293d7cf616b"


def _x87() -> bool:
    """Whether `longdouble` is x87's 80-bit format padded with bytes it does not use."""
    return np.finfo(np.longdouble).nmant == 63 and np.dtype(np.longdouble).itemsize > 10


LONGDOUBLE = """
import json, sys
import numpy as np
from hardy.hashing import hash_value
print(json.dumps([hash_value(np.array([1.0, 2.0, 3.0], dtype=np.longdouble)).hex(),
                  hash_value(np.array([1 + 2j], dtype=np.clongdouble)).hex(), hash_value(np.longdouble(0.1)).hex()]))
"""


def test_a_longdouble_array_is_keyed_by_its_value_not_its_padding(tmp_path):
    """x87's 80-bit `longdouble` is stored in 16 bytes whose last 6 are whatever the memory held:
    the same array was keyed otherwise in every process, and never hit. Keyed by its 10 bytes."""
    if not _x87():
        pytest.skip("longdouble here is no padded x87 format")
    first, second = _processes(tmp_path, LONGDOUBLE, ["1", "2"])
    assert first == second
    values = np.array([1.0, 2.5], dtype=np.longdouble)
    padded = values.view(np.uint8).copy()
    part = np.dtype(np.longdouble).itemsize
    padded.reshape(-1, part)[:, 10:] = 0xAB
    assert (padded.view(np.longdouble) == values).all()
    assert hash_value(padded.view(np.longdouble)) == hash_value(values)
    assert hash_value(values) != hash_value(np.array([1.0, 2.0], dtype=np.longdouble))


def test_an_arrow_dictionary_scalar_is_keyed_by_its_index_and_dictionary(tmp_path):
    """A dictionary scalar was keyed by its type and `as_py()`: index 0 into `[a, b]` and index 1
    into `[b, a]` (both `"a"`) shared a key, and `.index` read 1 was served 0."""
    pa = pytest.importorskip("pyarrow")
    first = pa.array(["a", "b"]).dictionary_encode()[0]
    second = pa.DictionaryArray.from_arrays(pa.array([1], pa.int32()), pa.array(["b", "a"]))[0]

    def index(x: typing.Any) -> int:
        return x.index.as_py()
    assert _served(tmp_path, index, [first, second]) == [0, 1]
    assert hash_value(pa.scalar(3)).hex() == "b2a7281bd685a561ad0be4182fa208ae"  # other scalars keep theirs


SALTED_NUMPY_SETS = """
import json, os, sys
import numpy as np
from hardy import DiskCache, Engine, Pipeline, node

@node(output_name="by")
def computed_by(spans):
    return os.getpid()

values = np.arange(1, 9)
sets = {f"{kind}[{unit}]": set(values.astype(f"{kind}[{unit}]"))  # set(df["dur"].to_numpy())
        for kind in ("timedelta64", "datetime64") for unit in ("ns", "us", "D")}
p = Pipeline(nodes=[computed_by], cache=DiskCache(sys.argv[1]), engine=Engine(map_executor="sequential"))
print(json.dumps({k: [p.run(inputs={"spans": s})["by"] == os.getpid(), [str(x) for x in s]] for k, s in sets.items()}))
"""


def test_a_set_of_numpy_timedeltas_or_datetimes_hits_under_another_hash_seed(tmp_path):
    """`np.timedelta64` is a numpy integer, and was taken for one whose hash is not salted: a set
    of `timedelta64[ns]` (whose hash, as `datetime64`'s in every unit, is) was keyed in its
    iteration order, another under each PYTHONHASHSEED, and a second process never hit. Keyed by
    its sorted members, as before sets were keyed in their order."""
    first, second = _processes(tmp_path, SALTED_NUMPY_SETS, ["1", "2"], seeded=True)
    assert first["timedelta64[ns]"][1] != second["timedelta64[ns]"][1], "the sets iterate alike: no case"
    assert {k: computed_here for k, (computed_here, _) in first.items()} == dict.fromkeys(first, True)
    assert {k: computed_here for k, (computed_here, _) in second.items()} == dict.fromkeys(second, False)


TRACED = """
import json, sys
import torch
from blake3 import blake3
from hardy.hashing import torchscript
from hardy.hashing.distributions import module_identity
from hardy.hashing.values import encode_into

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])

    def forward(self, x):
        return self.layers(x)

def key(m):
    h = blake3(); encode_into(m, h.update, set()); return h.hexdigest()

def archive_key(m):  # the key of a compiled module without Python attributes: its archive alone
    h = blake3(); h.update(b"JM" + module_identity("torch")); torchscript._archive(m, h.update); return h.hexdigest()

traced, scripted = torch.jit.trace(Net(), torch.ones(1, 4)), torch.jit.script(Net())
out = {"traced keyed by its archive": key(traced) == archive_key(traced),
       "scripted keyed by its archive": key(scripted) == archive_key(scripted)}
keys = [key(traced)]
traced.scale = 3.0
keys.append(key(traced))
getattr(traced.layers, "2").tag = "x"  # (a traced Sequential has no [])
keys.append(key(traced))
traced.scale = 4.0
out["attributes set on a trace keyed"] = len(set(keys + [key(traced)])) == 4
print(json.dumps(out))
"""


@pytest.mark.slow  # torch in a subprocess
def test_a_traced_module_without_attributes_set_keys_by_its_archive_alone(tmp_path):
    """Keying the Python attributes a script sets on a compiled module took a traced wrapper's own
    `_name` and `_actual_script_module` for some, and a scripted `Sequential`'s `__len__` (torch's,
    bound to the eager module): every traced model's key moved (a miss after the upgrade), and
    each submodule wrote its script module's archive once more (0.07 s against 0.008 s for 8
    layers). A module none was set on keys by its archive alone; one set on a trace is keyed."""
    needs_torch()
    out, = _processes(tmp_path, TRACED, ["-"])
    assert out == dict.fromkeys(out, True) and len(out) == 3


CLOSING_ESTIMATOR = """
import gc, json, os, sys
import numpy as np
from blake3 import blake3
from sklearn.linear_model import LinearRegression
from hardy.hashing import hash_value
from hardy.hashing.values import DIGEST, encode_object

class Logged(LinearRegression):  # owns a file it writes to, which its __del__ closes
    def fit(self, X, y):
        self.log_fd_ = os.open(sys.argv[1] + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return super().fit(X, y)

    def __del__(self):
        fd = getattr(self, "log_fd_", None)
        if fd is not None:
            os.close(fd)

def still_open(fd):
    try:
        return os.path.samestat(os.fstat(fd), os.stat(sys.argv[1] + ".log"))
    except OSError:
        return False

model = Logged().fit(np.array([[0.], [1.], [2.]]), np.array([0., 1., 2.]))
keys = [hash_value(model), hash_value(model)]
gc.collect()
h = blake3(); encode_object(model, b"SK", model.__getstate__(), h.update, set())
print(json.dumps({"file still open": still_open(model.log_fd_),
                  "keyed as its __getstate__ shows it": keys == [h.digest(DIGEST)] * 2}))
"""


@pytest.mark.slow  # scikit-learn imported
def test_hashing_an_estimator_never_runs_its_del(tmp_path):
    """The copy `__getstate__` runs on was an instance of the estimator's class: its `__del__` ran
    when it was dropped, on the attributes it shares with the model, and a subclass whose `__del__`
    closes its file had it closed by hashing. The key is what `__getstate__` shows, as before."""
    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed (pip install scikit-learn)")
    out, = _processes(tmp_path, CLOSING_ESTIMATOR, ["-"])
    assert out == {"file still open": True, "keyed as its __getstate__ shows it": True}

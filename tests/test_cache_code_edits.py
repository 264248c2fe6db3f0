"""Edits of what a node reaches through classes change its key, across fresh processes: real files
edited between two runs of a user's script. A comment-only edit changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# module -> (source, the edit: (old, new)); each module's node `step` reaches the construct
CASES = {
    "cached_prop": ('''
import functools

class Model:
    @functools.cached_property
    def scale(self):
        return 2

def step(x):
    return Model().scale * x
''', ("return 2", "return 3")),
    "lru_method": ('''
import functools

class Model:
    @functools.lru_cache(maxsize=None)
    def scale(self, k):
        return 2 * k

def step(x):
    return Model().scale(x)
''', ("return 2 * k", "return 3 * k")),
    "cache_static": ('''
import functools

class Model:
    @staticmethod
    @functools.cache
    def scale(k):
        return 2 * k

def step(x):
    return Model.scale(x)
''', ("return 2 * k", "return 3 * k")),
    "nested_class": ('''
class Model:
    class Config:
        FACTOR = 2

def step(x):
    return Model.Config.FACTOR * x
''', ("FACTOR = 2", "FACTOR = 3")),
    "class_array": ('''
import numpy as np

class Model:
    WEIGHTS = np.array([1.0, 2.0])

def step(x):
    return Model.WEIGHTS.sum() * x
''', ("[1.0, 2.0]", "[1.0, 3.0]")),
    "class_instance": ('''
class Settings:
    def __init__(self, factor):
        self.factor = factor

class Model:
    SETTINGS = Settings(factor=2)

def step(x):
    return Model.SETTINGS.factor * x
''', ("factor=2)", "factor=3)")),
    "self_instance": ('''
class Config:
    def __init__(self, factor):
        self.factor = factor

Config.DEFAULT = Config(2)

def step(x):
    return Config.DEFAULT.factor * x
''', ("Config(2)", "Config(3)")),
    "init_subclass": ('''
class Base:
    registry = {}
    def __init_subclass__(cls, factor=1, **kw):
        super().__init_subclass__(**kw)
        cls.factor = factor * 2

class Model(Base, factor=1):
    pass

def step(x):
    return Model.factor * x
''', ("factor * 2", "factor * 3")),
    "dataclass_factory": ('''
import dataclasses

@dataclasses.dataclass
class Options:
    weights: list = dataclasses.field(default_factory=lambda: [1, 2])

def step(x):
    return sum(Options().weights) * x
''', ("[1, 2]", "[1, 3]")),
    "namedtuple_default": ('''
import typing

class Options(typing.NamedTuple):
    factor: int = 2

def step(x):
    return Options().factor * x
''', ("int = 2", "int = 3")),
    "try_else": ('''
def step(x):
    try:
        try:
            y = 10 // x
            z = 10 // (x - 1)
        except ZeroDivisionError:
            return "inner"
        return z + y
    except ZeroDivisionError:
        return "outer"
''', ("            z = 10 // (x - 1)\n        except ZeroDivisionError:\n            return \"inner\"\n",
        "        except ZeroDivisionError:\n            return \"inner\"\n        else:\n            z = 10 // (x - 1)\n")),
    "function_attribute": ('''
def helper(x):
    return x

helper.factor = 2

def step(x):
    return helper.factor * x
''', ("helper.factor = 2", "helper.factor = 3")),
    "enum_method": ('''
import enum

class Mode(enum.Enum):
    A = 1

    def factor(self):
        return 2

DEFAULT = Mode.A

def step(x):
    return DEFAULT.factor() * x
''', ("return 2", "return 3")),
    "namedtuple_method": ('''
import typing

class Options(typing.NamedTuple):
    k: int

    def factor(self):
        return 2 * self.k

DEFAULT = Options(1)

def step(x):
    return DEFAULT.factor() * x
''', ("2 * self.k", "3 * self.k")),
    "str_subclass_method": ('''
class Tag(str):
    def marked(self):
        return self + "!"

DEFAULT = Tag("a")

def step(x):
    return DEFAULT.marked() * x
''', ('"!"', '"?"')),
    "annotation": ('''
import dataclasses
import typing

@dataclasses.dataclass
class Options:
    v: int = 2

def step(x):
    return typing.get_type_hints(Options)["v"](x)
''', ("v: int", "v: float")),
    "control": ('''
class Model:
    FACTOR = 2

def step(x):
    return Model.FACTOR * x  # a comment
''', ("# a comment", "# another comment")),
}

SCRIPT = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
from hardy import node
from hardy.cache.keys import call_fingerprint
keys = {}
for name in sys.argv[2].split(","):
    step = node(output_name="y")(importlib.import_module(name).step)
    assert step.func(1) is not None
    keys[name] = call_fingerprint(step, ["x"]).hex()
print(json.dumps(keys))
"""


def fingerprints(folder: Path) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-", str(folder), ",".join(CASES)], input=SCRIPT, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_edits_reached_through_classes_change_the_key_in_a_fresh_process(tmp_path):
    for name, (source, _) in CASES.items():
        (tmp_path / f"{name}.py").write_text(source)
    before = fingerprints(tmp_path)  # also: dataclass default_factory and NamedTuple defaults hash
    for name, (source, (old, new)) in CASES.items():
        assert old in source
        (tmp_path / f"{name}.py").write_text(source.replace(old, new))
    after = fingerprints(tmp_path)
    changed = {name for name in CASES if before[name] != after[name]}
    assert changed == set(CASES) - {"control"}


# name -> (files under the folder, the edit: (file, old, new)); module `name` defines the node `step`.
# What a probe found keyed by nothing, or by the wrong file: each edit must change the key.
IMPORT_CASES: dict[str, tuple[dict[str, str], tuple[str, str, str]]] = {
    "dotted_import": ({  # `import pkg.sub` inside the node, the package's __init__ not importing `sub`
        "dotted_import.py": "def step(x):\n    import lazypkg.sub\n    return lazypkg.sub.scale(x)\n",
        "lazypkg/__init__.py": "",
        "lazypkg/sub.py": "def scale(x):\n    return x * 2\n",
    }, ("lazypkg/sub.py", "x * 2", "x * 3")),
    "relpkg.nodes": ({  # a relative import inside the node
        "relpkg/__init__.py": "",
        "relpkg/nodes.py": "def step(x):\n    from .helpers import scale\n    return scale(x)\n",
        "relpkg/helpers.py": "def scale(x):\n    return x * 2\n",
    }, ("relpkg/helpers.py", "x * 2", "x * 3")),
    "relsub.nodes": ({  # `from . import helpers`: a submodule its package does not import
        "relsub/__init__.py": "",
        "relsub/nodes.py": "def step(x):\n    from . import helpers\n    return helpers.scale(x)\n",
        "relsub/helpers.py": "def scale(x):\n    return x * 2\n",
    }, ("relsub/helpers.py", "x * 2", "x * 3")),
    "renamed": ({  # a function's name, which the node reads
        "renamed.py": "def mean_abs(xs):\n    return 1\n\nMETRICS = [mean_abs]\n\n"
                      "def step(x):\n    return {f.__name__: f(x) for f in METRICS}\n",
    }, ("renamed.py", "def mean_abs(xs):\n    return 1\n\nMETRICS = [mean_abs]",
        "def mae(xs):\n    return 1\n\nMETRICS = [mae]")),
    "vendored": ({  # a package on a site-packages folder that no distribution installed
        "vendored.py": "import os, sys\nsys.path.insert(0, os.path.join(os.path.dirname(__file__), 'vendor', "
                       "'site-packages'))\nimport fakepkg\n\ndef step(x):\n    return fakepkg.scale(x)\n",
        "vendor/site-packages/fakepkg/__init__.py": "from .core import scale\n",
        "vendor/site-packages/fakepkg/core.py": "def scale(x):\n    return x * 2\n",
    }, ("vendor/site-packages/fakepkg/core.py", "x * 2", "x * 3")),
    "passed_module": ({  # a module passed along as a value: its constants count
        "passed_module.py": "import passed_cfg\n\ndef limit(settings, x):\n    return min(x, settings.THRESHOLD)\n\n"
                            "def step(x):\n    return limit(passed_cfg, x)\n",
        "passed_cfg.py": "THRESHOLD = 10\n",
    }, ("passed_cfg.py", "THRESHOLD = 10", "THRESHOLD = 20")),
}

KEYS_FIRST = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
from hardy import node
from hardy.cache.keys import call_fingerprint
keys = {}
for name in sys.argv[2].split(","):
    step = node(output_name="y")(importlib.import_module(name).step)
    keys[name] = call_fingerprint(step, ["x"]).hex()  # before the node runs, as a cached run keys it
    assert step.func(1) is not None
print(json.dumps(keys))
"""


def test_edits_reached_through_imports_and_names_change_the_key_in_a_fresh_process(tmp_path):
    for files, _ in IMPORT_CASES.values():
        for path, source in files.items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(source)

    def keys() -> dict[str, str]:
        out = subprocess.run([sys.executable, "-", str(tmp_path), ",".join(IMPORT_CASES)], input=KEYS_FIRST,
                             text=True, capture_output=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    before = keys()
    for _, (path, old, new) in IMPORT_CASES.values():
        source = (tmp_path / path).read_text()
        assert old in source
        (tmp_path / path).write_text(source.replace(old, new))
    after = keys()
    assert {name for name in IMPORT_CASES if before[name] == after[name]} == set()


# What pydantic keeps out of a model class's namespace, a property's setter and deleter, and
# class-level dunder values: edits a probe found served stale across processes (each keyed by nothing).
CLASS_CASES = {
    "pyd_default": ('''
from pydantic import BaseModel

class Settings(BaseModel):
    batch: int = 2

def step(x):
    return Settings().batch * x
''', ("batch: int = 2", "batch: int = 5")),
    "pyd_field_default": ('''
from pydantic import BaseModel, Field

class Settings(BaseModel):
    lr: float = Field(default=0.1)

def step(x):
    return Settings().lr * x
''', ("default=0.1", "default=0.7")),
    "pyd_factory": ('''
from pydantic import BaseModel, Field

class Settings(BaseModel):
    sizes: list = Field(default_factory=lambda: [1, 2])

def step(x):
    return sum(Settings().sizes) * x
''', ("[1, 2]", "[1, 3]")),
    "pyd_constraint": ('''
from pydantic import BaseModel, Field

class Settings(BaseModel):
    ratio: float = Field(default=0.5, le=1.0)

def step(x):
    try:
        return Settings(ratio=x + 0.5).ratio
    except ValueError:
        return "rejected"
''', ("le=1.0", "le=2.0")),
    "pyd_alias": ('''
from pydantic import BaseModel, Field

class Settings(BaseModel):
    k: int = Field(default=1, alias="kk")

def step(x):
    return Settings.model_validate({"k": 5, "kk": 7}).k * x
''', ('alias="kk"', 'alias="k"')),
    "pyd_validator_fields": ('''
from pydantic import BaseModel, field_validator

class Settings(BaseModel):
    a: int = 1
    b: int = 1

    @field_validator("a")
    @classmethod
    def double(cls, v):
        return v * 2

def step(x):
    s = Settings(a=x, b=x)
    return (s.a, s.b)
''', ('field_validator("a")', 'field_validator("b")')),
    "pyd_validator_mode": ('''
from pydantic import BaseModel, field_validator

class Settings(BaseModel):
    a: int = 1

    @field_validator("a", mode="after")
    @classmethod
    def parse(cls, v):
        return int(v) + 1 if isinstance(v, str) else v

def step(x):
    return Settings(a=str(x)).a
''', ('mode="after"', 'mode="before"')),
    "pyd_private": ('''
from pydantic import BaseModel, PrivateAttr

class Settings(BaseModel):
    _scale: int = PrivateAttr(default=2)

def step(x):
    return Settings()._scale * x
''', ("default=2", "default=3")),
    "property_setter": ('''
class Store:
    @property
    def k(self):
        return self._k

    @k.setter
    def k(self, v):
        self._k = v * 2

def step(x):
    s = Store()
    s.k = x
    return s.k
''', ("v * 2", "v * 3")),
    "property_deleter": ('''
class Store:
    def __init__(self):
        self.log = []

    @property
    def k(self):
        return 1

    @k.deleter
    def k(self):
        self.log.append("a")

def step(x):
    s = Store()
    del s.k
    return s.log * x
''', ('append("a")', 'append("b")')),
    "array_ufunc": ('''
import numpy as np

class Unit:
    __array_priority__ = 0

    def __radd__(self, other):
        return "Unit.radd"

def step(x):
    r = np.array([x]) + Unit()
    return r if isinstance(r, str) else r.tolist()
''', ("__array_priority__ = 0", "__array_ufunc__ = None")),
    "match_args": ('''
class Pair:
    __match_args__ = ("a", "b")

    def __init__(self):
        self.a, self.b = 1, 2

def step(x):
    match Pair():
        case Pair(v, _):
            return v * x
''', ('("a", "b")', '("b", "a")')),
    "typeddict_total": ('''
import typing

class Row(typing.TypedDict, total=True):
    a: int

def step(x):
    return sorted(Row.__required_keys__) * x
''', ("total=True", "total=False")),
    "pyd_rich": ('''
from typing import Annotated, Literal, Optional
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, computed_field, field_serializer,
                      model_validator)

def clip(v):
    return min(v, 10)

class Inner(BaseModel):
    tags: frozenset = frozenset({"alpha", "beta", "gamma", "delta"})  # (its repr follows the hash seed)

class Rich(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["a", "b"] = "a"
    n: Annotated[int, AfterValidator(clip), Field(ge=0)] = 3
    inner: Inner = Field(default_factory=Inner)
    maybe: Optional[dict[str, list[int]]] = None
    text: str = Field(default="x", pattern="^x", examples=["x", "xx"], description="d")
    _cache: dict = PrivateAttr(default_factory=dict)

    @computed_field
    @property
    def double(self) -> int:
        return self.n * 2

    @model_validator(mode="after")
    def check(self):
        return self

    @field_serializer("n")
    def show(self, v):
        return v

def step(x):
    try:
        return Rich(n=x - 1).double
    except ValueError:
        return "rejected"
''', ('pattern="^x"', 'pattern="^y"')),
    "pyd_control": ('''
from pydantic import BaseModel, Field, field_validator

class Settings(BaseModel):
    lr: float = Field(default=0.1, le=1.0)  # a comment
    _seed: int = 0

    @field_validator("lr")
    @classmethod
    def check(cls, v):
        return v

def step(x):
    return Settings().lr * x
''', ("# a comment", "# another comment")),
}

CLASS_KEYS = """
import importlib, json, pickle, sys
sys.path.insert(0, sys.argv[1])
from hardy import node
from hardy.cache.keys import call_fingerprint
keys = {}
for name in sys.argv[2].split(","):
    module = importlib.import_module(name)
    step = node(output_name="y")(module.step)
    assert step.func(1) is not None
    if sys.argv[3] == "pickle":  # what pickling an instance leaves on its class (copyreg's `__slotnames__`)
        for cls in [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == name]:
            try:
                pickle.dumps(cls.__new__(cls))
            except Exception:
                pass
    keys[name] = call_fingerprint(step, ["x"]).hex()
print(json.dumps(keys))
"""


def class_keys(folder: Path, seed: str, pickled: bool = False) -> dict[str, str]:
    import os
    out = subprocess.run([sys.executable, "-", str(folder), ",".join(CLASS_CASES), "pickle" if pickled else "-"],
                         input=CLASS_KEYS, text=True, capture_output=True, timeout=300,
                         env={**os.environ, "PYTHONHASHSEED": seed})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_edits_of_pydantic_models_property_accessors_and_dunder_values_change_the_key_in_a_fresh_process(tmp_path):
    """A pydantic model's defaults, `Field(...)` arguments, constraints, aliases, validators'
    fields and modes and private attributes' defaults live outside its class's namespace
    (`__pydantic_fields__`, `__pydantic_decorators__`, `__private_attributes__`); a property's
    setter and deleter, and `__array_ufunc__`, `__match_args__` or a TypedDict's `total=`, were
    left out of a class's fingerprint: an edit of any served the old result. Each now changes the
    key, and the keys of the unedited classes are the same in fresh processes with other hash
    seeds, and after an instance was pickled (which leaves `__slotnames__` on its class)."""
    for name, (source, _) in CLASS_CASES.items():
        (tmp_path / f"{name}.py").write_text(source)
    before = class_keys(tmp_path, "1")
    assert class_keys(tmp_path, "2", pickled=True) == before
    for name, (source, (old, new)) in CLASS_CASES.items():
        assert old in source
        (tmp_path / f"{name}.py").write_text(source.replace(old, new))
    after = class_keys(tmp_path, "3")
    assert {name for name in CLASS_CASES if before[name] == after[name]} == {"pyd_control"}


SETTINGS_JOB = """
import json, sys
sys.path.insert(0, sys.argv[1])
from hardy import DiskCache, Engine, Pipeline, node
from settings import Settings

def batch(x):
    return Settings().batch * x

def accepted(x):
    try:
        return Settings(ratio=x).ratio
    except ValueError:
        return "rejected"

out = {}
for f, x in ((batch, 1), (accepted, 1.5)):
    p = Pipeline([node(f, output_name="y")], cache=DiskCache(sys.argv[2]), engine=Engine(map_executor="sequential"))
    out[f.__name__] = [p.run(inputs={"x": x})["y"], f(x)]
print(json.dumps(out))
"""


def test_a_pydantic_settings_class_edited_between_two_runs_is_not_served_stale(tmp_path):
    """The probe's scenario, end to end: settings in a user module, a cache on disk, one fresh
    process before and one after editing a default and a constraint. The second run returned `2`
    and `'rejected'`, what the first computed; it must return what its own process computes."""
    settings = tmp_path / "settings.py"
    settings.write_text("from pydantic import BaseModel, Field\n\nclass Settings(BaseModel):\n"
                        "    batch: int = 2\n    ratio: float = Field(default=0.5, le=1.0)\n")

    def run() -> dict[str, list[object]]:
        out = subprocess.run([sys.executable, "-", str(tmp_path), str(tmp_path / "cache")], input=SETTINGS_JOB,
                             text=True, capture_output=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])
    assert run() == {"batch": [2, 2], "accepted": ["rejected", "rejected"]}
    settings.write_text(settings.read_text().replace("batch: int = 2", "batch: int = 5").replace("le=1.0", "le=2.0"))
    assert run() == {"batch": [5, 5], "accepted": [1.5, 1.5]}

"""A module held in a value, or imported by a constant name, is keyed by its code across processes:
real files edited between two runs of a user's script sharing one `DiskCache` folder.

A user module held as a class attribute (`class R: c = cfg`) counted only as present, so editing
`cfg.g` served the old result; one imported by name (`importlib.import_module("cfg")`) was not in
the key at all; one as a default argument (`def h(x, _m=math)`) refused the node with a message
naming neither the function nor the default.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MAIN = """
import importlib
import sys
import utils
from hardy import DiskCache, Pipeline, node

@node(output_name="y")
def f(x):
    print("COMPUTED")
    return NODE_BODY

print("RESULT", Pipeline(nodes=[f], cache=DiskCache(sys.argv[1])).run(inputs={"x": 3})["y"])
"""

CFG = "def g(x):\n    return x + {}\n"


def _write(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(textwrap.dedent(text).lstrip())


def _run(folder: Path) -> subprocess.CompletedProcess[str]:
    """The script in a fresh process, on the cache folder both runs share (no bytecode written: an
    edit within the same second keeps a `.pyc`'s timestamp)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "main.py", str(folder / "cache")], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=120)


def _result(folder: Path) -> tuple[str, bool]:
    done = _run(folder)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(s for s in done.stdout.splitlines() if s.startswith("RESULT"))
    return line.split(" ", 1)[1], "COMPUTED" in done.stdout


def _edited_between_runs(folder: Path, utils: str, body: str) -> list[tuple[str, bool]]:
    """(result, computed) of a run with `cfg.g` adding 1, then of one after it was edited to add 2."""
    _write(folder, "main.py", MAIN.replace("NODE_BODY", body))
    _write(folder, "utils.py", utils)
    runs = []
    for add in (1, 2):
        _write(folder, "cfg.py", CFG.format(add))
        runs.append(_result(folder))
    return runs


CLASS_ATTRIBUTE = """
import cfg

class R:
    c = cfg
    def m(self, x):
        return self.c.g(x)
"""

CLASS_DICT = """
import cfg

class R:
    B = {"k": cfg}
    def m(self, x):
        return self.B["k"].g(x)
"""

DEFAULT = """
import cfg

def h(x, m=cfg):
    return m.g(x)
"""

IN_A_LIST = """
import cfg

MODS = [cfg]
"""


@pytest.mark.parametrize(("utils", "body"), [(CLASS_ATTRIBUTE, "utils.R().m(x)"), (CLASS_DICT, "utils.R().m(x)"),
                                             (DEFAULT, "utils.h(x)"), (IN_A_LIST, "utils.MODS[0].g(x)")],
                         ids=["class attribute", "class-level dict", "default argument", "global list"])
def test_a_user_module_held_in_a_value_is_keyed_by_its_code(tmp_path, utils, body):
    """Editing `cfg.g` between two processes misses the cache: the module held in the value counts
    by what it defines, as one read from a closure cell does (a class attribute counted as present
    served 4 for 5; a default or a list's item refused the node)."""
    assert _edited_between_runs(tmp_path, utils, body) == [("4", True), ("5", True)]


def test_a_module_held_in_a_value_hits_when_nothing_changed(tmp_path):
    """The key of a module held in a value is the same in two processes: the second run hits."""
    _write(tmp_path, "main.py", MAIN.replace("NODE_BODY", "utils.R().m(x)"))
    _write(tmp_path, "utils.py", CLASS_ATTRIBUTE)
    _write(tmp_path, "cfg.py", CFG.format(1))
    assert [_result(tmp_path) for _ in range(2)] == [("4", True), ("4", False)]


def test_a_standard_library_module_as_a_default_is_keyed_by_python(tmp_path):
    """`def h(x, _m=math)`, the old speed idiom, is keyed (the standard library by Python's version)
    instead of refusing the node; the second process hits."""
    _write(tmp_path, "main.py", MAIN.replace("NODE_BODY", "utils.h(x)"))
    _write(tmp_path, "utils.py", "import math\ndef h(x, _m=math):\n    return _m.sqrt(x * 3)\n")
    assert [_result(tmp_path) for _ in range(2)] == [("3.0", True), ("3.0", False)]


def test_a_default_that_cannot_be_keyed_is_named_with_its_function(tmp_path):
    """A default without deterministic content is refused naming the function, the parameter and the
    fixes; so is a module default whose code reads one (the refusal named only `builtins.module`)."""
    _write(tmp_path, "main.py", MAIN.replace("NODE_BODY", "utils.h(x) + utils.j(x)"))
    _write(tmp_path, "utils.py", """
        import threading
        import cfg
        def h(x, _lock=threading.Lock()):
            return x
        def j(x, *, _m=cfg):
            return x
    """)
    _write(tmp_path, "cfg.py", "import threading\nL = threading.Lock()\ndef g(x):\n    with L:\n        return x\n")
    done = _run(tmp_path)
    assert done.returncode != 0
    assert "node 'f' cannot be cached: utils.h's default '_lock': _lock is a _thread.lock" in done.stderr
    assert "hardy.hashing.register(type, function)" in done.stderr
    _write(tmp_path, "utils.py", "import cfg\ndef h(x, *, _m=cfg):\n    return x\ndef j(x):\n    return x\n")
    done = _run(tmp_path)
    assert "utils.h's default '_m': the module cfg cannot be keyed: cfg.g reads the global 'L'" in done.stderr


@pytest.mark.parametrize(("utils", "body"), [
    ("", "importlib.import_module('cfg').g(x)"),
    ("def h(x):\n    return __import__('cfg').g(x)\n", "utils.h(x)"),
    ("from importlib import import_module\ndef h(x):\n    return import_module('cfg').g(x)\n", "utils.h(x)"),
], ids=["importlib.import_module in the node", "__import__ in a helper", "import_module from importlib"])
def test_a_module_imported_by_a_constant_name_is_keyed(tmp_path, utils, body):
    """`importlib.import_module("cfg")` and `__import__("cfg")` count as `import cfg` inside the
    function would: editing `cfg.g` misses (the name was in no attribute chain, and the second
    process was served the first one's result)."""
    assert _edited_between_runs(tmp_path, utils, body) == [("4", True), ("5", True)]

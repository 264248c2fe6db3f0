"""A node's exception that comes back from a worker process reads and behaves as in-process: an
exception group with its exceptions, an OSError subclass with its class and file, Python's "Did
you mean" hint, a class defined in a function by its full name (`shipping/failures.py`).

Every test runs a real script on the sequential executor and on worker processes, and compares
what it prints.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def _outputs(tmp_path: Path, script: str, *args: str) -> dict[str, subprocess.CompletedProcess[str]]:
    """`script` run as a file, by executor: what it printed and its exit status."""
    (tmp_path / "case.py").write_text(textwrap.dedent(script))
    return {executor: subprocess.run([sys.executable, "case.py", executor, *args], cwd=tmp_path,
                                     capture_output=True, text=True, timeout=180)
            for executor in ("sequential", "process")}


GROUPS = """
import asyncio, sys, threading, traceback
from hardy import Engine, Pipeline, node, NodeError

class ApiError(Exception):
    def __init__(self, code):
        super().__init__(f"API returned HTTP {code}")
        self.code = code

class ConnError(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()  # pickle refuses it (a client, a pool)

async def fetch(i):
    await asyncio.sleep(0)
    if i == 0:
        raise ApiError(503)
    if i == 1:
        raise ConnError("pool exhausted")
    raise ExceptionGroup("retries", [KeyError(f"user-{i}")])

async def fetch_all(n):
    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            tg.create_task(fetch(i))

def batch(n):
    class Batch(ExceptionGroup):  # a group class the caller cannot import
        pass
    try:
        asyncio.run(fetch_all(n))
    except ExceptionGroup as e:
        raise Batch("batch failed", list(e.exceptions))

@node(output_name="y")
def run(kind: str, n: int) -> int:
    return asyncio.run(fetch_all(n)) if kind == "group" else batch(n)

for kind, n in (("group", 1), ("group", 3), ("batch", 3)):
    try:
        Pipeline([run], engine=Engine(map_executor=sys.argv[1], workers=1)).run(inputs={"kind": kind, "n": n})
    except NodeError as err:
        c = err.__cause__
        print(type(c).__qualname__, isinstance(c, ExceptionGroup), str(c))
        print([(type(e).__name__, str(e), getattr(e, "code", None)) for e in c.exceptions])
        traceback.print_exception(c, file=sys.stdout)
        try:
            raise c
        except* ApiError as caught:
            print("except* ApiError:", [(str(e), e.code) for e in caught.exceptions])
        except* BaseException as rest:
            print("the rest:", [type(e).__name__ for e in rest.exceptions])
"""


def test_an_exception_group_comes_back_a_group_of_its_own_exceptions_each_with_its_traceback(tmp_path):
    """A group (asyncio.TaskGroup's) came back from a worker as a stand-in that was no group (no
    `.exceptions`, `except*` missed, its exceptions never printed) where one exception did not
    pickle, and with `ApiError(503)` saying "API returned HTTP API returned HTTP 503" where all did."""
    runs = _outputs(tmp_path, GROUPS)
    assert all(r.returncode == 0 for r in runs.values()), {k: r.stderr for k, r in runs.items()}
    text = runs["process"].stdout
    assert "except* ApiError: [('API returned HTTP 503', 503)]" in text, text
    assert "ConnError: pool exhausted" in text and "KeyError: 'user-2'" in text and "retries (1 sub-exception)" in text
    assert text.count('raise ConnError("pool exhausted")') == 3 and "batch.<locals>.Batch: batch failed" in text
    assert "HTTP API returned" not in text
    assert text == runs["sequential"].stdout


OSERRORS = """
import errno, os, sys
from hardy import Engine, Pipeline, node, NodeError

class AssetMissing(FileNotFoundError):
    def __init__(self, path):
        super().__init__(errno.ENOENT, os.strerror(errno.ENOENT), path)

def hidden(path):
    class Hidden(FileNotFoundError):  # a class the caller cannot import: a stand-in
        def __init__(self, path):
            super().__init__(errno.ENOENT, os.strerror(errno.ENOENT), path)
    raise Hidden(path)

@node(output_name="y")
def load(kind: str) -> bytes:
    if kind == "asset":
        raise AssetMissing("/data/weights.bin")
    if kind == "rename":
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/a/x", None, "/b/x")
    hidden("/data/other.bin")

for kind in ("asset", "rename", "hidden"):
    try:
        Pipeline([load], engine=Engine(map_executor=sys.argv[1], workers=1)).run(inputs={"kind": kind})
    except NodeError as err:
        c = err.__cause__
        print(type(c).__qualname__, isinstance(c, FileNotFoundError), str(c))
        print(c.errno, c.strerror, c.filename, c.filename2)
        if kind == "asset":
            print(isinstance(c, AssetMissing))
"""


def test_an_oserror_subclass_keeps_its_class_errno_and_file_names(tmp_path):
    """`class AssetMissing(FileNotFoundError)` calling `super().__init__(ENOENT, message, path)` came
    back from a worker as a stand-in that `except AssetMissing` missed, `errno` and `filename` None."""
    runs = _outputs(tmp_path, OSERRORS)
    assert all(r.returncode == 0 for r in runs.values()), {k: r.stderr for k, r in runs.items()}
    text = runs["process"].stdout
    assert "AssetMissing True [Errno 2] No such file or directory: '/data/weights.bin'\n" in text, text
    assert "2 No such file or directory /data/weights.bin None\nTrue\n" in text, text
    assert "18 Invalid cross-device link /a/x /b/x" in text and "2 No such file or directory /data/other.bin" in text
    assert text == runs["sequential"].stdout


TYPOS = """
import dataclasses, os, sys, threading
from hardy import Engine, Pipeline, node

class Doc:
    def __init__(self, text):
        self.text = text

@dataclasses.dataclass(slots=True)
class Slotted:  # made anew by value in a worker, where it had no slots
    text: str

class Locked:  # stays in the worker: pickle refuses it
    def __init__(self, text):
        self.text = text
        self.lock = threading.Lock()

def inside():
    class Local(Exception):
        pass
    raise Local("a class defined in a function")

@node(output_name="n")
def count_words(kind: str) -> int:
    if kind == "plain":
        return len(Doc("a b").txt)
    if kind == "unpicklable":
        return len(Locked("a b").txt)
    if kind == "slotted":
        return len(Slotted("a b").txt)
    if kind == "module":
        return len(os.pth)
    if kind == "name":
        return len(Docc("a b").text)
    inside()

Pipeline([count_words], engine=Engine(map_executor=sys.argv[1], workers=1)).run(inputs={"kind": sys.argv[2]})
"""


def _last_lines(tmp_path: Path, kind: str) -> dict[str, str]:
    """The last line of the node's own exception, uncaught, by executor."""
    runs = _outputs(tmp_path, TYPOS, kind)
    return {k: r.stderr.split("\n\nThe above exception")[0].splitlines()[-1] for k, r in runs.items()}


def test_an_attribute_typo_prints_did_you_mean_as_in_process(tmp_path):
    """Python's "Did you mean: 'text'?" was missing from a worker's AttributeError: pickle leaves its
    `name` and `obj` out. Where the object stays in the worker, its attribute names make the hint."""
    expected = {"plain": "AttributeError: 'Doc' object has no attribute 'txt'. Did you mean: 'text'?",
                "unpicklable": "AttributeError: 'Locked' object has no attribute 'txt'. Did you mean: 'text'?",
                "slotted": "AttributeError: 'Slotted' object has no attribute 'txt'. Did you mean: 'text'?",
                "module": "AttributeError: module 'os' has no attribute 'pth'. Did you mean: 'path'?"}
    for kind, line in expected.items():
        assert _last_lines(tmp_path, kind) == {"sequential": line, "process": line}


def test_a_name_typo_keeps_its_name_and_prints_did_you_mean_as_in_process(tmp_path):
    """A worker's NameError came back without its `name` (pickle leaves it out), which code reads
    (`except NameError as e: e.name`) and from which Python prints "Did you mean: 'Doc'?"."""
    line = "NameError: name 'Docc' is not defined. Did you mean: 'Doc'?"
    assert _last_lines(tmp_path, "name") == {"sequential": line, "process": line}


def test_a_class_defined_in_a_function_prints_its_full_name(tmp_path):
    """It printed as `Local`, not `inside.<locals>.Local`: cloudpickle makes a class it sends by
    value again without its `__qualname__`."""
    line = "inside.<locals>.Local: a class defined in a function"
    assert _last_lines(tmp_path, "local") == {"sequential": line, "process": line}


SLOTS = """
import sys, threading
from hardy import Engine, Pipeline, node

class Slotted(Exception):
    __slots__ = ("extra", "code")

    def __init__(self, message, extra, code=0):
        super().__init__(message)
        self.extra, self.code = extra, code

class Plain(Exception):  # its constructor takes its args: pickle makes it again, without its slots
    __slots__ = ("rows", "__secret")

class Locked(Plain):
    __slots__ = "lock"

@node(output_name="y")
def fail(kind: str) -> int:
    if kind == "slotted":
        raise Slotted("slotted failure", {"rows": 5}, code=7)
    err = Plain("plain failure") if kind == "plain" else Locked("locked failure")
    err.rows, err._Plain__secret = [1, 2], "s"
    if kind == "locked":
        err.lock = threading.Lock()  # pickle refuses it: it travels as its repr
    raise err

for kind in ("slotted", "plain", "locked"):
    out = Pipeline([fail], engine=Engine(map_executor=sys.argv[1], workers=1)).map(
        inputs={"kind": [kind]}, map_over="kind", on_error="continue", progress=False)
    c = out[0].error.__cause__
    print(type(c).__name__, c, [getattr(c, n, "unset") for n in ("extra", "code", "rows", "_Plain__secret")])
    if kind == "locked":
        print(str(c.lock).startswith("<unlocked _thread.lock object"))  # (its repr, from a worker)
"""


def test_an_exceptions_slots_come_back_with_it(tmp_path):
    """An exception holding its attributes in `__slots__` came back from a worker without them
    (AttributeError reading `err.extra`): pickle, and the copy that rebuilds what pickle cannot,
    carried only its `__dict__`."""
    runs = _outputs(tmp_path, SLOTS)
    assert all(r.returncode == 0 for r in runs.values()), {k: r.stderr for k, r in runs.items()}
    text = runs["process"].stdout
    assert "Slotted slotted failure [{'rows': 5}, 7, 'unset', 'unset']\n" in text, text
    assert "Plain plain failure ['unset', 'unset', [1, 2], 's']\n" in text, text
    assert "Locked locked failure ['unset', 'unset', [1, 2], 's']\nTrue\n" in text, text
    assert text == runs["sequential"].stdout

"""Modules not loaded from a plain `.py` file, and module names pointed at other modules, as the
workers see them (docs/same-answer.md): a zip on sys.path, a `.pyc` with no source, a custom
`sys.meta_path` importer, `sys.modules["settings"] = settings_prod`, and a library's C function
wrapped by a script that keeps the original. Real scripts (`python -`), real zip and `.pyc` files,
real worker processes; every answer compared with the sequential executor's in the same script."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")

STEPS = """
from hardy import node
SCALE = 1
CONFIG = {"offset": 0}

@node(output_name="y")
def f(x):
    return x * SCALE + CONFIG["offset"]
"""

COMPARE = """
from hardy import Engine, Pipeline
SEQUENTIAL = Engine(map_executor="sequential")

def both(nodes, xs=(1, 2, 3)):
    run = lambda engine: [r["y"] for r in Pipeline(nodes, engine=engine).map(inputs={"x": list(xs)}, map_over="x")]
    return run(None), run(SEQUENTIAL)
"""


def script(folder: Path, body: str) -> list[str]:
    """Run `body` as a user's script (`python -` in `folder`, with `both(nodes)`: the default
    executor's answer and the sequential one's); the lines it printed."""
    source = "import sys\n" + COMPARE + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-"], input=source, text=True, capture_output=True, timeout=120,
                         cwd=folder, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_state_set_at_run_time_in_a_zipped_or_bytecode_only_module_reaches_the_workers(tmp_path):
    """A module imported from a zip on sys.path (zipimport), and one shipped as a `.pyc` alone
    (SourcelessFileLoader): state set at run time, changed in place, and a rebuilt zip the workers
    import where the calling process still runs the old code, all give the sequential answer."""
    with zipfile.ZipFile(tmp_path / "lib.zip", "w") as archive:
        archive.writestr("zipped_steps.py", STEPS)
    (tmp_path / "source").mkdir()
    (tmp_path / "bytecode").mkdir()
    (tmp_path / "source" / "pyc_steps.py").write_text(STEPS)
    py_compile.compile(str(tmp_path / "source" / "pyc_steps.py"), cfile=str(tmp_path / "bytecode" / "pyc_steps.pyc"))
    lines = script(tmp_path, """
        import os, zipfile
        sys.path[:0] = [os.path.abspath("lib.zip"), os.path.abspath("bytecode")]
        import zipped_steps, pyc_steps
        print(type(zipped_steps.__loader__).__name__, type(pyc_steps.__loader__).__name__)
        for module in (zipped_steps, pyc_steps):
            module.SCALE = 10
            module.CONFIG["offset"] = 5
            print(*both([module.f]))
        os.remove("lib.zip")  # rebuilt on disk, not reloaded: the workers import the new one
        with zipfile.ZipFile("lib.zip", "w") as archive:
            archive.writestr("zipped_steps.py", "from hardy import node\\nSCALE = 1\\nCONFIG = {}\\n"
                             "@node(output_name='y')\\ndef f(x):\\n    return -x\\n")
        print(*both([zipped_steps.f]))
    """)
    assert lines == ["zipimporter SourcelessFileLoader", "[15, 25, 35] [15, 25, 35]", "[15, 25, 35] [15, 25, 35]",
                     "[15, 25, 35] [15, 25, 35]"]


IMPORTER = """
import importlib.abc, importlib.util
SOURCES = {}

class DictImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name in SOURCES else None

    def exec_module(self, module):
        exec(SOURCES[module.__name__], vars(module))

sys.meta_path.insert(0, DictImporter())
"""


def test_a_module_a_custom_importer_serves_travels_by_value_or_is_refused_before_any_item(tmp_path):
    """A module a `sys.meta_path` importer of the script serves: no worker can import it (each
    item failed with ModuleNotFoundError). It travels as the caller's objects; where one of them
    does not pickle (a lock), the map is refused before any item runs, naming the module, its
    loader, the node and the fix."""
    lines = script(tmp_path, IMPORTER + textwrap.dedent("""
        from hardy.errors import ReplicaError
        SOURCES["virtual_steps"] = "from hardy import node\\nK = 11\\n@node(output_name='y')\\ndef f(x): return x * K\\n"
        SOURCES["locked_steps"] = ("import threading\\nfrom hardy import node\\nLOCK = threading.Lock()\\nRAN = []\\n"
                                   "@node(output_name='y')\\ndef g(x):\\n    RAN.append(x)\\n    return x\\n")
        import virtual_steps, locked_steps
        virtual_steps.K = 12
        print(*both([virtual_steps.f]))
        try:
            Pipeline([locked_steps.g]).map(inputs={"x": [1, 2]}, map_over="x", on_error="continue")
        except ReplicaError as exc:
            print(type(exc).__name__, locked_steps.RAN)
            print(str(exc))
    """))
    assert lines[:2] == ["[12, 24, 36] [12, 24, 36]", "ReplicaError []"]
    for words in ("'locked_steps'", "__main__.DictImporter", "'LOCK'", "node 'g'", 'map_executor="sequential"',
                  "importable from a file"):
        assert words in lines[2]


def test_a_module_name_pointed_at_another_module_is_that_module_in_the_workers(tmp_path):
    """`sys.modules["settings"] = settings_prod` before a map whose node imports `settings`: the
    workers imported settings.py from disk (or failed where no file has that name); they now see
    the module the caller points the name at, and a later plan that does not import it gives them
    their own back."""
    (tmp_path / "settings.py").write_text('MODE = "default"\n')
    (tmp_path / "settings_prod.py").write_text('MODE = "prod"\n')
    (tmp_path / "steps.py").write_text(textwrap.dedent("""
        from hardy import node

        @node(output_name="y")
        def label(x):
            import settings
            return f"{x}:{settings.MODE}"

        @node(output_name="y")
        def legacy(x):
            import legacy_settings
            return f"{x}:{legacy_settings.MODE}"
    """))
    lines = script(tmp_path, """
        sys.path.insert(0, ".")
        from hardy import Engine
        import settings_prod, steps
        engine = Engine(workers=1)  # (one worker: the later plan runs where the alias was installed)
        sys.modules["settings"] = sys.modules["legacy_settings"] = settings_prod
        run = lambda nodes, engine: [r["y"] for r in Pipeline(nodes, engine=engine).map(inputs={"x": [1, 2]},
                                                                                         map_over="x")]
        print(run([steps.label], engine), run([steps.label], SEQUENTIAL))
        print(run([steps.legacy], engine), run([steps.legacy], SEQUENTIAL))
        del sys.modules["settings"]  # the name back to its file: the plan made again carries no alias
        print(run([steps.label], engine), run([steps.label], SEQUENTIAL))
    """)
    assert lines == ["['1:prod', '2:prod'] ['1:prod', '2:prod']", "['1:prod', '2:prod'] ['1:prod', '2:prod']",
                     "['1:default', '2:default'] ['1:default', '2:default']"]


def test_a_c_function_wrapped_by_a_script_that_keeps_the_original(tmp_path):
    """`_sqrt = math.sqrt; math.sqrt = wrapper calling _sqrt`, and the same over `builtins.round`:
    the original pickled by its name, which now finds the wrapper, so the map was refused as if
    the wrapper did not pickle. It travels as the library's own object of that name."""
    lines = script(tmp_path, """
        import builtins, math
        from hardy import node
        _sqrt, _round = math.sqrt, builtins.round
        def logged_sqrt(v):
            return _sqrt(v) + 1000
        def round_half_up(v, n=0):
            return _round(v + 1e-9, n)
        @node(output_name="y")
        def r(x):
            return math.sqrt(x)
        @node(output_name="y")
        def rounded(x):
            return round(x + 0.5)
        math.sqrt, builtins.round = logged_sqrt, round_half_up
        print(*both([r], [4.0, 9.0]))
        print(*both([rounded], [1, 2, 3]))
        print(*both([r], [16.0]))  # (a second plan, over the worker's patch installed by the first)
    """)
    assert lines == ["[1002.0, 1003.0] [1002.0, 1003.0]", "[2.0, 3.0, 4.0] [2.0, 3.0, 4.0]", "[1004.0] [1004.0]"]


def test_a_value_that_fails_to_pickle_is_refused_with_its_own_error_and_the_node(tmp_path):
    """A library patch holding an object whose pickling raises: the refusal says that error, not
    merely that the value "does not pickle", and names the node that reads it."""
    lines = script(tmp_path, """
        import math
        from hardy import node
        from hardy.errors import ReplicaError
        class Handle:
            def __reduce__(self):
                raise ValueError("the session handle expired")
            def __call__(self, v):
                return v
        @node(output_name="y")
        def measured(x):
            return math.sqrt(x)
        math.sqrt = Handle()
        try:
            both([measured], [4.0])
        except ReplicaError as exc:
            print(str(exc))
    """)
    assert "ValueError: the session handle expired" in lines[0] and "node 'measured'" in lines[0], lines
    assert "math.sqrt" in lines[0] and "does not pickle" not in lines[0]

"""Debugging a node as in-process code is debugged: its frames in the traceback, pdb where it raised.

Every test runs a real script the way users run theirs (a file, `python - < file`, `python -m pdb`,
`python -i`), feeding pdb its commands on stdin, and reads what a user would read.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BUG = """
import sys
from hardy import Engine, Pipeline, node

def helper(x):
    scale = 10
    big = list(range(1000))
    return scale / x

@node(output_name="y")
def inv(x: int) -> float:
    return helper(x) * 2

@node(output_name="z")
def other(y: float) -> float:
    return y

ENGINES = {"sequential": dict(map_executor="sequential"), "process": {}, "threaded": dict(map_executor="threaded"),
           "async": dict(map_executor="async"), "threaded-nodes": dict(node_executor="threaded",
                                                                       map_executor="sequential")}
p = Pipeline([inv, other], engine=Engine(**ENGINES[sys.argv[1] if len(sys.argv) > 1 else "process"]))
"""


def _python(tmp_path: Path, script: str, *args: str, stdin: str = "", name: str = "bug.py",
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    (tmp_path / name).write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, *args], cwd=tmp_path, input=stdin, capture_output=True, text=True,
                          timeout=180, env=env)


def test_a_workers_exception_prints_the_worker_frames_the_same_text_as_in_process(tmp_path):
    script = BUG + textwrap.dedent("""
        import traceback
        try:
            p.map(inputs={"x": [0]}, map_over="x")
        except Exception as e:
            traceback.print_exception(e)
            assert e.__cause__.__cause__.__traceback__ is not None
        try:
            p.run(inputs={"x": 0})
        except Exception as e:
            traceback.print_exception(e)
    """)
    texts = {}
    for executor in ("sequential", "process", "threaded", "async", "threaded-nodes"):
        out = _python(tmp_path, script, "bug.py", executor)
        assert out.returncode == 0, out.stderr
        texts[executor] = out.stderr
    text = texts["process"]
    # the worker's frames: file, line, function and source line, the part that raised underlined
    assert f'File "{tmp_path / "bug.py"}", line 12, in inv\n    return helper(x) * 2\n' in text, text
    assert 'line 8, in helper\n    return scale / x\n           ~~~~~~^~~\nZeroDivisionError' in text, text
    assert "<hardy plan" not in text and "engine/core.py" not in text and "in_process.py" not in text, text
    assert all(t == text for t in texts.values()), {k: t for k, t in texts.items() if t != text}


CHAINED = """
import sys, traceback
from hardy import Engine, Pipeline, node

def lookup(key):
    try:
        return {"a": 1}[key]
    except KeyError as e:
        raise ValueError(f"no setting {key!r}") from e

@node(output_name="y")
def read(key: str) -> int:
    if key == "zero":
        try:
            1 / 0
        except ZeroDivisionError:
            raise RuntimeError("while handling it")
    return lookup(key)

p = Pipeline([read], engine=Engine(map_executor=sys.argv[1]))
out = p.map(inputs={"key": ["b", "zero"]}, map_over="key", on_error="continue")
for failed in out:
    traceback.print_exception(failed.error.__cause__)
"""


def _printed(tmp_path: Path, script: str) -> dict[str, str]:
    """What `script` prints on stderr, by executor (sequential, process, threaded)."""
    texts = {}
    for executor in ("sequential", "process", "threaded"):
        out = _python(tmp_path, script, "bug.py", executor)
        assert out.returncode == 0, out.stderr
        texts[executor] = out.stderr
    return texts


def test_a_chained_exception_prints_its_whole_chain_on_every_executor(tmp_path):
    """`raise ... from e` and an exception raised while handling another: pickle leaves the chain
    out, so a worker's error came back without the exceptions it was raised from."""
    texts = _printed(tmp_path, CHAINED)
    text = texts["process"]
    assert "KeyError: 'b'\n\nThe above exception was the direct cause of the following exception:" in text, text
    assert "ZeroDivisionError: division by zero\n\nDuring handling of the above exception" in text, text
    assert 'line 7, in lookup\n    return {"a": 1}[key]' in text, text  # the chained exception's own frames
    assert all(t == text for t in texts.values()), {k: t for k, t in texts.items() if t != text}


GROUPED = """
import asyncio, sys, traceback
from hardy import Engine, Pipeline, node

async def fetch(i):
    await asyncio.sleep(0)
    raise ConnectionError(f"fetch {i} failed")

def check(x):
    raise ExceptionGroup("checks", [ValueError(f"bad {x}"), ExceptionGroup("inner", [KeyError(x)])])

@node(output_name="y")
async def gather(x: int):
    async with asyncio.TaskGroup() as tg:
        for i in range(2):
            tg.create_task(fetch(i))

@node(output_name="z")
def checked(x: int):
    try:
        check(x)
    except* KeyError as e:
        raise

for n in (gather, checked):
    out = Pipeline([n], engine=Engine(map_executor=sys.argv[1])).map(inputs={"x": [1]}, map_over="x",
                                                                   on_error="continue")
    traceback.print_exception(out[0].error.__cause__)
"""


def test_an_exception_groups_exceptions_keep_their_frames_on_every_executor(tmp_path):
    """asyncio.TaskGroup's ExceptionGroup, and one raised and re-raised by `except*`: pickle carries
    a group's exceptions without their tracebacks, so a worker's printed none of their frames."""
    texts = _printed(tmp_path, GROUPED)
    text = texts["process"]
    assert text.count("line 7, in fetch\n") == 2 and text.count('raise ConnectionError(f"fetch {i} failed")') == 2
    assert "ExceptionGroup: inner (1 sub-exception)" in text and "line 10, in check\n" in text, text
    assert all(t == text for t in texts.values()), {k: t for k, t in texts.items() if t != text}

def test_a_long_chain_keeps_its_root_cause(tmp_path):
    script = """
import sys
from hardy import Engine, Pipeline, node

@node(output_name="y")
def wrapped(x):
    try:
        raise OSError("disk full: the root cause")
    except OSError as exc:
        err = exc
    for k in range(20):
        try:
            raise RuntimeError(f"wrapper {k}") from err
        except RuntimeError as exc:
            err = exc
    raise err

out = Pipeline([wrapped], engine=Engine(map_executor=sys.argv[1])).map(inputs={"x": [0]}, map_over="x",
                                                                       on_error="continue")
links, exc = 0, out[0].error.__cause__
while exc is not None:
    links, root, exc = links + 1, exc, exc.__cause__
print(links, root)
"""
    seen = {executor: _python(tmp_path, script, "bug.py", executor).stdout.strip() for executor in ("sequential", "process")}
    assert seen["process"] == seen["sequential"] == "21 disk full: the root cause", seen


def test_pdb_pm_and_python_m_pdb_open_in_the_users_innermost_frame(tmp_path):
    script = BUG + 'p.map(inputs={"x": [1, 0]}, map_over="x")\n'
    out = _python(tmp_path, script, "-i", "bug.py",
                  stdin="import pdb; pdb.pm()\np x, scale\np big\nup\np x\np helper.__name__, sys.argv[1:]\nq\n")
    assert "(8)helper()\n-> return scale / x" in out.stdout, out.stdout + out.stderr
    assert "(0, 10)" in out.stdout  # the worker's plain locals came back
    assert "('helper', [])" in out.stdout, out.stdout  # and the module's globals are there, as in the worker
    assert "<list left in the worker process: [0, 1, 2, 3, 4, 5, ...]>" in out.stdout  # the others as stand-ins
    assert "(12)inv()\n-> return helper(x) * 2" in out.stdout
    out = _python(tmp_path, script, "-m", "pdb", "bug.py", stdin="c\np x, scale\nw\nq\nq\n")
    assert "Uncaught exception. Entering post mortem debugging" in out.stdout, out.stdout + out.stderr
    assert "(8)helper()\n-> return scale / x\n(Pdb) (0, 10)" in out.stdout
    here = _python(tmp_path, script.replace("p.map(", "p.run(").replace('[1, 0]}, map_over="x")', "0})"), "-i",
                   "bug.py", "sequential", stdin="import pdb; pdb.pm()\np len(big)\nq\n")
    assert "(8)helper()\n-> return scale / x\n(Pdb) 1000" in here.stdout, here.stdout + here.stderr  # in-process: live


def test_pdb_post_mortem_of_a_failed_items_error_opens_where_it_raised(tmp_path):
    """`pdb.post_mortem(failed.error.__traceback__)`, as users debug any exception: a `Failed`'s
    error was never raised, so it had no traceback and pdb refused it (ValueError)."""
    script = BUG + """
import pdb
out = p.map(inputs={"x": [1, 0]}, map_over="x", on_error="continue")
pdb.post_mortem(out[1].error.__traceback__)
"""
    for executor in ("process", "sequential"):
        out = _python(tmp_path, script, "bug.py", executor, stdin="p x, scale\nq\n")
        assert "(8)helper()\n-> return scale / x\n(Pdb) (0, 10)" in out.stdout, out.stdout + out.stderr

def test_ipython_debug_opens_in_the_users_innermost_frame(tmp_path):
    pytest.importorskip("IPython")
    (tmp_path / "bug.py").write_text(BUG)
    cell = "%run bug.py\np.map(inputs={'x': [1, 0]}, map_over='x')\n%debug\np x, scale\nq\nexit\n"
    out = subprocess.run([sys.executable, "-m", "IPython", "--simple-prompt", "--no-banner", "--colors=NoColor"],
                         cwd=tmp_path, input=cell, capture_output=True, text=True, timeout=180)
    assert "bug.py(8)helper()\n" in out.stdout and "ipdb> (0, 10)" in out.stdout, out.stdout + out.stderr


def test_debug_runs_the_failed_item_again_here_with_live_locals(tmp_path):
    script = BUG + textwrap.dedent("""
        import os
        print("caller", os.getpid())
        out = p.map(inputs={"x": [1, 0, 2]}, map_over="x", on_error="continue")
        print("failed again:", out[1].debug())
    """)
    out = _python(tmp_path, script, "bug.py", stdin="p len(big), x\np os.getpid()\nq\n")
    caller = re.search(r"caller (\d+)", out.stdout)[1]
    assert "-> return scale / x\n(Pdb) (1000, 0)\n(Pdb) " + caller in out.stdout, out.stdout + out.stderr
    assert "failed again: True" in out.stdout
    assert "hardy: item 1 failed again in this process: node 'inv' failed" in out.stderr


@pytest.mark.parametrize("call", ["run", "map"])
def test_debug_in_the_except_block_prints_the_rerun_alone(tmp_path, call):
    """`err.debug()` in `except NodeError as err:` (or `except MapError`), as the guide has it:
    the rerun's traceback, then pdb; not the first failure again followed by "During handling of
    the above exception, another exception occurred:", which read as a second error."""
    script = BUG + textwrap.dedent("""
        from hardy import MapError, NodeError
        try:
            p.run(inputs={"x": 0}) if sys.argv[2] == "run" else p.map(inputs={"x": [1, 0]}, map_over="x")
        except (NodeError, MapError) as err:
            print("failed again:", err.debug())
    """)
    out = _python(tmp_path, script, "bug.py", "process", call, stdin="p x\nq\n")
    assert "-> return scale / x\n(Pdb) 0\n" in out.stdout and "failed again: True" in out.stdout, out.stdout + out.stderr
    assert "During handling" not in out.stderr, out.stderr
    assert out.stderr.count("Traceback (most recent call last):") == 1, out.stderr


def test_breakpoint_in_a_worker_fails_its_item_saying_how_to_debug(tmp_path):
    script = """
        from hardy import Pipeline, node

        @node(output_name="y")
        def stop_here(x):
            breakpoint()
            return x

        out = Pipeline([stop_here]).map(inputs={"x": [1, 2]}, map_over="x", on_error="continue")
        print(getattr(out[0], "error", out[0]))
    """
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONBREAKPOINT"}  # (importing ray sets it, to its own)
    out = _python(tmp_path, script, "-", stdin=textwrap.dedent(script), env=plain)
    assert out.returncode == 0, out.stderr
    assert "DebuggerUnavailable: breakpoint() was called in a worker process" in out.stdout, out.stdout
    assert "err.debug()" in out.stdout and "hardy replay REPORT --item N --pdb" in out.stdout
    quiet = _python(tmp_path, script, "-", stdin=textwrap.dedent(script), env={**plain, "PYTHONBREAKPOINT": "0"})
    assert quiet.stdout.strip() == "{'y': 1}"  # PYTHONBREAKPOINT=0 turns breakpoint() off, in workers too



def test_debug_of_a_breakpoint_item_stops_there_and_says_why_it_failed_only_in_the_worker(tmp_path):
    """`failed.error.debug()` on a breakpoint() item: the rerun stops at the breakpoint, runs to its
    end, and says so (it blamed "what ran before it, ... or chance")."""
    script = """
        from hardy import Pipeline, node

        @node(output_name="y")
        def stop_here(x):
            breakpoint()
            return x * 2

        out = Pipeline([stop_here]).map(inputs={"x": [21]}, map_over="x", on_error="continue")
        print("failed again:", out[0].error.debug())
    """
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONBREAKPOINT"}
    (tmp_path / "stops.py").write_text(textwrap.dedent(script))
    out = subprocess.run([sys.executable, "stops.py"], cwd=tmp_path, input="p x\nc\n", capture_output=True,
                         text=True, timeout=180, env=plain)
    assert out.returncode == 0, out.stderr
    assert "(Pdb) 21" in out.stdout and "failed again: False" in out.stdout, out.stdout
    assert "ran to its end in this process, where its breakpoint() stopped in pdb" in out.stderr, out.stderr
    assert "chance" not in out.stderr

def test_a_map_under_a_debugger_says_once_that_its_breakpoints_in_nodes_are_not_hit(tmp_path):
    """`python -m pdb script.py` with a breakpoint in a node: the worker passes it by, so the
    first map says why (where it said nothing); a tracer that is no debugger says nothing."""
    script = BUG + 'print(p.map(inputs={"x": [1, 2]}, map_over="x"), p.run(inputs={"x": 4}))\n'
    out = _python(tmp_path, script, "-m", "pdb", "bug.py", stdin="b bug.py:12\nc\nq\n")
    said = "a debugger is tracing this process, but its breakpoints in nodes are not hit"
    assert "[{'y': 20.0, 'z': 20.0}, {'y': 10.0, 'z': 10.0}] {'y': 5.0, 'z': 5.0}" in out.stdout, out.stdout + out.stderr
    assert out.stderr.count(said) == 1, out.stderr  # once, for the map and the run
    assert "bug.py:22: UserWarning" in out.stderr  # at the user's call
    traced = _python(tmp_path, "import sys\nsys.settrace(lambda *a: None)\n" + script, "bug.py")
    assert traced.returncode == 0 and said not in traced.stderr, traced.stderr
    here = _python(tmp_path, script, "-m", "pdb", "bug.py", "sequential", stdin="b bug.py:12\nc\np x\nq\n")
    assert "(12)inv()" in here.stdout and said not in here.stderr  # in-process, the breakpoint stops


def test_a_breakpoint_on_a_nodes_line_stops_in_no_frame_hardy_rebuilt(tmp_path):
    """`python -m pdb` with a breakpoint on a node's line: as the worker's failure was read, pdb
    stopped in the frame hardy rebuilt for that line (run while pdb traced), which has none of the
    node's locals (`p x` failed), and a `q` there was lost with the failure's frames. pdb now
    stops where the error raised, with the locals that came back."""
    script = BUG + 'p.map(inputs={"x": [1, 0]}, map_over="x")\n'
    out = _python(tmp_path, script, "-m", "pdb", "bug.py", stdin="b bug.py:12\nc\np x, scale\nq\n")
    before = out.stdout.split("Uncaught exception. Entering post mortem debugging")[0]
    assert "(12)inv()" not in before, out.stdout  # (no stop in a rebuilt frame before the failure)
    assert "(8)helper()\n-> return scale / x\n(Pdb) (0, 10)" in out.stdout, out.stdout + out.stderr


def _where_frames_are_rebuilt() -> tuple[Path, int]:
    """The file and line where a worker's frames are made again in the caller (a pdb breakpoint)."""
    import hardy.tracebacks
    source = Path(hardy.tracebacks.__file__)
    return source, next(n for n, text in enumerate(source.read_text().splitlines(), 1)
                        if "frame.f_locals.update(local)" in text)


def test_quitting_pdb_while_hardy_rebuilds_a_traceback_quits(tmp_path):
    """A debugger's quit (bdb's BdbQuit, an Exception) raised while a worker's frames were made
    again was taken for a traceback that could not be made: the script went on after `q`."""
    source, line = _where_frames_are_rebuilt()
    script = """
    import pickle
    from hardy import Pipeline, node

    @node(output_name="y")
    def inv(x: int) -> float:
        return 1 / x

    out = Pipeline([inv]).map(inputs={"x": [0]}, map_over="x", on_error="continue")
    data = pickle.dumps(out[0].error)
    print("reading it again")
    pickle.loads(data)
    print("went on after q")
    """
    out = _python(tmp_path, script, "-m", "pdb", "bug.py", stdin=f"b {source}:{line}\nc\nc\nq\n")
    assert "reading it again" in out.stdout and "(Pdb) " in out.stdout.split("reading it again")[1], out.stdout + out.stderr
    assert "went on after q" not in out.stdout, out.stdout


def test_quitting_pdb_while_a_workers_failure_is_read_quits(tmp_path):
    """pdb's `q` at a breakpoint in the code that rebuilds a worker's frames, as the caller reads
    the worker's batch holding the failure: the read's `except Exception` (a result that cannot be
    read here is asked for again alone) took the quit for such a result, and the script went on."""
    source, line = _where_frames_are_rebuilt()
    script = """
    from hardy import Pipeline, node

    @node(output_name="y")
    def inv(x: int) -> float:
        return 1 / x

    out = Pipeline([inv]).map(inputs={"x": [0]}, map_over="x", on_error="continue")
    print("went on after q", out)
    """
    out = _python(tmp_path, script, "-m", "pdb", "bug.py", stdin=f"b {source}:{line}\nc\nq\n")
    assert f"tracebacks.py({line})rebuilt()" in out.stdout, out.stdout + out.stderr  # (it stopped there)
    assert "went on after q" not in out.stdout, out.stdout + out.stderr


USERS_TEST = """
# the top of the user's test file
from hardy import Engine, Pipeline, node
FILLER = [
    0,
    0,
    0,
]


def helper(x):
    return 10 / x


@node(output_name="y")
def inv(x):
    return helper(x)


def test_inverse():
    Pipeline([inv], engine=Engine(map_executor=EXECUTOR)).run(inputs={"x": 0})
"""


@pytest.mark.parametrize("executor", ["process", "sequential"])
def test_pytest_shows_a_workers_frames_from_their_functions_first_line(tmp_path, executor):
    """A frame rebuilt from a worker starts where its function does: pytest (and pdb's `ll`) read
    a function's source from there, and printed the worker's frames from the top of the file."""
    (tmp_path / "test_users.py").write_text(USERS_TEST.replace("EXECUTOR", repr(executor)))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_users.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert "1 failed" in out.stdout, out.stdout + out.stderr
    assert "    def helper(x):\n>       return 10 / x" in out.stdout, out.stdout
    assert "the top of the user's test file" not in out.stdout, out.stdout

REPORTED = """
import ctypes
from hardy import Engine, Pipeline, node

def helper(x):
    scale = 10
    return scale / x

@node(output_name="y")
def inv(x: int) -> float:
    if x == 13:
        ctypes.string_at(0)
    return helper(x) * 2

p = Pipeline([inv], engine=Engine(report_dir="reports"))
out = p.map(inputs={"x": [1, 2, 0, 13]}, map_over="x", on_error="continue")
"""


def test_report_and_replay_show_the_stacks_and_replay_pdb_opens_in_the_item(tmp_path):
    assert _python(tmp_path, REPORTED, "bug.py").returncode == 0
    [report] = (tmp_path / "reports").glob("*.json")

    def hardy(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hardy.cli", *args], cwd=tmp_path, input=stdin,
                              capture_output=True, text=True, timeout=180)

    shown = hardy("report", str(report), "--item", "2")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("item 2: node 'inv' failed: ZeroDivisionError: division by zero\n")
    assert "line 7, in helper\n    return scale / x\n" in shown.stdout and "--item 2 runs it again" in shown.stdout
    crash = hardy("report", str(report), "--item", "3").stdout
    assert "SIGSEGV" in crash and "native stack:" in crash and "Python stack:" in crash, crash
    assert "each failure's stacks: hardy report" in hardy("report", str(report)).stdout
    again = hardy("replay", str(report), "--item", "2")
    assert again.returncode == 1
    assert "line 7, in helper\n    return scale / x\n" in again.stdout, again.stdout  # the stack, not three lines
    assert "node 'inv' failed on item 2 (inputs: x=0)" in again.stdout  # the run's item number, not 0
    pdb = hardy("replay", str(report), "--item", "2", "--pdb", stdin="p x, scale\nup\nl\nq\n")
    assert pdb.returncode == 1
    assert "(7)helper()\n-> return scale / x\n(Pdb) (0, 10)" in pdb.stdout, pdb.stdout + pdb.stderr
    assert "->\t    return helper(x) * 2" in pdb.stdout  # `up`, then `l`: the node's source
    refused = hardy("replay", str(report), "--item", "3", "--pdb")
    assert refused.returncode == 2 and "crashed its worker (SIGSEGV)" in refused.stderr and "--gdb" in refused.stderr


def _shown(text: str) -> list[str]:
    """The lines of a transcript the guide shows that must be printed as shown (not its elisions)."""
    return [line for line in text.splitlines() if line.strip() and "..." not in line]


def _session(transcript: str) -> tuple[str, list[str]]:
    """A pdb session the guide shows: (the commands typed, the lines it printed)."""
    commands = [line[len("(Pdb) "):] for line in transcript.splitlines() if line.startswith("(Pdb) ")]
    printed = [line for line in _shown(transcript) if not line.startswith((">>> ", "(Pdb) "))]
    return "".join(c + "\n" for c in commands) + "q\n", printed


def _in_one_piece(transcript: str, printed: list[str]) -> bool:
    """Whether `printed` holds the guide's `transcript` as one run of lines, in its order: a line
    that holds "..." matches a printed line whose other parts are as shown."""
    lines = [re.compile(".*".join(map(re.escape, line.split("...")))) for line in transcript.rstrip("\n").split("\n")]
    return any(all(line.fullmatch(text) for line, text in zip(lines, printed[start:start + len(lines)]))
               for start in range(len(printed) - len(lines) + 1))


def test_the_guides_debugging_loop_runs_as_written(tmp_path):
    """docs/guide/debugging.md, followed as a user would: its script, its traceback, its pdb sessions."""
    guide = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "debugging.md").read_text()
    script = re.search(r"```python\n(.*?)```", guide, re.S)[1]
    texts = re.findall(r"```text\n(.*?)```", guide, re.S)

    def as_shown(out: str) -> str:
        return re.sub(r"\(pid \d+\)", "(pid 4242)", out.replace(str(tmp_path), "/home/me"))

    first = _python(tmp_path, script, "prices.py", name="prices.py")
    assert first.returncode == 1
    printed = as_shown(first.stderr).splitlines()
    assert _in_one_piece(texts[0], printed), first.stderr  # the traceback as the guide shows it, line for line
    commands, shown = _session(texts[1])  # pdb.pm() after python -i
    pm = _python(tmp_path, script, "-i", "prices.py", stdin="import pdb; pdb.pm()\n" + commands, name="prices.py")
    assert [line for line in shown if line not in as_shown(pm.stdout)] == [], pm.stdout
    report = sorted((tmp_path / "reports").glob("*.json"))[0]
    commands, shown = _session(texts[3])  # hardy replay --item 1 --pdb
    replay = subprocess.run([sys.executable, "-m", "hardy.cli", "replay", str(report), "--item", "1", "--pdb"],
                            cwd=tmp_path, input=commands, capture_output=True, text=True, timeout=180)
    assert [line for line in shown if line not in as_shown(replay.stdout + replay.stderr)] == [], replay.stdout
    assert replay.returncode == 1


def test_nested_failures_name_the_path_for_exceptions_as_for_crashes(tmp_path):
    script = """
        from hardy import Engine, Failed, Pipeline, node

        @node(output_name="length")
        def length(text: str) -> int:
            if text == "boom":
                raise ValueError("a bad document")
            return len(text)

        for on_error in ("continue", "raise"):
            per_doc = Pipeline(nodes=[length], name="per_doc").as_node(
                input_mapping={"docs": "text"}, output_mapping={"length": "lengths"}, map_over="docs",
                on_error=on_error)
            outer = Pipeline(nodes=[per_doc])
            out = outer.map(inputs={"docs": [["ab", "boom", "cde"]]}, map_over="docs", on_error="continue")
            err = out[0]["lengths"][1].error if on_error == "continue" else out[0].error
            print(on_error, err)
        for executor in ("sequential", "process"):  # a run() has no item: the inner one is not its
            try:
                outer.run(inputs={"docs": ["ab", "boom"]}, engine=Engine(map_executor=executor))
            except Exception as e:
                print(executor, e)
    """
    out = _python(tmp_path, script, "-", stdin=textwrap.dedent(script))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "continue node 'per_doc/length' failed on item 1 (inputs: text='boom'): ValueError: a bad document"
    assert lines[1] == ("raise node 'per_doc/length' failed on item 0, in nested map at 'per_doc' item 1 (inputs: "
                        "text='boom'): ValueError: a bad document"), lines
    ran = ("node 'per_doc/length' failed, in nested map at 'per_doc' item 1 (inputs: text='boom'): ValueError: a "
           "bad document")
    assert lines[2:] == [f"sequential {ran}", f"process {ran}"], lines


def test_an_uncaught_interrupt_exits_130_saying_what_it_held(tmp_path):
    script = """
        import os, signal, time
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def slow(x):
            if x == 3:
                os.kill(int(os.environ["SCRIPT"]), signal.SIGINT)  # Ctrl-C, as the terminal sends it to the script
                time.sleep(60)
            return x

        os.environ["SCRIPT"] = str(os.getpid())  # workers see the script's environment
        Pipeline([slow], engine=Engine(workers=1, report_dir="reports")).map(inputs={"x": range(6)}, map_over="x")
    """
    out = _python(tmp_path, script, "-", stdin=textwrap.dedent(script))
    assert out.returncode == 130, out.stderr
    held = int(re.search(r"MapInterrupted: map interrupted: (\d) of 6 items completed", out.stderr)[1])
    said = out.stderr.strip().splitlines()[-1]
    assert said.startswith(f"hardy: interrupted; the map's {held} finished result(s) were in MapInterrupted.results")
    assert "run report in reports" in said
    assert json.loads(next((tmp_path / "reports").glob("*.json")).read_text())["succeeded"] == held


SLOW_REPR = """
import signal, threading
from hardy import Engine, Pipeline, node

class Client:
    def __init__(self):
        self.lock = threading.Lock()
    def __repr__(self):
        with self.lock:  # waits for a request in flight, which never ends here
            return "Client()"

class Loud:
    def __repr__(self):
        return "x" * 5_000_000  # a repr that makes a huge string

class Broken:
    def __repr__(self):
        raise RuntimeError("no repr")

@node(output_name="y", timeout=15)
def fetch(x: int) -> int:
    signal.signal(signal.SIGALRM, lambda *args: None)  # the node's own alarm, which must outlive the failure
    signal.setitimer(signal.ITIMER_REAL, 600)
    loud, broken, client = Loud(), Broken(), Client()
    client.lock.acquire()
    after = Broken()
    raise ValueError(f"bad record {x}")

@node(output_name="alarm")
def alarm(x: int) -> tuple:
    return signal.getitimer(signal.ITIMER_REAL)[0] > 0, getattr(signal.getsignal(signal.SIGALRM), "__name__", "")

engine = Engine(workers=1)
err = Pipeline([fetch], engine=engine).map(inputs={"x": [1]}, map_over="x", on_error="continue")[0].error
cause = err.__cause__
print("cause", type(cause).__name__, cause)
tb = cause.__traceback__
while tb.tb_next is not None:
    tb = tb.tb_next
for name in ("loud", "broken", "client", "after"):
    print(name, repr(tb.tb_frame.f_locals[name])[:100])
print("alarm", Pipeline([alarm], engine=engine).map(inputs={"x": [1]}, map_over="x")[0]["alarm"])
"""


def test_a_local_whose_repr_blocks_costs_neither_the_error_nor_the_map(tmp_path):
    """A worker reprs a failing node's locals to send them: a `__repr__` waiting on a lock turned
    the node's ValueError into a NodeTimeout (or, without a timeout, held the map forever). The
    reprs have a budget: the one that waits and those after it are not taken, the error comes
    back whole, and the node's own alarm handler and timer are still there for the next item."""
    out = _python(tmp_path, SLOW_REPR, "bug.py")
    assert out.returncode == 0, out.stderr
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert said["cause"] == "ValueError bad record 1", out.stdout
    assert said["loud"].startswith("<__main__.Loud left in the worker process: xxx") and len(said["loud"]) == 100
    assert said["broken"].startswith("<__main__.Broken left in the worker process: <Broken instance at 0x"), said
    assert said["client"] == "<__main__.Client left in the worker process: <repr not taken: slow>>", said
    assert said["after"] == "<__main__.Broken left in the worker process: <repr not taken: slow>>", said
    assert said["alarm"] == "(True, '<lambda>')", said


def test_replay_under_pdb_leaves_a_closed_pipe_to_raise_in_the_node(tmp_path):
    """`hardy replay --pdb` runs the item in its own process; it had set SIGPIPE to its default
    first (for `| head`), so a node writing to a pipe whose reader went away killed it (141)
    where the run had raised BrokenPipeError, and pdb never opened."""
    assert _python(tmp_path, """
        import os
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def send(x: int) -> int:
            if x == 1:
                r, w = os.pipe()
                os.close(r)
                os.write(w, b"row")  # the reader went away
            return x

        Pipeline([send], engine=Engine(report_dir="reports")).map(inputs={"x": [0, 1]}, map_over="x",
                                                                   on_error="continue")
    """, "bug.py").returncode == 0
    [report] = (tmp_path / "reports").glob("*.json")
    pdb = subprocess.run([sys.executable, "-m", "hardy.cli", "replay", str(report), "--item", "1", "--pdb"],
                         cwd=tmp_path, input="q\n", capture_output=True, text=True, timeout=180)
    assert pdb.returncode == 1, (pdb.returncode, pdb.stdout, pdb.stderr)
    assert "BrokenPipeError" in pdb.stdout + pdb.stderr and "(Pdb)" in pdb.stdout

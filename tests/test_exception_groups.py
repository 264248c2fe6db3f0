"""An exception group and a frame from a worker process read as they do in-process.

Each test runs a real script on the default executor (worker processes) and on the sequential
one, and reads what a user reads: the printed traceback, the exceptions' attributes, pdb's `a`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def _run(tmp_path: Path, script: str, executor: str, stdin: str = "") -> str:
    """What `script` prints (stdout, then stderr), run with `executor` as its argument."""
    (tmp_path / "groups.py").write_text(textwrap.dedent(script))
    out = subprocess.run([sys.executable, "groups.py", executor], cwd=tmp_path, input=stdin, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return (out.stdout + out.stderr).replace(str(tmp_path) + "/", "")


CHAINS = """
import sys, traceback
from hardy import Engine, Pipeline, node

def explicit():
    try:
        raise ExceptionGroup("outer", [ValueError("v"), ExceptionGroup("inner", [TypeError("t")])])
    except* TypeError as eg:
        raise RuntimeError("from except*") from eg

def implicit():
    try:
        raise ExceptionGroup("outer", [ValueError("v"), TypeError("t")])
    except* TypeError:
        raise RuntimeError("handler failed")

def looped():
    member = KeyError("member")
    group = ExceptionGroup("looped", [member])
    member.__context__ = group  # a cycle: the member was raised while handling its own group
    raise group

def long():
    err = OSError("root")
    for k in range(150):
        link = OSError(f"link {k}")
        link.__context__, err = err, link
    raise ExceptionGroup("long", [err])

@node(output_name="y")
def failing(kind: str):
    return {"explicit": explicit, "implicit": implicit, "looped": looped, "long": long}[kind]()

out = Pipeline([failing], engine=Engine(map_executor=sys.argv[1])).map(
    inputs={"kind": ["explicit", "implicit", "looped", "long"]}, map_over="kind", on_error="continue")
explicit_, implicit_, looped_, long_ = (failed.error.__cause__ for failed in out)
print("cause:", repr(explicit_.exceptions[0].__cause__), explicit_.exceptions[0].__cause__.exceptions[0].exceptions)
print("context:", repr(implicit_.exceptions[0].__context__))
links, err = 0, long_.exceptions[0]
while err.__context__ is not None:
    links, err = links + 1, err.__context__
print("links:", links)
for failed in out[:3]:
    traceback.print_exception(failed.error.__cause__)
"""


def test_a_groups_exceptions_come_back_with_what_they_were_raised_from_or_while_handling(tmp_path):
    """`raise ... from eg` and an implicit context inside `except*`: a group's exceptions came back
    from a worker without `__cause__` and `__context__`, and the traceback without those sections,
    where a lone exception's chain came back. A cycle ends where it comes back round (printed as
    Python prints it: once), and a chain is cut at 100 links, as a lone exception's."""
    process, sequential = _run(tmp_path, CHAINS, "process"), _run(tmp_path, CHAINS, "sequential")
    assert "cause: ExceptionGroup('outer', [ExceptionGroup('inner', [TypeError('t')])]) (TypeError('t'),)" in process
    assert "context: ExceptionGroup('outer', [TypeError('t')])" in process
    assert "links: 100" in process, process
    assert "The above exception was the direct cause of the following exception:" in process, process
    assert 'raise ExceptionGroup("outer", [ValueError("v"), TypeError("t")])' in process, process
    assert "During handling of the above exception, another exception occurred:" in process, process
    assert process.replace("links: 100", "links: 150") == sequential


ARGUMENTS = """
import inspect, pdb, sys, threading
from hardy import Engine, Pipeline, node

def inner(total, /, count, *rest, scale, **options):
    lock = threading.Lock()
    return total / count

@node(output_name="price")
def price(order: dict, locked: bool = False) -> float:
    held = [1, 2]
    extra = (threading.Lock(),) if locked else (3, 4)
    return inner(order["total"], order["count"], *extra, scale=2, unit="eur")

out = Pipeline([price], engine=Engine(map_executor=sys.argv[1])).map(
    inputs={"order": [{"total": 1.0, "count": 0}], "locked": [False, True]}, map_over=["order", "locked"],
    map_mode="product", on_error="continue")
for failed in out:
    tb = failed.error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in ("price", "inner"):
            info = inspect.getargvalues(tb.tb_frame)
            print(tb.tb_frame.f_code.co_name, info.args, info.varargs, info.keywords,
                  inspect.formatargvalues(*info), sorted(info.locals))
        tb = tb.tb_next
pdb.post_mortem(out[0].error.__traceback__)
"""


def test_a_workers_frames_have_their_functions_arguments_for_pdb_and_inspect(tmp_path):
    """pdb's `a` printed nothing on a frame rebuilt from a worker, and `inspect.getargvalues` (what
    IPython's verbose traceback shows as `f(x=1)`) no arguments: the frame ran module-level code.
    Its code now has the function's parameters, positional-only to **kwargs, holding the values
    that came back; a `*rest` that came back as a stand-in is a local like the others."""
    process = _run(tmp_path, ARGUMENTS, "process", stdin="a\nup\na\nq\n")
    sequential = _run(tmp_path, ARGUMENTS, "sequential", stdin="a\nup\na\nq\n")
    unlocked = ("inner ['total', 'count', 'scale'] rest options (total=1.0, count=0, scale=2, *rest=(3, 4), "
                "**options={'unit': 'eur'}) ['count', 'lock', 'options', 'rest', 'scale', 'total']")
    assert unlocked in process and unlocked in sequential, process
    assert "inner ['total', 'count', 'scale'] None options" in process, process  # (the lock in *rest stayed there)
    assert ("price ['order', 'locked'] None None (order={'total': 1.0, 'count': 0}, locked=False) "
            "['extra', 'held', 'locked', 'order']") in process, process
    debugged = process[process.index("> groups.py(7)inner()"):]
    assert "(Pdb) total = 1.0\ncount = 0\nscale = 2\nrest = (3, 4)\noptions = {'unit': 'eur'}\n" in debugged, debugged
    assert "(Pdb) order = {'total': 1.0, 'count': 0}\nlocked = False\n" in debugged, debugged
    assert debugged == sequential[sequential.index("> groups.py(7)inner()"):]


PLANNED = """
import sys, traceback
from hardy import Engine, Pipeline, node

@node(output_name="y")
def checked(k: str):
    try:
        raise ExceptionGroup("outer", [ValueError("v"), TypeError("t")])
    except* TypeError:
        raise RuntimeError("handler failed")

out = Pipeline([checked], engine=Engine(map_executor=sys.argv[1])).map(inputs={"k": ["x"]}, map_over="k",
                                                                       on_error="continue")
traceback.print_exception(out[0].error.__cause__)
"""


def test_a_group_raised_by_except_star_in_a_node_shows_no_frame_of_the_plans_code(tmp_path):
    """A group `except*` raised again in the node itself has no frame of the node (Python starts
    its traceback at the caller's): it showed the plan's generated `_each` (`_run` in-process) on
    top, which hardy leaves out of a lone exception's traceback on every executor."""
    process, sequential = _run(tmp_path, PLANNED, "process"), _run(tmp_path, PLANNED, "sequential")
    assert "<hardy plan" not in process and "<hardy plan" not in sequential, process + sequential
    assert process.startswith("  | ExceptionGroup:  (2 sub-exceptions)\n"), process
    assert process == sequential

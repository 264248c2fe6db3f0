"""Every error names what went wrong, where, and how to fix it; every one is a `HardyError` from
`hardy/errors.py`, also the built-in a caller would catch it by."""

from __future__ import annotations

import ast
import builtins
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hardy import DiskCache, Engine, Failed, Pipeline, node
from hardy.errors import (
    CycleError,
    DuplicateNodeError,
    DuplicateOutputError,
    GraphError,
    InvalidArgument,
    InvalidArgumentType,
    MapError,
    MapInputError,
    MissingInputError,
    NodeDefinitionError,
    NodeError,
    OutputCountError,
    SelfDependencyError,
    UnknownInputError,
    UnknownInputWarning,
    UnknownOutputError,
    install_hint,
)


@node(output_name="b")
def f_ab(a):
    return a


@node(output_name="a")
def f_ba(b):
    return b


def test_cycle_names_the_nodes():
    with pytest.raises(CycleError) as exc:
        Pipeline(nodes=[f_ab, f_ba])
    assert set(exc.value.cycle) == {"f_ab", "f_ba"}
    assert "f_ab" in str(exc.value) and "->" in str(exc.value)
    assert isinstance(exc.value, GraphError)


def test_duplicate_output_names_both_nodes():
    @node(output_name="b")
    def other(x):
        return x

    with pytest.raises(DuplicateOutputError, match="'f_ab' and 'other'"):
        Pipeline(nodes=[f_ab, other])


def test_self_dependency():
    @node(output_name="x")
    def grow(x):
        return x + 1

    with pytest.raises(SelfDependencyError, match="grow"):
        Pipeline(nodes=[grow])


def test_missing_input_suggests_the_typo_and_is_a_value_error():
    @node(output_name="n")
    def length(text):
        return len(text)

    p = Pipeline(nodes=[length], name="p")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownInputWarning)
        with pytest.raises(MissingInputError) as exc:
            p.run(inputs={"txet": "abc"})
    msg = str(exc.value)
    assert "'text' (needed by 'length'; 'txet' was given: did you mean 'text'?)" in msg  # the name to use
    assert isinstance(exc.value, ValueError)


def test_unknown_input_warns_or_raises_when_strict():
    p = Pipeline(nodes=[f_ab])
    with pytest.warns(UnknownInputWarning, match="'aa'"):
        p.run(inputs={"a": 1, "aa": 2})
    strict = Pipeline(nodes=[f_ab], strict=True)
    with pytest.raises(UnknownInputError, match="did you mean 'a'"):
        strict.run(inputs={"a": 1, "aa": 2})


def test_unknown_output():
    with pytest.raises(UnknownOutputError, match="did you mean 'b'"):
        Pipeline(nodes=[f_ab]).run(inputs={"a": 1}, output_name="bb")


def test_node_error_names_node_inputs_and_keeps_cause():
    @node(output_name="q")
    def divide(x, y):
        return x / y

    with pytest.raises(NodeError) as exc:
        Pipeline(nodes=[divide]).run(inputs={"x": 1, "y": 0})
    err = exc.value
    assert err.node == "divide" and err.item is None
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert "x=1" in str(err) and "y=0" in str(err) and "ZeroDivisionError" in str(err)


def test_node_error_in_map_names_the_item():
    @node(output_name="q")
    def divide(x):
        return 1 / x

    p = Pipeline(nodes=[divide], engine=Engine(map_executor="sequential"))  # one item after another: item 3 is never run
    with pytest.raises(MapError) as exc:
        p.map(inputs={"x": [1, 2, 0, 4]}, map_over="x")
    err = exc.value
    assert list(err.failures) == [2]
    assert err.failures[2].item == 2 and "item 2" in str(err)
    assert err.results[:2] == [{"q": 1.0}, {"q": 0.5}]  # computed results are kept
    assert isinstance(err.results[2], Failed)
    assert err.results[3] is None and len(err.results) == 4  # one entry per item, None if not run
    assert "2 of 4 completed" in str(err) and "None for an item not run" in str(err)
    assert repr(err.results[2]) == ("Failed(NodeError(\"node 'divide' failed on item 2 (inputs: x=0): "
                                    "ZeroDivisionError: division by zero\"))")


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_a_dataframe_input_is_summarised_by_its_shape_and_columns(executor):
    """Its repr's first line is its padded column header: the error said `df=       a    ...`."""
    pd = pytest.importorskip("pandas")
    import numpy as np

    frames = [pd.DataFrame({"a": [1, 2, 3], "b": [0.5, 1.5, 2.5]}),
              pd.DataFrame(np.zeros((1000, 40)), columns=[f"col{i}" for i in range(40)])]
    with Engine(map_executor=executor, workers=1) as engine:
        out = Pipeline(nodes=[fails_on_frames], engine=engine).map(
            inputs={"df": frames, "s": [frames[0]["a"], np.eye(2)]}, map_over=["df", "s"], on_error="continue")
    assert out[0].error.inputs_summary == "df=DataFrame(3 rows × 2 columns: a, b), s=Series(3 values, dtype int64, " \
                                         "name 'a')", out[0].error.inputs_summary
    assert out[1].error.inputs_summary == "df=DataFrame(1,000 rows × 40 columns: col0, col1, +38 more), " \
                                         "s=array([[1., 0.], [0., 1.]])", out[1].error.inputs_summary  # one line
    assert "(inputs: df=DataFrame(3 rows × 2 columns: a, b), " in str(out[0].error)


@node(output_name="n")
def fails_on_frames(df, s):
    raise ValueError("no frames today")


@pytest.mark.parametrize("executor", ["sequential", "threaded", "async"])
def test_map_error_keeps_results_for_every_executor(executor):
    @node(output_name="q")
    def divide(x):
        return 1 / x

    p = Pipeline(nodes=[divide], engine=Engine(map_executor=executor, workers=2))
    with pytest.raises(MapError) as exc:
        p.map(inputs={"x": [1, 0, 2, 3]}, map_over="x")
    assert exc.value.results[0] == {"q": 1.0}
    out = p.map(inputs={"x": [1, 0, 2, 3]}, map_over="x", on_error="continue")
    assert isinstance(out[1], Failed) and out[3] == {"q": 1 / 3}


def test_wrong_number_of_outputs():
    @node(output_name=("a", "b"))
    def pair(x):
        return x

    with pytest.raises(OutputCountError, match=r"declared 2 outputs .* returned a int|returned 1"):
        Pipeline(nodes=[pair]).run(inputs={"x": 1})

    @node(output_name=("a", "b"))
    def triple(x):
        return x, x, x

    with pytest.raises(OutputCountError, match="tuple of length 3"):
        Pipeline(nodes=[triple]).run(inputs={"x": 1})

    @node(output_name=("a", "b"))
    def as_list(x):
        return [x, x + 1]

    assert Pipeline(nodes=[as_list]).run(inputs={"x": 1}) == {"a": 1, "b": 2}


def test_zip_lengths_differ():
    @node(output_name="s")
    def add(a, b):
        return a + b

    with pytest.raises(MapInputError, match=r"\{'a': 2, 'b': 3\}"):
        Pipeline(nodes=[add]).map(inputs={"a": [1, 2], "b": [1, 2, 3]}, map_over=["a", "b"])


def test_map_over_not_an_input():
    with pytest.raises(MapInputError, match="'aa'"):
        Pipeline(nodes=[f_ab]).map(inputs={"a": [1]}, map_over="aa")


def test_map_over_a_string_is_refused():
    with pytest.raises(MapInputError, match="list"):
        Pipeline(nodes=[f_ab]).map(inputs={"a": "abc"}, map_over="a")


def test_bad_map_mode_and_on_error():
    p = Pipeline(nodes=[f_ab])
    with pytest.raises(MapInputError, match="'zip' or 'product'"):
        p.map(inputs={"a": [1]}, map_over="a", map_mode="cartesian")
    with pytest.raises(MapInputError, match="on_error"):
        p.map(inputs={"a": [1]}, map_over="a", on_error="ignore")


def test_non_callable_node():
    with pytest.raises(NodeDefinitionError, match="item 1 is an int"):  # "a int" before
        Pipeline(nodes=[f_ab, 42])
    with pytest.raises(InvalidArgumentType, match=r"Pipeline\(nodes=7\) is an int, not a list of nodes"):
        Pipeline(nodes=7)
    with pytest.raises(NodeDefinitionError, match="callable"):
        node(output_name="x")(42)


def test_var_args_node_is_refused():
    with pytest.raises(NodeDefinitionError, match=r"\*args"):
        @node
        def bad(*xs):
            return xs


def test_two_pipelines_nested_under_the_same_name():
    inner1 = Pipeline(nodes=[f_ab], name="same")

    @node(output_name="c")
    def f_c(x):
        return x

    inner2 = Pipeline(nodes=[f_c], name="same")
    with pytest.raises(DuplicateNodeError, match="'same'"):
        Pipeline(nodes=[inner1, inner2])
    Pipeline(nodes=[inner1.as_node(name="one"), inner2.as_node(name="two")])  # distinct names work


def test_nested_error_names_the_path():
    @node(output_name="q")
    def boom(x):
        raise RuntimeError("inner failure")

    inner = Pipeline(nodes=[boom], name="inner")
    outer = Pipeline(nodes=[inner.as_node(name="stage")])
    with pytest.raises(NodeError) as exc:
        outer.run(inputs={"x": 1})
    assert exc.value.node == "stage/boom"
    assert isinstance(exc.value.__cause__, RuntimeError)


def _bad_calls():
    """Every wrong argument the issue lists, as (what is called, the class expected, words the
    message must hold: the argument, the value and the fix)."""
    p = Pipeline(nodes=[f_ab])
    return {
        "one node, not a list": (lambda: Pipeline(f_ab), InvalidArgumentType, ["nodes=", "f_ab", "Pipeline(nodes=[f_ab])"]),
        "nodes a string": (lambda: Pipeline("f_ab"), InvalidArgumentType, ["nodes='f_ab'", "list"]),
        "imap window text": (lambda: p.imap(inputs={"a": [1]}, map_over="a", window="10"), InvalidArgumentType,
                             ["window='10'", "whole number >= 1"]),
        "imap window 0": (lambda: p.imap(inputs={"a": [1]}, map_over="a", window=0), InvalidArgument,
                          ["window=0", "whole number >= 1"]),
        "cache size": (lambda: DiskCache(TMP, max_size="10 parsecs"), InvalidArgument,
                       ["max_size='10 parsecs'", "'10GB'"]),
        "cache size type": (lambda: DiskCache(TMP, max_size=1.5), InvalidArgumentType, ["max_size=1.5", "'10GB'"]),
        "cache store name": (lambda: DiskCache(TMP, store="s3"), InvalidArgument,
                             ["store='s3'", "'files'", "Store object"]),
        "cache store object": (lambda: DiskCache(TMP, store=object()), InvalidArgumentType,
                               ["store=<object", "lacks get, view"]),
        "cache path": (lambda: DiskCache(123), InvalidArgumentType, ["path=123", "a path"]),
        "report_dir": (lambda: Engine(report_dir=123), InvalidArgumentType, ["report_dir=123", "a path"]),
        "report": (lambda: Engine(report="yes"), InvalidArgumentType, ["report='yes'", "True or False"]),
        "workers": (lambda: Engine(workers=0), InvalidArgument, ["workers=0", "whole number >= 1"]),
        "stall_report": (lambda: Engine(stall_report=-1), InvalidArgument, ["stall_report=-1", "seconds > 0"]),
        "visualize orient": (lambda: p.visualize(orient="up"), InvalidArgument, ["orient='up'", "'LR'"]),
        "workers type": (lambda: Engine(workers="2"), InvalidArgumentType, ["workers='2'", "whole number >= 1"]),
        "node_executor": (lambda: Engine(node_executor="process"), InvalidArgument,
                          ["node_executor='process'", "map_executor='process'"]),
        "map_executor": (lambda: Engine(map_executor="gpu"), InvalidArgument, ["map_executor='gpu'", "'process'"]),
        "max_memory": (lambda: Engine(max_memory_per_worker="lots"), InvalidArgument,
                       ["max_memory_per_worker='lots'", "'10GB'"]),
        "bind": (lambda: Pipeline(nodes=[f_ab]).bind(nope=1), UnknownInputError, ["['nope']", "Accepted inputs: ['a']"]),
        "map_mode": (lambda: p.map(inputs={"a": [1]}, map_over="a", map_mode="cartesian"), MapInputError,
                     ["'cartesian'", "'zip' or 'product'"]),
        "on_error": (lambda: p.map(inputs={"a": [1]}, map_over="a", on_error="ignore"), MapInputError,
                     ["'ignore'", "'raise' or 'continue'"]),
    }


TMP = "/nonexistent/hardy-never-created"  # DiskCache refuses its arguments before touching the path


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_fail_where_they_are_made(case):
    call, kind, words = _bad_calls()[case]
    with pytest.raises(kind) as caught:
        call()
    err = caught.value
    assert isinstance(err, InvalidArgument) and isinstance(err, ValueError) and not isinstance(err, NodeDefinitionError)
    assert isinstance(err, TypeError) == (kind is InvalidArgumentType)
    for word in words:
        assert word in str(err), (word, str(err))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, "10"])
def test_a_timeout_that_would_never_be_enforced_is_refused_at_the_decorator(value):
    with pytest.raises(NodeDefinitionError, match=rf"timeout={value!r} is not valid; timeout must be a finite number"):
        node(output_name="y", timeout=value)(lambda x: x)


MISSING_ENGINES = """
import sys
for name in ("daft", "distributed", "ray"):
    sys.modules[name] = None  # as if the extra were not installed
from hardy import Engine, Pipeline, node
from hardy.integrations.dask import DaskExecutor
from hardy.integrations.ray import RayExecutor

@node(output_name="y")
def f(x):
    return x

for make in (lambda: DaskExecutor(), lambda: RayExecutor()):
    try:
        Pipeline(nodes=[f], engine=Engine(map_executor=make())).map(inputs={"x": [1]}, map_over="x")
    except ImportError as exc:
        print(exc)
try:
    import hardy.integrations.daft
except ImportError as exc:
    print(exc)
"""


def test_an_engine_that_is_not_installed_names_the_extra():
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", MISSING_ENGINES], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    # the packages by name, which pip finds wherever hardy came from, and the clone's form of the extra
    assert [line.split("Install it with: ")[-1] for line in lines] == [
        install_hint("dask"), install_hint("ray"), install_hint("daft")], lines
    assert all('-e ".[' in line and "hardy[" not in line for line in lines), lines
    assert "pip install 'distributed>=2024.1' (or" in lines[0]  # read from hardy's metadata


# --- one error story -----------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
INTERNAL = {"Exited": "a node's SystemExit inside the plan, turned back into it before any caller sees it",
            "Escaped": "a node's other BaseException out of an asyncio task, turned back into it before any caller sees it",
            "PipelineRefused": "a worker's refusal of a pipeline, raised as one ReplicaError before any caller sees it",
            "NodeInterrupted": "a node's KeyboardInterrupt in a worker, raised as one before any caller sees it"}


def documented_errors() -> list[str]:
    """The errors docs/api.md lists (its `members: [...]` under "## Errors")."""
    errors_section = (ROOT / "docs" / "api.md").read_text().split("## Errors", 1)[1]
    return re.search(r"members: \[([^\]]*)\]", errors_section)[1].replace(" ", "").split(",")


def test_every_error_is_documented_importable_from_hardy_errors_and_a_hardy_error():
    import hardy
    import hardy.errors as errors
    defined = {name for name, obj in vars(errors).items()
               if isinstance(obj, type) and issubclass(obj, BaseException | Warning) and obj.__module__ == errors.__name__}
    documented = documented_errors()
    assert sorted(defined - set(INTERNAL)) == sorted(documented), "docs/api.md's error list and hardy/errors.py differ"
    caught = {name for name in hardy.__all__ if name in defined}
    assert caught | hardy.MOVED_TO_ERRORS == set(documented) and not caught & hardy.MOVED_TO_ERRORS, (
        "each error is either one a caller catches (in hardy.__all__) or one that moved to hardy.errors")
    for name in documented:
        cls = getattr(errors, name)
        assert name not in caught or vars(hardy)[name] is cls  # the errors a caller catches: from hardy itself
        if issubclass(cls, Warning) or cls is errors.MapInterrupted:  # a KeyboardInterrupt: not an Exception
            continue
        assert issubclass(cls, errors.HardyError), f"{name} is not a HardyError"
        builtin_bases = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (object, BaseException,
                                                                                              Exception)]
        # a node's error carries its cause's type; a RemoteError's stand-ins take the original's built-in
        assert builtin_bases or issubclass(cls, errors.NodeError | errors.MapError | errors.RemoteError) or (
            cls is errors.HardyError), (
            f"{name} derives from no built-in a caller would catch it by (ValueError, TypeError, OSError, ...)")


def test_an_error_moved_to_hardy_errors_still_imports_from_hardy_with_a_warning_naming_the_new_import():
    import hardy
    import hardy.errors as errors
    for name in sorted(hardy.MOVED_TO_ERRORS):
        with pytest.warns(DeprecationWarning, match=rf"write `from hardy.errors import {name}`") as seen:
            assert getattr(hardy, name) is getattr(errors, name)
        assert seen[0].filename == __file__  # the warning points at the line that used the old name
    with pytest.warns(DeprecationWarning, match="from hardy.errors import CycleError") as seen:
        from hardy import CycleError as moved
    assert moved is errors.CycleError and {w.filename for w in seen} == {__file__}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what a script writes imports without a warning
        exec("from hardy import *", {})
    with pytest.raises(AttributeError, match="no attribute 'NoSuchError'"):
        hardy.NoSuchError  # noqa: B018


def test_a_script_that_imports_a_moved_error_from_hardy_runs_and_is_told_the_new_import(tmp_path):
    script = "from hardy import Pipeline, UnknownInputError, node\nprint(UnknownInputError.__module__)\n"
    out = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "hardy.errors\n", out.stderr
    assert "<stdin>:1: DeprecationWarning: hardy.UnknownInputError has moved: write `from hardy.errors import " \
           "UnknownInputError`" in out.stderr


def exception_classes_outside_errors() -> list[str]:
    """Classes defined outside hardy/errors.py whose name or bases say they are exceptions."""
    exceptional = re.compile(r"(Error|Exception|Exit|Interrupt|Warning)$")
    builtin_exceptions = {n for n, o in vars(builtins).items() if isinstance(o, type) and issubclass(o, BaseException)}
    found = []
    for path in sorted((ROOT / "src" / "hardy").rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "hardy":
            continue
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases]
            if exceptional.search(cls.name) or any(b in builtin_exceptions or exceptional.search(b) for b in bases):
                found.append(f"{path.relative_to(ROOT)}: class {cls.name}({', '.join(bases)})")
    return found


def test_no_exception_class_is_defined_outside_errors_py():
    """Private control-flow signals (`_Deferred`, `_WrongOutputCount`) that never leave their module
    are the only exception classes allowed elsewhere; anything a caller can see lives in errors.py."""
    outside = exception_classes_outside_errors()
    assert any("_WrongOutputCount" in c for c in outside)  # the scan sees a private one
    public = [c for c in outside if not c.split("class ", 1)[1].startswith("_")]
    assert not public, "exception classes outside hardy/errors.py:\n" + "\n".join(public)
    named = [c for c in outside if re.search(r"class \w*(Error|Exception)\(", c)]
    assert not named, "a class named ...Error/...Exception outside hardy/errors.py:\n" + "\n".join(named)


def test_a_map_errors_text_ends_each_sentence_once():
    """A first failure whose fix ends its sentence (an input that cannot be sent) read
    "...builds its own.. Use on_error=..." inside MapError's text."""
    from hardy.errors import MapError, NodeError
    first = NodeError("embed", {"x": 1}, 0, "cannot be sent. Pass plain data instead.")
    assert ".. " not in str(MapError([None, 1], {0: first}))

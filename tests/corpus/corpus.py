"""The differential corpus's harness: what the group scripts of tests/corpus/ share.

Each group script is a user's script (no `__main__` guard, run as `python - EXECUTOR < group.py`
in a fresh folder that holds the user's modules), and each `@pattern` function in it is one thing
users do: it runs at once, on the script's one engine, and its outcome is printed as one JSON
line: the value it returned (numpy, pandas and `Failed` made comparable), or the error it raised.
tests/test_same_answer_corpus.py runs every group on every executor and compares each pattern's outcome
with the sequential executor's (docs/same-answer.md, "The differential corpus").

What a pattern expects is declared with it: the same answer everywhere (the default), or
`refused=(error type, [names])`: the calling process computes the answer, and an executor whose
workers are other processes refuses with that error naming those names before any node runs
(`ran()` is the file a refusal pattern's nodes touch, so that "before" is checked, not assumed).
Each pattern's changes to the process (environment, working directory, argv, sys.path) are undone
after it, so that patterns do not lean on one another; the engine and its workers are shared, as
they are in a user's session, and so is the pipeline of each list of nodes (`pipeline`).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import textwrap
import time
import traceback
from collections.abc import Callable
from typing import Any

from hardy import Engine, Failed

# the executor: the script's first argument, or in a notebook's kernel (notebooks.py) its environment
EXECUTOR = os.environ.get("CORPUS_EXECUTOR") or sys.argv[1]
IN_PROCESS = EXECUTOR in ("sequential", "threaded")  # the executors whose nodes run in the calling process
WORKDIR = os.getcwd()
PREFIX = "@corpus "  # marks the outcome lines in a script's output
PATTERN_TIMEOUT = 240  # seconds: a pattern that hangs is reported as such, and the next one runs

_engines: list[Engine] = []


def executor() -> Any:
    """The map executor named on the command line, as a user would build it."""
    if EXECUTOR == "dask":
        from hardy.integrations.dask import DaskExecutor
        return DaskExecutor(workers=2)
    if EXECUTOR == "ray":
        from hardy.integrations.ray import RayExecutor
        return RayExecutor(workers=2)
    return EXECUTOR


def engine(**options: Any) -> Engine:
    """The script's engine (one per script: a Dask or Ray cluster starts once)."""
    made = Engine(map_executor=executor(), workers=2, **options)
    _engines.append(made)
    return made


_pipelines: dict[tuple[Any, ...], Any] = {}


def pipeline(nodes: list[Any], engine: Engine, **options: Any) -> Any:
    """One pipeline per list of nodes (and options), as a session keeps one: a change between two
    maps must make its plan stale, which a pipeline made anew for each map never shows (the
    nodes stay alive in it, so no id is reused)."""
    from hardy import Pipeline
    key = (tuple(map(id, nodes)), id(engine), repr(sorted(options.items())))
    if key not in _pipelines:
        _pipelines[key] = Pipeline(nodes=nodes, engine=engine, **options)
    return _pipelines[key]


def write(path: str, source: str) -> str:
    """Writes one of the user's files (a module, a config) in the working folder, as an editor would."""
    full = os.path.join(WORKDIR, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(textwrap.dedent(source).lstrip("\n"))
    importlib.invalidate_caches()
    return full


def ran(name: str) -> str:
    """The file a node of pattern `name` touches when it runs (a refusal must come before it)."""
    return os.path.join(WORKDIR, "ran", name)


def comparable(value: Any) -> Any:
    """`value` as JSON compares it: arrays, frames and tensors by their values, a `Failed` by its
    error's type and message's first line, tuples as lists."""
    if isinstance(value, Failed):
        return {"Failed": type(value.error).__name__, "cause": type(value.error.__cause__).__name__}
    if isinstance(value, dict):
        return {str(k): comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(comparable(v) for v in value)
    if hasattr(value, "to_dict") and hasattr(value, "columns"):  # a pandas DataFrame
        return {"frame": comparable(value.to_dict(orient="list"))}
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return comparable(value.tolist())
    if isinstance(value, float) and value != value:
        return "nan"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout(f"the pattern ran past {PATTERN_TIMEOUT} s")


OUT_OF_PROCESS = ("process", "dask", "ray")


def pattern(func: Callable[[], Any] | None = None, *, refused: tuple[str, list[str]] | None = None,
            by: tuple[str, ...] = OUT_OF_PROCESS) -> Any:
    """Runs the pattern now and prints its outcome. `refused`: the error and the names in its
    message with which the executors `by` refuse it (see the module's docstring)."""
    if func is None:
        return lambda f: pattern(f, refused=refused, by=by)
    saved = (os.getcwd(), dict(os.environ), list(sys.argv), list(sys.path))
    os.makedirs(os.path.dirname(ran(func.__name__)), exist_ok=True)
    line: dict[str, Any] = {"pattern": func.__name__, "refused": refused and [*refused, list(by)]}
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PATTERN_TIMEOUT)
    try:
        line["value"] = comparable(func())
    except BaseException as exc:  # SystemExit from a node, the alarm's timeout: outcomes too
        line["error"] = type(exc).__name__
        line["cause"] = _cause(exc)
        line["message"] = str(exc)[:2000]
        line["trace"] = traceback.format_exc()[-3000:]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        _restore(*saved)
    line["ran"] = os.path.exists(ran(func.__name__))
    line["seconds"] = round(time.perf_counter() - start, 3)
    print(PREFIX + json.dumps(line), flush=True)
    return func


def _cause(exc: BaseException) -> str | None:
    """The type of what made a map fail (its first failure's own cause), as it compares."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return type(exc).__name__


def _restore(cwd: str, environ: dict[str, str], argv: list[str], path: list[str]) -> None:
    os.chdir(cwd)
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)
    sys.argv[:] = argv
    sys.path[:] = path


def close() -> None:
    """Ends the script's engines (a Ray or Dask cluster with them)."""
    for made in _engines:
        made.close()

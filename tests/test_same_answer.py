"""The differential corpus: the same answer as your own process, or the same refusal.

Each group script of tests/corpus/ is a user's script (or, notebooks.py, a user's notebook in a
real kernel) whose `@pattern`s each do one thing users do to the state a node reads: module state
set at run time, code edited and reloaded, the environment and working directory changed, pools
and threads started by nodes, run/map/imap, nested pipelines, a cache. The script runs once per
executor, in its own folder, on one engine; every pattern's outcome is compared with the
sequential executor's, pattern by pattern: the same value, or, where the pattern says its state
cannot cross to another process, the same refusal on every executor whose workers are other
processes (the error type and the names it must give, raised before any node ran). The table in
docs/same-answer.md ("The differential corpus") summarises what these tests show.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
PREFIX = "@corpus "
GROUPS = ("module_state", "code_edits", "environment", "pools_and_calls", "notebooks", "torch_state")
ENGINES = ("dask", "ray")  # each group starts its cluster once per run: marked slow
EXECUTORS = ("threaded", "process", *ENGINES)

pytestmark = pytest.mark.timeout(1800)


def patterns(group: str) -> list[str]:
    """The patterns of a group, in order: the functions decorated with @pattern (in a notebook's
    cells, too), read from the source so that each is its own test before anything runs."""
    source = (CORPUS / f"{group}.py").read_text()
    return re.findall(r"@pattern\b[^\n]*?(?:\n|\\n)def (\w+)\(", source)


# Where an executor does not give the sequential executor's answer yet: (group, pattern) ->
# {executor: why}. Each is a bug in the mechanism of docs/same-answer.md (strict: when it is fixed,
# the test says so, and the entry goes).
KNOWN: dict[tuple[str, str], dict[str, str]] = {}


def cases() -> list[Any]:
    made = []
    for group in GROUPS:
        for name in patterns(group):
            for executor in EXECUTORS:
                marks = [pytest.mark.slow] if executor in ENGINES else []
                why = KNOWN.get((group, name), {}).get(executor)
                if why:
                    marks.append(pytest.mark.xfail(strict=True, reason=why))
                made.append(pytest.param(group, name, executor, marks=marks, id=f"{group}-{name}-{executor}"))
    return made


_RUNS: dict[tuple[str, str], tuple[dict[str, dict[str, Any]], str]] = {}


@pytest.fixture(scope="session")
def outcomes(tmp_path_factory: pytest.TempPathFactory):
    """outcomes(group, executor): each pattern's outcome line, by name, and the script's stderr;
    a group runs once per executor in the session, in a fresh folder."""

    def run(group: str, executor: str) -> tuple[dict[str, dict[str, Any]], str]:
        if (group, executor) not in _RUNS:
            folder = tmp_path_factory.mktemp(f"{group}-{executor}")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(CORPUS)]),
                   "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(folder)}
            with open(CORPUS / f"{group}.py") as script:
                done = subprocess.run([sys.executable, "-", executor], stdin=script, cwd=folder, env=env,
                                      capture_output=True, text=True, timeout=1500)
            lines = [json.loads(line[len(PREFIX):]) for line in done.stdout.splitlines() if line.startswith(PREFIX)]
            why = f"exit status {done.returncode}; stderr:\n{done.stderr[-6000:]}"
            _RUNS[(group, executor)] = ({line["pattern"]: line for line in lines}, why)
        return _RUNS[(group, executor)]

    return run


def answer(line: dict[str, Any]) -> Any:
    """What a pattern's outcome compares by: its value, or its error's type and cause."""
    if "value" in line:
        return {"value": line["value"]}
    return {"error": line["error"], "cause": line.get("cause")}


@pytest.mark.parametrize("group", GROUPS)
def test_every_pattern_answers_on_the_sequential_executor(group, outcomes):
    """The reference: each pattern ran and returned a value in the calling process (a pattern
    that raises there tests nothing)."""
    got, why = outcomes(group, "sequential")
    assert list(got) == patterns(group), f"patterns missing from the output ({why})"
    raised = {name: (line["error"], line["message"][:300]) for name, line in got.items() if "value" not in line}
    assert not raised, f"patterns failing in the calling process: {raised}"


@pytest.mark.parametrize(("group", "name", "executor"), cases())
def test_same_answer_or_the_same_refusal(group, name, executor, outcomes):
    reference, _ = outcomes(group, "sequential")
    got, why = outcomes(group, executor)
    assert name in reference and name in got, f"{group}/{name} did not report on {executor} ({why})"
    expected, line = reference[name], got[name]
    refused = expected["refused"]
    if refused and executor in refused[2]:
        error, names, _ = refused
        assert line.get("error") == error, (
            f"{group}/{name} on {executor}: expected a {error} before any node ran, got {answer(line)}: "
            f"{line.get('message', '')[:800]}")
        missing = [n for n in names if n not in line["message"]]
        assert not missing, f"{group}/{name} on {executor}: the refusal does not name {missing}: {line['message']}"
        assert not line["ran"], f"{group}/{name} on {executor}: a node ran before the refusal"
    else:
        assert answer(line) == answer(expected), (
            f"{group}/{name} on {executor} differs from the sequential executor:\n  sequential: "
            f"{answer(expected)}\n  {executor}: {answer(line)}\n  {line.get('message', '')[:1500]}")

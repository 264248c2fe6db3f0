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
GROUPS = ("module_state", "code_edits", "environment", "pools_and_calls", "notebooks", "torch_state",
          "exits_and_batches")
ENGINES = ("dask", "ray")  # each group starts its cluster once per run: marked slow
EXECUTORS = ("threaded", "process", *ENGINES)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # every pattern on every executor


def patterns(group: str) -> list[str]:
    """The patterns of a group, in order: the functions decorated with @pattern (in a notebook's
    cells, too), read from the source so that each is its own test before anything runs."""
    source = (CORPUS / f"{group}.py").read_text()
    return re.findall(r"@pattern\b[^\n]*?(?:\n|\\n)def (\w+)\(", source)


# Where an executor does not give the sequential executor's answer: (group, pattern) ->
# {executor: why}. Each is a limit docs/same-answer.md states (its "Limits" and this corpus's list
# of documented differences); strict, so that a fix shows (and its entry goes).
WORKERS = ("process", "dask", "ray")


def known(why: str, executors: tuple[str, ...] = WORKERS) -> dict[str, str]:
    return {executor: why for executor in executors}


LIBRARY_STATE = "a library's process state (documented limit): set it inside the node or in a @stateful class"
KNOWN: dict[tuple[str, str], dict[str, str]] = {
    ("module_state", "numpy_global_seed_set_by_the_script"): known(
        f"np.random.seed() in the script: numpy's global generator is {LIBRARY_STATE}"),
    ("module_state", "lru_cached_helper_called_before_its_table_changed"): known(
        "what an lru_cache holds is the process's own (documented limit): a worker's is empty, so it computes "
        "with the table as it is now where the script's cache still answers with the old one"),
    ("environment", "order_of_a_set_of_strings"): known(
        "str hashes are salted per process unless PYTHONHASHSEED is set (documented limit): a set of strings "
        "iterates in another order in a worker"),
    ("torch_state", "float32_sum_over_a_big_tensor"): known(
        "a float32 sum's rounding depends on the number of threads; a process worker runs cores / workers "
        "threads (documented limit)", ("process",)),
    ("notebooks", "spawn_pool_over_a_notebook_helper"): known(
        "a spawn pool over a notebook's helper cannot start in the kernel (BrokenProcessPool); in hardy's workers "
        "it can (documented: the helper travels by value)"),
}
UNANSWERED: dict[tuple[str, str], str] = {}  # patterns whose calling process gives no answer to compare yet


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
            env = {**os.environ, "CORPUS_STARTED": "start",  # (a variable every script starts with)
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(CORPUS)]),
                   "PYTHONDONTWRITEBYTECODE": "1"}
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
def test_every_pattern_reports(group, outcomes):
    got, why = outcomes(group, "sequential")
    assert list(got) == patterns(group), f"patterns missing from the output ({why})"


def references() -> list[Any]:
    return [pytest.param(group, name, id=f"{group}-{name}", marks=[pytest.mark.xfail(strict=True, reason=why)]
                         if (why := UNANSWERED.get((group, name))) else [])
            for group in GROUPS for name in patterns(group)]


@pytest.mark.parametrize(("group", "name"), references())
def test_the_calling_process_answers(group, name, outcomes):
    """The reference: the pattern returned a value on the sequential executor (a pattern that
    raises there compares nothing, unless its error is the answer the contract gives)."""
    line = outcomes(group, "sequential")[0].get(name)
    assert line is not None and "value" in line, f"{group}/{name} raised in the calling process: {line}"


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


def test_the_contract_page_lists_what_differs_and_counts_the_patterns():
    """docs/same-answer.md's section on the corpus names every pattern that is not the same (so
    that a fix, or a new difference, changes the page too) and the number of patterns."""
    page = (ROOT / "docs" / "same-answer.md").read_text()
    section = page[page.index("## The differential corpus"):]
    listed = section[section.index("Documented differences"):]
    named = set(re.findall(r"`(\w+)`", listed))
    assert named == {name for _, name in KNOWN}, "the page's list of differences is not KNOWN's"
    total = sum(len(patterns(group)) for group in GROUPS)
    assert f"The corpus holds {total} patterns." in section
    for group in GROUPS:
        assert f"`{group}.py`" in section, f"the table does not say where {group}.py's patterns stand"

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

pytestmark = pytest.mark.timeout(1800)


def patterns(group: str) -> list[str]:
    """The patterns of a group, in order: the functions decorated with @pattern (in a notebook's
    cells, too), read from the source so that each is its own test before anything runs."""
    source = (CORPUS / f"{group}.py").read_text()
    return re.findall(r"@pattern\b[^\n]*?(?:\n|\\n)def (\w+)\(", source)


# Where an executor does not give the sequential executor's answer yet: (group, pattern) ->
# {executor: why}. Each is a bug in the mechanism of docs/same-answer.md, or a limit still to be
# refused or documented; strict, so that a fix shows (and its entry goes).
WORKERS = ("process", "dask", "ray")


def known(why: str, executors: tuple[str, ...] = WORKERS) -> dict[str, str]:
    return {executor: why for executor in executors}


PER_ITEM = ("refused item by item (a MapError, every item a Failed of node '<pipeline>') after the map "
            "started, not by one ReplicaError before it (RayExecutor raises the ReplicaError)")
KNOWN: dict[tuple[str, str], dict[str, str]] = {
    ("module_state", "unpicklable_value_set_at_run_time"): known(PER_ITEM, ("process", "dask")),
    ("module_state", "connection_opened_at_run_time"): known(PER_ITEM, ("process", "dask")),
    ("module_state", "attribute_reached_through_a_package_chain"): known(
        "chain_pkg.inner.LIMITS (read as chain_pkg.inner.LIMITS, a package's submodule attribute), filled in "
        "place: not stamped, the workers keep their import's value"),
    ("module_state", "dynamic_getattr_on_the_module"): known(
        "getattr(sys.modules[__name__], 'MODE_SCALE'): a name read dynamically is not stamped; the workers "
        "keep their import's value (to be refused or documented as a limit)"),
    ("module_state", "value_deleted_from_the_module"): known(
        "globals().get('OVERRIDE') after `del module.OVERRIDE`: not stamped, the workers still have it"),
    ("module_state", "numpy_global_seed_set_by_the_script"): known(
        "np.random.seed() in the script: numpy's global generator is a library's state, not carried; each "
        "worker draws from its own seed (to be documented as a limit)"),
    ("module_state", "deque_filled_at_run_time"): known(
        "a collections.deque stamps by its type alone (RESOURCE), so the caller's filled deque and the "
        "worker's empty one compare equal: stale, no refusal"),
    ("module_state", "generator_object_rebound"): known(
        "a numpy Generator stamps by its type alone (RESOURCE): the rebound generator is never installed, "
        "the workers draw from their import's"),
    ("module_state", "function_attribute_set_at_run_time"): known(
        "an attribute set on a helper function (lookup.table = {...}) is not part of its stamp"),
    ("module_state", "big_array_rebound_before_each_of_ten_maps"): known(
        "a value over 64 KiB, rebound before each of ten maps: items fail with 'the pipeline being loaded is "
        "no longer in use' (each Dask thread ships the plan to its own pool, and each ship_plan makes a new "
        "Replica that replaces the one kept for the plan: a worker asking by the first one's id finds it "
        "gone)", ("dask",)),
    ("module_state", "script_global_dict_changed_between_maps"): known(
        "a __main__ dict changed in place between two maps: the second Dask map computes with the first "
        "map's content", ("dask",)),
    ("module_state", "lru_cached_helper_called_before_its_table_changed"): known(
        "the script called an lru_cache helper before changing the table it reads: the calling process "
        "answers from its cache ('old' for key 1), a worker's cache is empty and reads the new table"),
    ("module_state", "synthetic_module_put_in_sys_modules"): known(
        "a module the script made (types.ModuleType put in sys.modules) and a node imports: every item fails "
        "with ModuleNotFoundError in the workers; neither the value nor one refusal naming it"),
    ("module_state", "module_reads_the_scripts_main"): known(
        "a module reading __main__.SCRIPT_OFFSET: a worker's __main__ is not the script, every item fails "
        "with AttributeError; neither the value nor one refusal"),
    ("code_edits", "instance_of_an_edited_class_given_as_input"): known(
        "an input's class travels by reference: a worker imports the edited file's class and runs its "
        "code (1005, 1010, 1015), not the class the caller loaded (5, 10, 15)"),
    ("code_edits", "module_file_broken_after_import"): known(
        "the module's file has a syntax error since the caller imported it: every item fails (process, "
        "Dask) or a bare SyntaxError escapes (Ray); the caller's loaded code does not travel, and no "
        "refusal names the module"),
    ("code_edits", "module_file_deleted_after_import"): known(
        "the module's file was removed after the import: every item fails with ModuleNotFoundError "
        "(process, Dask); Ray refuses with WorkerImportError: neither the caller's answer nor one refusal"),
    ("code_edits", "script_function_redefined_between_maps"): known(
        "a helper in a node's closure redefined between two maps: the plan is not recompiled (a cell "
        "rebound), the second map runs the first helper", ("process",)),
    ("environment", "environ_deleted_between_maps"): known(
        "a variable the caller set, then deleted, stays set in a Ray worker that was given it (the delta "
        "is taken against the caller's start environment, which never had it)", ("ray",)),
    ("environment", "relative_path_resolved_by_a_module_at_import"): known(
        "after os.chdir, a worker that has not imported the nodes' module yet looks for it through the '' "
        "entry of sys.path, now the new directory: every item fails with ModuleNotFoundError",
        ("process", "dask")),
    ("environment", "timezone_set_by_the_script"): known(
        "TZ set and time.tzset() called by the script: a worker has TZ in its environment but never "
        "calls tzset (UTC hours)"),
    ("environment", "umask_set_by_the_script"): known(
        "os.umask() in the script: workers keep their own umask (files 0o644, not 0o600)"),
    ("environment", "order_of_a_set_of_strings"): known(
        "str hashes are salted per process: a set's iteration order in a worker is not the caller's (unless "
        "PYTHONHASHSEED is set; to be documented as a limit, or the workers given the caller's salt)"),
    ("pools_and_calls", "stateful_resource_built_from_module_state"): known(
        "a @stateful class's __init__ reads res_steps.CONFIG, which the script changed: the resource is "
        "built in the worker from its import's CONFIG (what the class reads is not stamped)"),
    ("notebooks", "spawn_pool_over_a_notebook_helper"): known(
        "a spawn pool over a notebook's helper fails in the kernel (BrokenProcessPool) but works in "
        "hardy's workers ([0, 1]): another answer (if intended, document it and change the pattern)"),
    ("torch_state", "float32_sum_over_a_big_tensor"): known(
        "a float32 sum's rounding depends on torch's thread count; a process worker is capped to cores / "
        "workers threads, the caller is not", ("process",)),
    ("torch_state", "default_dtype_set_by_the_script"): known(
        "torch.set_default_dtype(torch.float64) in the script is torch's process state: workers compute "
        "in float32"),
}
# Batched nodes whose outputs are rows (docs/batching.md), and SystemExit in a batch call, still
# raise out of the map in the calling process: no answer to compare yet.
ROWS = ("a batch's DataFrame or Arrow table is not split by rows: in the calling process the map raises "
        "ValueError (zip() argument 2 is shorter), in workers the items get column labels or 'worker "
        "exited with code 0'")
BATCH_EXIT = ("sys.exit in a batch call escapes map(on_error='continue') in the calling process (the process "
              "executor's workers fail an innocent item of the call with it, as 'worker exited with code 0')")
UNANSWERED = {("exits_and_batches", "batch_returns_a_dataframe_of_rows"): ROWS,
              ("exits_and_batches", "batch_returns_an_arrow_table"): ROWS,
              ("exits_and_batches", "sys_exit_in_a_batch_costs_its_item"): BATCH_EXIT}
KNOWN.update({key: known(why) for key, why in UNANSWERED.items()})

# Dask: a value over 64 KiB that the plan reads fails the map now and then ("the pipeline being
# loaded is no longer in use": a worker asks for it by a replica that was dropped meanwhile), in
# whichever of these patterns the race hits: not strict, since which one fails varies from run to run.
FLAKY = {("module_state", name) for name in ("big_array_rebound", "big_array_written_in_place",
                                              "big_array_changed_between_two_maps", "big_pandas_frame_rebound",
                                              "big_vocabulary_list_filled_at_run_time")}
FLAKY |= {("torch_state", name) for name in ("big_tensor_rebound", "big_tensor_changed_in_place",
                                             "float32_sum_over_a_big_tensor")}
FLAKY |= {("notebooks", "cell_rebinding_a_big_array")}


def cases() -> list[Any]:
    made = []
    for group in GROUPS:
        for name in patterns(group):
            for executor in EXECUTORS:
                marks = [pytest.mark.slow] if executor in ENGINES else []
                why = KNOWN.get((group, name), {}).get(executor)
                if why:
                    marks.append(pytest.mark.xfail(strict=True, reason=why))
                elif executor == "dask" and (group, name) in FLAKY:
                    marks.append(pytest.mark.xfail(strict=False, reason="Dask: a big value's replica dropped "
                                                   "while a worker asks for it ('no longer in use')"))
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
    """docs/same-answer.md's section on the corpus names every pattern that is not yet the same
    (so that a fix, or a new difference, changes the page too) and the number of patterns."""
    page = (ROOT / "docs" / "same-answer.md").read_text()
    section = page[page.index("## The differential corpus"):]
    listed = section[section.index("Not yet the same"):]
    named = set(re.findall(r"`(\w+)`", listed))
    assert named == {name for _, name in KNOWN}, "the page's list of differences is not KNOWN's"
    total = sum(len(patterns(group)) for group in GROUPS)
    assert f"The corpus holds {total} patterns." in section
    for group in GROUPS:
        assert f"`{group}.py`" in section, f"the table does not say where {group}.py's patterns stand"

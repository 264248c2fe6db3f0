"""The `hardy` command as a newcomer meets it: --version and the demo of the README's first command."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from hardy import __version__


def test_version():
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"hardy {__version__}"


def _not_a_terminal() -> dict[str, str]:
    """The environment of a command whose output goes to a file or a pipe, with no width asked for."""
    return {k: v for k, v in os.environ.items() if k != "COLUMNS"}


def test_demo_runs_and_one_segfault_costs_one_document():
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "demo", "--items", "400", "--no-progress"],
                         capture_output=True, text=True, timeout=120, env=_not_a_terminal())
    assert out.returncode == 0, out.stdout + out.stderr
    # not a terminal: no line is wrapped (at 80 columns, rich's default, a path broke mid-line)
    assert re.search(r"^node 'prep/tokenize' failed on item 200 \(inputs: doc='POISON .*\): worker died from SIGSEGV "
                     r"in \S+ \S+, called from node 'prep/tokenize' \(demo\.py:\d+\): .*$", out.stdout, re.M), out.stdout
    text = " ".join(out.stdout.split())
    assert "the crash was deliberate. Document 200" in text and "finished the other 399 documents" in text
    assert any(len(line) > 300 and line.startswith("What happened: ") for line in out.stdout.splitlines())


def test_demo_interrupted_says_how_many_documents_it_had_done():
    """Ctrl-C: exit code 130 and a line saying how far it got (it exited 130 without a word)."""
    proc = subprocess.Popen([sys.executable, "-m", "hardy.cli", "demo", "--items", "60000", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("hardy demo: 60000 documents")
    proc.send_signal(signal.SIGINT)  # as the map starts, or while it runs
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert re.search(r"^hardy demo: interrupted: [\d,]+ of 60,000 documents done, [01] failed$", err, re.M), err
    assert "Traceback" not in err and "results" not in out, err


def test_demo_with_threads_has_no_failure():
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "demo", "--items", "300", "--executor", "threaded",
                          "--no-progress"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"succeeded\W+300\W", out.stdout) and re.search(r"failed\W+0\W", out.stdout), out.stdout
    assert "What happened" not in out.stdout


FLOWS = """
import os, signal
from hardy import Pipeline, node

@node(output_name="y")
def scale(x: int, factor: int = 2) -> int:
    if x == 13:
        os.kill(os.getpid(), signal.SIGSEGV)
    return x * factor

pipeline = Pipeline([scale], name="flows")
"""


def _hardy_run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hardy.cli", "run", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_run_maps_a_pipeline_from_the_shell_and_exits_1_when_an_item_crashed(tmp_path):
    (tmp_path / "flows.py").write_text(FLOWS)
    (tmp_path / "items.jsonl").write_text("".join(json.dumps({"x": x}) + "\n" for x in (1, 13, 5)))
    out = _hardy_run(tmp_path, "flows:pipeline", "--set", "factor=3", "--inputs", "items.jsonl", "--map-over", "x",
                     "--executor", "process", "--workers", "2", "--report", "run.html")
    assert out.returncode == 1, out.stderr
    lines = sorted((json.loads(line) for line in out.stdout.splitlines()), key=lambda line: line["item"])  # as they finished
    assert lines[0] == {"item": 0, "ok": True, "outputs": {"y": 3}} and lines[2]["outputs"] == {"y": 15}
    assert lines[1]["ok"] is False and lines[1]["signal"] == "SIGSEGV" and lines[1]["node"] == "scale"
    assert "1 of 3 item(s) failed (item 1); each one's error and stack: its line on stdout, and the run report " \
           "run.html" in out.stderr, out.stderr
    assert "worker died from SIGSEGV" in (tmp_path / "run.html").read_text()


def test_every_key_of_an_inputs_line_is_that_items_input_and_no_line_runs_nothing(tmp_path):
    """A line's key left out of --map-over was dropped (the node took its default: wrong results,
    exit 0); an empty --inputs file ran the pipeline once."""
    (tmp_path / "flows.py").write_text(FLOWS)
    (tmp_path / "items.jsonl").write_text('{"x": 1, "factor": 10}\n{"x": 2, "factor": 100}\n')
    out = _hardy_run(tmp_path, "flows:pipeline", "--inputs", "items.jsonl", "--map-over", "x",
                     "--executor", "sequential")
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["outputs"]["y"] for line in out.stdout.splitlines()] == [10, 200]
    (tmp_path / "empty.jsonl").write_text("\n")
    for over in ([], ["--map-over", "x"]):
        out = _hardy_run(tmp_path, "flows:pipeline", "--inputs", "empty.jsonl", *over, "--output", "out.jsonl")
        assert out.returncode == 0 and out.stdout == "", out.stderr
        assert "--inputs empty.jsonl holds no item: nothing ran" in out.stderr
        assert (tmp_path / "out.jsonl").read_text() == ""


RAISES = """
from hardy import Pipeline, node

def helper(x):
    return 10 // (x - 2)

@node(output_name="y")
def divide(x):
    return helper(x)

pipeline = Pipeline([divide])
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_a_failed_items_line_says_where_it_failed(tmp_path, executor):
    """The line may be all a batch job keeps: a failure's carries the traceback of what the node
    raised, from the worker it ran in, as the run report does; a crash's, its stacks."""
    (tmp_path / "divide.py").write_text(RAISES)
    (tmp_path / "flows.py").write_text(FLOWS)
    out = _hardy_run(tmp_path, "divide:pipeline", "--set", "x=[1, 2]", "--map-over", "x", "--executor", executor)
    assert out.returncode == 1, out.stderr
    failed = next(line for line in map(json.loads, out.stdout.splitlines()) if not line["ok"])
    assert failed["item"] == 1 and failed["error"] == "ZeroDivisionError"
    stack = failed["stack"]
    assert stack.startswith("Traceback (most recent call last):") and stack.rstrip().endswith(
        "ZeroDivisionError: integer division or modulo by zero"), stack
    assert f'{tmp_path / "divide.py"}", line 9, in divide' in stack and "line 5, in helper" in stack, stack
    crashed = _hardy_run(tmp_path, "flows:pipeline", "--set", "factor=3", "--set", "x=[13]", "--map-over", "x",
                         "--executor", "process")
    line = json.loads(crashed.stdout)
    assert line["signal"] == "SIGSEGV" and "Python stack:" in line["stack"] and "scale" in line["stack"], line


def _run_reporting(tmp_path, executor: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`hardy run` of divide.py's items 1, 2, 3 (item 1 fails) under HARDY_REPORT_DIR: its run and its report."""
    env = {**os.environ, "HARDY_REPORT_DIR": str(tmp_path / "reports")}
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "run", "divide:pipeline", "--set", "x=[1, 2, 3]",
                          "--map-over", "x", "--executor", executor], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=env)
    [report] = (tmp_path / "reports").glob("*.json")
    return out, report


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_failed_items_written_elsewhere_are_named_with_where_they_are(tmp_path, executor):
    """Results in --output or a report directory: stderr named no item and no place ("4 of 9 item(s)
    failed"), where a failure's line is only found by reading every line."""
    (tmp_path / "divide.py").write_text(RAISES.replace("10 // (x - 2)", "10 // (x % 2)"))  # even items' x fail
    out = _hardy_run(tmp_path, "divide:pipeline", "--set", f"x={list(range(20))}", "--map-over", "x",
                     "--executor", executor, "--output", "out.jsonl")
    assert out.returncode == 1 and out.stdout == "", out.stderr
    assert "hardy: 10 of 20 item(s) failed (items 0, 2, 4, 6, 8 and 5 more); each one's error and stack: its line " \
           "in out.jsonl" in out.stderr, out.stderr
    (tmp_path / "divide.py").write_text(RAISES)
    out, report = _run_reporting(tmp_path, executor)
    assert out.returncode == 1 and f"(item 1); each one's error and stack: its line on stdout, and the run report " \
           f"{report} (hardy report {report} --item 1)" in out.stderr, out.stderr


def test_replay_of_a_hardy_run_report_says_that_hardy_run_keeps_no_inputs(tmp_path):
    """It said inputs are kept for maps run with Engine(report_dir=...), which HARDY_REPORT_DIR had
    set: `hardy run` (an imap) keeps none, and its items are the lines of --inputs."""
    (tmp_path / "divide.py").write_text(RAISES)
    _, report = _run_reporting(tmp_path, "sequential")
    replay = subprocess.run([sys.executable, "-m", "hardy.cli", "replay", str(report), "--item", "1"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    said = " ".join(replay.stderr.split())
    assert replay.returncode == 2 and "(as `hardy run` makes), and those keep no inputs" in said, said
    assert "Item 1 of a `hardy run` is line 2 of its --inputs file" in said and "--set NAME=VALUE" in said, said


INTERRUPTS = """
from hardy import Pipeline, node

@node(output_name="v")
def stop_at_3(n):
    if n == 3:
        raise KeyboardInterrupt("stop here")
    return n

pipeline = Pipeline([stop_at_3])
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_a_nodes_keyboard_interrupt_ends_hardy_run_as_an_interruption(tmp_path, executor):
    """Exit 130 and a line saying so, as Ctrl-C's: it exited 0, silently, with items missing."""
    (tmp_path / "interrupts.py").write_text(INTERRUPTS)
    out = _hardy_run(tmp_path, "interrupts:pipeline", "--set", "n=[0, 1, 2, 3, 4, 5]", "--map-over", "n",
                     "--executor", executor)
    assert out.returncode == 130, out.stdout + out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert all(line["ok"] and line["outputs"] == {"v": line["item"]} for line in lines) and 3 not in {
        line["item"] for line in lines}
    assert "interrupted by a node's KeyboardInterrupt('stop here')" in out.stderr, out.stderr
    once = _hardy_run(tmp_path, "interrupts:pipeline", "--set", "n=3", "--executor", executor)
    assert once.returncode == 130 and once.stdout == "" and "after 0 item(s)" in once.stderr, once.stderr


CHATTY = """
import os
print("importing chatty")
from hardy import Pipeline, node

@node(output_name="y")
def twice(x: int) -> int:
    print(f"processing {x}")  # one write: two workers' unbuffered prints (PYTHONUNBUFFERED) interleave by write
    os.write(1, b"written to descriptor 1\\n")  # as C code prints
    return 2 * x

pipeline = Pipeline([twice])
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_run_keeps_standard_output_for_the_result_lines(tmp_path, executor):
    """What the pipeline's code prints, at its import or in a node, in this process or a worker,
    goes to standard error: every line of standard output is an item's JSON."""
    (tmp_path / "chatty.py").write_text(CHATTY)
    out = _hardy_run(tmp_path, "chatty:pipeline", "--set", "x=[1,2]", "--map-over", "x", "--executor", executor)
    assert out.returncode == 0, out.stderr
    assert sorted(json.loads(line)["outputs"]["y"] for line in out.stdout.splitlines()) == [2, 4], out.stdout
    assert "importing chatty" in out.stderr and "processing 2" in out.stderr, out.stderr
    assert out.stderr.count("written to descriptor 1") == 2, out.stderr


def test_run_writes_its_lines_with_standard_error_closed(tmp_path):
    (tmp_path / "chatty.py").write_text(CHATTY)
    out = subprocess.run(["bash", "-c", f"{sys.executable} -m hardy.cli run chatty:pipeline --set 'x=[1,2]' "
                                        "--map-over x 2>&-"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and sorted(json.loads(line)["outputs"]["y"] for line in out.stdout.splitlines()) == [2, 4]


def test_run_once_with_a_cache_and_an_output_file_exits_0(tmp_path):
    (tmp_path / "flows.py").write_text(FLOWS)
    for _ in range(2):
        out = _hardy_run(tmp_path, "flows:pipeline", "--set", "x=[4, 5]", "--map-over", "x", "--cache", "c",
                         "--output", "out.jsonl", "--report", "run.json")
        assert out.returncode == 0 and out.stdout == "", out.stderr
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["outputs"]["y"] for line in lines) == [8, 10]
    assert json.loads((tmp_path / "run.json").read_text())["nodes"][0]["cached"] == 2  # the second run: hits
    single = _hardy_run(tmp_path, "flows:pipeline", "--set", "x=7")
    assert single.returncode == 0 and json.loads(single.stdout) == {"item": 0, "ok": True, "outputs": {"y": 14}}


@pytest.mark.parametrize("args, message", [
    (["flows:nothing"], "has no attribute 'nothing'; pipelines there: ['pipeline']"),
    (["nomodule:pipeline"], "cannot import 'nomodule'"),
    (["./flows.py:pipeline"], "'./flows.py' is a file path or a relative module; name the module as Python imports "
                              "it: flows:pipeline"),
    (["sub/flows:pipeline"], "name the module as Python imports it: sub.flows:pipeline"),
    (["raises:pipeline"], "importing 'raises' raised RuntimeError: no HARDY_CONFIG set (at"),
    (["deep:pipeline"], "importing 'deep' raised JSONDecodeError: Expecting property name enclosed in double quotes: "
                        "line 1 column 2 (char 1) (at deep.py, line 3, in helper)"),  # not json/decoder.py's line
    (["broken:pipeline"], "cannot import 'broken': SyntaxError in"),
    (["exits:pipeline"], "importing 'exits' called sys.exit(0), so nothing ran"),
    (["needs:pipeline"], "cannot import 'needs': ModuleNotFoundError: No module named 'hardy_no_such_dependency' (at"),
    (["flows:pipeline", "--set", "x"], "--set 'x' is not NAME=VALUE"),
    (["flows:pipeline", "--set", "factor=1"], "Missing required input(s): ['x']"),
    (["flows:pipeline", "--set", "factor=1"], "Give them with --set NAME=VALUE, or in each line of --inputs FILE"),
    (["consts:LIMIT"], "consts:LIMIT is an int, not a hardy Pipeline"),
    (["flows:pipeline", "--inputs", "bad.jsonl"], "bad.jsonl line 2 is not JSON"),
    (["flows:pipeline", "--inputs", "uneven.jsonl"], "uneven.jsonl line 2 holds ['factor', 'x'], line 1 ['x']: each "
                                                     "line holds the same inputs"),
    (["flows:pipeline", "--inputs", "braces.jsonl"], "braces.jsonl line 1 is not a JSON object of input values"),
    (["flows:pipeline", "--executor", "gpu"], "--executor 'gpu' is not one of sequential, threaded, async, process"),
    (["flows:pipeline", "--executor", "proces"], "--executor 'proces' is not one of sequential, threaded, async, "
                                                 "process (did you mean 'process'?)"),
    (["flows:pipeline", "--set", "x=1", "--set", "fctor=3"], "'fctor'"),
    (["flows:pipeline", "--set", "x=1", "--workers", "0"], "Invalid value for '--workers': must be 1 or more, not 0"),
    (["flows:pipeline", "--set", "x=1", "--report", "run.txt"], "use a .html or .json file name"),
    (["flows:pipeline", "--set", "x=1", "--output", "no/such/dir/out.jsonl"], "--output no/such/dir/out.jsonl: no directory"),
])
def test_usage_errors_exit_2_with_the_fix(tmp_path, args, message):
    (tmp_path / "flows.py").write_text(FLOWS.replace("return x * factor", "open('ran', 'w').close()\n    return x * factor"))
    (tmp_path / "raises.py").write_text(FLOWS + "raise RuntimeError('no HARDY_CONFIG set')\n")
    (tmp_path / "deep.py").write_text("import json\ndef helper():\n    return json.loads('{bad')\nCFG = helper()\n" + FLOWS)
    (tmp_path / "broken.py").write_text(FLOWS + "def oops(:\n")
    (tmp_path / "consts.py").write_text("LIMIT = 42\n")
    (tmp_path / "exits.py").write_text(FLOWS + "import sys\nsys.exit(0)\n")  # a script without a __main__ guard
    (tmp_path / "needs.py").write_text("import hardy_no_such_dependency\n" + FLOWS)
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n{x: 2}\n')
    (tmp_path / "uneven.jsonl").write_text('{"x": 1}\n{"x": 2, "factor": 5}\n')  # a key line 1 lacks
    (tmp_path / "braces.jsonl").write_text('{}\n{}\n')  # no input: two lines made one item
    out = _hardy_run(tmp_path, *args)
    assert out.returncode == 2 and message in " ".join(out.stderr.split()), out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "ran").exists()  # told before any work


@pytest.mark.parametrize("args, message", [
    (["demo", "--workers", "0"], "Invalid value for '--workers': must be 1 or more, not 0"),
    (["demo", "--items", "-5"], "Invalid value for '--items': must be 2 or more, not -5"),
    (["demo", "--executor", "bogus"], "one of sequential, threaded, async, process"),
    (["repeat", "-n", "0", "--", "true"], "must be 1 or more, not 0"),
    (["repeat", "-n", "2", "--", "/no/such/command"], "'/no/such/command': no such command"),
    (["libs", "/no/such/folder"], "not a folder: /no/such/folder"),
    (["doctor", "--then", "pass"], "give --matrix MODULES --repeat N too"),
    (["wheel", "verify", "no-such.whl"], "no-such.whl: no such file"),
    (["replay", "no-such.json", "--item", "1"], "no-such.json: no such report"),
    (["replay", "no-such.json", "--item", "-1"], "Invalid value for '--item': must be 0 or more, not -1"),
    (["replay", "not-json.json", "--item", "1"], "not-json.json is not a hardy run report"),
    (["replay", "other.json", "--item", "1"], "other.json is not a hardy run report"),
    (["report", "no-such.json", "--item", "-1"], "must be 0 or more, not -1"),
    (["doctor", "--matrix", "json", "--repeat", "1", "--jobs", "0"], "must be 1 or more, not 0"),
    (["report", "no-such.json"], "no-such.json: no such report"),
    (["report", "."], ". is a folder: give one of the run reports' JSON files in it"),
    (["replay", ".", "--item", "0"], ". is a folder: give one of the run reports' JSON files in it"),
    (["doctor", "--matrix", ",", "--repeat", "1"], "name the modules, comma-separated"),
])
def test_other_commands_refuse_what_they_cannot_do_with_a_usage_error(tmp_path, args, message):
    """Exit code 2 and one line saying what to give (a traceback before, or a silent success), in
    the words of the help ("1 or more", not pydantic's "Input should be greater than or equal to 1")."""
    (tmp_path / "not-json.json").write_text("{broken\n")
    (tmp_path / "other.json").write_text('{"a": 1}\n')
    out = subprocess.run([sys.executable, "-m", "hardy.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert message in " ".join(out.stderr.split()) and "Traceback" not in out.stderr, out.stderr
    assert "Input should be" not in out.stderr and "no kept inputs" not in out.stderr, out.stderr


@pytest.mark.parametrize("command", ["doctor", "demo --items 200 --no-progress"])
def test_a_reader_that_goes_away_ends_a_printing_command_as_sigpipe_does(tmp_path, command):
    """`hardy doctor | head -2`: exit status 141, as a Unix tool's, not click's silent 1 (a failure)."""
    out = subprocess.run(["bash", "-c", f"{sys.executable} -m hardy.cli {command} | head -1 >/dev/null; "
                                        "echo ${PIPESTATUS[0]}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "141", (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr


def test_a_usage_error_leaves_an_earlier_results_file_as_it_was(tmp_path):
    (tmp_path / "flows.py").write_text(FLOWS)
    (tmp_path / "out.jsonl").write_text("yesterday's results\n")
    out = _hardy_run(tmp_path, "flows:pipeline", "--set", "x=1", "--set", "fctor=3", "--output", "out.jsonl")
    assert out.returncode == 2 and (tmp_path / "out.jsonl").read_text() == "yesterday's results\n"


def test_report_refuses_a_page_name_that_is_not_html(tmp_path):
    (tmp_path / "r.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "report", "r.json", "--html", "r.txt"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "use a .html file name" in out.stderr and "Traceback" not in out.stderr


def test_run_keeps_the_pipelines_own_engine(tmp_path):
    own = 'engine=Engine(map_executor="process", report_dir="reports")'
    (tmp_path / "own.py").write_text(FLOWS.replace('name="flows")', f'name="flows", {own})')
                                     .replace("from hardy import Pipeline, node", "from hardy import Engine, Pipeline, node"))
    out = _hardy_run(tmp_path, "own:pipeline", "--set", "x=[12, 13]", "--map-over", "x", "--report", "r.json")
    assert out.returncode == 1, out.stderr  # item 1 segfaulted a worker process, not this command
    assert json.loads((tmp_path / "r.json").read_text())["failures"][0]["signal"] == "SIGSEGV"
    kept = list((tmp_path / "reports").glob("flows-*.json"))  # its engine's report_dir: every run's JSON
    assert len(kept) == 1 and json.loads(kept[0].read_text())["failures"][0]["item"] == 1


SLOW = """
import time
from hardy import Pipeline, node

@node(output_name="y")
def slow(x: int) -> int:
    time.sleep(0.2)
    return 2 * x

pipeline = Pipeline([slow], name="slow")
"""


def _lines(path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def _marked(mark: str) -> list[int]:
    """Processes whose environment carries `mark`: the command's, its fork servers and workers."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_half_way_keeps_every_finished_line_and_stops_the_workers(tmp_path, sig):
    (tmp_path / "slow.py").write_text(SLOW)
    (tmp_path / "items.jsonl").write_text("".join(json.dumps({"x": x}) + "\n" for x in range(200)))
    mark = f"hardy-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-m", "hardy.cli", "run", "slow:pipeline", "--inputs", "items.jsonl",
                             "--executor", "process", "--workers", "2", "--output", "out.jsonl"], cwd=tmp_path,
                            env={**os.environ, "HARDY_TEST_MARK": mark}, stderr=subprocess.PIPE, text=True)
    out = tmp_path / "out.jsonl"
    while len(_lines(out)) < 6:  # half-way enough: some items written, most not run yet
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    lines = [json.loads(line) for line in _lines(out)]  # every line whole
    assert 6 <= len(lines) < 200 and all(line["ok"] and line["outputs"] == {"y": 2 * line["item"]} for line in lines)
    assert len({line["item"] for line in lines}) == len(lines)
    assert f"interrupted by {sig.name} after {len(lines)} item(s) (0 failed), each written to out.jsonl" in err
    assert "Traceback" not in err
    for _ in range(600):  # the workers are stopped (a loaded machine may take a moment to reap them)
        if not _marked(mark):
            break
        time.sleep(0.05)
    assert _marked(mark) == []


def test_a_crash_of_the_process_running_the_nodes_keeps_every_finished_line(tmp_path):
    """--executor sequential runs nodes in the command's own process: item 13's segfault ends it,
    and the 13 items before it are in the output."""
    (tmp_path / "flows.py").write_text(FLOWS)
    (tmp_path / "items.jsonl").write_text("".join(json.dumps({"x": x}) + "\n" for x in range(20)))
    out = _hardy_run(tmp_path, "flows:pipeline", "--inputs", "items.jsonl", "--executor", "sequential",
                     "--output", "out.jsonl")
    assert out.returncode == -signal.SIGSEGV, out.stderr
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["item"] for line in lines] == list(range(13)) and lines[12]["outputs"] == {"y": 24}


def _commands(group, path=()):
    for name, cmd in group.commands.items():
        yield (*path, name), cmd
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*path, name))


def test_every_commands_help_reads_naturally():
    """Arguments and options are shown by what they hold (`FOLDER`, `--matrix MODULES`), never as
    a parameter's Python name and type (`{folder}`, `folder <str>`, `FOLDER <list[str]>`)."""
    import typer
    from typer.testing import CliRunner

    from hardy.cli import app
    root = typer.main.get_command(app)
    checked = []
    for path, _ in _commands(root):
        out = CliRunner().invoke(app, [*path, "--help"], terminal_width=200)
        assert out.exit_code == 0, (path, out.output)
        bad = re.findall(r"\{[a-z_]+\}|^\s+[a-z_]+(?:\.\.\.)? <|<(?:str|int|float|bool|list\[\w+\])>", out.output, re.M)
        assert not bad, f"hardy {' '.join(path)} --help shows {bad}:\n{out.output}"
        usage = out.output.strip().splitlines()[0]
        assert usage.startswith("Usage:") and not re.search(r"[{}]", usage), f"usage line in braces: {usage}"
        checked.append(path)
    assert ("wheel", "index") in checked and ("doctor",) in checked


def test_the_usage_line_names_an_argument_plainly():
    """The real command, as a user runs it: `FOLDER` in the usage line (Typer alone writes
    `{FOLDER}`), in its help and in the error for a missing argument; an optional argument that
    takes several is `[FOLDER]...`."""
    def usage(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hardy.cli", *args], capture_output=True, text=True,
                              env={**os.environ, "COLUMNS": "200"})

    helped = usage("wheel", "index", "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.splitlines()[0] == "Usage: python -m hardy.cli wheel index [OPTIONS] FOLDER"
    missing = usage("wheel", "index")
    assert missing.returncode == 2
    assert "Usage: python -m hardy.cli wheel index [OPTIONS] FOLDER\n" in missing.stderr
    assert "Missing argument 'FOLDER'" in missing.stderr
    assert usage("libs", "--help").stdout.splitlines()[0] == "Usage: python -m hardy.cli libs [OPTIONS] [FOLDER]..."



def test_cache_commands_take_the_folder_as_an_argument(tmp_path):
    """`hardy cache stats FOLDER`, as users type it; `-d FOLDER` still works."""
    from hardy import DiskCache, Engine, Pipeline, node

    @node(output_name="y")
    def twice(x: int) -> int:
        return 2 * x

    folder = str(tmp_path / "c")
    Pipeline([twice], engine=Engine(map_executor="sequential", cache=DiskCache(folder))).map(
        inputs={"x": [1, 2]}, map_over="x")

    def cache(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hardy.cli", "cache", *args], capture_output=True, text=True,
                              timeout=60)

    assert json.loads(cache("stats", folder, "--json").stdout)["entries"] == 2
    assert json.loads(cache("stats", "-d", folder, "--json").stdout)["entries"] == 2
    assert cache("stats", "--help").stdout.splitlines()[0] == "Usage: python -m hardy.cli cache stats [OPTIONS] [FOLDER]"
    assert cache("verify", folder).returncode == 0 and cache("ls", folder).stdout.count("index") == 2
    bogus = cache("prune", folder, "--max-size", "10XB")  # (a traceback and exit code 1 before)
    assert bogus.returncode == 2 and "Traceback" not in bogus.stderr, bogus.stderr
    assert "max_size='10XB' is not valid; max_size must be a number of bytes, or a size such as '10GB'" in " ".join(
        bogus.stderr.split())
    assert "deleted 2 entries" in cache("prune", folder, "--max-size", "0").stdout
    assert cache("clear", folder, "--yes").returncode == 0


def test_cache_clear_of_a_folder_without_a_cache_says_so_before_asking(tmp_path):
    """It asked "delete every entry in ...?" first, and only once answered said there was no cache."""
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "cache", "clear", str(tmp_path / "none")], input="y\n",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"no hardy cache in {tmp_path / 'none'}" in out.stderr, out.stderr
    assert "delete every entry" not in out.stdout + out.stderr and not (tmp_path / "none").exists()


LONG_FAILURE = """
from hardy import Engine, Pipeline, node

@node(output_name="y")
def check(x: int) -> int:
    raise ValueError("[bold]x[/bold] " + " ".join(f"/data/shard-{i}/part.parquet" for i in range(12)))

Pipeline([check], engine=Engine(map_executor="sequential")).map(inputs={"x": [1]}, map_over="x",
                                                                 on_error="continue")
"""


def test_report_printed_to_a_file_keeps_each_line_whole(tmp_path):
    """`hardy report` wrapped at 120 columns wherever it printed, a file or CI's log too: a path
    broken over two lines is one grep does not find. Off a terminal no line is wrapped, and rich
    markup in a message is shown as written."""
    (tmp_path / "fails.py").write_text(LONG_FAILURE)
    env = {**_not_a_terminal(), "HARDY_REPORT_DIR": str(tmp_path / "reports")}
    subprocess.run([sys.executable, "fails.py"], cwd=tmp_path, env=env, check=True, timeout=120, capture_output=True)
    [report] = (tmp_path / "reports").glob("*.json")
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "report", str(report)], capture_output=True, text=True,
                         timeout=60, env=_not_a_terminal())
    assert out.returncode == 0, out.stderr
    message = "[bold]x[/bold] " + " ".join(f"/data/shard-{i}/part.parquet" for i in range(12))
    assert any(message in line for line in out.stdout.splitlines()), out.stdout


OUTPUTS = """
import math, os, time
import numpy as np
from hardy import Pipeline, node

@node(output_name=("arr", "big", "stats"))
def make(x: int):
    with open("calls.log", "a") as log:
        log.write(f"{x}\\n")
    return np.arange(2000) * x, np.full((200, 60), 0.5, dtype=np.float32), {
        "nan": math.nan, "inf": -math.inf, "f32": np.float32(1.5), "pair": (1, "a")}

@node(output_name="blob")
def blob(x: int):
    return {1, 2} if x == 3 else "plain"

@node(output_name="y")
def slow(x: int) -> int:
    if x > 0:
        time.sleep(600)
    return x

pipeline = Pipeline([make, blob], name="outputs")
slowly = Pipeline([slow], name="slowly")
"""


def _strict(line: str) -> dict:
    """A JSON line as a strict parser (jq) reads it: no NaN or Infinity token."""
    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_run_writes_outputs_as_faithful_json_and_fails_an_item_whose_output_has_none(tmp_path):
    import base64

    import numpy as np
    (tmp_path / "outputs.py").write_text(OUTPUTS)
    out = _hardy_run(tmp_path, "outputs:pipeline", "--set", "x=[2, 3]", "--map-over", "x", "--executor", "process")
    assert out.returncode == 1, out.stderr
    lines = {line["item"]: line for line in map(_strict, out.stdout.splitlines())}
    arr, big, stats = (lines[0]["outputs"][k] for k in ("arr", "big", "stats"))
    assert arr == list(range(0, 4000, 2))  # every element, not numpy's abbreviated repr
    assert stats == {"nan": "NaN", "inf": "-Infinity", "f32": 1.5, "pair": [1, "a"]}
    assert big["$array"]["dtype"] == "<f4" and big["$array"]["shape"] == [200, 60]  # past LIST_LIMIT: bytes
    decoded = np.frombuffer(base64.b64decode(big["$array"]["base64"]), big["$array"]["dtype"]).reshape(200, 60)
    assert (decoded == 0.5).all()
    assert lines[1] == {"item": 1, "ok": False, "node": "blob", "error": "UnencodableOutput", "signal": None,
                        "message": "output 'blob' is a set, which has no JSON form for `hardy run`'s lines; return "
                                   "plain data (numbers, text, lists, dicts, arrays), leave it out with --outputs, "
                                   "or call the pipeline from Python"}
    chosen = _hardy_run(tmp_path, "outputs:pipeline", "--set", "x=[3]", "--map-over", "x", "--outputs", "stats")
    assert chosen.returncode == 0, chosen.stderr
    assert list(_strict(chosen.stdout)["outputs"]) == ["stats"]  # only what was asked for is computed and written
    unknown = _hardy_run(tmp_path, "outputs:pipeline", "--set", "x=[3]", "--map-over", "x", "--outputs", "stat")
    assert unknown.returncode == 2 and "has no output 'stat'" in unknown.stderr


def test_run_resumes_from_the_lines_an_earlier_run_wrote(tmp_path):
    (tmp_path / "outputs.py").write_text(OUTPUTS)
    args = ("outputs:pipeline", "--set", "x=[1, 2, 4, 5]", "--map-over", "x", "--outputs", "stats",
            "--executor", "sequential")
    first = _hardy_run(tmp_path, *args, "--output", "out.jsonl")
    assert first.returncode == 0, first.stderr
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    (tmp_path / "out.jsonl").write_text(lines[0] + "\n" + lines[2] + "\n" + lines[1][:25])  # killed mid-line
    (tmp_path / "calls.log").unlink()
    again = _hardy_run(tmp_path, *args, "--resume", "out.jsonl")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "calls.log").read_text().split() == ["2", "5"]  # only the items without a whole line ran
    resumed = [_strict(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(line["item"] for line in resumed) == [0, 1, 2, 3]
    done = _hardy_run(tmp_path, *args, "--resume", "out.jsonl", "--report", "run.json")
    assert done.returncode == 0 and "nothing ran, no report written" in done.stderr, done.stderr
    other = _hardy_run(tmp_path, *args, "--resume", "out.jsonl", "--output", "elsewhere.jsonl")
    assert other.returncode == 2 and "names another file" in other.stderr


def _processes_with(mark: str) -> list:
    import psutil
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("HARDY_TEST_MARK") == mark:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


@pytest.mark.parametrize("shell", ["| head -c 40", "> /dev/full"])
def test_a_closed_pipe_or_a_full_disk_ends_the_run_and_its_workers(tmp_path, shell):
    """Items 1 to 3 sleep for ten minutes: the command ends at once anyway, its workers with it."""
    (tmp_path / "outputs.py").write_text(OUTPUTS)
    mark = uuid.uuid4().hex
    command = (f"{sys.executable} -m hardy.cli run outputs:slowly --set 'x=[0, 1, 2, 3]' --map-over x --workers 2 "
               f"{shell}")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HARDY_TEST_MARK": mark})
    if shell.startswith("|"):
        assert done.returncode == 141, done.stderr
        assert done.stdout == '{"item": 0, "ok": true, "outputs": {"y":'
        assert re.search(r"hardy: the output was closed \(a closed pipe\) after [01] item\(s\); the map was stopped",
                         done.stderr), done.stderr  # (1 unless the reader left as the line's write returned)
    else:
        assert done.returncode == 74, done.stderr
        assert "hardy: cannot write stdout: No space left on device after 0 item(s)" in done.stderr
    assert "Traceback" not in done.stderr
    assert _processes_with(mark) == []  # no worker, no fork server left


def test_a_reader_that_goes_away_ends_a_run_still_waiting_for_its_items(tmp_path):
    (tmp_path / "outputs.py").write_text(OUTPUTS)
    mark = uuid.uuid4().hex
    run = subprocess.Popen([sys.executable, "-m", "hardy.cli", "run", "outputs:slowly", "--set", "x=[0, 1, 2]",
                            "--map-over", "x", "--workers", "3"], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "HARDY_TEST_MARK": mark})
    assert json.loads(run.stdout.readline())["item"] == 0
    run.stdout.close()  # no line will come for ten minutes: the run must notice the reader went anyway
    assert run.wait(timeout=120) == 141
    assert "the output was closed" in run.stderr.read()
    assert _processes_with(mark) == []


DEEP = """
from hardy import Pipeline, node

def down(n):
    if n == 0:
        raise ValueError("the bottom")
    return across(n - 1)

def across(n):  # (two functions in turn: Python's traceback folds a frame repeated)
    return down(n)

@node(output_name="v")
def deep(x):
    return down(200)

pipeline = Pipeline([deep])
"""


def test_a_failed_lines_stack_keeps_its_innermost_8000_characters_and_resume_reads_lines(tmp_path):
    """A stack of 400 frames: its line keeps the innermost part, saying how much it left out; and
    --resume reads such a file a line at a time (it read the whole file into memory)."""
    (tmp_path / "deep.py").write_text(DEEP)
    out = _hardy_run(tmp_path, "deep:pipeline", "--set", "x=[1, 2]", "--map-over", "x", "--executor", "sequential",
                     "--output", "out.jsonl")
    assert out.returncode == 1, out.stderr
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    stack = lines[0]["stack"]
    assert stack.startswith("[") and "characters left out]\n" in stack and stack.endswith("ValueError: the bottom\n")
    assert len(stack) < 8100 and int(stack[1:stack.index(" ")].replace(",", "")) > 1000
    with open(tmp_path / "out.jsonl", "a") as f:
        f.write('{"item": 7, "ok": tr')  # a line cut short by whatever ended the run
    again = _hardy_run(tmp_path, "deep:pipeline", "--set", "x=[1, 2]", "--map-over", "x", "--executor", "sequential",
                       "--resume", "out.jsonl")
    assert again.returncode == 1, again.stderr  # (the failed items' lines are there: nothing runs again)
    assert (tmp_path / "out.jsonl").read_text().count("\n") == 2  # the cut line dropped, nothing run again


def test_resume_refuses_a_sparse_file_before_reading_it(tmp_path):
    """A 3 GB sparse file (no newline) at --resume's name: its one "line" was read whole, ending in
    a MemoryError's traceback under a batch job's memory cap. Refused as `hardy report` refuses one."""
    (tmp_path / "deep.py").write_text(DEEP)
    with open(tmp_path / "out.jsonl", "wb") as f:
        f.truncate(3 << 30)
    out = _hardy_run(tmp_path, "deep:pipeline", "--set", "x=[1, 2]", "--map-over", "x", "--resume", "out.jsonl")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert "--resume out.jsonl is no results file hardy wrote, not read: a sparse file (3,221,225,472 bytes long" in out.stderr
    assert (tmp_path / "out.jsonl").stat().st_size == 3 << 30


FILE_NAMES = """
import os
from hardy import Pipeline, node

@node(output_name="name")
def file_name(i: int, suffix: str = ".txt") -> str:
    # os.listdir's name for a file whose name is not UTF-8 (a Latin-1 "café" from an old archive)
    return (os.fsdecode(b"caf\\xe9") if i == 1 else f"file{i}") + suffix

pipeline = Pipeline([file_name], name="names")
"""


@pytest.mark.parametrize("output", [None, "out.jsonl"])
def test_a_str_that_is_not_utf8_is_written_as_a_json_escape_that_reads_back_the_same(tmp_path, output):
    """A file name from os.listdir holds a surrogate escape: stdout got the raw byte (no JSON parser
    reads the line), --output died with hardy's traceback, losing the lines after it, and the
    stream's clean-up started a fork server as the interpreter ended. A --set value that is not
    UTF-8 (argv) is the same case."""
    (tmp_path / "names.py").write_text(FILE_NAMES)
    args = ["names:pipeline", "--set", "i=[0, 1, 2]", "--map-over", "i", *(["--output", output] if output else [])]
    command = [sys.executable, "-m", "hardy.cli", "run", *args, "--set", os.fsdecode(b"suffix=.t\xe9t")]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, timeout=120)
    assert out.returncode == 0 and out.stderr == b"", out.stderr.decode(errors="replace")
    raw = (tmp_path / output).read_bytes() if output else out.stdout
    lines = {line["item"]: line["outputs"]["name"] for line in map(_strict, raw.decode("utf-8").splitlines())}
    assert lines == {0: "file0.t\udce9t", 1: "caf\udce9.t\udce9t", 2: "file2.t\udce9t"}, raw
    assert os.fsencode(lines[1]) == b"caf\xe9.t\xe9t" and b"\\udce9" in raw


def test_a_streamed_map_ended_after_its_engine_closed_starts_nothing(tmp_path):
    """The stream's clean-up asked whether its plan ran in workers by making the engine's
    executor: after `close()` that started a new fork server and pool (at interpreter exit, a
    second traceback of hardy's internals)."""
    script = textwrap.dedent("""
        import os
        from pathlib import Path
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def twice(x: int) -> int:
            return 2 * x

        with Engine(workers=1) as engine:
            rows = Pipeline([twice]).imap(inputs={"x": list(range(20))}, map_over="x", engine=engine)
            print(next(rows))
        rows.close()
        me = Path(f"/proc/{os.getpid()}/task")
        print("children", [c for t in me.iterdir() for c in (t / "children").read_text().split()])
        left = Pipeline([twice]).imap(inputs={"x": list(range(20))}, map_over="x", engine=engine)
        print(next(left))
        engine.close()  # and this one is left to the interpreter's exit
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines() == ["{'y': 0}", "children []", "{'y': 0}"], out
    assert out.stderr == "", out.stderr


@pytest.mark.parametrize("encoding, said", [
    ("utf-16", "is UTF-16 text (as PowerShell's > writes it): JSON lines are read as UTF-8; save it as UTF-8 "
               "(PowerShell: Out-File -Encoding utf8; elsewhere: iconv -f UTF-16 -t UTF-8)"),
    ("latin-1", "is not UTF-8 text (byte 0xe9 on line 2): JSON lines are read as UTF-8; save it as UTF-8"),
])
def test_inputs_that_are_not_utf8_are_a_usage_error_naming_the_file_and_the_fix(tmp_path, encoding, said):
    (tmp_path / "flows.py").write_text(FLOWS)
    (tmp_path / "items.jsonl").write_text('{"x": 1}\n{"x": 2, "note": "café"}\n', encoding=encoding)
    out = _hardy_run(tmp_path, "flows:pipeline", "--inputs", "items.jsonl", "--map-over", "x")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert f"hardy: --inputs items.jsonl {said}" in out.stderr and out.stderr.count("\n") == 1, out.stderr
    (tmp_path / "items.jsonl").write_bytes(b'\xef\xbb\xbf{"x": 1}\n')  # a byte order mark (PowerShell's utf8)
    out = _hardy_run(tmp_path, "flows:pipeline", "--inputs", "items.jsonl", "--map-over", "x", "--executor",
                     "sequential")
    assert out.returncode == 0 and json.loads(out.stdout)["outputs"] == {"y": 2}, out.stderr


def _with_no_reader(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """`hardy ARGS | head` where head has already gone: a pipe whose reader is closed."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run([sys.executable, "-m", "hardy.cli", *args], cwd=tmp_path, stdout=writer,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(writer)


def test_repeat_report_and_replay_end_as_sigpipe_does_when_the_reader_goes(tmp_path):
    """They exited 1 in silence, which is repeat's and replay's "a run failed": every run here
    succeeded. A repeat with runs still going stops them first (in sessions of their own, they
    outlive a process that SIGPIPE ends)."""
    (tmp_path / "divide.py").write_text(RAISES)
    script = "from divide import pipeline\npipeline.map(inputs={'x': [1, 2]}, map_over='x', on_error='continue')\n"
    made = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HARDY_REPORT_DIR": str(tmp_path / "reports")})
    assert made.returncode == 0, made.stderr
    [report] = (tmp_path / "reports").glob("*.json")
    for args in (["report", str(report)], ["replay", str(report), "--item", "1"], ["repeat", "-n", "2", "--", "true"]):
        out = _with_no_reader(tmp_path, *args)
        assert out.returncode in (141, -signal.SIGPIPE) and "Traceback" not in out.stderr, (args, out)
    slow = "if [ $HARDY_RUN_INDEX = 2 ]; then echo $$ > slow.pid; exec sleep 300; fi"
    out = _with_no_reader(tmp_path, "repeat", "-n", "2", "-j", "2", "--", "sh", "-c", slow)
    assert out.returncode == 141 and out.stderr == "", out
    if (tmp_path / "slow.pid").exists():  # (it may not have started by the time the first run's line failed)
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / "slow.pid").read_text()), 0)


LONG = """
from hardy import Pipeline, node

def call_api(item_id, size):
    page = "<html><body>" + "<div>upstream error page</div>\\n" * (size // 31) + "</body></html>"
    raise RuntimeError(f"GET /items/{item_id} returned 502: {page}")

@node(output_name="item")
def fetch(item_id: int, size: int) -> dict:
    return call_api(item_id, size)

pipeline = Pipeline([fetch])
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_a_long_message_leaves_the_frames_in_a_failed_lines_stack_and_the_line_small(tmp_path, executor):
    """An error quoting a 12 KB error page: the stack, cut to its last 8,000 characters, held only
    message and no frame; a 1 MB message made a 1 MB line. Every frame stays, both fields are cut."""
    (tmp_path / "longmsg.py").write_text(LONG)
    out = _hardy_run(tmp_path, "longmsg:pipeline", "--set", "item_id=[7, 8]", "--set", "size=[12000, 1000000]",
                     "--map-over", "item_id,size", "--executor", executor)
    assert out.returncode == 1, out.stderr
    lines = sorted(map(json.loads, out.stdout.splitlines()), key=lambda line: line["item"])
    for line, raw in zip(lines, out.stdout.splitlines()):
        stack = line["stack"]
        assert f'{tmp_path / "longmsg.py"}", line 10, in fetch' in stack, stack
        assert f'{tmp_path / "longmsg.py"}", line 6, in call_api' in stack, stack
        assert "RuntimeError: GET /items/" in stack and stack.rstrip().endswith("</body></html>"), stack[-300:]
        assert len(line["message"]) < 2100 and line["message"].startswith("GET /items/")
        assert line["message"].endswith(" characters left out]") and len(raw) < 12_000, len(raw)


@pytest.fixture
def read_only_folder(tmp_path):
    """(a folder this process cannot write although it is root: a read-only bind mount, as a shared
    report folder mounted read-only is; the writable folder under it). Unmounted after."""
    source, view = tmp_path / "rw", tmp_path / "ro"
    source.mkdir()
    view.mkdir()
    for args in (["--bind", str(source), str(view)], ["-o", "remount,bind,ro", str(view)]):
        done = subprocess.run(["mount", *args], capture_output=True, text=True)
        if done.returncode:
            subprocess.run(["umount", str(view)], capture_output=True)
            pytest.skip(f"mount {' '.join(args)} failed ({done.stderr.strip()}): needs root")
    yield view, source
    subprocess.run(["umount", "-l", str(view)], check=True)


def test_a_report_in_a_folder_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, read_only_folder):
    """`--report` there ran every item, then ended with a traceback naming a temporary file and exit
    code 1 (the code of failed items); `hardy report --html` there, a traceback too."""
    ro, _ = read_only_folder
    (tmp_path / "flows.py").write_text(FLOWS.replace("return x * factor", "open('ran', 'w').close()\n    return x * factor"))
    out = _hardy_run(tmp_path, "flows:pipeline", "--set", "x=1", "--report", f"{ro}/sub/run.json")
    assert out.returncode == 2 and not (tmp_path / "ran").exists(), out.stderr
    assert out.stderr == f"hardy: --report {ro}/sub/run.json: the folder {ro} cannot be written here (read-only, or " \
                         f"not yours): give a --report path in a folder you can write\n", out.stderr
    assert _hardy_run(tmp_path, "flows:pipeline", "--set", "x=1", "--report", "ok.json").returncode == 0
    page = subprocess.run([sys.executable, "-m", "hardy.cli", "report", "ok.json", "--html", f"{ro}/r.html"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert page.returncode == 2 and page.stdout == "" and page.stderr.count("\n") == 1, page.stderr
    assert f"--html {ro}/r.html: the folder {ro} cannot be written here" in page.stderr


READ_ONLY_MEANWHILE = """
import subprocess
from hardy import Pipeline, node

@node(output_name="y")
def half(x: int, folder: str) -> int:
    subprocess.run(["mount", "-o", "remount,bind,ro", folder], check=True)  # (the report's folder, from here on)
    return 10 // (x - 2)

pipeline = Pipeline([half])
"""


def test_a_report_that_cannot_be_written_at_the_end_costs_no_result_and_not_the_exit_code(tmp_path,
                                                                                        read_only_folder):
    """The folder becomes read-only while the items run: the report is said in one line not to be
    written, every item has its line, and the exit code is the items' (0: none failed), where it
    was a traceback naming a temporary file and exit code 1, which reads as "items failed"."""
    ro, source = read_only_folder
    subprocess.run(["mount", "-o", "remount,bind,rw", str(ro)], check=True)
    (tmp_path / "meanwhile.py").write_text(READ_ONLY_MEANWHILE)
    out = _hardy_run(tmp_path, "meanwhile:pipeline", "--set", "x=[1, 3, 4]", "--map-over", "x", "--set",
                     f"folder={ro}", "--executor", "sequential", "--report", f"{ro}/run.json")
    assert out.returncode == 0, out.stderr
    assert sorted(json.loads(line)["outputs"]["y"] for line in out.stdout.splitlines()) == [-10, 5, 10]
    assert out.stderr == f"hardy: the run report could not be written to {ro}/run.json (Read-only file system); " \
                         "each item's line is in stdout\n", out.stderr
    assert list(source.iterdir()) == []


@pytest.mark.parametrize("args, inputs, message", [
    (["--set", "x=1", "--set", "x=2"], None, "--set x=1 and --set x=2 both give input 'x': give it once"),
    (["--set", "factor=1000"], '{"x": 1, "factor": 3}\n',
     "--set factor=1000 and --inputs items.jsonl (each of its lines holds 'factor') both give input 'factor': give "
     "it in one place (drop the --set, or the key from the lines)"),
])
def test_an_input_given_twice_is_a_usage_error_naming_both(tmp_path, args, inputs, message):
    """The lines' value won over an explicit --set, and the last of two --set's, without a word, exit 0."""
    (tmp_path / "flows.py").write_text(FLOWS.replace("return x * factor", "open('ran', 'w').close()\n    return x * factor"))
    if inputs:
        (tmp_path / "items.jsonl").write_text(inputs)
        args = [*args, "--inputs", "items.jsonl"]
    out = _hardy_run(tmp_path, "flows:pipeline", *args)
    assert out.returncode == 2 and out.stderr == f"hardy: {message}\n", out.stderr
    assert not (tmp_path / "ran").exists()


BREAKS = """
from hardy import Pipeline, node

@node(output_name="y")
def f(x: int) -> int:
    y = x + 1
    breakpoint()
    return y

pipeline = Pipeline([f], name="bp")
"""


@pytest.mark.parametrize("command", [["-m", "hardy.cli"], ["-m", "hardy"]])
def test_breakpoint_under_hardy_run_says_the_commands_way_and_it_works(tmp_path, command):
    """The item's message told a shell user to call err.debug() (there is no Python object), to use
    `hardy replay REPORT --item N --pdb` (which refuses every report `hardy run` writes) or
    Engine(map_executor="sequential"); it says --executor sequential, which stops in pdb."""
    (tmp_path / "bpnode.py").write_text(BREAKS)
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONBREAKPOINT"}  # (importing ray sets it, to its own)
    out = subprocess.run([sys.executable, *command, "run", "bpnode:pipeline", "--set", "x=1", "--executor", "process"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=plain)
    message = json.loads(out.stdout)["message"]
    assert out.returncode == 1 and "run the same `hardy run` command again with `--executor sequential`" in message
    assert "debug()" not in message and "hardy replay" not in message and "Engine(" not in message, message
    followed = subprocess.run([sys.executable, *command, "run", "bpnode:pipeline", "--set", "x=1", "--executor",
                               "sequential"], cwd=tmp_path, input="p y * 100\nc\n", capture_output=True, text=True,
                              timeout=120, env=plain)
    assert followed.returncode == 0 and "200" in followed.stderr, followed.stderr
    assert json.loads(followed.stdout) == {"item": 0, "ok": True, "outputs": {"y": 2}}


UNWRITTEN = """
import warnings
from hardy import Engine, Pipeline, node

@node(output_name="y")
def f(x: int) -> int:
    return x

pipeline = Pipeline([f], engine=Engine(map_executor="{executor}", workers=1, report_dir={folder!r}))
pipeline.map(inputs={{"x": [1, 2]}}, map_over="x")  # line 10
"""


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_the_unwritten_report_warning_points_at_the_users_call(tmp_path, read_only_folder, executor):
    """It was attributed to hardy/observe/watch.py, a line of hardy's, not the map that wrote no report."""
    ro, _ = read_only_folder
    script = tmp_path / "script.py"
    script.write_text(UNWRITTEN.format(executor=executor, folder=str(ro)))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"{script}:10: RuntimeWarning: hardy: the run report could not be written to {ro}/" in out.stderr, out.stderr


def test_python_dash_m_hardy_is_the_hardy_command(tmp_path):
    """`python -m hardy` failed: "No module named hardy.__main__"."""
    (tmp_path / "flows.py").write_text(FLOWS)
    version = subprocess.run([sys.executable, "-m", "hardy", "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout == f"hardy {__version__}\n", version.stderr
    out = subprocess.run([sys.executable, "-m", "hardy", "run", "flows:pipeline", "--set", "x=[1, 13]", "--map-over",
                          "x", "--executor", "process"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = sorted(map(json.loads, out.stdout.splitlines()), key=lambda line: line["item"])
    assert out.returncode == 1 and lines[0]["outputs"] == {"y": 2} and lines[1]["signal"] == "SIGSEGV", out.stderr


def test_a_closed_standard_output_without_output_is_a_usage_error(tmp_path):
    """`hardy run` started with its standard output closed (`>&-`, as a daemon or cron job may be)
    and no --output ended in an AttributeError traceback and exit code 1: the result lines have
    nowhere to go, which is a usage error before anything runs; with --output it runs."""
    (tmp_path / "flows.py").write_text(FLOWS)
    base = [sys.executable, "-m", "hardy", "run", "flows:pipeline", "--set", "x=[1, 2]", "--map-over", "x"]
    closed = subprocess.run(base, cwd=tmp_path, stdout=None, stderr=subprocess.PIPE, text=True, timeout=120,
                            preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2, closed.stderr
    assert closed.stderr.strip() == ("hardy: standard output is closed, so the result lines have nowhere to go: "
                                     "give --output FILE"), closed.stderr
    given = subprocess.run([*base, "--output", str(tmp_path / "out.jsonl")], cwd=tmp_path, stderr=subprocess.PIPE,
                           text=True, timeout=120, preexec_fn=lambda: os.close(1))
    assert given.returncode == 0, given.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


BIG_LINES = """
from hardy import Pipeline, node

@node(output_name="text")
def padded(x: int) -> str:
    return str(x) * 4000

pipeline = Pipeline([padded])
"""


def test_an_output_on_a_full_disk_says_how_to_resume_and_resuming_writes_each_item_once(tmp_path):
    """`--output` on a disk that fills ended with exit code 74 and no word of `--resume`, which
    runs the items without a line once there is room: it is said, and doing it writes every item
    once (the line cut short by the full disk runs again)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"mount tmpfs failed ({done.stderr.strip()}): needs root")
    try:
        (tmp_path / "big.py").write_text(BIG_LINES)
        out = disk / "out.jsonl"
        args = ["big:pipeline", "--set", f"x={list(range(40))}", "--map-over", "x", "--executor", "sequential"]
        full = _hardy_run(tmp_path, *args, "--output", str(out))
        assert full.returncode == 74, full.stderr
        assert f"the same command with --resume {out} runs the items that have no line in it yet" in full.stderr
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)  # room on its disk
        resumed = _hardy_run(tmp_path, *args, "--output", str(out), "--resume", str(out))
        assert resumed.returncode == 0, resumed.stderr
        items = [json.loads(line)["item"] for line in out.read_text().splitlines() if line.endswith("}")]
        assert sorted(items) == list(range(40)), items
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


SHOUT = """
import sys
from hardy import Pipeline, node

@node(output_name="y")
def shout(text: str, lang: str = "en") -> str:
    open("ran", "a").write(text + "\\n")
    if text == "exit":
        sys.exit(4)
    if "<" in text:
        raise ValueError(f"markup in {text!r}")
    return f"{lang}:{text.upper()}"

pipeline = Pipeline([shout], name="shout")
"""


def _hardy(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hardy.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def test_replay_and_the_report_name_an_items_own_line_of_an_inputs_file_with_blank_lines(tmp_path):
    """Blank lines are skipped, so item N is not always line N+1: `hardy replay` said line 2 of the
    file for item 1 on line 4; a U+2028 in a string (JSON allows it unescaped) split its line in two
    ("line 1 is not JSON"); and under --resume the report numbered the items it ran from 0, so
    `hardy report --item N`, as the command said it, named another item or none."""
    (tmp_path / "shout.py").write_text(SHOUT)
    (tmp_path / "items.jsonl").write_text('{"text": "a\u2028b"}\n\n\n{"text": "<b>"}\n\n{"text": "<c>"}\n')
    out = _hardy_run(tmp_path, "shout:pipeline", "--inputs", "items.jsonl", "--report", "run.json",
                     "--executor", "sequential")
    assert out.returncode == 1, out.stderr
    lines = [json.loads(line) for line in out.stdout.split("\n") if line]
    assert lines[0]["outputs"] == {"y": "en:A\u2028B"} and [line["item"] for line in lines] == [0, 1, 2]
    replay = _hardy(tmp_path, "replay", "run.json", "--item", "1")
    said = " ".join(replay.stderr.split())
    assert replay.returncode == 2 and "Item 1 of a `hardy run` is line 4 of its --inputs file items.jsonl:" in said, said
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    again = _hardy_run(tmp_path, "shout:pipeline", "--inputs", "items.jsonl", "--resume", "out.jsonl",
                       "--report", "again.json", "--executor", "sequential")
    assert again.returncode == 1 and "(hardy report again.json --item 1)" in again.stderr, again.stderr
    failures = json.loads((tmp_path / "again.json").read_text())["failures"]
    assert [(f["item"], f["line"]) for f in failures] == [(2, 6)], failures
    shown = _hardy(tmp_path, "report", "again.json", "--item", "2")
    assert shown.returncode == 0 and "markup in '<c>'" in shown.stdout, shown.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n\n{"text": "b", "lang": "fr"}\n')
    refused = _hardy_run(tmp_path, "shout:pipeline", "--inputs", "bad.jsonl")
    assert refused.returncode == 2 and "bad.jsonl line 3 holds ['lang', 'text'], line 1 ['text']" in refused.stderr


def test_a_set_list_is_mapped_over_alongside_inputs_one_value_per_item(tmp_path):
    """As the docs say a --set list can be: it was refused as "--inputs six.jsonl line 1 has no
    ['lang']", which blamed the file; a list of another length, or one value, is refused as what it is."""
    (tmp_path / "shout.py").write_text(SHOUT)
    (tmp_path / "items.jsonl").write_text('{"text": "a"}\n\n{"text": "b"}\n{"text": "c"}\n')
    args = ["shout:pipeline", "--inputs", "items.jsonl", "--map-over", "text,lang", "--executor", "sequential"]
    out = _hardy_run(tmp_path, *args, "--set", 'lang=["x", "y", "z"]')
    assert out.returncode == 0, out.stderr
    rows = sorted(map(json.loads, out.stdout.splitlines()), key=lambda row: row["item"])
    assert [row["outputs"]["y"] for row in rows] == ["x:A", "y:B", "z:C"]
    short = _hardy_run(tmp_path, *args, "--set", 'lang=["x"]')
    assert short.returncode == 2 and short.stderr == (
        "hardy: --map-over lang names --set lang, a list of 1 value(s), and --inputs items.jsonl holds 3 item(s): a "
        "list mapped over alongside --inputs gives one value per item, in the file's order; give 3 values, or put "
        "lang in each line of items.jsonl instead\n"), short.stderr
    one = _hardy_run(tmp_path, *args, "--set", "lang=x")
    assert one.returncode == 2 and "--set lang, which is one value, not a list: drop lang from --map-over" in \
        one.stderr, one.stderr
    assert (tmp_path / "ran").read_text().split() == ["a", "b", "c"]  # the refused commands ran nothing


@pytest.mark.parametrize("executor", ["sequential", "process"])
def test_a_nodes_sys_exit_is_said_in_its_line_as_python_says_it(tmp_path, executor):
    """The line said "error": "SystemExit", "message": "4", where the Python API's error says why."""
    (tmp_path / "shout.py").write_text(SHOUT)
    out = _hardy_run(tmp_path, "shout:pipeline", "--set", "text=exit", "--executor", executor)
    line = json.loads(out.stdout)
    assert out.returncode == 1 and line["error"] == "SystemExit", out.stderr
    assert line["message"] == ("called sys.exit(4); a node cannot end the process that runs it: raise an exception "
                               "instead"), line


def test_resume_refuses_a_file_with_a_line_of_an_item_the_inputs_do_not_give(tmp_path):
    """A line for item 99 of a 6-item run was taken silently: the file came from other inputs, and
    resuming would have mixed its results with these."""
    (tmp_path / "shout.py").write_text(SHOUT)
    written = '{"item": 0, "ok": true, "outputs": {"y": "en:A"}}\n{"item": 99, "ok": true, "outputs": {}}\n'
    (tmp_path / "out.jsonl").write_text(written)
    out = _hardy_run(tmp_path, "shout:pipeline", "--set", 'text=["a", "b", "c"]', "--map-over", "text",
                     "--resume", "out.jsonl")
    assert out.returncode == 2 and out.stderr == (
        "hardy: --resume out.jsonl line 2 is the line of item 99, and these inputs give 3 item(s) (items 0 to 2): "
        "out.jsonl was written by a run of other inputs, whose results resuming would mix with these; resume with "
        "the inputs of the run that wrote it, or give a fresh --output\n"), out.stderr
    assert not (tmp_path / "ran").exists() and (tmp_path / "out.jsonl").read_text() == written


def _cached_twice(tmp_path) -> str:
    """A cache folder holding two entries, written by `hardy run --cache`."""
    (tmp_path / "flows.py").write_text(FLOWS)
    out = _hardy_run(tmp_path, "flows:pipeline", "--set", "x=[1, 2]", "--map-over", "x", "--cache", "cc")
    assert out.returncode == 0, out.stderr
    return "cc"


@pytest.mark.parametrize("args, said", [
    (["--older-than", "-1"], "Invalid value for --older-than: -1 is not a number of days: give 0 or more"),
    (["--older-than", "-5"], "Invalid value for --older-than: -5 is not a number of days: give 0 or more"),
    (["--older-than", "nan"], "Invalid value for --older-than: nan is not a number of days: give 0 or more"),
    (["--older-than", "inf"], "Invalid value for --older-than: inf is not a number of days: give 0 or more"),
    (["--max-size", "-1"], "Invalid value for --max-size: -1 is negative: give 0 or more bytes, e.g. --max-size 10GB"),
    ([], "hardy: cache prune deletes nothing without a limit: give --max-size SIZE (e.g. 10GB), --older-than DAYS"),
])
def test_cache_prune_refuses_a_negative_or_nan_limit_and_none_at_all(tmp_path, args, said):
    """A negative age deleted every entry, and nan none, both with exit code 0; no limit at all said
    "deleted 0 entries". Each is a usage error naming the option, the value and the fix, and the
    cache keeps its entries; the Python method refuses such an age too."""
    folder = _cached_twice(tmp_path)
    out = _hardy(tmp_path, "cache", "prune", folder, *args)
    assert out.returncode == 2 and said in " ".join(out.stderr.split()), out.stderr
    assert "deleted" not in out.stdout and "Traceback" not in out.stderr, out.stdout
    assert json.loads(_hardy(tmp_path, "cache", "stats", folder, "--json").stdout)["entries"] == 2
    from hardy import DiskCache
    for age in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"DiskCache.prune: older_than=.* is not valid; older_than must be a "
                                             r"finite number of seconds >= 0"):
            DiskCache(tmp_path / folder).prune(older_than=age)
    assert "deleted 2 entries" in _hardy(tmp_path, "cache", "prune", folder, "--older-than", "0").stdout


def test_cache_commands_refuse_two_folders_and_say_how_to_name_one(tmp_path):
    """`hardy cache stats -d cc other` read `other` and ignored `-d cc`; with no cache in the
    default folder the command did not say how to name another."""
    folder = _cached_twice(tmp_path)
    for command in ("stats", "ls", "verify", "prune", "clear"):
        out = _hardy(tmp_path, "cache", command, "-d", folder, "other")
        assert out.returncode == 2 and out.stderr == (
            "hardy: FOLDER other and -d cc name two cache folders: give one\n"), (command, out.stderr)
    assert json.loads(_hardy(tmp_path, "cache", "stats", "-d", folder, folder, "--json").stdout)["entries"] == 2
    out = _hardy(tmp_path, "cache", "stats")
    assert out.returncode == 2 and out.stderr.startswith("no hardy cache in .hardy-cache (the default folder"), out.stderr
    assert "give the cache's folder as the command's FOLDER argument or with -d FOLDER" in out.stderr, out.stderr


def test_the_commands_hardy_suggests_paste_into_a_shell_as_they_are(tmp_path):
    """A report in `ünï dir` was named unquoted, `(hardy report ünï dir/rép.json --item 1)`, which
    a shell splits in two; a pipeline file in that folder was to be named `ünï dir.flows:pipeline`,
    no module name. Each command said is run here as a shell reads it, and does what it says; an
    item the run never had is said so, with the items it had."""
    folder = tmp_path / "ünï dir"
    folder.mkdir()
    (folder / "flows.py").write_text(SHOUT)
    (folder / "ïn.jsonl").write_text('{"text": "a"}\n{"text": "<b>"}\n')
    shell = f'hardy() {{ {shlex.quote(sys.executable)} -m hardy.cli "$@"; }}; '

    def pasted(said: str, tail: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", shell + said + tail], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)

    out = pasted("PYTHONPATH='ünï dir' hardy run flows:pipeline --inputs 'ünï dir/ïn.jsonl' --report "
                 "'ünï dir/rép.json' --executor sequential")
    assert out.returncode == 1, out.stderr
    command = re.search(r"\((hardy report .*)\)$", out.stderr.strip())
    assert command and command.group(1) == "hardy report 'ünï dir/rép.json' --item 1", out.stderr
    shown = pasted(command.group(1))
    assert shown.returncode == 0 and shown.stdout.startswith("item 1: node 'shout' failed: ValueError"), shown.stderr
    listed = pasted("hardy report 'ünï dir/rép.json'")
    assert "each failure's stacks: hardy report 'ünï dir/rép.json' --item N" in listed.stdout, listed.stdout
    missing = _hardy(tmp_path, "report", "ünï dir/rép.json", "--item", "7")
    assert missing.returncode == 2 and missing.stderr == (
        "hardy: the run in ünï dir/rép.json has no item 7 (it had 2 item(s): 0-1); the items that failed: [1]\n"), \
        missing.stderr
    kept = _hardy(tmp_path, "report", "ünï dir/rép.json", "--item", "0")
    assert kept.returncode == 2 and "item 0 did not fail in ünï dir/rép.json" in kept.stderr, kept.stderr
    refused = _hardy_run(tmp_path, "ünï dir/flows:pipeline", "--set", "text=x")
    assert refused.returncode == 2 and "ünï dir.flows" not in refused.stderr, refused.stderr
    suggested = re.search(r"(PYTHONPATH=.* hardy run \S+)", refused.stderr)
    assert suggested and suggested.group(1) == "PYTHONPATH='ünï dir' hardy run flows:pipeline", refused.stderr
    ran = pasted(suggested.group(1), " --set text=x")
    assert ran.returncode == 0 and json.loads(ran.stdout)["outputs"] == {"y": "en:X"}, ran.stderr


@pytest.mark.parametrize("args, said", [
    (["--set", "x=[1, 2]", "--map-over", "xx"], "hardy: --map-over xx names no input of pipeline 'flows'; its inputs: "
     "['factor', 'x'] (did you mean 'x'?): map over one of them, given as a list (--set NAME='[...]', or a key of "
     "each --inputs line)"),
    (["--set", "x=[1, 2]", "--map-over", "x,factor"], "hardy: --map-over factor names input 'factor', which neither "
     "--set nor --inputs gives: give it its list of values, --set 'factor=[...]', or a 'factor' key in each line of "
     "--inputs FILE"),
])
def test_a_map_over_name_no_input_holds_is_said_in_the_commands_words(tmp_path, args, said):
    """It said `pass inputs={'xx': [...]} or fix the name`: the Python call's words, not the command's."""
    (tmp_path / "flows.py").write_text(FLOWS)
    out = _hardy_run(tmp_path, "flows:pipeline", *args)
    assert out.returncode == 2 and out.stderr == said + "\n", out.stderr
    assert "inputs={" not in out.stderr


def test_a_crash_under_hardy_run_names_the_executor_option_that_contains_it(tmp_path):
    """The crash of the command's own process advised `map_executor="process" or @node(isolate=True)`,
    the Python API's arguments; under `hardy run` it names the command's option."""
    (tmp_path / "flows.py").write_text(FLOWS)
    out = _hardy_run(tmp_path, "flows:pipeline", "--set", "x=[1, 13]", "--map-over", "x", "--executor", "sequential")
    assert out.returncode == -signal.SIGSEGV, out.stderr
    assert ("hardy: --executor sequential runs nodes in this process, so the crash ends it; --executor process (or "
            "@node(isolate=True) on that node, in its code) contains it: only that item would fail.") in out.stderr
    assert "map_executor" not in out.stderr, out.stderr

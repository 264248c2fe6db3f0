"""The `hardy` command as a newcomer meets it: --version and the demo of the README's first command."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from hardy import __version__


def test_version():
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"hardy {__version__}"


def test_demo_runs_and_one_segfault_costs_one_document():
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "demo", "--items", "400", "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())  # rich wraps lines at the terminal width
    assert "node 'prep/tokenize' failed on item 200 (inputs: doc='POISON " in text  # the nested node, named
    assert re.search(r"worker died from SIGSEGV .* called from node 'prep/tokenize' \(demo\.py:\d+\)", text), text
    assert "the crash was deliberate. Document 200" in text and "finished the other 399 documents" in text


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
    assert "1 of 3 item(s) failed; see run.html" in out.stderr
    assert "worker died from SIGSEGV" in (tmp_path / "run.html").read_text()


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
    (["broken:pipeline"], "cannot import 'broken': SyntaxError in"),
    (["exits:pipeline"], "importing 'exits' called sys.exit(0), so nothing ran"),
    (["needs:pipeline"], "cannot import 'needs': ModuleNotFoundError: No module named 'hardy_no_such_dependency' (at"),
    (["flows:pipeline", "--set", "x"], "--set 'x' is not NAME=VALUE"),
    (["flows:pipeline", "--set", "factor=1"], "Missing required input(s): ['x']"),
    (["flows:pipeline", "--inputs", "bad.jsonl"], "bad.jsonl line 2 is not JSON"),
    (["flows:pipeline", "--executor", "gpu"], "Engine(map_executor='gpu') is not one of"),
    (["flows:pipeline", "--set", "x=1", "--set", "fctor=3"], "'fctor'"),
    (["flows:pipeline", "--set", "x=1", "--workers", "0"], "Invalid value for '--workers'"),
    (["flows:pipeline", "--set", "x=1", "--report", "run.txt"], "use a .html or .json file name"),
    (["flows:pipeline", "--set", "x=1", "--output", "no/such/dir/out.jsonl"], "--output no/such/dir/out.jsonl: no directory"),
])
def test_usage_errors_exit_2_with_the_fix(tmp_path, args, message):
    (tmp_path / "flows.py").write_text(FLOWS.replace("return x * factor", "open('ran', 'w').close()\n    return x * factor"))
    (tmp_path / "raises.py").write_text(FLOWS + "raise RuntimeError('no HARDY_CONFIG set')\n")
    (tmp_path / "broken.py").write_text(FLOWS + "def oops(:\n")
    (tmp_path / "exits.py").write_text(FLOWS + "import sys\nsys.exit(0)\n")  # a script without a __main__ guard
    (tmp_path / "needs.py").write_text("import hardy_no_such_dependency\n" + FLOWS)
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n{x: 2}\n')
    out = _hardy_run(tmp_path, *args)
    assert out.returncode == 2 and message in " ".join(out.stderr.split()), out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "ran").exists()  # told before any work


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
    """Arguments and options are shown by what they hold (`FOLDER <dir>`, `--matrix MODULES`),
    never as a parameter's Python name and type (`{folder}`, `folder <str>`, `<list[str]>`)."""
    import typer
    from typer.testing import CliRunner

    from hardy.cli import app
    root = typer.main.get_command(app)
    checked = []
    for path, _ in _commands(root):
        out = CliRunner().invoke(app, [*path, "--help"], terminal_width=200)
        assert out.exit_code == 0, (path, out.output)
        bad = re.findall(r"\{[a-z_]+\}|^\s+[a-z_]+(?:\.\.\.)? <|(?:--[\w-]+|-\w) <(?:str|list\[\w+\])>", out.output, re.M)
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
    assert "deleted 2 entries" in cache("prune", folder, "--max-size", "0").stdout
    assert cache("clear", folder, "--yes").returncode == 0

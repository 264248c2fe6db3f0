"""A report file is data written by whoever wrote it: a crafted one, rendered by `hardy report --html`
and opened in a real headless Chromium, runs nothing and fetches nothing; in the terminal its
control characters and rich markup are shown, not obeyed; and writing reports and kept inputs into
a directory another user can write (a team's report_dir) never follows a link they planted; nor do
`hardy run --output/--resume` and `hardy repeat --logs`, and --resume trusts no file another user may write."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hardy import Engine, Pipeline, node
from test_cache_trust import ATTACKER, area, needs_root  # noqa: F401  (area: a fixture)
from test_security_cache import attacker

chromium = pytest.mark.skipif(shutil.which("chromium") is None,
                              reason="Chromium is not installed (Debian: apt-get install chromium)")

MARKER = "attacker-script-ran"


@node(output_name="y")
def flaky(x: int) -> int:
    if x == 1:
        raise ValueError("one is not allowed")
    return x


def genuine(tmp_path: Path) -> dict:
    """A real report's data: a map with one failure, recorded in full."""
    p = Pipeline([flaky], engine=Engine(report=True), name="genuine")
    p.map(inputs={"x": [0, 1, 2]}, map_over="x", on_error="continue")
    return json.loads(json.dumps(p.report().to_dict()))


def hardy_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hardy.cli", *args], capture_output=True, text=True, timeout=180)


def open_in_chromium(page: Path, profile: Path) -> str:
    """The page's DOM after Chromium has loaded it and let its timers run (a refresh, a script)."""
    done = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


@pytest.mark.slow  # headless Chromium
@chromium
def test_a_crafted_report_renders_as_text_and_runs_no_script(tmp_path):
    """`dag.svg` and `failures[].item` were inserted as they were: a refresh to the author's page (whose
    script then ran), scripts and handlers in the drawing (held back only by the page's CSP)."""
    evil = tmp_path / "evil.html"  # the author's page: shipped beside the report, or any URL
    evil.write_text(f"<html><body><script>document.body.setAttribute('data-x', '{MARKER}')</script></body></html>")
    data = genuine(tmp_path)
    data["dag"]["svg"] = ('<svg xmlns="http://www.w3.org/2000/svg" onload="document.title=\'' + MARKER + '\'">'
                          f"<script>document.title='{MARKER}'</script><g class=\"node\"><title>ok</title>"
                          "<rect x=\"1\" y=\"1\" width=\"10\" height=\"10\" fill=\"#dbeafe\"/></g></svg>")
    data["failures"][0]["item"] = f'<meta http-equiv="refresh" content="0;url={evil.as_uri()}">'
    crafted = tmp_path / "crafted.json"
    crafted.write_text(json.dumps(data))
    done = hardy_cli("report", str(crafted), "--html", str(tmp_path / "crafted.html"))
    if done.returncode == 2:  # refused as not a report: nothing rendered, nothing to open
        assert "failures[0].item" in done.stderr, done.stderr
        data["failures"][0]["item"] = 1
        crafted.write_text(json.dumps(data))
        done = hardy_cli("report", str(crafted), "--html", str(tmp_path / "crafted.html"))
    assert done.returncode == 0, done.stderr
    dom = open_in_chromium(tmp_path / "crafted.html", tmp_path / "profile")
    assert "<title>hardy report: genuine</title>" in dom and "one is not allowed" in dom
    assert MARKER not in dom.replace(f"document.title='{MARKER}'", "")  # in the page only as escaped text
    assert "<script" not in dom and " onload=" not in dom and "<meta http-equiv=\"refresh\"" not in dom


# --- the terminal -------------------------------------------------------------------------------

def test_a_crafted_report_in_the_terminal_shows_control_characters_and_markup_as_text(tmp_path):
    """Escape sequences in a name or a message reach the terminal as escapes (`\\x1b`), never as
    themselves: no retitled window, cleared screen or hyperlink; rich markup is shown as written."""
    data = genuine(tmp_path)
    data["pipeline"] = "title\x1b]0;owned\x07"
    data["nodes"][0]["name"] = "flaky\x1b[2J\x1b[H"
    data["failures"][0]["message"] = "[link=https://example.invalid]click[/link] \u202eevil\x9b31m"
    data["failures"][0]["signal"] = "SIG[bold]X[/bold]"
    crafted = tmp_path / "crafted.json"
    crafted.write_text(json.dumps(data))
    done = hardy_cli("report", str(crafted))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert not any(c in out for c in "\x1b\x07\x9b\u202e"), repr(out)
    flat = "".join(out.split())  # the table wraps long cells
    assert "\\x1b]0;owned\\x07" in flat and "\\x1b[2J" in flat and "\\u202eevil\\x9b31m" in flat
    assert "[link=https://example.invalid]click[/link]" in flat and "SIG[bold]X[/bold]" in flat


@pytest.mark.parametrize("field, value, where", [
    ("items", "3", "items: expected an integer"),
    ("wall_s", float("nan"), "wall_s: expected a number"),
    ("timeline", [[0, "pid 1", 0.0, 1e308, True]], "timeline[0][3]: expected a number"),
    ("dag", {"svg": 12, "nodes": []}, "dag.svg: expected a string or null"),
    ("failures", [{"item": 0}], "failures[0].node: expected a value"),
])
def test_the_loader_names_the_field_that_is_not_as_hardy_writes_it(tmp_path, field, value, where):
    data = genuine(tmp_path)
    data[field] = value
    crafted = tmp_path / "crafted.json"
    crafted.write_text(json.dumps(data))
    done = hardy_cli("report", str(crafted))
    assert done.returncode == 2 and "is not a hardy run report" in done.stderr and where in done.stderr, done.stderr


# --- report_dir and kept inputs in a folder another user writes --------------------------------

PLANT = """
import os, sys
for link, target in zip(sys.argv[1::2], sys.argv[2::2]):
    os.symlink(target, link)
print("planted")
"""


@needs_root
def test_writing_a_report_into_a_shared_folder_never_follows_a_planted_link(area):  # noqa: F811
    """The report was written to `.<name>.<pid>.tmp` with a plain open: a link planted at that name
    (the pid is no secret) made root write the report wherever the link pointed."""
    from hardy.observe.report import RunReport
    shared = area / "reports"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)  # a team's report folder: anyone may add files, only owners remove theirs
    precious = area / "root-only"
    precious.mkdir(mode=0o700)
    (precious / "config").write_text("root's own file\n")
    report = RunReport(genuine(area))
    pairs = [str(shared / f".{name}.{os.getpid()}.tmp") for name in ("run.json", "run.html")]
    attacker(PLANT, pairs[0], str(precious / "config"), pairs[1], str(precious / "made-by-root"))
    report.save(shared / "run.json")
    report.save(shared / "run.html")
    assert (precious / "config").read_text() == "root's own file\n" and not (precious / "made-by-root").exists()
    assert RunReport.load(shared / "run.json").to_dict()["pipeline"] == "genuine"


@needs_root
def test_a_report_folder_that_is_another_users_link_is_refused(area, tmp_path):  # noqa: F811
    """report_dir=/shared/ci-reports where another user made that name a link to a folder of yours."""
    mine = area / "root-only"
    mine.mkdir(mode=0o700)
    attacker(PLANT, str(area / "ci-reports"), str(mine))
    p = Pipeline([flaky], engine=Engine(report_dir=area / "ci-reports"), name="shared")
    with pytest.warns(RuntimeWarning, match="could not be written.*symbolic link of uid 65534"):
        out = p.map(inputs={"x": [0, 2]}, map_over="x")
    assert out == [{"y": 0}, {"y": 2}] and list(mine.iterdir()) == []


@needs_root
def test_kept_inputs_and_the_state_folder_refuse_another_users_links(area, monkeypatch):  # noqa: F811
    from hardy.crash import kept
    from hardy.errors import UntrustedCacheError
    monkeypatch.setenv("XDG_STATE_HOME", str(area / "state"))
    (area / "state").mkdir(mode=0o700)
    shared = area / "reports"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)
    mine = area / "root-only"
    mine.mkdir(mode=0o700)
    attacker(PLANT, str(shared / "run.inputs"), str(mine))
    said = kept.keep(shared / "run.json", Pipeline([flaky]), {1: {"x": 1}})
    assert said[1].startswith("not kept") and list(mine.iterdir()) == []
    # the user's own state folder (their cache key, their reports), if another user's link: refused
    monkeypatch.setenv("XDG_STATE_HOME", str(shared))
    attacker(PLANT, str(shared / "hardy"), str(mine))
    with pytest.raises(UntrustedCacheError, match="cache key folder"):
        kept.default_folder(create=True)
    assert list(mine.iterdir()) == []


def test_replay_refuses_a_sparse_or_deeply_nested_report_before_reading_it(tmp_path):
    """Another user's file in a team's report folder: `hardy replay` read it whole and parsed it
    (a 2 GiB sparse file took 4 GB of memory; 200,000 brackets ended in a RecursionError's
    traceback). It is checked as `hardy report` checks it, and read once."""
    sparse = tmp_path / "big.json"
    with open(sparse, "wb") as f:
        f.truncate(300 << 20)  # (past the 256 MiB a report may hold, and nothing on disk)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000)
    for path, why in ((sparse, "a sparse file"), (deep, "is not a hardy run report")):
        out = hardy_cli("replay", str(path), "--item", "0")
        assert out.returncode == 2, out.stdout + out.stderr
        assert why in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_replay_under_gdb_imports_no_hardy_from_the_working_directory(tmp_path):
    """`hardy replay --gdb` (and `--py-spy`) ran the item with `python -m hardy.replay_item`,
    which searches the working directory first: a `hardy/` another user left in a team's report
    folder, where the user replays from, ran as them before any signature was checked."""
    reports = tmp_path / "reports"
    with Engine(map_executor="process", workers=1, report_dir=reports) as engine:
        Pipeline([flaky], engine=engine).map(inputs={"x": [0, 1]}, map_over="x", on_error="continue")
    (report,) = reports.glob("*.json")
    planted = reports / "hardy"
    planted.mkdir()
    (planted / "__init__.py").write_text(f"open({str(tmp_path / MARKER)!r}, 'w').close()\n")
    command = shutil.which("hardy", path=os.path.dirname(sys.executable)) or "hardy"  # (as installed: its own folder first)
    out = subprocess.run([command, "replay", report.name, "--item", "1", "--gdb"],
                         cwd=reports, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")})
    assert "one is not allowed" in out.stdout + out.stderr, out.stdout + out.stderr
    assert not (tmp_path / MARKER).exists()


# --- `hardy run --output/--resume` and `hardy repeat --logs` in folders other users may write ---------

FLOW = """
from hardy import Pipeline, node

@node(output_name="y")
def double(x: int) -> int:
    return 2 * x

pipeline = Pipeline([double])
"""

FORGE = """
import os, sys
tmp = sys.argv[1] + ".forged"
with open(tmp, "w") as f:
    f.write('{"item": 0, "ok": true, "outputs": {"y": 999}}\\n')
os.chmod(tmp, 0o666)
os.replace(tmp, sys.argv[1])
print("forged")
"""


def run_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`hardy run flow:pipeline` over x=1..3 (a fresh process of root's), from `folder`."""
    (folder / "flow.py").write_text(FLOW)
    return subprocess.run([sys.executable, "-m", "hardy.cli", "run", "flow:pipeline", "--set", "x=[1, 2, 3]",
                           "--map-over", "x", "--executor", "sequential", *args], cwd=folder, capture_output=True,
                          text=True, timeout=180)


@pytest.fixture
def team(area: Path) -> tuple[Path, Path]:  # noqa: F811
    """(a team's folder, writable by others and not sticky, a file only root may write, elsewhere)."""
    shared = area / "team"
    shared.mkdir()
    shared.chmod(0o777)
    precious = area / "root-only"
    precious.mkdir(mode=0o700)
    (precious / "notes").write_text("root's own file\n")
    return shared, precious / "notes"


@needs_root
def test_run_output_replaces_a_planted_link_and_never_writes_through_it(team, area):  # noqa: F811
    """`--output` was opened with a plain open("w"): a link another user planted at its name, in a
    team's folder or a sticky one, made the run overwrite (and an empty --inputs empty) the file it
    pointed to. The link is replaced by a fresh file of the user's, as --report replaces one."""
    shared, notes = team
    (area / "empty.jsonl").write_text("")
    for folder in (shared, area):  # not sticky, sticky
        attacker(PLANT, str(folder / "out.jsonl"), str(notes), str(folder / "none.jsonl"), str(notes))
        done = run_in(folder, "--output", "out.jsonl")
        assert done.returncode == 0, done.stderr
        empty = run_in(folder, "--inputs", str(area / "empty.jsonl"), "--map-over", "x", "--output", "none.jsonl")
        assert empty.returncode == 0, empty.stderr
        assert notes.read_text() == "root's own file\n"
        st = (folder / "out.jsonl").lstat()
        assert st.st_uid == 0 and oct(st.st_mode) == "0o100644"
        assert sorted(json.loads(line)["outputs"]["y"] for line in (folder / "out.jsonl").open()) == [2, 4, 6]
        assert (folder / "none.jsonl").read_text() == "" and not (folder / "none.jsonl").is_symlink()


@needs_root
def test_resume_refuses_a_planted_link_and_a_file_another_user_owns_or_may_write(team):
    """--resume appended through a planted link, and kept the lines of a file another user had put in
    its place (their forged results, as the user's own). Each is refused, before anything runs."""
    shared, notes = team
    attacker(PLANT, str(shared / "linked.jsonl"), str(notes))
    linked = run_in(shared, "--resume", "linked.jsonl")
    assert linked.returncode == 2 and "a symbolic link of uid 65534's" in linked.stderr, linked.stderr
    assert notes.read_text() == "root's own file\n"
    assert run_in(shared, "--output", "out.jsonl").returncode == 0
    attacker(FORGE, str(shared / "out.jsonl"))
    forged = run_in(shared, "--resume", "out.jsonl")
    assert forged.returncode == 2 and len(forged.stderr.splitlines()) == 1, forged.stderr
    assert "out.jsonl is owned by uid 65534, mode 666" in forged.stderr
    assert "resume from a file only you can write" in forged.stderr
    assert (shared / "out.jsonl").read_text().count("\n") == 1  # nothing appended to the forged lines
    (shared / "out.jsonl").unlink()
    assert run_in(shared, "--output", "out.jsonl").returncode == 0
    (shared / "out.jsonl").chmod(0o664)  # the user's own, but the team may write it
    os.chown(shared / "out.jsonl", -1, ATTACKER)  # (a group of others': root's own group is root's alone)
    assert run_in(shared, "--resume", "out.jsonl").returncode == 2
    (shared / "out.jsonl").chmod(0o644)
    assert run_in(shared, "--resume", "out.jsonl").returncode == 0


@needs_root
def test_repeat_logs_replace_planted_links_and_refuse_a_folder_others_may_swap(team, area):  # noqa: F811
    """`hardy repeat --logs` wrote run-N.log with write_bytes, through a link planted at that name.
    A sticky folder (/tmp's kind) is used, each log a fresh file renamed into place; a folder others
    may write without the sticky bit, or another user's link, is refused."""
    from hardy.doctor.repeat import repeat
    from hardy.errors import InvalidArgument
    shared, notes = team
    failing = ["sh", "-c", "echo boom >&2; exit 3"]
    attacker(PLANT, str(area / "run-1.log"), str(notes), str(area / "theirs"), str(shared))
    report = repeat(failing, n=1, logs=area, native=False)
    assert notes.read_text() == "root's own file\n"
    assert report.runs[0].log == str(area / "run-1.log") and "boom" in (area / "run-1.log").read_text()
    assert not (area / "run-1.log").is_symlink()
    for logs, why in ((shared, "is uid 0's folder, mode 777"), (area / "theirs", "a symbolic link, not followed")):
        with pytest.raises(InvalidArgument, match=why):
            repeat(failing, n=1, logs=logs, native=False)
        said = subprocess.run([sys.executable, "-m", "hardy", "repeat", "-n", "1", "--logs", str(logs), "--", "true"],
                              capture_output=True, text=True, timeout=120)
        assert (said.returncode, said.stderr.count("\n")) == (2, 1) and why in said.stderr, said.stderr  # no traceback
    assert list(shared.iterdir()) == []


FIFO = """
import os, sys
os.mkfifo(sys.argv[1], 0o666)
os.chmod(sys.argv[1], 0o666)
print("planted")
"""


@needs_root
def test_run_output_replaces_another_users_fifo_and_refuses_a_fifo_nothing_reads(area):  # noqa: F811
    """Anything at --output's name that was not a regular file was written to as it was: a 0666
    FIFO another user planted in /tmp got the user's results, and a FIFO nobody reads held
    `hardy run` forever. Another user's FIFO is replaced by a fresh file; the user's own that
    nothing reads is refused, in one line; /dev/stdout and /dev/null still work."""
    attacker(FIFO, str(area / "out.jsonl"))
    theirs = os.open(area / "out.jsonl", os.O_RDONLY | os.O_NONBLOCK)  # what the FIFO's reader would get
    try:
        done = run_in(area, "--output", "out.jsonl")
        assert done.returncode == 0, done.stderr
        assert os.read(theirs, 1 << 16) == b""
    finally:
        os.close(theirs)
    st = (area / "out.jsonl").lstat()
    assert st.st_uid == 0 and oct(st.st_mode) == "0o100644"
    assert sorted(json.loads(line)["outputs"]["y"] for line in (area / "out.jsonl").open()) == [2, 4, 6]
    os.mkfifo(area / "mine.jsonl")
    unread = run_in(area, "--output", "mine.jsonl")
    assert (unread.returncode, unread.stderr.count("\n")) == (2, 1), unread.stderr
    assert "--output mine.jsonl is a FIFO that nothing is reading: start its reader first" in unread.stderr
    shown = run_in(area, "--output", "/dev/stdout")
    assert shown.returncode == 0 and shown.stdout.count("\n") == 3, shown.stderr
    assert run_in(area, "--output", "/dev/null").returncode == 0


AS_NOBODY = """
import os, sys
import typer
import hardy.cache.folders, hardy.cli.outputs, hardy.errors  # (imported as root: the user cannot read them)
os.setgid(65534)
os.setuid(65534)
try:
    hardy.cli.outputs.fresh_results(sys.argv[1]).close()
except typer.Exit as exit:
    sys.exit(exit.exit_code)
"""


@needs_root
def test_run_output_refuses_the_users_own_write_protected_file(area):  # noqa: F811
    """--output replaced a file of the user's own that they had made read-only (0444: to keep it),
    where a plain open had failed with EACCES. It is refused, naming the file and the fix."""
    folder = area / "nobodys"
    folder.mkdir()
    (folder / "out.jsonl").write_text("kept\n")
    (folder / "out.jsonl").chmod(0o444)
    for path in (folder, folder / "out.jsonl"):
        os.chown(path, ATTACKER, ATTACKER)
    done = subprocess.run([sys.executable, "-c", AS_NOBODY, str(folder / "out.jsonl")], capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stderr.count("\n")) == (2, 1), done.stderr
    assert f"--output {folder / 'out.jsonl'} is a file of yours, mode 444, that you may not write" in done.stderr
    assert f"chmod u+w {folder / 'out.jsonl'}" in done.stderr
    assert (folder / "out.jsonl").read_text() == "kept\n" and oct((folder / "out.jsonl").stat().st_mode) == "0o100444"


@needs_root
def test_group_write_of_the_users_own_private_group_is_trusted_and_of_any_other_refused(area):  # noqa: F811
    """Under umask 002 with a group per user (Debian's default), the user's folders are 0775 and
    their files 0664: --output replaced the user's own link there, --resume refused their file and
    --logs their folder. The user's private group (root's here) is the user's alone; any other
    group that may write still makes a file or folder refused."""
    import grp
    import pwd

    from hardy.doctor.repeat import repeat
    from hardy.errors import InvalidArgument
    assert not grp.getgrgid(0).gr_mem and all(user.pw_gid or not user.pw_uid for user in pwd.getpwall()), \
        "root's group is not root's alone on this machine"
    mine = area / "mine"
    mine.mkdir()
    mine.chmod(0o775)
    (mine / "target.jsonl").write_text("")
    (mine / "target.jsonl").chmod(0o664)
    (mine / "out.jsonl").symlink_to("target.jsonl")
    done = run_in(mine, "--output", "out.jsonl")
    assert done.returncode == 0 and (mine / "out.jsonl").is_symlink(), done.stderr
    assert (mine / "target.jsonl").read_text().count("\n") == 3
    resumed = run_in(mine, "--resume", "target.jsonl")
    assert resumed.returncode == 0, resumed.stderr
    failing = ["sh", "-c", "exit 3"]
    assert repeat(failing, n=1, logs=mine, native=False).runs[0].log == str(mine / "run-1.log")
    for path in (mine, mine / "target.jsonl"):
        os.chown(path, -1, ATTACKER)  # a group of others'
    refused = run_in(mine, "--resume", "target.jsonl")
    assert refused.returncode == 2 and "is owned by uid 0, mode 664, group 65534" in refused.stderr, refused.stderr
    with pytest.raises(InvalidArgument, match="mode 775"):
        repeat(failing, n=1, logs=mine, native=False)
    assert run_in(mine, "--output", "out.jsonl").returncode == 0
    assert not (mine / "out.jsonl").is_symlink() and (mine / "target.jsonl").read_text().count("\n") == 3

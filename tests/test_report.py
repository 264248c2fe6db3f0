"""Run reports: real maps (in-process and through crashing worker processes), a real cache, real
JSON files, and the HTML page loaded in a real headless Chromium."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from hardy import DiskCache, Engine, HardyError, MapError, NodeError, Pipeline, node
from hardy.observe.report import RunReport
from test_visualize import _png_pixels

PAYLOAD = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"


@node(output_name="a")
def prepare(x: int) -> int:
    return x + 1


@node(output_name="b")
def score(a: int) -> int:
    if a == 4:
        raise ValueError(PAYLOAD)
    if a == 8:
        os.kill(os.getpid(), signal.SIGSEGV)
    return a * 2


def pipeline(engine: Engine, **kw) -> Pipeline:
    return Pipeline([prepare, score], engine=engine, name="scoring", **kw)


def test_in_process_map_counts_calls_cache_hits_and_failures(tmp_path):
    p = pipeline(Engine(map_executor="sequential", report=True), cache=DiskCache(tmp_path / "c"))
    items = [x for x in range(10) if x != 7]  # item 7 would segfault this test process
    p.map(inputs={"x": items}, map_over="x", on_error="continue")
    first = p.report().to_dict()
    nodes = {n["name"]: n for n in first["nodes"]}
    assert nodes["prepare"]["calls"] == 9 and nodes["prepare"]["cached"] == 0
    assert nodes["score"]["calls"] == 9 and nodes["score"]["failures"] == 1
    assert first["items"] == 9 and first["succeeded"] == 8 and first["failed"] == 1
    [failure] = first["failures"]
    assert failure["item"] == 3 and failure["node"] == "score" and failure["error"] == "ValueError"
    assert failure["message"] == PAYLOAD and "in score" in failure["stack"] and failure["signal"] is None
    assert 0 < nodes["score"]["p95_s"] <= nodes["score"]["total_s"]
    assert nodes["score"]["peak_rss"] is None  # it ran in this process, not in a worker

    p.map(inputs={"x": items}, map_over="x", on_error="continue")
    again = {n["name"]: n for n in p.report().to_dict()["nodes"]}
    assert again["prepare"]["cached"] == 9 and again["prepare"]["calls"] == 0
    assert again["score"]["cached"] == 8 and again["score"]["calls"] == 1  # the failure was not cached
    json.dumps(p.report().to_dict())


def test_process_map_report_names_the_crash_its_signal_and_the_workers():
    with Engine(map_executor="process", workers=2, report=True) as engine:
        p = pipeline(engine)
        out = p.map(inputs={"x": list(range(20))}, map_over="x", on_error="continue")
        assert sum(1 for r in out if isinstance(r, dict)) == 18
        d = p.report().to_dict()
        pids = set(engine.process_pool().pids())
    crash = next(f for f in d["failures"] if f["item"] == 7)
    assert crash["node"] == "score" and crash["signal"] == "SIGSEGV" and "score" in crash["stack"]
    nodes = {n["name"]: n for n in d["nodes"]}  # node events came back from the workers
    assert nodes["prepare"]["calls"] == 19  # item 7's own log died with its worker
    assert nodes["score"]["calls"] == 20 and nodes["score"]["failures"] == 2  # a ValueError and the crash
    raised = next(f for f in d["failures"] if f["item"] == 3)  # its traceback came back as text
    assert raised["error"] == "ValueError" and "in score" in raised["stack"] and "raise ValueError" in raised["stack"]
    assert d["workers"]["died"] == 1 and d["workers"]["started"] >= 2 and d["workers"]["recycled"] == 0
    assert set(d["workers"]["peak_rss"]) == {str(p) for p in pids}
    assert all(v > 1 << 20 for v in d["workers"]["peak_rss"].values())
    lanes = {worker for _, worker, *_ in d["timeline"]}
    peaks = d["workers"]["peak_rss"]  # a node's: the highest of the workers (alive at the end) that ran it
    assert nodes["score"]["peak_rss"] == max(peaks[w.split()[1]] for w in lanes if w.split()[1] in peaks)
    assert pids - {int(w.split()[1]) for w in lanes} == set() and len(d["timeline"]) == 20
    assert {i for i, *_, ok in d["timeline"] if not ok} == {3, 7}


@pytest.mark.parametrize("ordered", [True, False])
def test_imap_report_from_workers_streamed_in_windows(ordered):
    with Engine(map_executor="process", workers=2, report=True) as engine:
        p = pipeline(engine)
        out = list(p.imap(inputs={"x": (x for x in range(20))}, map_over="x", on_error="continue",
                          window=6, ordered=ordered))
        d = p.report().to_dict()
    assert len(out) == 20 and d["kind"] == "imap"
    assert d["items"] == 20 and d["failed"] == 2 and d["succeeded"] == 18
    assert {f["item"]: f["error"] for f in d["failures"]} == {3: "ValueError", 7: "NodeCrashed"}
    assert next(f for f in d["failures"] if f["item"] == 7)["signal"] == "SIGSEGV"
    nodes = {n["name"]: n for n in d["nodes"]}
    assert nodes["score"]["calls"] == 20 and nodes["score"]["failures"] == 2
    assert sorted(i for i, *_ in d["timeline"]) == list(range(20))


def test_imap_report_covers_what_was_consumed_when_stopped_or_raised():
    p = pipeline(Engine(map_executor="threaded", workers=2, report=True))
    stream = p.imap(inputs={"x": [x for x in range(100) if x != 7]}, map_over="x", window=4)  # 7 segfaults
    assert [next(stream)["b"] for _ in range(2)] == [2, 4]
    stream.close()
    d = p.report().to_dict()
    assert d["kind"] == "imap" and d["items"] == 2 and d["failed"] == 0
    with pytest.raises(MapError):
        list(p.imap(inputs={"x": [0, 1, 2, 3]}, map_over="x"))
    d = p.report().to_dict()
    assert d["items"] == 4 and d["failed"] == 1 and d["failures"][0]["item"] == 3


def test_run_report_and_a_failed_run():
    p = pipeline(Engine(report=True))
    assert p.run(inputs={"x": 1}) == {"a": 2, "b": 4}
    assert p.report().to_dict()["succeeded"] == 1
    with pytest.raises(NodeError):
        p.run(inputs={"x": 3})
    d = p.report().to_dict()
    assert d["kind"] == "run" and d["failed"] == 1 and d["failures"][0]["error"] == "ValueError"


def test_a_map_that_raised_counts_its_unrun_items_as_neither():
    p = pipeline(Engine(map_executor="sequential", report=True))
    with pytest.raises(MapError):
        p.map(inputs={"x": list(range(10))}, map_over="x")  # item 3 raises; 4 to 9 never run
    d = p.report().to_dict()
    assert (d["items"], d["succeeded"], d["failed"]) == (10, 3, 1)
    assert "3 of 10 items ok, 1 failed, 6 not run" in " ".join(str(p.report()).split())


def test_what_the_report_cannot_make_never_costs_the_results(tmp_path):
    (tmp_path / "taken").write_text("a file where the reports' directory should be")

    @node(output_name="n")
    def undecodable(x: int) -> int:
        raise ValueError(f"cannot parse {os.fsdecode(b'data_' + bytes([0xFF]) + b'.csv')}")  # a listdir name

    p = Pipeline([undecodable], name="nul\x00in its name", engine=Engine(report_dir=tmp_path / "taken" / "reports"))
    with pytest.warns(RuntimeWarning, match="could not be written"):
        out = p.map(inputs={"x": [1, 2]}, map_over="x", on_error="continue")
    dag = p.report().to_dict()["dag"]  # Graphviz refuses the NUL, grandalf draws it: either way the page shows the nodes
    assert len(out) == 2 and dag["nodes"] == ["undecodable"]
    page = p.report().save(tmp_path / "r.html").read_text()
    assert ("<svg" in page) if dag["svg"] else ("<li>undecodable</li>" in page)
    assert "data_\\udcff.csv" in page  # shown escaped
    assert sorted(os.listdir(tmp_path)) == ["r.html", "taken"]  # and no temporary file left


@pytest.mark.parametrize("executor", ["sequential", "process"])
@pytest.mark.parametrize("how", ["read-only", "a file in the way"])
def test_keep_failed_inputs_where_no_state_folder_can_be_made_returns_the_results(tmp_path, monkeypatch, executor,
                                                                                   how):
    """keep_failed_inputs=True where `~/.local/state` cannot be made (a service user's
    HOME=/nonexistent, a read-only home, a file where a folder should be): the results come back
    with one warning, as with a report_dir that cannot be written, and nothing is made."""
    home = tmp_path / "home"
    if how == "read-only":
        home.mkdir()
        if subprocess.run(["mount", "--bind", "-o", "ro", str(home), str(home)], capture_output=True).returncode:
            pytest.skip("a read-only mount needs root")
    else:
        home.write_text("a file, not a folder")
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "state"))
    try:
        p = pipeline(Engine(map_executor=executor, workers=1, keep_failed_inputs=True))
        with pytest.warns(RuntimeWarning) as said:
            out = p.map(inputs={"x": list(range(6))}, map_over="x", on_error="continue")
        assert os.listdir(tmp_path) == ["home"] and (how != "read-only" or os.listdir(home) == [])
    finally:
        if how == "read-only":
            subprocess.run(["umount", "-l", str(home)], check=True)
    assert [o["b"] if isinstance(o, dict) else "failed" for o in out] == [2, 4, 6, "failed", 10, 12]
    (line,) = [str(w.message) for w in said if "could not be kept" in str(w.message)]
    assert line.startswith("hardy: the inputs of 1 failed item(s) could not be kept: "
                           f"{home / 'state' / 'hardy' / 'reports'} cannot be made (")
    assert line.endswith("set XDG_STATE_HOME to a folder you can write, or give Engine(report_dir=...)")
    assert how != "read-only" or "Read-only file system" in line
    assert "\n" not in line and p.report().to_dict()["failed"] == 1


def test_a_report_that_cannot_be_written_leaves_no_inputs_folder(tmp_path):
    """A full disk under report_dir: the kept inputs' folder can be made, the report cannot; the
    results come back with the warning, and no `<report>.inputs/` folder is left that no report names."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip("a full disk needs a tmpfs mount (root)")
    try:
        with open(disk / "fill", "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
        p = pipeline(Engine(map_executor="sequential", report_dir=disk))
        with pytest.warns(RuntimeWarning, match="the run report could not be written to .*No space left on device"):
            out = p.map(inputs={"x": list(range(5))}, map_over="x", on_error="continue")
        assert len(out) == 5 and os.listdir(disk) == ["fill"]
        assert p.report().to_dict()["failures"][0]["kept_inputs"].startswith("not kept: ")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_map_where_everything_failed_lists_every_failure_and_shows_the_first(tmp_path):
    @node(output_name="y")
    def refuse(x: int) -> int:
        raise ValueError(f"bad {x}")

    p = Pipeline([refuse], engine=Engine(report=True))
    p.map(inputs={"x": list(range(150))}, map_over="x", on_error="continue")
    failures = p.report().to_dict()["failures"]
    assert [f["message"] for f in failures] == [f"bad {x}" for x in range(150)]
    assert [bool(f["stack"]) for f in failures] == [True] * 100 + [False] * 50
    shown = " ".join(str(p.report()).split())
    assert "bad 99" in shown and "bad 100" not in shown and "and 50 more failures" in shown
    page = p.report().save(tmp_path / "r.html").read_text()
    assert "bad 99<" in page and "bad 100<" not in page and "and 50 more failures" in page


def test_without_recording_report_says_how_to_turn_it_on():
    p = pipeline(Engine())
    p.run(inputs={"x": 1})
    with pytest.raises(HardyError, match=r"Engine\(report=True\)"):
        p.report()


@node(output_name="n")
def hog(x: int) -> int:
    block = b"\1" * (160 << 20)  # written, so resident
    return len(block) + x


def test_a_nodes_peak_worker_rss_in_the_tables_and_the_page(tmp_path):
    with Engine(map_executor="process", workers=1, report=True) as engine:
        p = Pipeline([hog], engine=engine, name="memory")
        p.map(inputs={"x": [1, 2]}, map_over="x")
    [n] = p.report().to_dict()["nodes"]
    assert n["peak_rss"] >= 160 << 20
    assert f"{n['peak_rss'] / 2**20:,.0f} MiB" in str(p.report())
    page = p.report().save(tmp_path / "r.html").read_text()
    assert "peak worker RSS" in page and f"{n['peak_rss'] / 2**20:,.0f} MiB" in page


def test_terminal_tables():
    p = pipeline(Engine(report=True))
    p.map(inputs={"x": [1, 2, 3]}, map_over="x", on_error="continue")
    text = " ".join(str(p.report()).split())
    assert "2 of 3 items ok, 1 failed" in text and "cache hits" in text
    assert "ValueError" in text and "<script>" in text  # rich markup in a message is shown, not interpreted


def test_report_dir_and_the_cli_renders_a_written_report(tmp_path):
    code = ("from hardy import Pipeline, node\n"
            "@node(output_name='y')\n"
            "def double(x): return 2 * x\n"
            "Pipeline([double], name='env dir').map(inputs={'x': [1, 2]}, map_over='x')\n")
    env = {**os.environ, "HARDY_REPORT_DIR": str(tmp_path / "reports")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    [written] = (tmp_path / "reports").glob("*.json")
    assert written.name.startswith("env_dir-")
    report = RunReport.load(written)
    assert report.to_dict()["succeeded"] == 2 and report.to_dict()["nodes"][0]["calls"] == 2
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "report", str(written), "--html",
                          str(tmp_path / "r.html")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2 of 2 items ok" in " ".join(out.stdout.split()) and (tmp_path / "r.html").read_text().count("<svg") >= 2
    bad = subprocess.run([sys.executable, "-m", "hardy.cli", "report", str(tmp_path / "r.html")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a hardy run report" in bad.stderr


def _chromium(*args: str, profile: str) -> subprocess.CompletedProcess:
    return subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120, check=True)


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Chromium is not installed (Debian: apt-get install chromium)")
@pytest.mark.slow  # headless Chromium
def test_html_page_escapes_everything_and_shows_the_dag_and_failures(tmp_path):
    with Engine(map_executor="process", workers=2, report=True) as engine:
        p = pipeline(engine)
        p.map(inputs={"x": list(range(20))}, map_over="x", on_error="continue")
        page = p.report().save(tmp_path / "run.html")
    text = page.read_text()
    assert "<script" not in text and "<img" not in text
    assert re.search(r"<[a-z]+[^>]*\s(src|href)=", text) is None and "<link" not in text  # nothing to fetch
    dom = _chromium("--dump-dom", page.as_uri(), profile=str(tmp_path / "p1")).stdout
    assert "<title>hardy report: scoring</title>" in dom and "pwned" not in dom.split("</title>")[0]
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom and "SIGSEGV" in dom
    shot = tmp_path / "shot.png"
    _chromium(f"--screenshot={shot}", "--window-size=1000,1400", page.as_uri(), profile=str(tmp_path / "p2"))
    width, height, pixels = _png_pixels(shot.read_bytes())
    colours = set(pixels)
    assert bytes.fromhex("dbeafe") in colours  # the DAG's node boxes
    assert bytes.fromhex("fecaca") in colours  # the failure table's header
    assert bytes.fromhex("22c55e") in colours and bytes.fromhex("ef4444") in colours  # the timeline

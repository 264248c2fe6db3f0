"""A report file is data written by whoever wrote it: a crafted one, rendered by `hardy report --html`
and opened in a real headless Chromium, runs nothing and fetches nothing; in the terminal its
control characters and rich markup are shown, not obeyed; and writing reports and kept inputs into
a directory another user can write (a team's report_dir) never follows a link they planted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hardy import Engine, Pipeline, node

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

"""The `hardy` command as a newcomer meets it: --version and the demo of the README's first command."""

from __future__ import annotations

import re
import subprocess
import sys

from hardy import __version__


def test_version():
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"hardy {__version__}"


def test_demo_runs_and_one_segfault_costs_one_document():
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "demo", "--items", "400", "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())  # rich wraps lines at the terminal width
    assert "node 'prep' failed on item 200: worker died from SIGSEGV" in text
    assert "the crash was deliberate. Document 200" in text and "finished the other 399 documents" in text


def test_demo_with_threads_has_no_failure():
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "demo", "--items", "300", "--executor", "threaded",
                          "--no-progress"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"succeeded\W+300\W", out.stdout) and re.search(r"failed\W+0\W", out.stdout), out.stdout
    assert "What happened" not in out.stdout

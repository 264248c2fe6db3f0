"""The codebase's own checks, run by the suite (so `.ci/run` runs them): lint, types, the docs site.

Each is the tool a contributor runs by hand, with the configuration in pyproject.toml and
mkdocs.yml; a failure prints the tool's own findings.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*cmd: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    out = run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_passes_with_the_public_api_strict():
    out = run(sys.executable, "-m", "mypy", "--no-incremental")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr


def test_docs_site_builds_strict(tmp_path):
    if shutil.which("mkdocs") is None and run(sys.executable, "-m", "mkdocs", "--version").returncode != 0:
        pytest.fail('mkdocs is missing: pip install -e ".[test]" installs it')
    out = run(sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("doc-heading") > 20

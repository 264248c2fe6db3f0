"""The codebase's own checks, run by the suite (so `.ci/run` runs them): lint, types, the docs site.

Each is the tool a contributor runs by hand, with the configuration in pyproject.toml and
mkdocs.yml; a failure prints the tool's own findings.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Left out of the fast loop, which runs ruff, mypy and mkdocs on their own (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def run(*cmd: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    out = run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_passes_with_the_public_api_strict():
    out = run(sys.executable, "-m", "mypy", "--no-incremental")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs site, built once with `--strict` for the tests that read it."""
    if shutil.which("mkdocs") is None and run(sys.executable, "-m", "mkdocs", "--version").returncode != 0:
        pytest.fail('mkdocs is missing: pip install -e ".[test]" installs it')
    path = tmp_path_factory.mktemp("docs") / "site"
    out = run(sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    return path


def test_docs_site_builds_strict(site):
    assert (site / "api" / "index.html").read_text().count("doc-heading") > 20


def test_the_api_page_shows_signatures_and_docstrings_not_code(site):
    text = page_text(site / "api" / "index.html")
    assert 'imap( inputs: Mapping[str, Any] | None = None, map_over: str | Sequence[str] | None = None' in text
    assert "arguments.flag(" not in text and "self._" not in text, "the API page shows how attributes are computed"


def page_text(page: Path) -> str:
    """A built page's visible text, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page.read_text())).split())


def test_benchmarks_page_shows_every_table_cell(site):
    """The site renders every cell of docs/benchmarks.md's tables (a table broken by a stray `|`
    would drop figures silently)."""
    source = (ROOT / "docs" / "benchmarks.md").read_text()
    cells = {c for row in re.findall(r"^\|(.*)\|$", source, re.M) for c in row.split("|")}
    cells = {" ".join(c.replace("**", "").replace("`", "").split()) for c in cells} - {"", "---"}
    shown = page_text(site / "benchmarks" / "index.html")
    missing = sorted(c for c in cells if c not in shown)
    assert len(cells) > 50 and not missing, f"the built benchmarks page does not show these cells: {missing}"


# Loaded into a collection of the suite (`-p`): every test's id and its marks, once the conftest
# has marked the fast loop's tests.
MARKS_PLUGIN = """
import json, os
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    marks = {item.nodeid: [m.name for m in item.iter_markers()] for item in items}
    with open(os.environ["HARDY_TEST_MARKS"], "w") as out:
        json.dump(marks, out)
"""


def test_the_fast_loop_is_the_cores_tests_less_the_slow_ones(tmp_path):
    """`python -m pytest -m fast` (CONTRIBUTING.md): every file of tests/conftest.py's CORE takes
    part, no other file does, and no test marked slow runs in it."""
    from conftest import CORE
    (tmp_path / "hardy_test_marks.py").write_text(MARKS_PLUGIN)
    env = {**os.environ, "HARDY_TEST_MARKS": str(tmp_path / "marks.json"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p",
                          "hardy_test_marks"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    marks = json.loads((tmp_path / "marks.json").read_text())
    fast = {test for test, names in marks.items() if "fast" in names}
    assert not [test for test in fast if "slow" in marks[test]], "a slow test in the fast loop"
    assert {test.split("::")[0].removeprefix("tests/") for test in fast} == set(CORE)
    assert "tests/test_workers.py::test_one_crash_costs_one_item[c_loop]" in fast  # a crash, in a worker
    assert "tests/test_distributed.py::test_two_node_ray_cluster_on_loopback" in set(marks) - fast

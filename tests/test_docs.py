"""The documentation runs as pasted: every ```python block of README.md and docs/ executes.

A page's blocks run in order in one fresh interpreter (a later block may use an earlier one's
names), in an empty working directory, the way a reader pastes them into a script. A block that
cannot run here (it needs a cluster or a GPU) says so on the line above it:
`<!-- not run: the reason -->`; the reason is required, so every exception is explained.

Measured figures have one source, README.md's Performance section, shown verbatim on
docs/benchmarks.md; the other docs pages link to it instead of quoting figures that would drift.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:<!-- not run: (?P<why>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def blocks(page: Path) -> tuple[list[str], list[str]]:
    """(code of the blocks to run, reasons given for the others)"""
    run, skipped = [], []
    for m in FENCE.finditer(page.read_text()):
        if m.group("why") is not None:
            assert m.group("why").strip(), f"{page.name}: a block marked 'not run' needs a reason"
            skipped.append(m.group("why"))
        else:
            run.append(m.group("code"))
    return run, skipped


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_blocks_run_as_pasted(page: Path, tmp_path: Path) -> None:
    code, _ = blocks(page)
    if not code:
        pytest.skip(f"{page.name} has no Python block to run")
    script = "\n".join(f"# --- block {i + 1}\n{c}" for i, c in enumerate(code))
    (tmp_path / "page.py").write_text(script)
    out = subprocess.run([sys.executable, "page.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"{page.name}: a Python block failed\n{out.stderr[-3000:]}"


# A figure is a number with a benchmark unit: a time, a rate or a ratio.
FIGURE = re.compile(
    r"(?<![\w.,-])\d[\d,.]*[kM]?(?:\s?[-–]\s?\d[\d,.]*)?\s?(?:µs|ms|s|items/s|[KMG]i?B/s|/s|x|×)(?![\w/])"
)
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
# Settings of the code, not measurements; each must still occur, so a stale entry fails too.
DESIGN_CONSTANTS = {
    "architecture.md": ("every 50 ms", "every ≥5 ms", "≤5 ms of work", "gives a peer 5 s"),
    "caching.md": ("its 60 s timeout",),
    "failures.md": ("every ≥5 ms", "last ≤5 ms", "~0.25–0.5 s, then 0.5–1 s, 1–2 s"),
}
DOC_PAGES = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks.md"]


def quoted_figures(page: Path) -> list[str]:
    """The benchmark figures a page states in prose or tables (code blocks show sample output)."""
    text = CODE_BLOCK.sub("", page.read_text())
    for phrase in DESIGN_CONSTANTS.get(page.name, ()):
        assert phrase in text, f"{page.name}: the allowed design constant {phrase!r} is gone; drop it from the list"
        text = text.replace(phrase, "")
    return [" ".join(text[max(m.start() - 40, 0) : m.end()].split()) for m in FIGURE.finditer(text)]


@pytest.mark.parametrize("page", DOC_PAGES, ids=[p.name for p in DOC_PAGES])
def test_docs_pages_quote_no_measured_figures(page: Path) -> None:
    found = quoted_figures(page)
    assert not found, (
        f"{page.name} quotes measured figures; they belong in README.md's Performance section "
        "(shown on docs/benchmarks.md): state the claim and link there, "
        "e.g. [measured](benchmarks.md#engines)\n" + "\n".join(f"  ...{f}" for f in found)
    )


SECTION = re.compile(
    r"<!-- --8<-- \[start:(?P<name>[\w-]+)\] -->\n(?P<text>.*?)<!-- --8<-- \[end:(?P=name)\] -->", re.S
)
INCLUDE = re.compile(r'^--8<-- "README\.md:(?P<name>[\w-]+)"$', re.M)


def measured_section() -> str:
    """README.md's Performance section, from its heading to the next one."""
    return (ROOT / "README.md").read_text().split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]


def test_benchmarks_page_includes_the_whole_measured_section() -> None:
    """A paragraph added to the Performance section outside the marked parts would miss the site."""
    parts = {m["name"]: m["text"] for m in SECTION.finditer(measured_section())}
    included = INCLUDE.findall((ROOT / "docs" / "benchmarks.md").read_text())
    assert included == list(parts), (
        "docs/benchmarks.md must include every marked part of README.md's Performance section, in order"
    )
    outside = SECTION.sub("", measured_section()).split()
    assert not outside, (
        f"README.md's Performance section has text outside the parts the docs include: {' '.join(outside)[:300]}"
    )

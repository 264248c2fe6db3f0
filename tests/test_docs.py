"""The documentation runs as pasted: every ```python block of README.md and docs/ executes.

A page's blocks run in order in one fresh interpreter (a later block may use an earlier one's
names), in an empty working directory, the way a reader pastes them into a script. A block that
cannot run here (it needs a cluster or a GPU) says so on the line above it:
`<!-- not run: the reason -->`; the reason is required, so every exception is explained.

Measured figures have one source, docs/benchmarks.md; the other docs pages link to it instead of
quoting figures that would drift, and the README's table of headline ratios quotes it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # every page run as pasted; on its own: python -m pytest tests/test_docs.py
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]
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


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
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
    "architecture.md": ("every 50 ms", "every ≥5 ms", "≤5 ms of work", "up to `SPIN`, 50 µs", "at most 50 µs a call",
                        "at most 50 µs an item",
                        "200 ms by default"),
    "caching.md": ("its 60 s timeout",),
    "guide/executors.md": ("its timeout of 2 s", "after 10 s"),
    "failures.md": ("every ≥5 ms", "the last 5 ms", "whenever 5 ms have passed", "take\n5 ms or more",
                    "~0.25–0.5 s, then 0.5–1 s, 1–2 s"),
}
DOC_PAGES = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p.name != "benchmarks.md"]


def quoted_figures(page: Path) -> list[str]:
    """The benchmark figures a page states in prose or tables (code blocks show sample output)."""
    text = CODE_BLOCK.sub("", page.read_text())
    for phrase in DESIGN_CONSTANTS.get(str(page.relative_to(ROOT / "docs")), ()):
        assert phrase in text, f"{page.name}: the allowed design constant {phrase!r} is gone; drop it from the list"
        text = text.replace(phrase, "")
    return [" ".join(text[max(m.start() - 40, 0) : m.end()].split()) for m in FIGURE.finditer(text)]


@pytest.mark.parametrize("page", DOC_PAGES, ids=[str(p.relative_to(ROOT)) for p in DOC_PAGES])
def test_docs_pages_quote_no_measured_figures(page: Path) -> None:
    found = quoted_figures(page)
    assert not found, (
        f"{page.name} quotes measured figures; they belong in docs/benchmarks.md: state the claim and link "
        "there, "
        "e.g. [measured](benchmarks.md#engines)\n" + "\n".join(f"  ...{f}" for f in found)
    )


def test_the_readme_quotes_only_figures_of_the_benchmarks_page() -> None:
    """The README's headline table repeats figures of docs/benchmarks.md, each verbatim, so a figure
    changed there and not in the README (or made up in the README) fails here."""
    readme = CODE_BLOCK.sub("", (ROOT / "README.md").read_text())
    benchmarks = " ".join((ROOT / "docs" / "benchmarks.md").read_text().replace("**", "").split())
    figures = [m.group() for m in FIGURE.finditer(readme)]
    assert len(figures) >= 10, "the README's table of headline ratios is gone"
    missing = [f for f in figures if " ".join(f.split()) not in benchmarks]
    assert not missing, f"README.md quotes figures docs/benchmarks.md does not hold: {missing}"


def test_no_page_includes_another():
    """Each page owns its text (the site once included README.md's parts, which hid them from review)."""
    for page in PAGES:
        assert "--8<--" not in page.read_text(), f"{page.name} includes text from another file"

"""The documentation runs as pasted: every ```python block of README.md and docs/ executes.

A page's blocks run in order in one fresh interpreter (a later block may use an earlier one's
names), in an empty working directory, the way a reader pastes them into a script. A block that
cannot run here (it needs a cluster or a GPU) says so on the line above it:
`<!-- not run: the reason -->`; the reason is required, so every exception is explained.
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

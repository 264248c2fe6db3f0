"""Which import order crashes: each module alone and each ordered pair, in fresh interpreters.

`import_matrix()` runs each combination N times (in the incident behind it, `import torch` before
`cuml` segfaulted 10-30 % of runs, at exit) and says where each crash happened: during the imports,
during the snippet, or at interpreter exit.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .repeat import classify, wilson

STAGES = ("importing", "running the snippet", "at interpreter exit")


@dataclass
class Cell:
    modules: tuple[str, ...]
    runs: int = 0
    crashes: dict[str, int] = field(default_factory=dict)   # outcome -> count
    stages: dict[str, int] = field(default_factory=dict)    # stage -> crash count

    @property
    def failures(self) -> int:
        return sum(self.crashes.values())

    @property
    def rate(self) -> float:
        return self.failures / self.runs if self.runs else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.failures, self.runs)

    @property
    def label(self) -> str:
        return "; ".join(f"import {m}" for m in self.modules)


def python_command(code: str) -> list[str]:
    """`python -c code` without the working directory on sys.path, which `-c` puts first: `hardy
    doctor` (an installed command) does not look there, and a `torch.py` another user left in a
    shared working directory would be what the doctor examined, and ran (PYTHONPATH still counts)."""
    return [sys.executable, "-c", f"import sys; sys.path[:] = [p for p in sys.path if p]\n{code}"]


def _script(modules: Sequence[str], then: str | None) -> str:
    lines = ["import sys", "sys.stdout.write('HARDY-STAGE 0\\n'); sys.stdout.flush()"]
    lines += [f"import {m}" for m in modules]
    lines += ["sys.stdout.write('HARDY-STAGE 1\\n'); sys.stdout.flush()"]
    if then:
        lines.append(then)
    lines += ["sys.stdout.write('HARDY-STAGE 2\\n'); sys.stdout.flush()"]
    return "\n".join(lines)


def import_matrix(modules: Sequence[str], then: str | None = None, repeat: int = 30, jobs: int = 2,
                  timeout: float = 120, on_cell: Callable[[Cell], None] | None = None) -> list[Cell]:
    """Each module alone and each ordered pair, `repeat` fresh interpreters each."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor
    combos = [(m,) for m in modules] + list(itertools.permutations(modules, 2))
    cells = []
    for combo in combos:
        cell = Cell(tuple(combo))
        script = _script(combo, then)

        def one(_: int, script: str = script) -> tuple[str, str]:
            try:
                proc = subprocess.run(python_command(script), capture_output=True, text=True, timeout=timeout)
                outcome, _sig = classify(proc.returncode, False)
                out = proc.stdout
            except subprocess.TimeoutExpired as exc:
                outcome = "timeout"
                out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            marks = [ln for ln in out.splitlines() if ln.startswith("HARDY-STAGE ")]
            reached = int(marks[-1].split()[1]) if marks else 0
            return outcome, STAGES[min(reached, 2)]

        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for outcome, stage in pool.map(one, range(repeat)):
                cell.runs += 1
                if outcome != "success":
                    cell.crashes[outcome] = cell.crashes.get(outcome, 0) + 1
                    cell.stages[stage] = cell.stages.get(stage, 0) + 1
        cells.append(cell)
        if on_cell:
            on_cell(cell)
    return cells

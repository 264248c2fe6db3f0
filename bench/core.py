"""hardy's per-call cost against a plain-Python loop, in one run: `python bench/core.py`.

Work: three trivial nodes (a = x+1, b = 2a, c = a+b). Targets: per-run overhead <= 3 µs (median of
3,000 runs) and a sequential map of 10,000 items >= 300,000 items/s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def table(results: dict, title: str) -> Table:
    floor = results["plain"]
    t = Table(title=title)
    for col in ("framework", "per run (median µs)", "overhead vs plain (µs)", "map items/s", "plain / framework"):
        t.add_column(col, justify="right")
    for name, r in results.items():
        if "error" in r:
            t.add_row(name, r["error"], "", "", "")
            continue
        t.add_row(name, f"{r['run_us']:.2f}", f"{r['run_us'] - floor['run_us']:.2f}", f"{r['map_per_s']:,.0f}",
                  f"{floor['map_per_s'] / r['map_per_s']:.1f}x slower" if name != "plain" else "1.0x")
    return t


def measure(python: str, names: list[str]) -> dict:
    out = subprocess.run([python, str(Path(__file__).with_name("_measure.py")), *names], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    rows = measure(sys.executable, ["plain", "hardy"])
    Console(width=120).print(table(rows, "hardy vs a plain loop (3 trivial nodes)"))

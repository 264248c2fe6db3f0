"""The cache against joblib.Memory and pipefunc's disk cache, in one run: `python bench/cache.py`.

Work: 10,000 items through 3 trivial nodes. Cold = empty cache directory, warm = the same map
again in a new interpreter (what re-running a script costs). Targets: cold <= 1.5 s, warm >= 50,000
items/s. Also hashing an 8 MB float64 array (target <= 10 ms) and a 100,000 x 10 DataFrame
(<= 15 ms), against joblib.hash.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from compare import environment

HERE = Path(__file__).resolve().parent

HASHING = """
import json, time
import numpy as np, pandas as pd, joblib
from hardy.hashing import hash_value
arr = np.random.default_rng(0).random(1 << 20)
df = pd.DataFrame(np.random.default_rng(1).random((100_000, 10)), columns=list("abcdefghij"))
def best(f, x):
    f(x)
    return min(_t(f, x) for _ in range(5))
def _t(f, x):
    t = time.perf_counter(); f(x); return time.perf_counter() - t
print(json.dumps({"hardy": [best(hash_value, arr), best(hash_value, df)],
                  "joblib": [best(joblib.hash, arr), best(joblib.hash, df)]}))
"""


def run(python: str, framework: str, folder: str) -> float:
    out = subprocess.run([python, str(HERE / "_cache_measure.py"), framework, folder], check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


if __name__ == "__main__":
    python = environment()
    table = Table(title="10,000 items x 3 nodes through a disk cache (2-core machine)")
    for col in ("framework", "cold run", "warm re-run", "warm items/s", "warm vs hardy"):
        table.add_column(col, justify="right")
    rows = {}
    for fw in ("hardy", "joblib", "pipefunc"):
        with tempfile.TemporaryDirectory() as folder:
            try:
                rows[fw] = (run(python, fw, folder), run(python, fw, folder))
            except subprocess.CalledProcessError as exc:
                rows[fw] = None
                table.add_row(fw, "error", exc.stderr.strip().splitlines()[-1][:60], "", "")
    for fw, r in rows.items():
        if r:
            table.add_row(fw, f"{r[0]:.2f} s", f"{r[1]:.3f} s", f"{10_000 / r[1]:,.0f}",
                          f"{r[1] / rows['hardy'][1]:.1f}x slower" if fw != "hardy" else "1.0x")
    console = Console(width=120)
    console.print(table)
    h = json.loads(subprocess.run([python, "-c", HASHING], check=True, capture_output=True, text=True).stdout)
    t2 = Table(title="hashing inputs")
    for col in ("what", "hardy", "joblib.hash"):
        t2.add_column(col, justify="right")
    t2.add_row("8 MB float64 array", f"{h['hardy'][0] * 1000:.1f} ms", f"{h['joblib'][0] * 1000:.1f} ms")
    t2.add_row("100,000 x 10 DataFrame", f"{h['hardy'][1] * 1000:.1f} ms", f"{h['joblib'][1] * 1000:.1f} ms")
    console.print(t2)

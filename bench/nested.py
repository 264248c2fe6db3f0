"""What a nested pipeline costs when the outer pipeline reads only part of it: `python bench/nested.py`.

Work: a nested pipeline with a cheap branch (`summary`) and an expensive one (`embedding`, ~1 ms of
CPU); the outer pipeline reads only `summary`. Rows: plain Python calling only the cheap function
(the floor), plain Python calling both, hardy (which runs only what the outer pipeline reads),
hardy asked for every inner output (what a nested pipeline cost before hardy narrowed it), and
HyperNodes 0.4.8 where bench/.venv-hn (made by tests/test_hypernodes_compat.py) has it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = 200
VENV_HN = Path(__file__).resolve().parent / ".venv-hn" / "bin" / "python"


def summarize(text):
    return text[:3]


def embed(text):
    total = 0
    for k in range(20_000):  # ~1 ms: a stand-in for a model call
        total += k * len(text)
    return total


def title(summary):
    return summary.title()


def timed(call) -> float:
    """Median seconds per call over RUNS calls."""
    samples = []
    for _ in range(RUNS):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(library: str) -> dict[str, float]:
    if library == "plain":
        return {"plain, cheap branch only": timed(lambda: title(summarize("hello"))),
                "plain, both branches": timed(lambda: (title(summarize("hello")), embed("hello")))}
    module = __import__("hardy.compat.hypernodes" if library == "hardy" else "hypernodes", fromlist=["node"])
    inner = module.Pipeline(nodes=[module.node(output_name="summary")(summarize),
                                   module.node(output_name="embedding")(embed)])
    outer = module.Pipeline(nodes=[inner.as_node(), module.node(output_name="title")(title)])
    assert outer.run(inputs={"text": "hello"}) == {"summary": "hel", "title": "Hel"}
    rows = {library: timed(lambda: outer.run(inputs={"text": "hello"}))}
    if library == "hardy":
        everything = ["summary", "embedding", "title"]
        rows["hardy, every inner output asked for"] = timed(
            lambda: outer.run(inputs={"text": "hello"}, output_name=everything))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(measure(sys.argv[1])))
        raise SystemExit
    rows = {**measure("plain"), **measure("hardy")}
    if VENV_HN.exists():
        out = subprocess.run([str(VENV_HN), __file__, "hypernodes"], capture_output=True, text=True)
        rows.update(json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0
                    else {"hypernodes": float("nan")})
    floor = rows["plain, cheap branch only"]
    print(f"{'':40} {'per run (median µs)':>20} {'vs floor':>10}")
    for name, seconds in rows.items():
        print(f"{name:40} {seconds * 1e6:20.1f} {seconds / floor:9.1f}x")

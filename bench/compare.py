"""hardy against HyperNodes and pipefunc on the same work, side by side, in one run.

    python bench/compare.py

Peers are installed into bench/.venv (created on first use; never a dependency of hardy), together
with hardy from this checkout, and all are measured by the same script in the same interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from rich.console import Console

from core import measure, table

HERE = Path(__file__).resolve().parent
PEERS = ["hypernodes==0.4.8", "pipefunc==0.93.2", "joblib", "pandas"]


def environment() -> str:
    folder = HERE / ".venv"
    python = folder / "bin" / "python"
    if not python.exists():
        venv.create(folder, with_pip=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PEERS, "-e", str(HERE.parent)], check=True)
    return str(python)


if __name__ == "__main__":
    python = environment()
    results = measure(python, ["plain", "hardy", "hypernodes", "pipefunc"])
    Console(width=120).print(table(results, f"3 trivial nodes, Python {sys.version.split()[0]}"))

"""The doctor: what a native-heavy Python environment looks like from the inside, and which import
order crashes it.

`examine()` reports versions of the native-heavy packages (and whether hardy's patches of their
internals are known to be safe there), the OpenMP/BLAS runtimes loaded, threads, CUDA state, fork
hazards and shared libraries that cannot be resolved. `import_matrix()` runs each module alone and
each ordered pair in fresh interpreters N times (in the incident behind it, `import torch` before `cuml`
segfaulted 10-30 % of runs, at exit) and says where each crash happened: during the imports, during the
snippet, or at interpreter exit.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import os
import platform
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from .native.loaded import thread_pools
from .repeat import classify, wilson
from .safety.environment import NUMBA_GUARD_RANGE, version_in
from .safety.hazards import fork_hazards

# distribution name -> import name
PACKAGES = {"torch": "torch", "numba": "numba", "llvmlite": "llvmlite", "tokenizers": "tokenizers",
            "cuml": "cuml", "cupy": "cupy", "jax": "jax", "daft": "daft", "numpy": "numpy", "scipy": "scipy",
            "scikit-learn": "sklearn"}

# Internals hardy touches, and the versions it was checked against (PEP 440 specifiers).
KNOWN_RANGES = {
    "numba": (NUMBA_GUARD_RANGE, "FunctionIdentity._unique_ids (the unique-id guard)"),
    "torch": (">=1.10,<2.15", "torch.cuda._is_in_bad_fork (the CUDA fork probe)"),
}

SEVERITY = {"ok": 0, "warning": 1, "error": 2}


@dataclass
class Finding:
    severity: str  # "ok", "warning", "error"
    topic: str
    message: str


@dataclass
class Report:
    python: str
    platform: str
    packages: dict[str, str | None] = field(default_factory=dict)
    imported: list[str] = field(default_factory=list)
    openmp: list[str] = field(default_factory=list)
    blas: list[str] = field(default_factory=list)
    threads: dict[str, Any] = field(default_factory=dict)
    cuda: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    @property
    def worst(self) -> str:
        return max((f.severity for f in self.findings), key=SEVERITY.__getitem__, default="ok")

    @property
    def exit_code(self) -> int:
        return SEVERITY[self.worst]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["worst"] = self.worst
        return d


def examine(imports: Sequence[str] = ()) -> Report:
    """Import `imports` here, then describe this process (see the module docstring)."""
    report = Report(python=sys.version.split()[0] + f" ({sys.executable})",
                    platform=f"{platform.system()} {platform.release()} {platform.machine()}")
    for module in imports:
        try:
            importlib.import_module(module)
            report.imported.append(module)
        except Exception as exc:  # the doctor reports, it does not fail
            report.findings.append(Finding("error", "import", f"import {module} failed: {type(exc).__name__}: {exc}"))
    for dist in PACKAGES:
        try:
            report.packages[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            report.packages[dist] = None
    for dist, (specifier, what) in KNOWN_RANGES.items():
        version = report.packages.get(dist)
        if version is None:
            continue
        if not version_in(version, specifier):
            report.findings.append(Finding(
                "warning", "versions", f"{dist} {version} is outside the range hardy checked for {what} "
                f"({specifier}); hardy leaves it unpatched"))
        else:
            report.findings.append(Finding("ok", "versions", f"{dist} {version}: {what} is known to be safe"))
    pools = thread_pools()
    report.openmp = [p["filepath"] for p in pools if p["user_api"] == "openmp"]
    report.blas = [p["filepath"] for p in pools if p["user_api"] == "blas"]
    report.threads = {
        "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
        "python_threads": threading.active_count(),
        **{f"{p['internal_api']} threads ({os.path.basename(p['filepath'])})": p["num_threads"] for p in pools},
        "cpu_count": os.cpu_count(),
        **{v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                          "TOKENIZERS_PARALLELISM")},
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        report.threads["torch_threads"] = torch.get_num_threads()
        report.cuda = {"torch_cuda_compiled": torch.cuda._is_compiled(),
                       "torch_cuda_initialized": torch.cuda.is_initialized()}
    for hazard in fork_hazards():
        severity = "warning"
        report.findings.append(Finding(severity, f"fork hazard: {hazard.kind}", f"{hazard.summary}. {hazard.detail}"))
    if report.imported:
        from .native.libs import analyse, scan
        dirs = _module_dirs(report.imported)
        plan = analyse(scan(dirs), search=[p for p in sys.path if p and os.path.isdir(p)])
        for m in plan.missing:
            report.findings.append(Finding("error", "shared libraries", str(m)))
    return report


def _module_dirs(modules: Sequence[str]) -> list[str]:
    """The directories of the imported packages (single-file modules have no libraries of their own)."""
    dirs = []
    for name in modules:
        mod = sys.modules.get(name.split(".")[0])
        dirs += [d for d in getattr(mod, "__path__", []) if os.path.isdir(d)]
    return dirs


# --- the import-order crash matrix ----------------------------------------------------------------

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

        def one(_: int) -> tuple[str, str]:
            try:
                proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                      timeout=timeout)
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

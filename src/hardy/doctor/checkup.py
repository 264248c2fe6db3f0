"""What a native-heavy Python environment looks like from the inside.

`examine()` reports versions of the native-heavy packages (and whether hardy's patches of their
internals are known to be safe there), the OpenMP/BLAS runtimes loaded, threads, CUDA state, fork
hazards and shared libraries that cannot be resolved.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import NoGpuError, install_hint
from ..native.loaded import thread_pools
from ..safety.environment import NUMBA_GUARD_RANGE, version_in
from ..safety.hazards import fork_hazards

# distribution name -> import name
PACKAGES = {"torch": "torch", "numba": "numba", "llvmlite": "llvmlite", "tokenizers": "tokenizers",
            "cuml": "cuml", "cupy": "cupy", "jax": "jax", "daft": "daft", "numpy": "numpy", "scipy": "scipy",
            "scikit-learn": "sklearn"}

# Internals hardy touches, and the versions it was checked against (PEP 440 specifiers).
KNOWN_RANGES = {
    "numba": (NUMBA_GUARD_RANGE, "FunctionIdentity._unique_ids (the unique-id guard)"),
    "torch": (">=1.10,<2.15", "torch.cuda._is_in_bad_fork (the CUDA fork probe)"),
}

SEVERITY = {"ok": 0, "note": 0, "warning": 1, "error": 2}


@dataclass
class Finding:
    severity: str  # "ok", "note" (worth knowing, nothing wrong), "warning", "error"
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
    gpu: dict[str, Any] = field(default_factory=dict)
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
            report.findings.append(import_failure(module, exc))
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
    hazards = fork_hazards()
    for hazard in hazards:
        report.findings.append(Finding("warning", f"fork hazard: {hazard.kind}", f"{hazard.summary}. {hazard.detail}"))
    report.gpu, gpu_findings = examine_gpus([h.summary for h in hazards if h.kind == "cuda"])
    report.findings += gpu_findings
    report.findings += examine_forensics()
    if report.imported:
        report.findings += examine_libraries(_module_dirs(report.imported))
    return report


def examine_libraries(dirs: Sequence[str]) -> list[Finding]:
    """A library of the imported packages whose dependency cannot be found. Loaded, it had all it
    needs (the loader found it: nothing to say); not loaded, it is a part the package loads only
    when asked (numba's TBB threading layer, `tbbpool...so` needing libtbb.so.12, on a numba that
    runs on its OpenMP layer): a note, since nothing fails unless something loads it."""
    from ..native.libs import analyse, scan
    from ..native.loaded import loaded_libraries
    plan = analyse(scan(dirs), search=[p for p in sys.path if p and os.path.isdir(p)])
    loaded = set(loaded_libraries())  # (real paths)
    return [Finding("note", "shared libraries", f"{m}; it is not loaded here (an optional part of its package, "
                    "loaded only when asked for), so nothing fails unless something loads it")
            for m in plan.missing if os.path.realpath(m.library.path) not in loaded]


def import_failure(module: str, exc: Exception) -> Finding:
    """`import module` failed: with what the package's shared libraries need and cannot find, where
    on sys.path each is, and the fix (on a split sys.path, a Bazel layout: `pkgb/libb.so` needing
    `liba.so`, which only another entry's `pkga` has; the loader never looks there)."""
    said = f"import {module} failed: {type(exc).__name__}: {exc}"
    from ..native.libs import analyse, scan
    plan = analyse(scan(_spec_dirs(module)), search=[p for p in sys.path if p and os.path.isdir(p)])
    return Finding("error", "import", "; ".join([said, *(_library_fix(m) for m in plan.missing)]))


def _spec_dirs(module: str) -> list[str]:
    """The directories of a module that failed to import (its own if a package, else its package's),
    found without importing it or its parents: `find_spec("pkg.sub")` imports pkg, whose failure
    (an OSError for a missing library) is often the one being explained. The path finder, given
    each parent's folders, looks a name up without running anything."""
    head, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(head)  # (a top-level name: nothing is imported)
        for part in rest:
            places = spec.submodule_search_locations if spec is not None else None
            if spec is None or not places:
                break
            found = importlib.machinery.PathFinder.find_spec(f"{spec.name}.{part}", list(places))
            if found is None:  # (a submodule the path finder cannot see: the package's folders then)
                break
            spec = found
    except Exception:  # (a finder or an odd name failing: no folders to scan)
        return []
    if spec is None:
        return []
    dirs = spec.submodule_search_locations or ([os.path.dirname(spec.origin)] if rest and spec.origin else [])
    return [d for d in dirs if os.path.isdir(d)]


def _library_fix(m: Any) -> str:
    """One unresolved DT_NEEDED (`native.libs.Missing`), with the fix where it is on sys.path."""
    if m.unnamed or not m.elsewhere:
        return str(m)
    dirs = [m.elsewhere, m.library.directory]
    return (f"{m}: load it first, by path: Engine(preload_libs={dirs!r}) for hardy's workers, or "
            f"hardy.native.preload(paths={dirs!r}) before the import in this process "
            f"(`hardy libs {' '.join(dirs)} --order` prints the order)")


def examine_forensics() -> list[Finding]:
    """Whether a crashed worker will name its native frames and a hung one its stacks, here, and
    what to change if not (docs/failures.md, "Native crash forensics")."""
    from ..crash.handler import NO_COMPILER, mechanism
    from ..crash.stacks import ptrace_scope, py_spy
    kind, why = mechanism()
    # the fix for a missing compiler; any other reason (a read-only or full cache folder, a compiler's
    # error, a folder someone else may write) names its own
    fix = "; install a C compiler (gcc) so hardy builds its native handler" if why.startswith(NO_COMPILER) else ""
    found = [Finding("ok", "forensics", "native frames of crashes: the compiled handler is installed in workers")
             if kind == "native" else
             Finding("warning", "forensics", f"native frames of crashes: the ctypes fallback ({why}): it runs Python "
                     f"in the signal handler and records nothing for a stack overflow{fix}") if kind == "ctypes" else
             Finding("warning", "forensics", f"native frames of crashes: none ({why})")]
    scope = ptrace_scope()
    if py_spy() is None:
        found.append(Finding("warning", "forensics", "stacks of hung items: Python frames only (faulthandler); "
                             f"for every thread's native frames, py-spy: {install_hint('forensics')}"))
    elif scope is not None and scope >= 2:
        found.append(Finding("warning", "forensics", f"stacks of hung items: Yama ptrace_scope={scope} lets only "
                             "an administrator attach py-spy: run `sysctl kernel.yama.ptrace_scope=1` (workers "
                             "name their parent as tracer), or expect Python frames only"))
    else:
        found.append(Finding("ok", "forensics", "stacks of hung items: py-spy, every thread's Python and native "
                             f"frames ({'no Yama' if scope is None else f'Yama ptrace_scope={scope}'}; workers "
                             "name their parent as tracer)"))
    gdb = shutil.which("gdb")
    found.append(Finding("ok", "forensics", f"hardy replay --gdb: gdb is {gdb}" if gdb else
                         "hardy replay --gdb: gdb is not installed (optional: apt-get install gdb, dnf install gdb)"))
    return found


def examine_gpus(cuda_hazards: Sequence[str] = ()) -> tuple[dict[str, Any], list[Finding]]:
    """The GPUs the driver reports, the CUDA versions the installed torch/cupy were built for and
    whether the driver runs them, the GPUs' compute capabilities against torch's architectures,
    and what this process has done with CUDA; all without initialising CUDA here."""
    from ..safety.gpus import ASSUME, inventory
    found: list[Finding] = []
    try:
        inv = inventory()
    except NoGpuError as exc:
        return {"source": "none", "gpus": []}, [Finding("error", "gpu", str(exc))]
    torch = sys.modules.get("torch")
    built = {"torch": torch.version.cuda if torch is not None else _torch_built_for(),
             "cupy": _cupy_built_for()}
    info: dict[str, Any] = {
        "source": inv.source, "driver": inv.driver, "cuda_driver": inv.cuda_driver,
        "gpus": [asdict(g) for g in inv.gpus], "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "built_for_cuda": {k: v for k, v in built.items() if v}, "torch_architectures": [],
        "cuda_in_this_process": "; ".join(cuda_hazards) or ("untouched" if torch is not None or "cupy" in sys.modules
                                                            else "untouched (no CUDA library imported)")}
    if inv.source == ASSUME:
        found.append(Finding("warning", "gpu", f"{ASSUME}={os.environ[ASSUME]} declares GPUs nobody looked for "
                             "(meant for tests of GPU slots on machines without one); unset it for real work"))
        return info, found
    if not inv.gpus:
        found.append(Finding("ok", "gpu", f"no NVIDIA GPU: {inv.problem}. Engine(gpus=...) cannot start GPU "
                             "workers here; every node runs on CPU"))
        return info, found
    for lib, version in info["built_for_cuda"].items():
        found.append(_driver_runs(lib, version, inv.cuda_driver, inv.driver))
    if built["torch"]:
        info["torch_architectures"] = _torch_architectures(torch)
        for g in inv.gpus:
            if g.compute_capability and info["torch_architectures"]:
                found.append(_architecture_finding(g.index, g.name, g.compute_capability, info["torch_architectures"]))
    return info, found


def _torch_built_for() -> str | None:
    """torch.version.cuda read from torch's version.py: importing torch costs seconds and would
    change the process being examined."""
    import importlib.util
    import re
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            match = re.search(r"^cuda\b[^=]*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        return None
    return match.group(1) if match else None


def _cupy_built_for() -> str | None:
    """cupy's wheels name their CUDA: cupy-cuda12x is CUDA 12, cupy-cuda118 is CUDA 11.8."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("cupy-cuda"):
            tag = name[len("cupy-cuda"):]
            return f"{tag[:-1]}.x" if tag.endswith("x") else f"{tag[:-1]}.{tag[-1]}"
    return None


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in (text or "").split(".") if p.isdigit())


def _driver_runs(lib: str, built: str, supported: str | None, driver: str | None) -> Finding:
    have, need = _version(supported), _version(built)
    if not have:
        return Finding("warning", "gpu", f"{lib} was built for CUDA {built}; the driver's CUDA version is unknown")
    if have[0] < need[0]:
        return Finding("error", "gpu", f"{lib} was built for CUDA {built}, but driver {driver} runs CUDA up to "
                       f"{supported}: CUDA calls fail ('driver too old'); update the driver or install a {lib} "
                       f"built for CUDA {have[0]}")
    if have < need:
        return Finding("warning", "gpu", f"{lib} was built for CUDA {built}, driver {driver} runs CUDA up to "
                       f"{supported}: minor-version compatibility runs it, except kernels compiled for the newer "
                       "release (PTX)")
    return Finding("ok", "gpu", f"{lib} built for CUDA {built}: driver {driver} runs CUDA up to {supported}")


def _torch_architectures(torch: Any) -> list[str]:
    """The architectures compiled into torch (`torch.cuda.get_arch_list()` without its CUDA probe);
    when torch is not imported here, read in a child interpreter."""
    if torch is not None:
        flags = getattr(torch._C, "_cuda_getArchFlags", lambda: None)()
    else:
        import subprocess

        from .imports import python_command
        code = "import torch, sys; sys.stdout.write(getattr(torch._C, '_cuda_getArchFlags', lambda: '')() or '')"
        try:
            flags = subprocess.run(python_command(code), capture_output=True, text=True, timeout=120).stdout
        except (OSError, subprocess.SubprocessError):
            flags = ""
    return (flags or "").split()


def runs_on(capability: str, architectures: Sequence[str]) -> bool:
    """Whether code built for `architectures` (sm_80, compute_90...) runs on a GPU of this compute
    capability: a cubin runs on its major version from its minor up, PTX on anything newer."""
    have = _version(capability)
    for arch in architectures:
        kind, _, number = arch.partition("_")
        digits = "".join(ch for ch in number if ch.isdigit())
        if not digits:
            continue
        built = divmod(int(digits), 10)
        if kind == "sm" and built[0] == have[0] and built[1] <= have[1] or kind == "compute" and built <= have:
            return True
    return False


def _architecture_finding(index: int, name: str, capability: str, architectures: list[str]) -> Finding:
    if runs_on(capability, architectures):
        return Finding("ok", "gpu", f"GPU {index} ({name}, compute capability {capability}) is among torch's "
                       "architectures")
    return Finding("error", "gpu", f"GPU {index} ({name}) has compute capability {capability}, which torch was not "
                   f"built for ({' '.join(architectures)}): kernels fail with 'no kernel image is available for "
                   "execution on the device'; install a torch wheel built for it")


def _module_dirs(modules: Sequence[str]) -> list[str]:
    """The directories of the imported packages (single-file modules have no libraries of their own)."""
    dirs = []
    for name in modules:
        mod = sys.modules.get(name.split(".")[0])
        dirs += [d for d in getattr(mod, "__path__", []) if os.path.isdir(d)]
    return dirs

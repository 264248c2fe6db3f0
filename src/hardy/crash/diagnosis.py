"""What a native stack says about the hazards hardy knows.

Each rule reads the frames of a crash (or the text of a hung worker's stacks) and, when it
matches, says which hazard it is and what to change. They name a cause only where the frames
show it: a hang in an OpenMP barrier, a crash inside a CUDA library, a library loaded from another
directory than this process loaded it from, a crash after the node had returned.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from ..native.loaded import loaded_libraries
from .symbols import Frame

_OPENMP_WAIT = re.compile(r"gomp_(team_)?barrier_wait|GOMP_barrier|gomp_mutex_lock_slow|__kmp_(suspend|wait)|"
                          r"kmp_barrier|__kmp_fork_barrier")
_LOCK = re.compile(r"pthread_mutex_lock|__lll_lock_wait|futex_wait")
_ATFORK = re.compile(r"atfork|libgomp|libiomp|libomp")
_OPENMP_LIB = re.compile(r"\((libgomp|libiomp5|libomp)[.-]")
_CUDA = re.compile(r"^lib(cuda|cudart|cudnn\w*|cublas\w*|cufft|curand|cusparse|cusolver|nccl|nvrtc|nvJitLink)\b")


def diagnose(frames: Sequence[Frame] = (), stacks: str = "", after_return: bool = False) -> list[str]:
    """Sentences naming each matched hazard and its remedy (none when nothing matches)."""
    text = "\n".join(map(str, frames)) + "\n" + stacks
    found = []
    if _OPENMP_WAIT.search(text) or (_LOCK.search(text) and _ATFORK.search(text)) or _waits_in_openmp(stacks):
        found.append("waits in an OpenMP barrier or lock: the fork-after-OpenMP hazard when this worker was forked "
                     "from a process whose OpenMP pool had threads (they do not exist in the child, so it waits "
                     "for ever). Remedy: start workers with start_method='forkserver' or 'spawn' (hardy's default "
                     "unless 'fork' was asked for), or set OMP_NUM_THREADS=1 before the parent's first parallel "
                     "region; `hardy doctor` lists the OpenMP runtimes loaded")
    cuda = next((f for f in frames if f.library and _CUDA.match(f.name)), None)
    if cuda is not None:
        found.append(f"the crash is inside the CUDA stack ({cuda.short()}): check that the driver supports this "
                     "CUDA version and that the CUDA libraries come from one install (`hardy doctor`, `hardy "
                     "libs`); run CUDA nodes with map_executor='process' so one crash costs one item, and set "
                     "CUDA_LAUNCH_BLOCKING=1 to make the failing kernel the one reported")
    found += _elsewhere(frames)
    replaced = next((f for f in frames if f.replaced), None)
    if replaced is not None:
        found.append(f"{replaced.name} was replaced on disk after the worker loaded it (a rebuild, a `pip install "
                     "-U` during the run): the worker ran the old file, so its functions are named from that copy "
                     "where the worker could still read it, else not at all (never from the new file); close the "
                     "engine (engine.close()) so that its workers load one same file")
    if after_return and frames:
        culprit = next((f for f in frames if f.library), None)
        where = f" in {culprit.short()}" if culprit else ""
        found.append(f"crash at exit: the node had returned and its results were kept; the crash{where} came "
                     "during clean-up (a destructor or a library's own thread), not from the item")
    return found


def _waits_in_openmp(stacks: str) -> bool:
    """Whether a thread of py-spy's dump is stopped inside an OpenMP runtime (its innermost
    frame there: their internal barrier functions are unnamed in a stripped libgomp)."""
    for block in stacks.split("\nThread ")[1:]:
        lines = block.splitlines()
        if len(lines) > 1 and _OPENMP_LIB.search(lines[1]):
            return True
    return False


def _elsewhere(frames: Sequence[Frame]) -> list[str]:
    """Libraries of the crash that this process loaded from another directory. Both sides by real
    path (this process's map names files so), matched by name up to the major version
    (`_one_library`): a worker that loaded a soname's link and this process the file behind it,
    or two builds of `libstdc++.so.6` (6.0.30 and 6.0.32), name one library."""
    theirs = {frame.library: os.path.realpath(frame.library) for frame in frames if frame.library}
    here: dict[str, str] = {}
    for path in loaded_libraries():
        here.setdefault(_one_library(path), path)
    said: list[str] = []
    for frame in frames:
        if not frame.library:
            continue
        real = theirs[frame.library]
        mine = here.get(_one_library(real))
        if mine and os.path.dirname(mine) != os.path.dirname(real) and frame.name not in str(said):
            said.append(f"{frame.name} was loaded from {os.path.dirname(real)} in the worker but from "
                        f"{os.path.dirname(mine)} in this process: two copies of one library, the worker's from "
                        "an unexpected directory (LD_LIBRARY_PATH, RPATH or import order; `hardy libs` shows "
                        "which package ships each, preload_libs= pins one)")
    return said


_MAJOR = re.compile(r"^(.*?\.so(?:\.\d+)?)(?:\..*)?$")  # the name up to `.so.N`


def _one_library(path: str) -> str:
    """`libstdc++.so.6` for `.../libstdc++.so.6.0.32`; a name without `.so` as it is."""
    name = os.path.basename(path)
    major = _MAJOR.match(name)
    return major.group(1) if major else name

"""Fork hazards: state in this process that a forked child would inherit broken.

`fork()` copies memory but only the calling thread. Whatever another thread held (an OpenMP pool's
barrier, a CUDA context, a tokenizer's rayon pool, a lock inside malloc) stays held forever in the
child: the child hangs or crashes. These checks are cheap (microseconds; the CUDA probe ~10 ms and
only when torch is imported with CUDA support) and run before any worker starts. hardy itself never
forks a bare child unless asked (`start_method="fork"`), and then refuses when a hazard is present.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from dataclasses import dataclass

from ..errors import ForkRefused, HazardError
from ..native.loaded import openmp_runtimes


@dataclass(frozen=True)
class Hazard:
    kind: str       # "cuda", "openmp-pool", "openmp-runtimes", "tokenizers", "threads", "jax"
    summary: str    # one line
    detail: str     # why it breaks a forked child, and what hardy does about it

    def __str__(self) -> str:
        return f"{self.kind}: {self.summary}. {self.detail}"


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _cuda_hazards() -> list[Hazard]:
    found = []
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda"):
        cuda = torch.cuda
        if cuda.is_initialized():
            found.append(Hazard("cuda", "torch has initialised CUDA in this process",
                                "A forked child cannot re-initialise CUDA ('Cannot re-initialize CUDA in "
                                "forked subprocess'); hardy starts workers with forkserver/spawn instead."))
        elif getattr(cuda, "_is_compiled", lambda: False)() and _fork_probe_bad_cuda():
            found.append(Hazard("cuda", "torch has probed CUDA (torch.cuda.is_available() or a device query)",
                                "The probe already binds the CUDA driver to this process: a forked child is "
                                "in torch's 'bad fork' state and fails on its first CUDA call."))
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        found.append(Hazard("cuda", "cupy is imported",
                            "If cupy has touched the GPU, a forked child inherits an unusable CUDA context."))
    jax = sys.modules.get("jax")
    if jax is not None:
        backends = getattr(sys.modules.get("jax._src.xla_bridge"), "_backends", None)
        if backends:
            found.append(Hazard("jax", "jax has initialised its backends",
                                "JAX runs internal thread pools; JAX documents os.fork() as incompatible."))
    return found


def _fork_probe_bad_cuda() -> bool:
    """Fork a throwaway child that only reads torch's bad-fork flag and exits (~10 ms)."""
    pid = os.fork()
    if pid == 0:  # child: touch nothing, report, leave without running any finaliser
        try:
            import torch
            os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 1


# hardy's own threads, which hold no lock a forked worker needs, so that a fork may leave them out:
# imap's runner (blocked on its queue, or running this very fork), the progress bar's refresher and
# rich's drawing thread it starts (they hold rich's locks, which a worker's print takes only under a
# bar in a terminal, as before any re-check), `hardy run`'s output watch (a poll), a pool's spare
# starter (never with "fork"), an object-store lease's renewer (waits on fsspec's loop, reset in a
# child), the threads writing parts of a shipped message (pwrite) and the sklearn-config reader.
# Not "hardy-await": it runs the user's coroutine, which may hold the user's locks.
OWN_THREADS = frozenset({"hardy-imap", "hardy-progress", "hardy-progress-draw", "hardy-output-watch",
                         "hardy-spare-worker", "hardy-lease-renew", "hardy-ship-part", "hardy-sklearn-config"})


def _foreign_threads(caller: threading.Thread | None) -> list[threading.Thread]:
    """The Python threads whose locks a forked child could need: all but this one and hardy's own
    (`OWN_THREADS`). When this one is hardy's own (imap's runner forking a worker), the fork is
    made for `caller` (the thread that started the pool, and passed its check then): not it either."""
    me = threading.current_thread()
    spared = {me, caller} if me.name in OWN_THREADS and caller is not None else {me}
    return [t for t in threading.enumerate() if t not in spared and t.name not in OWN_THREADS]


def fork_hazards(probe_cuda: bool = True, runtimes: bool = True,
                 caller: threading.Thread | None = None) -> list[Hazard]:
    """Every reason, right now, why forking this process would give a broken child.

    `runtimes=False` (the check before each later fork of a pool, `check_fork_again`) asks
    threadpoolctl for the OpenMP runtimes (most of the check's cost: ~0.4 ms) only when native
    threads run, to name their pool: without them a fork child inherits no held lock, and two
    runtimes loaded at once (oversubscription, not a broken child) were checked at the pool's start.
    `caller`: the thread a fork from one of hardy's threads is for (`_foreign_threads`)."""
    found = _cuda_hazards() if probe_cuda else []
    py_threads = threading.active_count()
    os_threads = _os_threads()
    omp = openmp_runtimes() if runtimes or os_threads > py_threads else []
    if len(omp) > 1:
        found.append(Hazard("openmp-runtimes", f"{len(omp)} OpenMP runtimes are loaded: "
                            + ", ".join(os.path.basename(p) for p in omp),
                            "Two runtimes each size their own thread pool (oversubscription) and can crash "
                            "when both are active; install packages built against one runtime if you can."))
    if omp and os_threads > py_threads:
        found.append(Hazard("openmp-pool", f"an OpenMP runtime is loaded and {os_threads - py_threads} native "
                            "thread(s) are running (typically the pool of a parallel region that has run)",
                            "A forked child inherits the pool's state but not its threads: its next parallel "
                            "region waits forever (libgomp) or aborts."))
    elif os_threads > py_threads:
        found.append(Hazard("threads", f"{os_threads - py_threads} native thread(s) run outside Python",
                            "A forked child gets only the forking thread; locks held by the others (malloc, "
                            "rayon/TBB pools) stay locked in the child forever."))
    others = _foreign_threads(caller)
    if others:
        names = ", ".join(repr(t.name) for t in others)
        found.append(Hazard("threads", f"{len(others)} Python thread(s) besides this one are running ({names}; "
                            "hardy's own are not counted)",
                            "A forked child gets only the forking thread; locks the others hold stay locked."))
    if "tokenizers" in sys.modules and os.environ.get("TOKENIZERS_PARALLELISM", "").lower() not in (
            "false", "0"):
        found.append(Hazard("tokenizers", "HF tokenizers is imported with parallelism enabled",
                            "If its rayon pool has run, a forked child deadlocks on first use; hardy's workers "
                            "set TOKENIZERS_PARALLELISM=false unless you set it."))
    return found


def _refusal(hazards: list[Hazard], when: str) -> str:
    return (f"start_method='fork' refused{when}: forking this process now would give broken workers.\n  - "
            + "\n  - ".join(str(h) for h in hazards)
            + "\nUse the default (forkserver) or 'spawn', or start_method='fork!' to fork anyway.")


def check_fork_again(caller: threading.Thread | None) -> None:
    """Before every fork of a start_method="fork" pool's worker: the hazards again, since a thread
    started after the pool (holding a lock) would hang the fork child on it until its timeout.
    `caller`: the thread that started the pool, for whom imap's runner forks. Microseconds (the
    threads, the CUDA state) unless native threads run (`fork_hazards`)."""
    hazards = fork_hazards(runtimes=False, caller=caller)
    if hazards:
        raise ForkRefused(_refusal(hazards, " for a new worker (the pool's first, or one replacing a worker "
                                            "that died or was recycled)")
                          + " A map's finished results are in this error's .results (None for an item not run).")


def choose_start_method(requested: str) -> str:
    """A start method the user asked for: "fork" only when no hazard is present; "fork!" forces.
    (The default, a fork server, needs no check: `workers.launch.DEFAULT_START_METHOD`.)"""
    import multiprocessing as mp
    available = mp.get_all_start_methods()
    if requested in ("fork", "fork!"):
        hazards = fork_hazards()
        if hazards and requested == "fork":
            raise HazardError(_refusal(hazards, ""))
        if hazards:
            warnings.warn("start_method='fork!' with fork hazards present: "
                          + "; ".join(h.summary for h in hazards), RuntimeWarning, stacklevel=3)
        return "fork"
    if requested not in available:
        raise HazardError(f"start_method={requested!r} is not available here; choose one of {available}.")
    return requested

"""Fork hazards with real native runtimes: torch's OpenMP pool (CPU build) and the numba guard.

Each scenario runs in a fresh interpreter, so the state it creates (an OpenMP pool, torch
imported) is exactly what a user's process would have, and this test process stays clean.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import needs_torch
from hardy.safety import numba_guard_supported
from hardy.workers.launch import THREAD_VARIABLES, worker_environment


def run_script(code: str, timeout: float = 240, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_no_hazard_in_a_plain_process():
    # a fresh interpreter: this test process has loaded whatever earlier tests loaded (OpenMP too)
    out = run_script("""
        from hardy.safety import fork_hazards
        print([h.kind for h in fork_hazards() if h.kind in ("cuda", "openmp-pool", "tokenizers")])
    """)
    assert out.strip() == "[]"


@pytest.mark.slow
def test_torch_openmp_pool_is_detected_and_avoided():
    needs_torch()
    out = run_script("""
        import time
        import torch
        from hardy import Engine, NodeTimeout, Pipeline, node, Failed
        from hardy.errors import HazardError
        from hardy.safety import fork_hazards

        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        (a @ a).sum()                       # the OpenMP pool is now alive in this process
        kinds = {h.kind for h in fork_hazards()}
        assert "openmp-pool" in kinds, kinds

        @node(output_name="s", timeout=10)
        def matmul(x):
            b = torch.full((256, 256), float(x))
            return float((b @ b).sum())

        expected = [256 * 256 * 256 * float(x * x) for x in range(6)]
        with Engine(map_executor="process", workers=2, preload=["torch"]) as e:
            out = Pipeline(nodes=[matmul], engine=e).map(inputs={"x": list(range(6))}, map_over="x")
        assert [o["s"] for o in out] == expected, out
        print("forkserver: ok")

        try:
            Engine(map_executor="process", start_method="fork").process_pool()
        except HazardError as exc:
            assert "openmp-pool" in str(exc)
            print("fork: refused")

        # Forcing a bare fork shows the hazard is real: the child hangs in libgomp, and the
        # node's timeout turns the hang into NodeTimeout instead of a pipeline stuck forever.
        import warnings
        warnings.simplefilter("ignore")
        fast = node(output_name="s", timeout=3)(matmul.func)
        with Engine(map_executor="process", workers=1, start_method="fork!") as e:
            out = Pipeline(nodes=[fast], engine=e).map(inputs={"x": [1]}, map_over="x", on_error="continue")
        assert isinstance(out[0], Failed) and isinstance(out[0].error, NodeTimeout), out
        print("fork!: hung child killed")
    """)
    assert out.split("\n")[:3] == ["forkserver: ok", "fork: refused", "fork!: hung child killed"]


@pytest.mark.slow
def test_preloaded_torch_is_imported_once_in_the_fork_server_not_per_worker():
    """Workers fork from a server that imported torch: they start holding it (how fast that is,
    ~30 ms, is measured in bench/workers.py)."""
    needs_torch()
    out = run_script("""
        import sys
        import torch
        from hardy import Engine, Pipeline, node

        @node(output_name="y")
        def held(x):
            return "torch" in sys.modules  # this node never imports torch itself

        @node(output_name="y")
        def compiler_loaded(x):
            return "torch._dynamo" in sys.modules

        with Engine(map_executor="process", workers=1, preload=["torch"]) as e:
            print(Pipeline(nodes=[held], engine=e).map(inputs={"x": [0]}, map_over="x")[0]["y"])
            # taking the caller's torch settings (docs/same-answer.md) loads nothing more: the first
            # call of torch.use_deterministic_algorithms imports torch's compiler (a second, 800 modules)
            print(Pipeline(nodes=[compiler_loaded], engine=e).map(inputs={"x": [0]}, map_over="x")[0]["y"])
        with Engine(map_executor="process", workers=1) as e:
            print(Pipeline(nodes=[held], engine=e).map(inputs={"x": [0]}, map_over="x")[0]["y"])
    """)
    assert out.split() == ["True", "False", "False"]


def test_worker_environment_leaves_user_settings():
    env = worker_environment(2)
    assert env["TOKENIZERS_PARALLELISM"] in ("false", *filter(None, [__import__("os").environ.get(
        "TOKENIZERS_PARALLELISM")]))
    assert set(env) >= {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"}


def test_numba_guard_version_range():
    assert numba_guard_supported("0.60.0")
    assert not numba_guard_supported("0.40.1")
    assert not numba_guard_supported("1.2.0")
    assert not numba_guard_supported("dev")


@pytest.mark.slow  # torch in a subprocess
def test_forked_workers_get_their_thread_caps_through_threadpoolctl():
    """Environment variables reach only runtimes loaded after them: a worker forked from a parent
    whose OpenMP and OpenBLAS runtimes are loaded gets its cap through each runtime's own call."""
    needs_torch()
    out = run_script("""
        import warnings
        import numpy, torch
        from threadpoolctl import threadpool_info
        from hardy import Engine, Pipeline, node

        warnings.simplefilter("ignore")  # fork! warns about the threads of this process

        @node(output_name="threads")
        def threads(x):
            return sorted({p["user_api"]: p["num_threads"] for p in threadpool_info()}.items())

        parent = sorted({p["user_api"]: p["num_threads"] for p in threadpool_info()}.items())
        with Engine(map_executor="process", workers=2, start_method="fork!") as e:
            out = Pipeline(nodes=[threads], engine=e).map(inputs={"x": [0, 1]}, map_over="x")
        print(parent, out[0]["threads"])
    """, env={k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES})  # no caps chosen by the user
    parent, child = out.strip().split("] [")
    assert "('openmp', 2)" in parent and "('blas', 2)" in parent  # 2 cores: each runtime sized to both
    assert "('openmp', 1)" in child and "('blas', 1)" in child    # 2 workers: one thread each


def test_runtimes_loaded_in_a_worker_or_preloaded_in_its_server_get_the_workers_cap():
    """A fork server without preload loads no OpenMP or BLAS runtime, so it asks threadpoolctl
    nothing (its import would delay every first map): a runtime a node loads reads the cap from
    the worker's environment. A preloaded runtime is loaded before the caps apply: the server caps
    it through threadpoolctl, once, before its workers fork."""
    needs_torch()
    out = run_script("""
        import sys
        from hardy import Engine, Pipeline, node
        from hardy.native.loaded import may_hold_thread_pools

        @node(output_name="threads")
        def threads(x):
            asked = "threadpoolctl" in sys.modules  # before this node loads torch
            import torch
            return asked, torch.get_num_threads()

        print(may_hold_thread_pools())  # this process: none loaded yet
        for preload in ([], ["torch"]):
            with Engine(map_executor="process", workers=2, preload=preload) as e:
                out = Pipeline(nodes=[threads], engine=e).map(inputs={"x": [0, 1]}, map_over="x")
            print(*out[0]["threads"])
        import torch
        print(may_hold_thread_pools(), torch.get_num_threads())
    """, env={k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES})  # no caps chosen by the user
    cap = max(1, (os.cpu_count() or 1) // 2)
    assert out.split("\n")[:4] == ["False", f"False {cap}", f"True {cap}", f"True {os.cpu_count()}"]


def test_a_process_pool_of_the_users_after_a_map_never_waits_on_a_lost_sigterm():
    """After a map, hardy's SIGTERM handler is installed (it stops its servers first). A
    multiprocessing pool forked afterwards ends its workers with SIGTERM as it closes; one that
    came before the child had put the default action back used to be lost (Python drops the
    signals pending in a fork child) and the pool waited on that worker forever, about one pool
    in twenty. SIGTERM is now blocked across the fork until the child has."""
    out = run_script("""
        import multiprocessing as mp
        from hardy import Pipeline, node

        @node(output_name="y")
        def one(x):
            return x

        Pipeline([one]).map(inputs={"x": [1, 2]}, map_over="x")
        total = 0
        for _ in range(100):
            with mp.get_context("fork").Pool(2) as pool:  # __exit__ terminates its workers at once
                total += sum(pool.map(abs, range(3)))
        print(total)
    """, timeout=120)
    assert out.strip() == "300"



def _walking(walk: str) -> str:
    """A script's start: a thread that lists the loaded libraries, over and over."""
    return f"""
    import os, sys, threading, time
    from hardy.native.loaded import loaded_libraries, thread_pools

    def walk():
        while True:
            {walk}()

    threading.Thread(target=walk, daemon=True).start()
    time.sleep(0.05)
"""


def test_a_fork_as_another_thread_asks_threadpoolctl_for_the_runtimes_leaves_a_working_child():
    """threadpoolctl before 3.7 walked the loader's list, whose lock glibc does not reset in a fork
    child: a fork as another thread asked it (hardy does as it checks for fork hazards and as a
    worker caps its runtimes) left the child's own question, or any dlopen, waiting forever.
    hardy requires a threadpoolctl that reads the memory map instead."""
    out = run_script(_walking("thread_pools") + """
    hung = 0
    for _ in range(20):
        pid = os.fork()
        if pid == 0:
            thread_pools()
            os._exit(0)
        for _ in range(200):  # 10 s: a child that walks takes milliseconds
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.05)
        else:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    print("hung", hung)
    """, timeout=300)
    assert out.strip() == "hung 0"


def test_listing_the_loaded_libraries_blocks_neither_an_import_nor_a_forked_worker():
    """hardy lists a process's libraries as a map diagnoses a crash, while a pool's spare-worker
    thread forks the next worker, and as each worker starts. Read from the loader's list, the
    listing held the loader's lock while it waited for the GIL: a thread importing an extension
    module (GIL held, waiting for that lock) hung both, and a worker forked meanwhile never
    started. Bounded by the node's timeout: a worker that hangs is a NodeTimeout here."""
    out = run_script(_walking("loaded_libraries") + """
    import _bz2, _csv, _decimal, _lzma, _opcode, _queue, _statistics  # extension modules, loaded now
    import warnings
    from hardy import Engine, Pipeline, node

    @node(output_name="y", timeout=20)
    def crash_or_not(x):
        if x % 2:
            os.kill(os.getpid(), 11)
        return x

    warnings.simplefilter("ignore")  # "fork!" with a thread running warns of it
    with Engine(map_executor="process", workers=1, start_method="fork!") as engine:
        out = Pipeline([crash_or_not], engine=engine).map(inputs={"x": list(range(12))}, map_over="x",
                                                          on_error="continue")
    print(*[o["y"] if isinstance(o, dict) else type(o.error).__name__ for o in out])
    """, timeout=180)
    assert out.split() == [str(x) if x % 2 == 0 else "NodeCrashed" for x in range(12)]

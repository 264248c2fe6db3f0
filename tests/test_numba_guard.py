"""Seed 002 reproduced: numba's per-process id counter makes two processes emit the same symbol
for different bodies; a third process that loads both caches calls the wrong one. hardy's workers
draw numba's ids from uuid4, so the same scenario through hardy gives the right bodies."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hardy import Engine, Pipeline, node

numba = pytest.importorskip("numba")

KERNELS = textwrap.dedent("""
    import os
    import numba

    # Two bodies under one qualname, as code generators (pytensor, sympy lambdify) produce them.
    # Recursion keeps LLVM from inlining `helper`, so it stays a (weak) symbol of its own.
    if os.environ.get("BODY") == "b":
        @numba.njit
        def helper(n):
            return 2 if n <= 0 else helper(n - 1) + 2
    else:
        @numba.njit
        def helper(n):
            return 1 if n <= 0 else helper(n - 1) + 1

    @numba.njit(cache=True)
    def use_a(n):
        return helper(n)

    @numba.njit(cache=True)
    def use_b(n):
        return helper(n)
""")

LOAD_BOTH = "import sys; sys.path.insert(0, sys.argv[1]); import kernels; print(kernels.use_a(3), kernels.use_b(3))"


def _fresh(folder, body: str | None, code: str) -> str:
    env = {**os.environ, "BODY": body or ""}
    run = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@node(output_name="value")
def compile_kernel(body: str, folder: str) -> int:
    os.environ["BODY"] = body
    sys.path.insert(0, folder)
    import kernels
    return getattr(kernels, f"use_{body}")(3)


@pytest.mark.slow
def test_numba_cache_collision_without_and_with_hardy(tmp_path):
    plain, guarded = tmp_path / "plain", tmp_path / "guarded"
    for folder in (plain, guarded):
        folder.mkdir()
        (folder / "kernels.py").write_text(KERNELS)

    # Without the guard: two fresh processes compile, a third loads both caches -> wrong body.
    compile_one = "import sys, os; sys.path.insert(0, sys.argv[1]); import kernels; " \
                  "print(getattr(kernels, 'use_' + os.environ['BODY'])(3))"
    assert _fresh(plain, "a", compile_one) == "4"
    assert _fresh(plain, "b", compile_one) == "8"
    assert _fresh(plain, None, LOAD_BOTH) == "4 4"  # use_b ran helper's *a* body

    # Through hardy: each compile in its own fresh worker, ids drawn from uuid4 -> right bodies.
    with Engine(map_executor="process", workers=1, max_tasks_per_worker=1) as engine:
        out = Pipeline(nodes=[compile_kernel], engine=engine).map(
            inputs={"body": ["a", "b"], "folder": str(guarded)}, map_over="body")
    assert [o["value"] for o in out] == [4, 8]
    assert _fresh(guarded, None, LOAD_BOTH) == "4 8"

"""A needed library with no SONAME, in another folder: preloading it cannot satisfy the DT_NEEDED.

glibc matches a DT_NEEDED among the libraries already loaded by SONAME only, so `liba.so` loaded
first by path does not give `libb.so` its `liba.so`: `hardy libs` must say so, with the fix, and
a pool whose `preload_libs=` fails that way must carry the worker's own OSError."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hardy import Engine, Pipeline, node
from hardy.errors import WorkerStartError


@pytest.fixture()
def unnamed(tmp_path: Path) -> Path:
    """a/liba.so built without -soname; b/libb.so needs it (DT_NEEDED liba.so), no RPATH."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    (tmp_path / "a.c").write_text("int a_val(void){return 1;}")
    (tmp_path / "b.c").write_text("int a_val(void); int b_val(void){return a_val()+1;}")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "a" / "liba.so"), str(tmp_path / "a.c")],
                   check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "b" / "libb.so"), "-Wl,-soname,libb.so",
                    str(tmp_path / "b.c"), "-L", str(tmp_path / "a"), "-la"], check=True)
    return tmp_path


def test_hardy_libs_says_a_dependency_without_soname_cannot_be_preloaded(unnamed: Path):
    a, b = str(unnamed / "a"), str(unnamed / "b")
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "libs", a, b, "--order"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "1000"})
    said = " ".join(out.stdout.split())
    assert f"{b}/libb.so needs liba.so: {a}/liba.so has that file name but no SONAME" in said, out.stdout + out.stderr
    assert f"patchelf --set-soname liba.so {a}/liba.so" in said and f"put {a} on LD_LIBRARY_PATH" in said
    assert "load it first (hardy libs --order)" not in said  # the advice that does not work
    assert out.returncode == 2


@node(output_name="y")
def same(x: int) -> int:
    return x


def test_a_worker_that_cannot_preload_carries_its_own_oserror(unnamed: Path):
    libs = [str(unnamed / "a"), str(unnamed / "b")]
    with Engine(map_executor="process", workers=1, preload_libs=libs) as e:
        with pytest.raises(WorkerStartError) as caught:
            Pipeline(nodes=[same], engine=e).map(inputs={"x": [1]}, map_over="x")
    said = str(caught.value)
    assert "sys.exit" not in said and "see the worker's error above" not in said, said
    assert f"OSError: preloading {unnamed}/b/libb.so failed: liba.so: cannot open shared object file" in said, said
    assert "has that file name but no SONAME" in said

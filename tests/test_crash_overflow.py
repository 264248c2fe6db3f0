"""A native stack overflow (deep C recursion) in a worker: the record of 64 return addresses is
full of the recursing function and never reaches the interpreter. The report must say the stack
overflowed and count the frames it leaves out as that function's, not the interpreter's."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from hardy import Engine, Pipeline, node

SOURCE = r"""
__attribute__((noinline)) int recurse(volatile int n) {
    volatile char pad[256];
    pad[0] = (char)n;
    return recurse(n + 1) + pad[0];
}
int overflow(int n) { return recurse(n); }
"""


@node(output_name="y")
def call(lib: str) -> int:
    return ctypes.CDLL(lib).overflow(1)


def test_a_native_stack_overflow_is_named_and_its_frames_counted_as_the_recursion(tmp_path: Path):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("gcc is needed to build the recursing library")
    (tmp_path / "deep.c").write_text(SOURCE)
    lib = str(tmp_path / "libdeep.so")
    subprocess.run([cc, "-O0", "-shared", "-fPIC", "-o", lib, str(tmp_path / "deep.c")], check=True)
    with Engine(map_executor="process", workers=1) as e:
        [out] = Pipeline(nodes=[call], engine=e).map(inputs={"lib": [lib]}, map_over="lib", on_error="continue")
    err = out.error
    first = str(err).splitlines()[0]
    assert first.endswith("stack overflow: recurse recursed until the native stack ran out"), first
    assert {f.function for f in err.native_frames} == {"recurse"}
    assert f"... {len(err.native_frames) - 24} more frame(s) of recurse" in str(err), str(err)
    assert "in the Python interpreter and below" not in str(err)
    assert "the native stack overflowed: recurse calls itself" in str(err)

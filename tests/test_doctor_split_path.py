"""`hardy doctor --import pkgb` on a split sys.path (each package's folder its own entry, as Bazel
lays out wheels): pkgb's libb.so needs liba.so, which only another entry's pkga has. The failed
import must say where the missing library is and how to load it first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _split_path(tmp_path: Path) -> tuple[Path, Path, str]:
    """site_a/pkga/liba.so, and site_b/pkgb (with a plain submodule `sub`) whose __init__ loads
    libb.so, which needs liba.so: the import raises OSError. Returns pkga, pkgb and the PYTHONPATH."""
    a, b = tmp_path / "site_a" / "pkga", tmp_path / "site_b" / "pkgb"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (tmp_path / "a.c").write_text("int a_val(void){return 1;}")
    (tmp_path / "b.c").write_text("int a_val(void); int b_val(void){return a_val()+1;}")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(a / "liba.so"), "-Wl,-soname,liba.so",
                    str(tmp_path / "a.c")], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(b / "libb.so"), "-Wl,-soname,libb.so",
                    str(tmp_path / "b.c"), "-L", str(a), "-la"], check=True)
    (a / "__init__.py").write_text("")
    (b / "__init__.py").write_text("import ctypes, os\nctypes.CDLL(os.path.join(os.path.dirname(__file__), 'libb.so'))\n")
    (b / "sub.py").write_text("VALUE = 1\n")
    path = os.pathsep.join(filter(None, [str(tmp_path / "site_b"), str(tmp_path / "site_a"),
                                         os.environ.get("PYTHONPATH")]))
    return a, b, path


def _import_finding(module: str, path: str) -> str:
    out = subprocess.run([sys.executable, "-m", "hardy.cli", "doctor", "--import", module, "--json"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert out.stdout.startswith("{"), out.stdout + out.stderr
    [said] = [f["message"] for f in json.loads(out.stdout)["findings"] if f["topic"] == "import"]
    return str(said)


def test_a_failed_import_names_the_missing_library_where_it_is_and_the_fix(tmp_path: Path) -> None:
    a, b, path = _split_path(tmp_path)
    said = _import_finding("pkgb", path)
    assert said.startswith("import pkgb failed: OSError: liba.so: cannot open shared object file"), said
    assert f"{b}/libb.so needs liba.so: not found; it is in {a}, which the loader does not search" in said, said
    assert f"Engine(preload_libs=[{str(a)!r}, {str(b)!r}])" in said
    assert f"hardy libs {a} {b} --order" in said


def test_a_submodule_whose_package_raises_oserror_is_explained_not_a_traceback(tmp_path: Path) -> None:
    """`--import pkgb.sub`: finding pkgb.sub's folder must not import pkgb again (its OSError
    escaped the doctor as a traceback); the package's folder is scanned as for `--import pkgb`."""
    a, b, path = _split_path(tmp_path)
    said = _import_finding("pkgb.sub", path)
    assert said.startswith("import pkgb.sub failed: OSError: liba.so: cannot open shared object file"), said
    assert f"{b}/libb.so needs liba.so: not found; it is in {a}, which the loader does not search" in said, said
